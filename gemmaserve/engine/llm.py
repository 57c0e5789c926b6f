"""`LLM`: the offline Python API (the shape users know from vLLM), with streaming.

    from gemmaserve import LLM, SamplingParams
    llm = LLM()                       # the embedded Gemma 3 270M
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
    print(out[0].outputs[0].text)

    llm.generate("<start_of_image> What is in this picture?", images=["cat.png"])   # multimodal models
    llm.generate("<|audio|> Transcribe this.", audio=["speech.wav"])                # Gemma 4 E2B/E4B
    llm.generate("<|video|> What happens?", videos=["clip.mp4"])                    # Gemma 4

    for delta in llm.stream(["Once upon a time"]):          # text as it is generated
        print(delta.outputs[0].delta_text, end="", flush=True)

    async for delta in llm.astream(["Hi"]): ...               # the same from asyncio

    with LLM() as llm: ...            # memory and threads back at the end of the block (llm.close(); `del llm` too)
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from collections.abc import AsyncIterator, Iterator, Sequence

from ..config.engine import EngineConfig
from ..errors import UserInputError
from ..models.embedded import DEFAULT_MODEL
from ..models.loader import LoadedModel
from ..models.multimodal import Modality
from .llm_engine import LLMEngine
from .request import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_options):
        """`engine_options` are the fields of `EngineConfig` (dtype, device, max_model_len, ...)."""
        try:
            config = EngineConfig(model=model, **engine_options)
        except TypeError as exc:  # an unknown keyword
            raise UserInputError(str(exc).replace("EngineConfig.__init__()", "LLM()")) from None
        self.engine = LLMEngine(config)
        self._calls = 0

    @classmethod
    def from_config(cls, config: EngineConfig, reuse_weights_of: "LLM | LoadedModel | None" = None) -> "LLM":
        """An LLM for `config`; `reuse_weights_of` (another LLM, or a LoadedModel) skips loading."""
        llm = cls.__new__(cls)
        loaded = reuse_weights_of.engine._loaded if isinstance(reuse_weights_of, LLM) else reuse_weights_of
        llm.engine = LLMEngine(config, loaded)
        llm._calls = 0
        return llm

    @property
    def tokenizer(self):
        return self.engine.inputs.tokenizer

    def close(self) -> None:
        """Free the engine's memory (KV cache, weights unless another LLM shares them, compiled steps, CUDA graphs)
        and stop its threads and workers now, whoever still refers to this LLM; later calls raise
        EngineClosedError. Idempotent. `with LLM(...) as llm:` closes it at the end of the block."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, e.g. before timing a cold start (the prefix hit counters restart from zero);
        running requests keep their pages."""
        self.engine.reset_prefix_cache()

    def add_lora(self, name: str, path: str) -> None:
        """Serve the PEFT LoRA adapter directory `path` as `name` (`generate(..., lora=name)`)."""
        self.engine.adapters.add(name, path)

    def remove_lora(self, name: str) -> None:
        self.engine.adapters.remove(name)

    # -- submission ------------------------------------------------------------------------------
    def _submit(self, prompts: str | Sequence[str],
                params: SamplingParams | Sequence[SamplingParams] | None,
                images: Sequence | None = None, audio: Sequence | None = None,
                videos: Sequence | None = None, lora: str | Sequence[str | None] | None = None) -> list[tuple[str, int]]:
        """Validate everything first (a bad prompt raises before any is queued), then queue the
        runs. Returns (request id, n) per prompt. `images` / `audio` / `videos`: for a single prompt, its inputs
        of that kind (or one); for a list of prompts, a list of lists (None for a prompt without). `lora`: a
        loaded adapter's name for every prompt, or one name (or None) per prompt."""
        single = isinstance(prompts, str)
        if single:
            prompts = [prompts]
        images, audio, videos = _per_prompt(images, single), _per_prompt(audio, single), _per_prompt(videos, single)
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
        for name, given in (("images", images), ("audio", audio), ("videos", videos)):
            if given is not None and (not isinstance(given, Sequence) or len(given) != len(prompts)):
                raise UserInputError(f"{name} must hold one list per prompt ({len(prompts)})")
        engine = self.engine
        adapters = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        if len(adapters) != len(prompts):
            raise UserInputError(f"lora must name one adapter (or None) per prompt ({len(prompts)}), got {len(adapters)}")
        for name in {a for a in adapters if a is not None}:
            engine.adapters.get(name)   # an unknown name raises before anything is queued
        checked = []
        for i, (prompt, p, a) in enumerate(zip(prompts, per_prompt, adapters)):
            try:
                ids, items = engine.inputs.prepare(prompt, images[i] if images else None, audio[i] if audio else None,
                                                   videos[i] if videos else None)
                checked.append(engine.validate(ids, p, items, a, text=prompt))
            except UserInputError as exc:
                raise UserInputError(f"prompt {i}: {exc}") from None
        self._calls += 1
        return [(engine.add_checked(c, request_id=f"llm{self._calls}-{i}"), c.params.n) for i, c in enumerate(checked)]

    def _abort(self, submitted: list[tuple[str, int]]) -> None:
        for rid, _ in submitted:
            self.engine.abort_request(rid)

    # -- blocking ----------------------------------------------------------------------------
    def generate(self, prompts: str | Sequence[str],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None, images: Sequence | None = None,
                 audio: Sequence | None = None, videos: Sequence | None = None,
                 lora: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in prompt order, each with its n completions.
        A progress bar shows on a terminal for more than one prompt (`use_tqdm` forces it).
        `images`, `audio` (multimodal models): see `_submit`; an audio input is float samples at the model's
        rate, (samples, rate), encoded bytes (WAV, FLAC, OGG, MP3), a data URL or a file path; a video is encoded
        bytes (MP4, WebM, MKV, ...), a data URL, a file path or (uint8 frames [T, H, W, 3], fps). `lora`: the
        name of an adapter loaded with `lora_modules` or `add_lora`, for every prompt or one (or None) per prompt."""
        return self._collect(self._submit(prompts, params, images, audio, videos, lora), use_tqdm)

    def _collect(self, submitted: list[tuple[str, int]], use_tqdm: bool | None) -> list[RequestOutput]:
        """Step until every submitted request finished; their final outputs, in order."""
        index = {rid: i for i, (rid, _) in enumerate(submitted)}
        done: list[dict[int, CompletionOutput]] = [{} for _ in submitted]
        firsts: list[RequestOutput | None] = [None] * len(submitted)
        show = use_tqdm if use_tqdm is not None else (len(submitted) > 1 and sys.stderr.isatty())
        bar = _progress(len(submitted)) if show else None
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if not out.finished or out.request_id not in index:
                        continue
                    i = index[out.request_id]
                    done[i][out.outputs[0].index] = out.outputs[0]
                    firsts[i] = firsts[i] or out
                    if bar is not None and len(done[i]) == submitted[i][1]:
                        bar.update(1)
        except BaseException:
            self._abort(submitted)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [dataclasses.replace(firsts[i], outputs=[done[i][k] for k in range(n)], finished=True)
                for i, (_, n) in enumerate(submitted)]

    def chat(self, messages: list[dict], params: SamplingParams | None = None,
             chat_template_kwargs: dict | None = None, lora: str | None = None) -> RequestOutput:
        """Complete one conversation in OpenAI's message format, rendered with the checkpoint's chat
        template (Gemma's turn format when it has none). Images and audio (multimodal models) are content
        parts, in place: {"type": "image_url", "image_url": {"url": data URL or file path}},
        {"type": "image", "image": PIL image, uint8 array or path}, {"type": "input_audio", "input_audio":
        {"data": base64, "format": "wav"}}, {"type": "audio_url", "audio_url": {"url": ...}} or
        {"type": "audio", "audio": samples, (samples, rate), bytes or path}; videos as {"type": "video_url",
        "video_url": {"url": ...}} or {"type": "video", "video": path, bytes or (frames, fps)}. `chat_template_kwargs` go to the
        template (e.g. {"enable_thinking": True} for Gemma 4); the output is the raw text, thinking included."""
        from ..models.chat_template import ChatFormatter, parse_chat

        engine = self.engine
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise UserInputError(f"expected SamplingParams, got {type(params).__name__}")
        if lora is not None:
            engine.adapters.get(lora)   # an unknown name raises before any media is loaded
        inputs = engine.inputs
        parsed, media = parse_chat(messages, {m: lay.placeholder for m, lay in inputs.layouts.items()},
                                   python_objects=True)
        loaded = inputs.load_media(*([x for m, x in media if m is kind] for kind in
                                     (Modality.IMAGE, Modality.AUDIO, Modality.VIDEO)))
        ids = ChatFormatter(inputs.tokenizer).encode(parsed, (lambda text: inputs.expand(text, loaded)) if media else None,
                                                     template_kwargs=chat_template_kwargs)
        items = inputs.place(ids, loaded) if media else []
        text = inputs.tokenizer.decode(ids, skip_special_tokens=False)
        checked = engine.validate(ids, params, items, lora, text=text)
        self._calls += 1
        rid = engine.add_checked(checked, request_id=f"llm{self._calls}-chat")
        return self._collect([(rid, params.n)], use_tqdm=False)[0]

    # -- streaming -------------------------------------------------------------------------------
    def stream(self, prompts: str | Sequence[str],
               params: SamplingParams | Sequence[SamplingParams] | None = None,
               images: Sequence | None = None, audio: Sequence | None = None,
               videos: Sequence | None = None, lora: str | Sequence[str | None] | None = None
               ) -> Iterator[RequestOutput]:
        """Yield an output each time a completion has new text or finishes: `outputs[0]` is that
        completion (its `delta_text` is what is new) and `prompt_index` says which prompt it is for.
        Closing the iterator early aborts what is still running."""
        submitted = self._submit(prompts, params, images, audio, videos, lora)
        index = {rid: i for i, (rid, _) in enumerate(submitted)}
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id in index:
                        out.prompt_index = index[out.request_id]
                        yield out
        finally:
            self._abort(submitted)  # no-op for what finished

    async def astream(self, prompts: str | Sequence[str],
                      params: SamplingParams | Sequence[SamplingParams] | None = None
                      ) -> AsyncIterator[RequestOutput]:
        """`stream()` for asyncio: each engine step runs in a worker thread, so the event loop stays
        free while the model computes."""
        submitted = self._submit(prompts, params)
        index = {rid: i for i, (rid, _) in enumerate(submitted)}
        try:
            while self.engine.has_unfinished_requests():
                for out in await asyncio.to_thread(self.engine.step):
                    if out.request_id in index:
                        out.prompt_index = index[out.request_id]
                        yield out
        finally:
            self._abort(submitted)


def _per_prompt(given: Sequence | None, single: bool) -> list | None:
    """A single prompt's inputs (one input, or a list of them) as a one-prompt list of lists."""
    if given is None or not single:
        return given
    if isinstance(given, (str, bytes, dict, tuple)) or not isinstance(given, Sequence):
        return [[given]]
    return [list(given)]


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="prompts", unit="prompt", file=sys.stderr, dynamic_ncols=True)
