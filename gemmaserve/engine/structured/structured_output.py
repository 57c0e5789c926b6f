"""Structured output: a request's grammar narrows the tokens the sampler may pick, step by step.

    StructuredOutput (plain data, in SamplingParams)      e.g. json_schema '{"type": "object", ...}'
        --Grammars.compile-->  compiled grammar (cached; an invalid spec is the user's error)
        --Grammars.matcher-->  GrammarState, one per request, kept by the runner beside its sampler state

    each step:  accept the token sampled last step -> fill the request's bitmask row (host)
                -> copy the bitmask to the device -> disallowed logits = -inf -> sample

The grammar library is xgrammar (measured against llguidance: `gemmaserve bench grammar`; it also
knows Gemma 4's tool-call format); it is a default dependency (a server that speaks OpenAI's API
answers `response_format` without extras). Masks are filled on the host for all constrained rows at
once (xgrammar's batch matcher, its own threads), then applied on the logits' device: xgrammar's
kernel on a GPU, llguidance's on the CPU (17x faster there than xgrammar's; same bitmask layout).

With asynchronous scheduling a request's previous token is still on the device when the next step
is launched. The state keeps where that token will land (the step's `Sampled` and row) and accepts
it just before filling the next mask: the wait is for that step only, while the device already runs
the next forward, so building the mask overlaps the model.

JSON (json_object and json_schema) is bounded where xgrammar leaves it open (json_grammar.py):
whitespace to what pretty-printing needs, numbers to I-JSON's (RFC 7493) unless the schema says more.

Grammars end in a stop token: once complete, only the tokenizer's end-of-sequence tokens are
allowed, so a constrained request finishes with reason "stop" (or "length" at max_tokens, where the
output is cut short as OpenAI's is).

Reasoning models (`StructuredOutput.reasoning`: the thought channel's begin and end token ids, Gemma 4's
`<|channel>` and `<channel|>`): the grammar starts where the reasoning ends. The first token may open the
channel as well as start the grammar's text; inside the channel anything goes; its end token hands over to the
grammar. A schema never stops a model from thinking first.
"""

from __future__ import annotations

import enum
import importlib
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...errors import UserInputError
from .json_grammar import json_ebnf

if TYPE_CHECKING:
    import torch

    from ...models.tokenizer import Tokenizer
    from ..sampler import Sampled

log = logging.getLogger(__name__)

MAX_SPEC_CHARS = 256 * 1024   # a schema, regex or grammar this long is a mistake, not a request
# Compiled grammars kept (0.2-0.7 MB each for Gemma's 262k-token vocabulary): a server sees a few
# schemas again and again; past this many the least recently used is compiled again when it returns.
GRAMMAR_CACHE_SIZE = 64
# Special tokens that grammars spell out as text: Gemma 4's tool-call markers.
TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_STRING, TOOL_RESPONSE = "<|tool_call>", "<tool_call|>", '<|"|>', "<|tool_response>"
GRAMMAR_MARKERS = frozenset({TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_STRING, TOOL_RESPONSE})
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")
INSTALL_HINT = "structured output needs xgrammar, a dependency of gemmaserve that is missing here: pip install 'xgrammar>=0.2.9'"


class GrammarKind(str, enum.Enum):
    JSON = "json"                       # any JSON object (OpenAI's response_format json_object)
    JSON_SCHEMA = "json_schema"         # JSON valid against a schema (strict)
    REGEX = "regex"
    GRAMMAR = "grammar"                 # EBNF (GBNF-style) text
    STRUCTURAL_TAG = "structural_tag"   # xgrammar structural tag JSON: tool calls in the model's format


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match; `spec` is the schema / regex / grammar / tag as text."""

    kind: GrammarKind
    spec: str = ""
    reasoning: tuple[int, int] | None = None   # (begin, end) token ids of a thought channel the grammar follows

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", GrammarKind(self.kind))
        except ValueError:
            raise UserInputError(f"structured output kind must be one of "
                                 f"{', '.join(k.value for k in GrammarKind)}, got {self.kind!r}") from None
        if not isinstance(self.spec, str):
            raise UserInputError("a structured output spec must be a string")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise UserInputError(f"structured output spec is {len(self.spec)} characters; at most {MAX_SPEC_CHARS}")
        if self.kind is not GrammarKind.JSON and not self.spec.strip():
            raise UserInputError(f"structured output {self.kind.value} needs a non-empty spec")
        if self.reasoning is not None:
            pair = tuple(self.reasoning)
            if len(pair) != 2 or not all(isinstance(t, int) and t >= 0 for t in pair) or pair[0] == pair[1]:
                raise UserInputError(f"structured output reasoning must be two token ids, got {self.reasoning!r}")
            object.__setattr__(self, "reasoning", pair)

    @classmethod
    def json_schema(cls, schema: dict | str) -> "StructuredOutput":
        return cls(GrammarKind.JSON_SCHEMA, schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def parse(cls, value: object) -> "StructuredOutput | None":
        """From a StructuredOutput, a {"kind", "spec"} dict (a plan sent as JSON), or None."""
        if value is None or isinstance(value, StructuredOutput):
            return value
        if isinstance(value, dict) and set(value) <= {"kind", "spec", "reasoning"} and "kind" in value:
            return cls(value["kind"], value.get("spec", ""), value.get("reasoning"))
        raise UserInputError("structured output must be a StructuredOutput (kind and spec)")


def parse_cli_structured(text: str) -> StructuredOutput:
    """--structured-output: 'json', or KIND=SPEC (json_schema / regex / grammar), SPEC inline or @file."""
    if text == "json":
        return StructuredOutput(GrammarKind.JSON)
    kind, sep, spec = text.partition("=")
    if not sep:
        raise UserInputError("expected 'json' or KIND=SPEC, e.g. json_schema=@schema.json or regex='[0-9]+'")
    if spec.startswith("@"):
        try:
            with open(spec[1:], encoding="utf-8") as fh:
                spec = fh.read()
        except OSError as exc:
            raise UserInputError(f"cannot read {spec[1:]!r}: {exc.strerror}") from None
    return StructuredOutput(kind, spec)


def import_libraries() -> None:
    """Import xgrammar and llguidance's torch module (1-4 s, parts of it holding the GIL for tenths
    of a second): the server does it on a thread while the model loads, when such a stall delays
    nobody, rather than on its first structured request."""
    for name in ("xgrammar", "llguidance.torch"):
        try:
            importlib.import_module(name)
        except ImportError:   # reported when a request needs it
            pass


@dataclass(frozen=True)
class _Backend:
    """What every grammar of one tokenizer shares (built once, on a background thread)."""

    xgr: Any            # the xgrammar module
    compiler: Any       # its GrammarCompiler over the tokenizer's vocabulary
    batch: Any          # its BatchGrammarMatcher (fills many masks at once, on its own threads)


class Grammars:
    """Compiles grammars for one tokenizer and makes matchers. Thread-safe, and nothing here waits
    for another request's compile.

    Off the request path: the per-tokenizer state (xgrammar's TokenizerInfo over the vocabulary and
    its compiler; for Gemma's 262k tokens ~0.3 s once xgrammar is imported, ~1 s more to import it)
    is built once on a thread of its own, started by `warm_up` (the server imports the libraries
    while the model loads and builds the state before it says ready) or by the first request that
    needs it. Each spec is compiled once on a worker thread (`submit` returns its future) and kept
    in a bounded LRU keyed by the canonical spec. The engine admits a request only once its grammar
    is compiled, so a schema that takes long delays its own request only.

    The mask kernel: llguidance's CPU kernel is a torch.compile function, built on its first call
    (measured on a shared 2-core VM: 11-21 s with a cold inductor cache, ~4 s warm, plus 1-3 s to
    import it: most of the first `json_schema` request's 12-17 s). It is built in the background on
    the shapes the sampler passes when masks are first applied on the CPU (or by
    `warm_up(cpu_kernel=True)`); until then they go through xgrammar's CPU kernel (no compile;
    slower at large batches). Not when the server starts: the build holds the GIL for tenths of a
    second at a time, which /health would feel, and a server that never sees a structured request
    would spend 4-21 s of CPU on it for nothing."""

    def __init__(self, tokenizer: "Tokenizer", vocab_size: int, cache_size: int = GRAMMAR_CACHE_SIZE):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._lock = threading.Lock()   # guards the fields below; never held while building or compiling
        self._backend: Future[_Backend] | None = None
        self._kernel_started = False
        self._kernel_tried = threading.Event()   # the warm-up thread is done with the kernel, built or not
        self._cpu_kernel: Callable[["torch.Tensor", "torch.Tensor"], None] | None = None   # set once warm
        self._pool: ThreadPoolExecutor | None = None
        self._cache: OrderedDict[tuple[GrammarKind, str], Future[Any]] = OrderedDict()

    # -- off the request path --------------------------------------------------------------------
    def warm_up(self, cpu_kernel: bool = False) -> "Future[_Backend]":
        """Start building the per-tokenizer state (and, with `cpu_kernel`, the CPU mask kernel) on a
        background thread and compile the json_object grammar; returns at once. The future is done
        when the per-tokenizer state is."""
        backend = self._start(kernel=cpu_kernel)
        self.submit(StructuredOutput(GrammarKind.JSON))
        return backend

    def close(self) -> None:
        """Stop the compile threads (a compile under way finishes first, queued ones are cancelled) and drop the
        compiled grammars: the engine is closing. A warm-up thread still running ends by itself."""
        with self._lock:
            pool = self._pool
            self._cache.clear()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def is_ready(self) -> bool:
        """Whether the per-tokenizer state is built (a structured request then waits only for its spec)."""
        backend = self._backend
        return backend is not None and backend.done() and backend.exception() is None

    def _start(self, kernel: bool) -> Future[_Backend]:
        with self._lock:
            backend = self._backend
            start_backend = backend is None
            if start_backend:
                backend = self._backend = Future()
            start_kernel = kernel and not self._kernel_started
            self._kernel_started |= kernel
        if start_backend or start_kernel:
            threading.Thread(target=self._build, args=(backend if start_backend else None, start_kernel),
                             name="gemmaserve-grammars", daemon=True).start()
        return backend

    def _build(self, backend: Future[_Backend] | None, kernel: bool) -> None:
        """The warm-up thread: the per-tokenizer state, then the CPU mask kernel."""
        try:
            if backend is not None:
                start = time.perf_counter()
                try:
                    backend.set_result(self._make_backend())
                except BaseException as exc:   # every waiting compile gets it
                    backend.set_exception(exc)
                    return
                log.info("structured output: %d-token vocabulary ready in %.1fs", self.vocab_size,
                         time.perf_counter() - start)
            if kernel:
                self._warm_cpu_kernel()
        finally:
            if kernel:
                self._kernel_tried.set()

    def _make_backend(self) -> _Backend:
        try:
            import xgrammar
        except ImportError:
            raise UserInputError(INSTALL_HINT) from None
        tok = self.tokenizer
        # Special tokens are given as empty strings: xgrammar then never allows them inside the
        # output (a JSON string may not contain <start_of_turn>); stop tokens end the grammar. The
        # markers a grammar spells out (Gemma 4's tool calls) keep their text.
        def text(i: int) -> str:
            t = tok.backend.id_to_token(i) or ""
            return t if not tok.is_special(i) or t in GRAMMAR_MARKERS else ""

        vocab = [text(i) for i in range(min(tok.vocab_size, self.vocab_size))]
        stops = sorted(t for t in tok.stop_token_ids if t < self.vocab_size)
        info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.BYTE_FALLBACK, vocab_size=self.vocab_size,
                                      stop_token_ids=stops, add_prefix_space=False)
        # The LRU below is the cache: xgrammar's own would keep every grammar ever compiled.
        compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        return _Backend(xgrammar, compiler, xgrammar.BatchGrammarMatcher(max_threads=2))

    def _warm_cpu_kernel(self, attempts: int = 30, pause_s: float = 2.0) -> None:
        """Compile llguidance's CPU kernel for the shapes the sampler gives it: float32 [rows, vocab]
        logits made under inference mode; torch.compile keeps one graph for a single row and one for
        two or more. Retried while another thread runs compiled code under the "fail_on_recompile"
        stance (the compiled decode step sets it process-wide for its call)."""
        try:
            import torch
            from llguidance.torch import apply_token_bitmask_inplace as kernel
        except ImportError as exc:
            log.warning("structured output: llguidance's CPU mask kernel is unavailable (%s); "
                        "xgrammar's applies the masks", exc)
            return
        start = time.perf_counter()
        words = (self.vocab_size + 31) // 32
        for attempt in range(attempts):
            try:
                with torch.inference_mode():
                    for rows in (1, 2):
                        logits = torch.zeros(rows, self.vocab_size)
                        kernel(logits, torch.zeros(rows, words, dtype=torch.int32))
                        if not bool(torch.isneginf(logits).all()):   # an empty mask allows nothing
                            raise RuntimeError("the kernel did not apply the mask")
                break
            except Exception as exc:
                if "fail_on_recompile" not in str(exc) or attempt == attempts - 1:
                    log.warning("structured output: llguidance's CPU mask kernel did not build (%s); "
                                "xgrammar's applies the masks", exc)
                    return
                time.sleep(pause_s)
        self._cpu_kernel = kernel
        log.info("structured output: CPU mask kernel ready in %.1fs", time.perf_counter() - start)

    def wait_for_kernel(self, timeout: float | None = None) -> bool:
        """Wait until the CPU mask kernel is built or given up (once started); True if built."""
        self._kernel_tried.wait(timeout)
        return self._cpu_kernel is not None

    # -- compiling -----------------------------------------------------------------------------------
    def submit(self, so: StructuredOutput) -> Future[Any]:
        """The future compiled grammar of `so`: cached, or compiling on a worker thread. Its result
        raises UserInputError naming what is wrong with the spec (JSON syntax at once)."""
        key = (so.kind, _canonical(so))
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="gemmaserve-grammar")
            fut = self._pool.submit(self._compile, so)
            self._cache[key] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)   # a request holding its future keeps that grammar
            return fut

    def compile(self, so: StructuredOutput) -> Any:
        """The compiled grammar, waiting for it; raises UserInputError naming what is wrong with the spec."""
        return self.submit(so).result()

    def _compile(self, so: StructuredOutput) -> Any:
        """A worker thread: waits for the per-tokenizer state, then compiles."""
        backend = self._start(kernel=False).result()
        c = backend.compiler
        try:
            if so.kind is GrammarKind.JSON:   # an object, as OpenAI's json_object promises
                return c.compile_grammar(json_ebnf(backend.xgr, '{"type": "object"}', strict=False))
            if so.kind is GrammarKind.JSON_SCHEMA:
                return c.compile_grammar(json_ebnf(backend.xgr, so.spec, strict=True))
            if so.kind is GrammarKind.REGEX:
                return c.compile_regex(so.spec)
            if so.kind is GrammarKind.GRAMMAR:
                return c.compile_grammar(so.spec)
            return c.compile_structural_tag(so.spec)
        except json.JSONDecodeError as exc:
            raise UserInputError(f"the JSON schema is not valid JSON: {exc}") from None
        except (RuntimeError, ValueError, TypeError) as exc:   # xgrammar's errors derive from these
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            first = _LOG_PREFIX.sub("", first)   # "[19:22:23] /project/cpp/x.cc:5082: " says nothing to a user
            raise UserInputError(f"invalid {so.kind.value}: {first}") from None

    # -- each step (the engine thread) ---------------------------------------------------------------
    def matcher(self, so: StructuredOutput) -> "GrammarState":
        """A matcher for a request whose grammar is compiled (the engine admits it only then)."""
        return GrammarState(self._start(kernel=False).result().xgr.GrammarMatcher(self.compile(so)), so.reasoning)

    def bitmask(self, rows: int) -> "torch.Tensor":
        return self._start(kernel=False).result().xgr.allocate_token_bitmask(rows, self.vocab_size)

    def fill(self, states: list["GrammarState"], bitmask: "torch.Tensor", rows: list[int]) -> None:
        """bitmask[rows[j]] <- the tokens states[j] allows next (after accepting its last token)."""
        for s in states:
            s.catch_up()
        live = []
        for s, row in zip(states, rows):
            # a request that ends with this step's result, or is thinking: anything goes
            if s.phase is Phase.REASONING or s.matcher.is_terminated():
                bitmask[row].fill_(-1)
            else:
                live.append((s.matcher, row))
        if live:
            batch = self._start(kernel=False).result().batch
            batch.batch_fill_next_token_bitmask([m for m, _ in live], bitmask, [r for _, r in live])
        for s, row in zip(states, rows):
            if s.phase is Phase.FIRST:   # the first token may also open the thought channel
                _allow(bitmask, row, s.reasoning[0])

    def apply(self, logits: "torch.Tensor", bitmask: "torch.Tensor", rows: list[int]) -> None:
        """For each r in rows: tokens bitmask[r] disallows get logits[r] = -inf, on the logits' device.
        On the CPU llguidance's kernel does it once built (same bitmask layout): xgrammar's CPU
        kernel writes each disallowed logit alone, 68 ms against 4 ms for 64 rows of 262k tokens."""
        kernel = self._cpu_kernel
        if logits.device.type == "cpu" and kernel is None:
            self._start(kernel=True)   # first use: built in the background, xgrammar's kernel meanwhile
        if logits.device.type == "cpu" and kernel is not None:
            if len(rows) == logits.shape[0]:
                # A row's logits may come with any row stride (one row of a transposed product):
                # view() gives the stride the kernel was compiled for, else torch.compile would
                # compile it again here, on the engine thread.
                kernel(logits.view(logits.shape), bitmask)
            else:
                import torch

                index = torch.tensor(rows)
                part = logits[index]
                kernel(part, bitmask[index])
                logits[index] = part
            return
        mask = bitmask.to(logits.device, non_blocking=True)
        xgr = self._start(kernel=False).result().xgr
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab_size, indices=rows)


def _canonical(so: StructuredOutput) -> str:
    """The cache key's spec: a JSON schema without its insignificant whitespace (key order is kept:
    it is the order the properties are written in)."""
    if so.kind is not GrammarKind.JSON_SCHEMA:
        return so.spec
    try:
        return json.dumps(json.loads(so.spec), separators=(",", ":"), ensure_ascii=False)
    except json.JSONDecodeError as exc:
        raise UserInputError(f"the JSON schema is not valid JSON: {exc}") from None


class Phase(enum.Enum):
    FIRST = "first"            # nothing sampled yet: the thought channel may open
    REASONING = "reasoning"    # inside the thought channel: unconstrained
    CONSTRAINED = "constrained"


def _allow(bitmask: "torch.Tensor", row: int, token: int) -> None:
    """Set `token`'s bit in a row of xgrammar's int32 bitmask."""
    word, bit = divmod(token, 32)
    value = (int(bitmask[row, word]) & 0xFFFFFFFF) | (1 << bit)
    bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value


class GrammarState:
    """One request's matcher and the token it sampled last step (accepted lazily, see the module), and where it
    stands with respect to a thought channel (`reasoning`: its begin and end ids; None: constrained from the
    first token)."""

    def __init__(self, matcher: Any, reasoning: tuple[int, int] | None = None):
        self.matcher = matcher
        self.reasoning = reasoning
        self.phase = Phase.FIRST if reasoning is not None else Phase.CONSTRAINED
        self._pending: tuple["Sampled", int] | None = None

    def _gate(self, token: int) -> bool:
        """Move through the thought channel; True if `token` belongs to it (the grammar does not see it)."""
        if self.phase is Phase.FIRST:
            self.phase = Phase.REASONING if token == self.reasoning[0] else Phase.CONSTRAINED
            return self.phase is Phase.REASONING
        if self.phase is Phase.REASONING:
            if token == self.reasoning[1]:
                self.phase = Phase.CONSTRAINED
            return True
        return False

    def _take(self, token: int) -> bool:
        return self._gate(token) or self.matcher.is_terminated() or self.matcher.accept_token(token)

    def accept(self, token: int) -> None:
        """A token sampled elsewhere (before this matcher existed)."""
        self.catch_up()
        if not self._take(token):
            raise UserInputError(f"token {token} does not fit the request's grammar")

    def sampled(self, step: "Sampled", row: int) -> None:
        self._pending = (step, row)

    def allowed_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` the grammar takes next, in a row (drafts it forbids are never worth
        verifying); the matcher is left as it was."""
        self.catch_up()
        phase, n, fed = self.phase, 0, 0
        for t in tokens:
            if self._gate(t):
                n += 1
                continue
            if self.matcher.is_terminated() or not self.matcher.accept_token(t):
                break
            n += 1
            fed += 1
        if fed:
            self.matcher.rollback(fed)
        self.phase = phase
        return n

    def catch_up(self) -> None:
        if self._pending is None:
            return
        step, row = self._pending
        self._pending = None
        token = step.host_token(row)
        if not self._take(token):
            # The mask allowed only accepted tokens: a rejected one means the mask was not applied.
            raise RuntimeError(f"token {token} violates the request's grammar")
