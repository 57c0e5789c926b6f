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
"""

from __future__ import annotations

import enum
import json
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import UserInputError
from .json_grammar import json_ebnf

if TYPE_CHECKING:
    import torch

    from ..models.tokenizer import Tokenizer
    from .sampler import Sampled

MAX_SPEC_CHARS = 256 * 1024   # a schema, regex or grammar this long is a mistake, not a request
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

    @classmethod
    def json_schema(cls, schema: dict | str) -> "StructuredOutput":
        return cls(GrammarKind.JSON_SCHEMA, schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def parse(cls, value: object) -> "StructuredOutput | None":
        """From a StructuredOutput, a {"kind", "spec"} dict (a plan sent as JSON), or None."""
        if value is None or isinstance(value, StructuredOutput):
            return value
        if isinstance(value, dict) and set(value) <= {"kind", "spec"} and "kind" in value:
            return cls(value["kind"], value.get("spec", ""))
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


class Grammars:
    """Compiles grammars for one tokenizer (cached by spec) and makes matchers. Thread-safe: the
    server validates requests on worker threads while the engine thread makes matchers. Nothing is
    imported or built until the first structured request (the vocabulary scan takes ~0.2 s)."""

    def __init__(self, tokenizer: "Tokenizer", vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._xgr: Any = None

    def _ready(self) -> Any:
        if self._xgr is not None:
            return self._xgr
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
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2)
        self._batch = xgrammar.BatchGrammarMatcher(max_threads=2)
        try:
            from llguidance.torch import apply_token_bitmask_inplace as cpu_kernel
        except ImportError:
            cpu_kernel = None
        self._cpu_kernel = cpu_kernel
        self._xgr = xgrammar
        return xgrammar

    def compile(self, so: StructuredOutput) -> Any:
        """The compiled grammar; raises UserInputError naming what is wrong with the spec."""
        try:
            with self._lock:
                self._ready()
                c = self.compiler
                if so.kind is GrammarKind.JSON:   # an object, as OpenAI's json_object promises
                    return c.compile_grammar(json_ebnf(self._xgr, '{"type": "object"}', strict=False))
                if so.kind is GrammarKind.JSON_SCHEMA:
                    return c.compile_grammar(json_ebnf(self._xgr, so.spec, strict=True))
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

    def matcher(self, so: StructuredOutput) -> "GrammarState":
        compiled = self.compile(so)
        return GrammarState(self._xgr.GrammarMatcher(compiled))

    def bitmask(self, rows: int) -> "torch.Tensor":
        return self._ready().allocate_token_bitmask(rows, self.vocab_size)

    def fill(self, states: list["GrammarState"], bitmask: "torch.Tensor", rows: list[int]) -> None:
        """bitmask[rows[j]] <- the tokens states[j] allows next (after accepting its last token)."""
        for s in states:
            s.catch_up()
        live = []
        for s, row in zip(states, rows):
            if s.matcher.is_terminated():   # its request ends with this step's result: anything goes
                bitmask[row].fill_(-1)
            else:
                live.append((s.matcher, row))
        if live:
            self._batch.batch_fill_next_token_bitmask([m for m, _ in live], bitmask, [r for _, r in live])

    def apply(self, logits: "torch.Tensor", bitmask: "torch.Tensor", rows: list[int]) -> None:
        """For each r in rows: tokens bitmask[r] disallows get logits[r] = -inf, on the logits' device.
        On the CPU llguidance's kernel does it when installed (same bitmask layout): xgrammar's CPU
        kernel writes each disallowed logit alone, 68 ms against 4 ms for 64 rows of 262k tokens."""
        if logits.device.type == "cpu" and self._cpu_kernel is not None:
            if len(rows) == logits.shape[0]:
                self._cpu_kernel(logits, bitmask)
            else:
                import torch

                index = torch.tensor(rows)
                part = logits[index]
                self._cpu_kernel(part, bitmask[index])
                logits[index] = part
            return
        mask = bitmask.to(logits.device, non_blocking=True)
        self._xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab_size, indices=rows)


class GrammarState:
    """One request's matcher and the token it sampled last step (accepted lazily, see the module)."""

    def __init__(self, matcher: Any):
        self.matcher = matcher
        self._pending: tuple["Sampled", int] | None = None

    def accept(self, token: int) -> None:
        """A token sampled elsewhere (before this matcher existed)."""
        self.catch_up()
        if not self.matcher.is_terminated() and not self.matcher.accept_token(token):
            raise UserInputError(f"token {token} does not fit the request's grammar")

    def sampled(self, step: "Sampled", row: int) -> None:
        self._pending = (step, row)

    def catch_up(self) -> None:
        if self._pending is None:
            return
        step, row = self._pending
        self._pending = None
        token = step.host_token(row)
        if not self.matcher.is_terminated() and not self.matcher.accept_token(token):
            # The mask allowed only accepted tokens: a rejected one means the mask was not applied.
            raise RuntimeError(f"token {token} violates the request's grammar")
