"""`LLM`: the offline Python API (the shape users know from vLLM).

    from gemmaserve import LLM, SamplingParams
    llm = LLM()                       # the embedded Gemma 3 270M
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
    print(out[0].outputs[0].text)
"""

from __future__ import annotations

from collections.abc import Sequence

from ..config.engine import EngineConfig
from ..errors import UserInputError
from ..models.embedded import DEFAULT_MODEL
from .llm_engine import LLMEngine
from .request import RequestOutput
from .sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_options):
        """`engine_options` are the fields of `EngineConfig` (dtype, device, max_model_len, ...)."""
        try:
            config = EngineConfig(model=model, **engine_options)
        except TypeError as exc:  # an unknown keyword
            raise UserInputError(str(exc).replace("EngineConfig.__init__()", "LLM()")) from None
        self.engine = LLMEngine(config)

    @classmethod
    def from_config(cls, config: EngineConfig, reuse_weights_of: "LLM | None" = None) -> "LLM":
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(config, reuse_weights_of.engine.loaded if reuse_weights_of else None)
        return llm

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | Sequence[str],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in prompt order. All prompts are checked before
        any runs, so one bad prompt rejects the call without side effects."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, Sequence) or len(prompts) == 0:
            raise UserInputError("no prompts given")
        if params is None:
            params = SamplingParams()
        per_prompt = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise UserInputError(f"{len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        for p in per_prompt:
            if not isinstance(p, SamplingParams):
                raise UserInputError(f"expected SamplingParams, got {type(p).__name__}")
        engine = self.engine
        encoded = []
        for i, (prompt, p) in enumerate(zip(prompts, per_prompt)):
            try:
                ids = engine.tokenize(prompt)
                engine.check_request(ids, p)
            except UserInputError as exc:
                raise UserInputError(f"prompt {i}: {exc}") from None
            encoded.append(ids)
        order = {engine.add_request(prompt, p, ids): i
                 for i, (prompt, p, ids) in enumerate(zip(prompts, per_prompt, encoded))}
        results: list[RequestOutput | None] = [None] * len(prompts)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    results[order[out.request_id]] = out
        except BaseException:
            for rid in order:
                engine.abort_request(rid)
            raise
        return results  # type: ignore[return-value]
