"""Tensor parallelism over processes: rank 0 is the engine's own process (it alone schedules and owns
the KV manager), ranks 1..N-1 are workers spawned here (torch.multiprocessing, spawn), one device
each, in one torch.distributed group (NCCL on CUDA, gloo on the CPU).

    engine process, rank 0                        worker r (tp_worker.py)
    scheduler -> StepPlan ---plan.to_dict()--->   StepPlan.from_dict
    ModelRunner(shard 0).launch                   ModelRunner(shard r).launch
           <------ all_reduce / all_gather: identical hidden states and full-vocab logits ------>
    sample (the engine reads these ids)           sample identically (ids stay on its device)

Plans travel on pipes, not as collectives: an idle engine may leave its workers waiting on their
pipe for hours, while collectives (run only while every rank computes the same step) keep a finite
timeout. Start-up goes in stages that rank 0 waits for on the pipes while watching the processes
(`_expect`), so a worker that fails or dies is an error naming it, never a hang; so is one that dies
mid-step (its peers' collectives fail when its connections close, or time out). Any failure is fatal
to the group: ranks could no longer pair their collectives, so the executor stops its workers and
every later call raises `TensorParallelError` (the engine fails the affected requests with it).
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import time
import weakref
from datetime import timedelta

import torch
from torch import nn

from ...attention.base import AttentionBackend
from ...config.engine import EngineConfig
from ...errors import UserInputError
from ...kv.spec import LayerSpec
from ...models.loader import LoadedModel, check_tensor_parallel, load_model
from ...models.tensor_parallel import TensorParallelShard, local_kv_heads
from ..model_runner import ModelRunner, PendingStep, RunnerKV, RunnerOptions
from ..spec_decode.drafters import Drafter
from ..step import StepPlan, StepResult
from ..structured.structured_output import Grammars
from .tp_worker import COLLECTIVE_TIMEOUT_S, HOST, RunnerSpec, WorkerArgs, join_group, worker_main

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600     # a worker's start (imports) and again its shard's load; a dead one is seen at once
STOP_TIMEOUT_S = 10


# Spawned workers import the parent's main script: unguarded, it runs again in each of them.
_SPAWN_HINT = ("; a script that starts a tensor-parallel engine must do so under `if __name__ == \"__main__\":` "
               "(workers are spawned processes that import the main script)")


class TensorParallelError(RuntimeError):
    """The tensor-parallel group failed (a rank raised, died or stopped answering): the engine has to
    be restarted."""


class MultiprocExecutor:
    def __init__(self, config: EngineConfig, procs: list, conns: list, comm, threads_before: int | None = None):
        self.config = config
        self.world_size = config.tensor_parallel_size
        self.procs = procs            # index r - 1: rank r
        self.conns = conns
        self.comm = comm
        self.runner: ModelRunner | None = None
        self._broken: str | None = None
        self._finalizer = weakref.finalize(self, _stop, procs, conns, threads_before)

    @classmethod
    def start(cls, config: EngineConfig) -> "MultiprocExecutor":
        """Check the model splits, spawn the workers and join the group with them (as rank 0)."""
        import torch.distributed as dist
        import torch.multiprocessing as mp

        tp = config.tensor_parallel_size
        check_tensor_parallel(config.model, tp, config.hub_options())
        if dist.is_initialized():
            raise UserInputError("a tensor-parallel engine is already running in this process (one group per "
                                 "process: shut the other one down first)")
        device = config.torch_device()
        devices = _rank_devices(device, tp)
        threads_before = torch.get_num_threads()
        threads = max(1, threads_before // tp)   # CPU: N ranks share the cores, a share of the threads each
        store = dist.TCPStore(HOST, 0, tp, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        ctx = mp.get_context("spawn")
        procs, conns = [], []
        for rank in range(1, tp):
            ours, theirs = ctx.Pipe()
            args = WorkerArgs(config, rank, tp, store.port, str(devices[rank]), threads)
            proc = ctx.Process(target=worker_main, args=(args, theirs), name=f"gemmaserve-tp{rank}", daemon=True)
            proc.start()
            theirs.close()
            procs.append(proc)
            conns.append(ours)
        executor = cls(config, procs, conns, None, threads_before if device.type == "cpu" else None)
        if device.type == "cpu":
            torch.set_num_threads(threads)   # given back by shutdown
        executor._expect("up")
        executor.comm = join_group(0, tp, store, device)
        log.info("tensor parallel: %d ranks on %s (%s)", tp, ", ".join(map(str, devices)),
                 "nccl" if device.type == "cuda" else "gloo")
        return executor

    # -- the Executor interface ---------------------------------------------------------------------
    def load_model(self, dtype: torch.dtype, device: torch.device) -> LoadedModel:
        return load_model(self.config.model, dtype, device, self.config.quantized_weights(device),
                          shard=TensorParallelShard(0, self.world_size, self.comm), quantization=self.config.quantization,
                          mmproj=self.config.mmproj, hub=self.config.hub_options())

    def local_kv_specs(self, specs: list[LayerSpec]) -> list[LayerSpec]:
        return [dataclasses.replace(s, num_kv_heads=local_kv_heads(s.num_kv_heads, self.world_size)) for s in specs]

    def create_runner(self, model: nn.Module, backend: AttentionBackend, device: torch.device, kv: RunnerKV,
                      options: RunnerOptions, grammars: Grammars | None, drafter: Drafter | None
                      ) -> "MultiprocExecutor":
        """Rank 0's runner here, every worker's from the same layout and options; returns the runner the
        engine drives (this executor: each call goes to every rank)."""
        plan = getattr(model, "tensor_parallel_plan", None)
        if plan is None or plan.shard.world_size != self.world_size:
            raise UserInputError("tensor parallelism needs weights loaded by its own executor (reusing another "
                                 "engine's weights is not supported)")
        self._expect("loaded")
        # Each worker builds its own grammars from its own tokenizer (every rank samples the same way), and
        # its own drafter (an MTP drafter's attention reads that rank's KV heads).
        spec = RunnerSpec(backend.capabilities.name, kv, options)
        for conn in self.conns:
            conn.send(spec)
        self.runner = self._guard(lambda: ModelRunner(model, backend, device, kv, options, grammars, drafter))
        self._expect("ready")
        return self

    def shutdown(self) -> None:
        self._finalizer()

    # -- the runner interface (engine/executor/base.py StepRunner) -----------------------------------------
    @property
    def graphs(self):
        return self.runner.graphs

    def apply(self, plan: StepPlan) -> None:
        self._send(("apply", plan.to_dict()))
        self.runner.apply(plan)

    def launch(self, plan: StepPlan, only: list[int] | None = None) -> PendingStep:
        self._send(("launch", plan.to_dict(), only))
        return self._guard(lambda: self.runner.launch(plan, only))

    def execute(self, plan: StepPlan, only: list[int] | None = None) -> StepResult:
        return self.launch(plan, only).resolve()

    # Disaggregated handoffs: the wire buffers live on rank 0 (its runner sends them to, or gathers them from,
    # the other ranks inside the plan that loads or saves them).
    def put_staged(self, key: str, wire: torch.Tensor) -> None:
        self.runner.put_staged(key, wire)

    def drop_staged(self, key: str) -> None:
        self.runner.drop_staged(key)

    def take_staged(self, key: str) -> torch.Tensor | None:
        return self.runner.take_staged(key)

    # -- failures ----------------------------------------------------------------------------------
    def _send(self, msg: tuple) -> None:
        if self._broken is not None:
            raise TensorParallelError(self._broken)
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            try:
                conn.send_bytes(data)
            except OSError as exc:
                self._fail(exc)

    def _guard(self, fn):
        if self._broken is not None:
            raise TensorParallelError(self._broken)
        try:
            return fn()
        except Exception as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException):
        """Name what went wrong (a worker's own report if it sent one), stop the group, raise."""
        reason = None
        deadline = time.monotonic() + 2.0   # a failing worker reports just before it exits
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            report = _report(proc, conn, max(0.0, deadline - time.monotonic()))
            if report is not None:
                reason = f"tensor-parallel rank {rank} {report}"
                break
        if reason is None:
            reason = f"tensor-parallel rank 0 failed: {type(exc).__name__}: {exc}"
        self._broken = reason + "; the engine must be restarted"
        log.error("%s", self._broken)
        self._finalizer()
        raise TensorParallelError(self._broken) from exc

    def _expect(self, stage: str) -> None:
        """Wait until every worker reports `stage`, failing fast if one reports an error or dies."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            while True:
                if conn.poll(0.1):
                    try:
                        msg = conn.recv()
                    except EOFError:
                        proc.join(STOP_TIMEOUT_S)
                        msg = ("error", f"exited with code {proc.exitcode}{_SPAWN_HINT if stage == 'up' else ''}")
                    if msg[0] == stage:
                        break
                    self._finalizer()
                    raise TensorParallelError(f"tensor-parallel rank {rank} failed while starting: {msg[1]}")
                if not proc.is_alive():
                    self._finalizer()
                    raise TensorParallelError(f"tensor-parallel rank {rank} exited with code {proc.exitcode} "
                                              f"while starting (waiting for {stage!r})"
                                              f"{_SPAWN_HINT if stage == 'up' else ''}")
                if time.monotonic() > deadline:
                    self._finalizer()
                    raise TensorParallelError(f"tensor-parallel rank {rank} did not report {stage!r} within "
                                              f"{START_TIMEOUT_S} s")


def _report(proc, conn, wait_s: float) -> str | None:
    """What a worker said or how it ended, or None if it is still running without complaint."""
    try:
        if conn.poll(wait_s):
            msg = conn.recv()
            if msg[0] == "error":
                return f"failed:\n{msg[1]}"
    except (EOFError, OSError):
        pass
    proc.join(0.1)
    if proc.exitcode is not None:
        return f"exited with code {proc.exitcode}"
    return None


def _rank_devices(device: torch.device, tp: int) -> list[torch.device]:
    if device.type != "cuda":
        return [device] * tp
    first = device.index if device.index is not None else torch.cuda.current_device()
    if first + tp > torch.cuda.device_count():
        raise UserInputError(f"tensor_parallel_size {tp} from cuda:{first} needs {first + tp} GPUs; "
                             f"{torch.cuda.device_count()} are visible")
    return [torch.device("cuda", first + r) for r in range(tp)]


def _stop(procs: list, conns: list, threads_before: int | None) -> None:
    """Ask every worker to stop, then end those that do not; leave the group; give this process its
    threads back (at most once)."""
    import torch.distributed as dist

    data = pickle.dumps(("stop",))
    for conn in conns:
        try:
            conn.send_bytes(data)
        except OSError:
            pass
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.terminate()
            proc.join(STOP_TIMEOUT_S)
    for conn in conns:
        conn.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    if threads_before is not None:
        torch.set_num_threads(threads_before)
