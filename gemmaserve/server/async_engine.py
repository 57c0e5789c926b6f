"""The engine on its own thread, for asyncio callers.

    HTTP handlers ──commands──▶ [engine thread: add / abort / step / snapshot] ──outputs──▶ per-request queues
         (event loop)           (a thread-safe queue, run between steps)           (call_soon_threadsafe)

Handlers never touch the engine: they use this client, which posts commands and awaits their request's
queue, or reads what is safe from any thread (`info`, the adapters' names, `validate`: the engine's checks
read only what is fixed at its construction and the thread-safe grammar cache). The thread runs
commands between steps, steps while anything is unfinished, and when it falls idle runs the KV
integrity check once, in slices of a few milliseconds between looks at the command queue: a request
that arrives meanwhile stops the check (it starts over at the next idle), so it never waits for it.

Admission (`--max-queue-len`): `AdmissionBound` counts every completion from the moment a handler
admits it (on the event loop, before anything is posted) until it leaves the engine (on the engine
thread: finished, aborted, timed out or failed), so a burst is counted exactly, whatever the engine
thread has taken yet.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..engine.factory import EngineInfo
from ..engine.input_processor import InputProcessor
from ..engine.lora import LoRARef
from ..engine.llm_engine import LLMEngine
from ..engine.media.items import MediaItem
from ..engine.request import RequestOutput
from ..engine.sampling_params import SamplingParams
from ..engine.snapshot import EngineSnapshot
from ..engine.validation import CheckedRequest
from .metrics import ServerMetrics

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shutdown, or a bug outside any one request)."""


class DeadlineExceeded(RuntimeError):
    """A request ran past its deadline; it was aborted and its pages freed."""


class QueueFull(RuntimeError):
    """Admitting the request would take the server past its bound (`AdmissionBound`)."""

    def __init__(self, in_system: int, bound: "AdmissionBound"):
        super().__init__(f"{in_system} completions are running or waiting (at most {bound.capacity}: "
                         f"{bound.slots} running, --max-num-seqs, and {bound.queue_len} waiting, --max-queue-len)")
        self.in_system = in_system


@dataclass
class AdmissionBound:
    """At most `slots + queue_len` completions in the server at once (a request of n completions for
    each of p prompts counts n * p): `slots` may run (--max-num-seqs) and `queue_len` more may wait
    (--max-queue-len; None: unbounded). While nothing waits (at most `slots` in the server) any request
    is taken, however many completions it has, so a large request is never refused for its size alone.
    Admitted on the event loop, released on the engine thread: one lock keeps the count exact."""
    slots: int
    queue_len: int | None
    count: int = 0   # completions admitted and not yet out of the engine
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def capacity(self) -> int | None:
        return None if self.queue_len is None else self.slots + self.queue_len

    def admit(self, completions: int) -> None:
        """Count `completions`, or raise QueueFull (and count nothing)."""
        with self._lock:
            capacity = self.capacity
            if capacity is not None and self.count > self.slots and self.count + completions > capacity:
                raise QueueFull(self.count, self)
            self.count += completions

    def release(self, completions: int) -> None:
        if completions:
            with self._lock:
                self.count -= completions


@dataclass
class Admission:
    """One request's completions, admitted against the bound. Handed to `AsyncEngine.generate`, which
    posts them (from then on the engine thread releases each as it leaves), or to
    `AsyncEngine.withdraw` if the request failed before it was posted."""
    completions: int
    settled: bool = False   # posted or withdrawn: the handler no longer owns the count


@dataclass
class _Timing:
    arrival: float
    first: float | None = None
    last: float | None = None


@dataclass
class _Sink:
    """Where one HTTP request's outputs go: (prompt index, output) items, or an exception."""
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float
    prompt_index: dict[str, int] = field(default_factory=dict)   # engine group id -> prompt index
    unfinished: dict[str, int] = field(default_factory=dict)     # engine group id -> completions still running
    timing: dict[tuple[str, int], _Timing] = field(default_factory=dict)

    def put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:   # the event loop has closed: nobody is listening
            pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, max_queue_len: int | None = None):
        self._engine = engine
        self.metrics = metrics
        self.bound = AdmissionBound(engine.config.max_num_seqs, max_queue_len)
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}          # engine group id -> sink
        self._thread = threading.Thread(target=self._run, name="gemmaserve-engine", daemon=True)
        self.integrity_ok = True   # what the last idle KV integrity check found
        self._checked_idle = True
        self._idle_check: Iterator[None] | None = None   # the idle check in progress
        self.error: BaseException | None = None
        self.active = 0       # generate() calls in progress (the event loop's count)

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._commands.put(None)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def admit(self, completions: int) -> Admission:
        """Admit `completions` against the bound (QueueFull if they do not fit), for `generate`."""
        self.bound.admit(completions)
        return Admission(completions)

    def withdraw(self, admission: Admission) -> None:
        """Uncount an admission that was never posted (its request failed first); once posted, a no-op."""
        if not admission.settled:
            admission.settled = True
            self.bound.release(admission.completions)

    def abort_all(self) -> None:
        """Abort every request (shutdown past its grace period): each client gets its final output."""
        self._commands.put(lambda: self._abort(list(self._sinks)))

    def abort(self, ids: list[str], reason: str = "abort") -> None:
        """Abort these engine requests between steps; `reason` labels them in the metrics."""
        self._commands.put(lambda: self._abort(ids, reason))

    # -- what is safe from any thread ------------------------------------------------------------------
    @property
    def info(self) -> EngineInfo:
        return self._engine.info

    @property
    def inputs(self) -> InputProcessor:
        """Preparing prompts and media: the tokenizer and the model's media layouts (stateless)."""
        return self._engine.inputs

    def adapter_names(self) -> list[str]:
        return self._engine.adapters.names()

    def adapter_refs(self) -> list[LoRARef]:
        return self._engine.adapters.refs()

    def has_adapter(self, name: str) -> bool:
        return name in self._engine.adapters

    async def validate(self, prompts: list[tuple[str, list[int]]], params: SamplingParams,
                       media: list[list[MediaItem]] | None = None, lora: str | None = None) -> list[CheckedRequest]:
        """The engine's checks of each (text, ids) prompt (and its media) under OpenAI's length rule (prompt and
        max_tokens fit the context together), on a worker thread (a grammar may take a while to compile): the
        requests for `generate`, which the engine queues without checking again. UserInputError if one fails."""
        engine = self._engine
        return await asyncio.to_thread(lambda: [
            engine.validate(ids, params, media[i] if media else None, lora, text=text, strict_length=True)
            for i, (text, ids) in enumerate(prompts)])

    # -- called from the event loop ------------------------------------------------------------------
    async def add_adapter(self, name: str, path: str) -> None:
        await self.call(lambda eng: eng.adapters.add(name, path))

    async def remove_adapter(self, name: str) -> None:
        await self.call(lambda eng: eng.adapters.remove(name))

    async def snapshot(self) -> EngineSnapshot:
        """The engine's counters and gauges, taken on the engine thread between steps."""
        return await self.call(lambda eng: eng.snapshot())

    def generate(self, request_id: str, prompts: list[CheckedRequest], deadline: float | None = None,
                 adopt: Callable[[LLMEngine, str], list[RequestOutput]] | None = None,
                 admission: Admission | None = None) -> "Generation":
        """Post every prompt (checked by `validate`, all with the same sampling params) to the engine now,
        under `admission` (from `admit`; without one they are admitted here, QueueFull if they do not fit),
        and return the Generation that yields (prompt index, output of one completion) as they come.
        `adopt(engine, id)` runs on the engine thread right after each prompt is added (a disaggregated
        decode engine starts it from received KV there) and returns outputs to deliver at once."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        completions = len(prompts) * prompts[0].params.n
        if admission is None:
            self.bound.admit(completions)
        elif admission.settled or admission.completions != completions:
            raise ValueError(f"an admission of {admission.completions} completions cannot post {completions} "
                             "(or was settled already)")
        else:
            admission.settled = True
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue(), time.perf_counter())
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        self._commands.put(lambda: self._add(sink, ids, prompts, adopt))
        self.active += 1
        return Generation(self, sink, ids, completions, deadline)

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps and return its result."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def run() -> None:
            try:
                result = fn(self._engine)
            except BaseException as exc:   # handed to the caller
                loop.call_soon_threadsafe(_set, fut, None, exc)
            else:
                loop.call_soon_threadsafe(_set, fut, result, None)

        self._commands.put(run)
        return await fut

    def post(self, fn: Callable[[LLMEngine], None]) -> None:
        """Run fn(engine) on the engine thread between steps; nobody waits for it."""
        self._commands.put(lambda: fn(self._engine))

    def call_blocking(self, fn: Callable[[LLMEngine], Any], timeout: float = 60.0) -> Any:
        """`call` for plain threads (tests, tools)."""
        done = threading.Event()
        box: list = [None, None]

        def run() -> None:
            try:
                box[0] = fn(self._engine)
            except BaseException as exc:
                box[1] = exc
            done.set()

        self._commands.put(run)
        if not done.wait(timeout):
            raise TimeoutError("the engine thread did not answer")
        if box[1] is not None:
            raise box[1]
        return box[0]

    # -- the engine thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        eng = self._engine
        try:
            while True:
                busy = eng.has_unfinished_requests()
                checking = not busy and not self._checked_idle and self._advance_idle_check()
                building = not busy and eng.poll_builds()   # (switches to compiled steps once they are built)
                try:   # idle: sleep until a command comes (a build: a look at it every second); busy or
                    # checking: take what is there
                    cmd = self._commands.get(block=not (busy or checking), timeout=1.0 if building else None)
                    self._idle_check = None   # a command may change the state: the check starts over
                    while True:
                        if cmd is None:
                            return
                        cmd()
                        cmd = self._commands.get_nowait()
                except queue.Empty:
                    pass
                if eng.has_unfinished_requests():
                    self._checked_idle = False
                    try:
                        outputs = eng.step()
                    except Exception as exc:   # not one request's fault (the engine isolates those): fail all
                        log.exception("engine step failed")
                        self._fail_all(exc)
                        continue
                    self._dispatch(outputs)
        except BaseException as exc:
            log.exception("engine thread died")
            self.error = exc
            self._fail_all(exc)
        finally:
            self._fail_all(EngineDeadError("the engine stopped"))

    def _add(self, sink: _Sink, ids: list[str], prompts: list[CheckedRequest],
             adopt: Callable[[LLMEngine, str], list[RequestOutput]] | None = None) -> None:
        added = []
        n = prompts[0].params.n
        try:
            for i, (gid, checked) in enumerate(zip(ids, prompts)):
                self._engine.add_checked(checked, request_id=gid)
                added.append(gid)
                sink.prompt_index[gid] = i
                sink.unfinished[gid] = n
                self._sinks[gid] = sink
                self.metrics.prompt_tokens.inc(len(checked.prompt_ids))
                self.metrics.admitted.inc(n)
                if adopt is not None:
                    self._dispatch(adopt(self._engine, gid))
        except Exception as exc:   # an adapter removed since the check, or a failed adoption
            self.bound.release((len(prompts) - len(added)) * n)   # these never reached the engine
            self._abort(added)
            sink.put(exc)

    def _abort(self, ids: list[str], reason: str = "abort") -> None:
        """Abort engine requests; `reason` labels them in the metrics ("abort", "timeout")."""
        for gid in ids:
            sink = self._sinks.pop(gid, None)
            if sink is not None:
                self.bound.release(sink.unfinished[gid])
            for out in self._engine.abort_request(gid):
                if sink is not None:
                    self._record(sink, out, time.perf_counter(), reason)
                    sink.put((sink.prompt_index[gid], out))   # a waiting client (drain) gets its end

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            self._record(sink, out, now)
            sink.put((sink.prompt_index[out.request_id], out))
            if out.finished:
                self.bound.release(1)
                sink.unfinished[out.request_id] -= 1
                if not sink.unfinished[out.request_id]:   # every completion of this prompt is done
                    del self._sinks[out.request_id]

    def _record(self, sink: _Sink, out: RequestOutput, now: float, reason: str | None = None) -> None:
        c = out.outputs[0]
        m = self.metrics
        t = sink.timing.setdefault((out.request_id, c.index), _Timing(sink.arrival))
        new = len(c.delta_token_ids)
        if new:
            m.generation_tokens.inc(new)
            if t.first is None:
                t.first = now
                m.ttft.observe(now - t.arrival)
                new -= 1
            if new and t.last is not None:
                gap = (now - t.last) / new
                for _ in range(new):
                    m.itl.observe(gap)
            t.last = now
        if c.finished:
            m.requests.labels(reason or c.finish_reason).inc()
            m.e2e.observe(now - t.arrival)

    def _fail_all(self, exc: BaseException) -> None:
        for gid in list(self._sinks):
            sink = self._sinks.pop(gid)
            self.bound.release(sink.unfinished[gid])
            try:
                for out in self._engine.abort_request(gid):
                    self._record(sink, out, time.perf_counter(), "error")
            except Exception:   # the engine may be what is broken; the clients still get their error
                log.exception("abort after failure")
            sink.put(exc)

    def _advance_idle_check(self, slice_s: float = 0.005) -> bool:
        """Run the KV integrity check for about `slice_s`; True while it is unfinished. In slices, so
        a request that arrives while the engine checks waits milliseconds, not the whole check."""
        if self._idle_check is None:
            self._idle_check = self._engine.kv_integrity_steps()
        deadline = time.perf_counter() + slice_s
        try:
            while time.perf_counter() < deadline:
                next(self._idle_check)
            return True
        except StopIteration:
            self.integrity_ok = True
        except AssertionError:
            self.integrity_ok = False
            log.exception("KV cache integrity check failed while idle")
        self._idle_check = None
        self._checked_idle = True
        return False


class Generation:
    """The outputs of one `AsyncEngine.generate` call: an async iterator of (prompt index, output of
    one completion). Its requests are in the engine from its creation, so it is a class, not an async
    generator: closing it (`aclose`, or an error or cancellation while it waits) aborts what is
    unfinished even if it was never iterated. Past `deadline` (time.monotonic()) it aborts and raises
    DeadlineExceeded. `on_end` callbacks run once, when it ends however it ends."""

    def __init__(self, owner: AsyncEngine, sink: _Sink, ids: list[str], completions: int,
                 deadline: float | None):
        self._owner = owner
        self._sink = sink
        self._ids = ids
        self._remaining = completions   # completions not finished yet
        self._deadline = deadline
        self._ended = False
        self._on_end: list[Callable[[], None]] = []

    def on_end(self, fn: Callable[[], None]) -> None:
        self._on_end.append(fn)

    def __aiter__(self) -> "Generation":
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self._remaining or self._ended:
            self._end("abort")
            raise StopAsyncIteration
        try:
            wait = None if self._deadline is None else self._deadline - time.monotonic()
            try:
                if wait is not None and wait <= 0:
                    raise TimeoutError
                item = await asyncio.wait_for(self._sink.queue.get(), wait)
            except TimeoutError:
                raise DeadlineExceeded("the request ran past its deadline and was aborted") from None
            if isinstance(item, BaseException):
                raise item
        except BaseException as exc:   # an error, the deadline, or the consumer was cancelled (it left)
            self._end("timeout" if isinstance(exc, DeadlineExceeded) else "abort")
            raise
        if item[1].outputs[0].finished:
            self._remaining -= 1
        return item

    async def aclose(self) -> None:
        self._end("abort")

    def _end(self, reason: str) -> None:
        """Abort what is unfinished (`reason` labels it in the metrics), once."""
        if self._ended:
            return
        self._ended = True
        self._owner.active -= 1
        if self._remaining:
            self._owner.abort(self._ids, reason)
        for fn in self._on_end:
            fn()


def _set(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():   # the caller gave up (cancelled)
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
