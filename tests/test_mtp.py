"""Gemma 4 MTP drafters (`--speculative-config '{"method": "mtp", "model": DIR, ...}'`): our drafter against
transformers' Gemma4AssistantForCausalLM (logits) and the engine against transformers' assisted generation with it
(tokens, every round's drafts, with images, audio and video too), and the engine's output with drafts equal to one
token per step in every cache mode."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from gemmaserve import LLM, SamplingParams
from gemmaserve.attention.base import AttentionMetadata
from gemmaserve.config.engine import EngineConfig
from gemmaserve.errors import UserInputError
from gemmaserve.models.base import ModelInputs
from gemmaserve.models.gemma4_assistant import AssistantConfig, Gemma4Assistant

from helpers import (fresh_seed, generate_rows, ours_from_hf, paged_kv, save_checkpoint, tiny_gemma4_assistant,
                     tiny_gemma4_hf, tiny_hf_model)


def _ids(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [2] + torch.randint(3, 300, (n - 1,), generator=g).tolist()


def _hf_drafts(target, assistant, committed: list[int], k: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' drafter loop (candidate_generator.py's, one round) for the last token of `committed`,
    the target's KV and hidden state computed over the tokens before it: each draft's logits too, which
    `generate` does not give."""
    p = len(committed) - 1
    with torch.no_grad():
        out = target(torch.tensor([committed[:-1]]), output_hidden_states=True, return_shared_kv_states=True,
                     use_cache=False)
        hidden, token = out.hidden_states[-1][:, -1:], torch.tensor([[committed[-1]]])
        embed = target.get_input_embeddings()
        drafts, logits = [], []
        for _ in range(k):
            o = assistant(inputs_embeds=torch.cat([embed(token), hidden], -1), position_ids=torch.tensor([[p]]),
                          attention_mask=torch.ones(1, p + 1, dtype=torch.long), shared_kv_states=out.shared_kv_states)
            token, hidden = o.logits.argmax(-1), o.last_hidden_state
            drafts.append(int(token))
            logits.append(o.logits[0, 0])
    return drafts, logits


@pytest.mark.parametrize("variant,ordered,backend", [("e2b", True, "torch"), ("31b", False, "torch"),
                                                     ("31b", True, "triton")])
def test_drafter_logits_match_transformers(variant, ordered, backend):
    """E2B-like (KV-sharing target, PLE, centroid head) and 31B-like (K = V, 2 KV heads): a prompt several
    windows long through our paged target, then three drafts through our drafter reading its KV (the
    Triton kernels run under the interpreter here)."""
    seed = fresh_seed()
    target = tiny_gemma4_hf(seed, variant)
    hf = tiny_gemma4_assistant(seed + 1, variant, ordered=ordered)
    ids = _ids(seed, 3 * target.config.sliding_window + 5)
    with torch.no_grad():
        token = int(target(torch.tensor([ids])).logits[0, -1].argmax())
    want, want_logits = _hf_drafts(target, hf, ids + [token], 3)

    ours = ours_from_hf(target)
    cfg = AssistantConfig.from_hf(hf.config.to_dict())
    drafter = Gemma4Assistant(cfg, cfg.reads(ours.config))
    drafter.load_weights(drafter.map_checkpoint(hf.state_dict().items()))
    kv, backend, cache = paged_kv(ours, backend, 400)
    n = len(ids)
    assert kv.allocate("0", ids, 0, n, prefill=True)
    with torch.inference_mode():
        md = AttentionMetadata([n], [n], kv.group_tables(["0"]), kv.layer_slot)
        hidden = ours(ModelInputs(torch.tensor(ids), torch.arange(n), backend.begin_batch(md, cache)))[-1:]
        kv.commit("0", ids, n)
        attn = backend.begin_batch(AttentionMetadata([1], [n], kv.group_tables(["0"]), kv.layer_slot), cache)
        t = torch.tensor([token])
        for i in range(3):
            x = torch.cat([ours.embed(t), hidden], -1)
            h = drafter(ModelInputs(None, torch.tensor([n]), attn, inputs_embeds=x))
            err = (drafter.compute_logits(h)[0] - want_logits[i]).abs().max().item()
            assert err < 1e-4, f"{variant} seed={seed} draft {i}: max abs diff {err}"
            t = drafter.draft(h)
            assert int(t) == want[i]
            hidden = drafter.project(h)


def _hf_assisted(target, assistant, inputs: dict, max_new_tokens: int, k: int = 3,
                 committed_kv: bool = True) -> tuple[list[int], dict]:
    """transformers' own assisted generation with the MTP drafter (`generate(assistant_model=...)`, which runs its
    SinglePositionMultiTokenCandidateGenerator), greedy, k drafts a round: the tokens after `inputs["input_ids"]`,
    and every round's drafts by the length of the sequence they follow (its last token included).

    `committed_kv`: after a verification, the drafter reads the target's KV of the committed tokens before the last
    one (computed without a cache), as it does after the prefill. transformers gives it the verification's KV cut
    at the new length instead, which after a partly rejected round holds a rejected draft's KV at the new token's
    position (on sliding layers, whose tensors start at the window and not at position 0, every rejected draft's)
    and, on sliding layers, as few as W keys where the drafter reads W + 1 (its cache keeps W - 1). A drafter whose
    attention matters then drafts otherwise than from the committed context (as ours does): 8 of the 10 rounds of
    each prompt for the random drafter of the tensor-parallel test, 3 to 9 of 9 to 13 for the agreeing pair's."""
    from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator as Generator

    rounds: dict[int, list[int]] = {}
    get_candidates = Generator.get_candidates
    media = {key: v for key, v in inputs.items() if key not in ("input_ids", "attention_mask", "mm_token_type_ids")}
    types = inputs.get("mm_token_type_ids")

    def recorded(self, input_ids, *args, **kwargs):
        outputs = kwargs.get("model_outputs")
        p = input_ids.shape[1] - 1
        if committed_kv and outputs is not None and outputs.shared_kv_states["full_attention"][0].shape[2] != p:
            extra = {} if types is None else {"mm_token_type_ids": torch.nn.functional.pad(types, (0, p))[:, :p]}
            outputs["shared_kv_states"] = target(input_ids[:, :p], **media, **extra, return_shared_kv_states=True,
                                                 use_cache=False).shared_kv_states
        ids, logits = get_candidates(self, input_ids, *args, **kwargs)
        if logits is not None:   # (None: no round, e.g. the prefill's)
            rounds[input_ids.shape[1]] = ids[0, input_ids.shape[1]:].tolist()
        return ids, logits

    ids = inputs["input_ids"]
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        mp.setattr(Generator, "get_candidates", recorded)
        mp.setattr(assistant.generation_config, "num_assistant_tokens", k)
        mp.setattr(assistant.generation_config, "num_assistant_tokens_schedule", "constant")
        out = target.generate(**{"attention_mask": torch.ones_like(ids), **inputs}, assistant_model=assistant,
                              max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, eos_token_id=[])
    return out[0, ids.shape[1]:].tolist(), rounds


def _accepted(rounds: dict[int, list[int]], tokens: list[int], prompt_len: int) -> int:
    """Drafts of `rounds` that greedy verification kept: each round's longest prefix that `tokens` continue with."""
    kept = 0
    for at, drafts in rounds.items():
        after = tokens[at - prompt_len:]
        kept += next((i for i, d in enumerate(drafts) if i >= len(after) or after[i] != d), len(drafts))
    return kept


def _verified_drafts(engine) -> dict[str, dict[int, list[int]]]:
    """From now on, the drafts each request's steps verify, by the length of the sequence they follow (what
    `_hf_assisted` gives for transformers)."""
    rounds: dict[str, dict[int, list[int]]] = {}
    schedule = engine._scheduler.schedule

    def recorded():
        plan = schedule()
        for s in plan.seqs:
            if s.num_drafts:
                rounds.setdefault(s.req_id, {})[s.start + s.num_new_tokens - s.num_drafts] = \
                    s.token_ids[len(s.token_ids) - s.num_drafts:]
        return plan

    engine._scheduler.schedule = recorded
    return rounds


def _agreeing_pair(seed: int, variant: str = "31b"):
    """A target whose next token leans on its current one and a drafter built to guess it (its input
    projection passes twice the token's embedding through, its head is the target's table): drafts are accepted
    often but not always, so every acceptance length runs, and the hidden state and KV it reads still change
    them (with 4x the embedding, a drafter given the wrong row's hidden state drafted the same)."""
    target = tiny_gemma4_hf(seed, variant)
    drafter = tiny_gemma4_assistant(seed + 1, variant, hidden_size=target.config.hidden_size)
    h = target.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for model, damp in ((target, 0.2), (drafter, 0.05)):
            for name, p in model.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    p.mul_(damp)
        mix = 0.3 * torch.randn(h, h, generator=g) / h ** 0.5   # the hidden state's (small) part
        drafter.pre_projection.weight.copy_(torch.cat([2 * torch.eye(h), mix], 1))
        drafter.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        drafter.model.norm.weight.copy_(target.model.norm.weight)
    drafter.tie_weights()
    return target, drafter


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target, drafter = _agreeing_pair(31)
    root = tmp_path_factory.mktemp("mtp")
    path = save_checkpoint(target, root / "target")
    drafter.save_pretrained(root / "drafter")
    return target, drafter, str(path), str(root / "drafter"), LLM(model=str(path), page_size=4)


def _mtp(drafter_dir: str, k: int = 3) -> dict:
    return {"method": "mtp", "model": drafter_dir, "num_speculative_tokens": k, "disable_by_batch_size": 64}


PROMPTS = ["abcdefghij klmnop qrstuv " * 4, "zyxw vuts " * 5, "hello world " * 3, "one two three four five"]
MODES = {
    "v1": dict(kv_cache_manager="v1"),
    "v2": dict(kv_cache_manager="v2", enable_prefix_caching=False),
    "v2+scratch+prefix": dict(kv_cache_manager="v2", swa_scratch_reuse="on", enable_prefix_caching=True),
    "chunk 8": dict(kv_cache_manager="v2", swa_scratch_reuse="on", max_num_batched_tokens=8),
    "preempting": dict(kv_cache_manager="v2", kv_cache_memory=88 * 1024, max_num_batched_tokens=16),
    "async": dict(async_scheduling="on"),
    "fp8 kv": dict(kv_cache_dtype="fp8"),
    "compiled": dict(cpu_compile="on"),   # decode and verification steps through the graphs, hidden states too
}


def _generate(path, base, opts, params, spec):
    return generate_rows(path, base, opts, params, spec, PROMPTS)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_tokens_equal_without_drafts_in_every_cache_mode(pair, mode):
    _, _, path, drafter_dir, base = pair
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    ref, _ = _generate(path, base, MODES[mode], params, None)
    got, engine = _generate(path, base, MODES[mode], params, _mtp(drafter_dir))
    assert got == ref
    st = engine._scheduler.spec_stats
    assert 0 < st.accepted < st.drafted, st   # drafts both kept and rejected: both paths ran
    assert len(st.accepted_at) == 3 and st.accepted_at[2] > 0, st   # whole rounds accepted too
    if mode == "preempting":
        assert engine._scheduler.num_preemptions > 0
    if mode == "compiled":
        assert engine.info.cpu_compile == "ready"


def test_sampling_with_seeds_and_logprobs_equal_without_drafts(pair):
    _, _, path, drafter_dir, base = pair
    params = SamplingParams(max_tokens=16, temperature=0.1, top_p=0.9, seed=7, logprobs=2, ignore_eos=True)
    ref, _ = _generate(path, base, {}, params, None)
    got, engine = _generate(path, base, {}, params, _mtp(drafter_dir, 4))
    assert got == ref and engine._scheduler.spec_stats.accepted > 0


@pytest.fixture(scope="module")
def assisted(pair):
    """transformers' assisted generation (tokens, rounds) of each of PROMPTS, with the pair's drafter."""
    target, drafter, _, _, base = pair
    return [_hf_assisted(target, drafter, {"input_ids": torch.tensor([base.engine.inputs.prepare(p)[0]])}, 20)
            for p in PROMPTS]


@pytest.mark.parametrize("cpu_compile", ["off", "on"])
def test_tokens_and_every_rounds_drafts_equal_transformers_assisted_generation(pair, assisted, cpu_compile):
    """The prompts in one batch against transformers' generate(assistant_model=drafter), each alone: the same
    tokens, and the same drafts in every round after the same committed tokens (whatever the last round
    accepted: the hidden state comes from the row that chose the last token, the KV stops before it), so the
    same accepted counts, also where the target's steps run compiled graphs (their hidden states). The
    requests draft at every step, as transformers does (no pause after misses)."""
    _, _, path, drafter_dir, base = pair
    llm = LLM.from_config(EngineConfig(model=path, page_size=4, speculative_config=_mtp(drafter_dir),
                                       cpu_compile=cpu_compile), base)
    assert llm.engine.info.cpu_compile == ("ready" if cpu_compile == "on" else "off")
    engine = llm.engine
    engine._scheduler.misses_before_pause = 1 << 30
    compiled_rows: list[int] = []   # decode batches the graphs computed
    if cpu_compile == "on":
        run = engine._runner.compiled.run

        def counted(ids, pos, md):
            out = run(ids, pos, md)
            if out is not None:
                compiled_rows.append(len(ids))
            return out

        engine._runner.compiled.run = counted
    rounds = _verified_drafts(engine)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=20, ignore_eos=True))
    for o, (tokens, theirs) in zip(outs, assisted):
        c = o.outputs[0]
        assert c.token_ids == tokens
        assert rounds[o.request_id] == theirs, o.prompt
        assert (c.num_draft_tokens, c.num_accepted_tokens) == (
            sum(map(len, theirs.values())), _accepted(theirs, tokens, len(o.prompt_token_ids)))
    st = engine._scheduler.spec_stats
    assert 0 < st.accepted_at[0] and st.accepted_at[0] > st.accepted_at[2] > 0, st   # every acceptance length
    assert cpu_compile == "off" or 16 in compiled_rows   # verification steps of 4 x 4 rows ran the graphs


def test_two_tensor_parallel_ranks_draft_what_transformers_drafts(pair, tmp_path):
    """Every rank builds its own drafter whose attention keeps the q heads that read that rank's KV heads
    (o_proj all-reduced, the rest replicated). A random drafter at full strength (attention matters, drafts
    mostly rejected), drafting at every step: the tokens and every round's drafts are transformers' assisted
    generation's."""
    target, _, path, _, base = pair
    assistant = tiny_gemma4_assistant(8, "31b", hidden_size=target.config.hidden_size)
    assistant.save_pretrained(tmp_path / "drafter")
    two = LLM(path, page_size=4, tensor_parallel_size=2, speculative_config=_mtp(str(tmp_path / "drafter")))
    engine = two.engine
    engine._scheduler.misses_before_pause = 1 << 30   # draft at every step, however often rejected
    try:
        rounds = _verified_drafts(engine)
        for o in two.generate(PROMPTS[:2], SamplingParams(max_tokens=12, ignore_eos=True)):
            tokens, theirs = _hf_assisted(target, assistant, {"input_ids": torch.tensor([o.prompt_token_ids])}, 12)
            assert o.outputs[0].token_ids == tokens and rounds[o.request_id] == theirs and len(theirs) > 8
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def media_pair(tmp_path_factory):
    """An E2B-like target with image and audio towers whose text tower's post-norms (attention, feed-forward,
    per-layer input) are scaled to 0.2, so that its next token leans on the current one, and a drafter that often
    guesses it (twice the token's embedding passed through, the target's table as its head) while reading the
    target's KV at full strength (the media's too: its drafts change with it); the engine over the target."""
    from helpers import save_gemma4_audio_checkpoint, tiny_hf_gemma4_audio

    target = tiny_hf_gemma4_audio(77)
    text = target.model.language_model
    h = text.config.hidden_size
    drafter = tiny_gemma4_assistant(78, "e2b", hidden_size=h)
    g = torch.Generator().manual_seed(77)
    with torch.no_grad():
        for name, p in text.named_parameters():
            if name.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight",
                              "post_per_layer_input_norm.weight")):
                p.mul_(0.2)
        mix = 0.3 * torch.randn(h, h, generator=g) / h ** 0.5
        drafter.pre_projection.weight.copy_(torch.cat([2 * torch.eye(h), mix], 1))
        drafter.model.embed_tokens.weight.copy_(text.embed_tokens.weight)
        drafter.model.norm.weight.copy_(text.norm.weight)
    drafter.tie_weights()
    root = tmp_path_factory.mktemp("mtp_media")
    path = save_gemma4_audio_checkpoint(target, root / "target")
    drafter.save_pretrained(root / "drafter")
    llm = LLM(str(path), dtype="float32", page_size=4, kv_cache_memory=16 << 20, max_num_batched_tokens=800)
    return target, drafter, str(root / "drafter"), llm


def _hf_media_inputs(ids: list[int], items) -> dict:
    """transformers' Gemma4ForConditionalGeneration inputs for our prompt ids and media items (image patches and
    positions, a video's frames, audio features and mask) and the token types that place them."""
    import numpy as np

    from helpers import AUD, IMG, VID

    t = torch.tensor([ids])
    types = torch.zeros_like(t)
    inputs = {"input_ids": t, "mm_token_type_ids": types}

    def stacked(kind: str, field: str) -> torch.Tensor:
        return torch.from_numpy(np.stack([getattr(it, field) for it in items if it.modality.value == kind]))

    kinds = {it.modality.value for it in items}
    if "image" in kinds:
        inputs.update(pixel_values=stacked("image", "data"), image_position_ids=stacked("image", "extra"))
        types[t == IMG] = 1
    if "video" in kinds:   # one video: its frames
        frames = stacked("video", "data")
        inputs.update(pixel_values_videos=frames, video_position_ids=stacked("video", "extra"),
                      num_frames_per_video=torch.tensor([len(frames)]))
        types[t == VID] = 2
    if "audio" in kinds:
        inputs.update(input_features=stacked("audio", "data"), input_features_mask=stacked("audio", "extra"))
        types[t == AUD] = 3
    return inputs


def test_image_audio_and_video_requests_accept_the_drafts_transformers_makes(media_pair):
    """Requests with an image, an audio clip and a video, beside a text one, in one batch with MTP drafts: each
    one's greedy tokens equal the same request's without drafts and transformers' assisted generation given the
    same prompt ids and media inputs (their preprocessing is checked against transformers' in test_gemma4_*), every
    round drafts what transformers drafts after the same committed tokens (the drafter reads the target's KV over
    the image, clip and frames), and each request accepts drafts."""
    from pathlib import Path

    import numpy as np
    import soundfile
    from PIL import Image

    target, drafter, drafter_dir, llm = media_pair
    rng = np.random.default_rng(4)
    image = Image.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8))
    frames = rng.integers(0, 256, (3, 30, 40, 3), dtype=np.uint8)
    speech = soundfile.read(Path(__file__).parent / "data" / "speech_16k.wav", dtype="float32")[0][:16_000]
    prompts = ["look <|image|> here", "hear <|audio|> again", "watch <|video|> now", "only text here"]
    media = dict(images=[[image], None, None, None], audio=[None, [speech], None, None],
                 videos=[None, None, [(frames, 4)], None])
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False, **media)]
    spec = LLM.from_config(llm.engine.config.replace(speculative_config=_mtp(drafter_dir)), llm)
    spec.engine._scheduler.misses_before_pause = 1 << 30   # draft at every step, as transformers does
    rounds = _verified_drafts(spec.engine)
    outs = spec.generate(prompts, params, use_tqdm=False, **media)
    spec.engine._kv.check_integrity()
    for i, (o, tokens) in enumerate(zip(outs, want)):
        ids, items = llm.engine.inputs.prepare(prompts[i], *(media[kind][i] for kind in ("images", "audio", "videos")))
        assert ids == o.prompt_token_ids and {it.modality.value for it in items} == [{"image"}, {"audio"}, {"video"},
                                                                                   set()][i]
        theirs_tokens, theirs = _hf_assisted(target, drafter, _hf_media_inputs(ids, items), params.max_tokens)
        c = o.outputs[0]
        assert c.token_ids == tokens == theirs_tokens, prompts[i]
        assert rounds[o.request_id] == theirs, prompts[i]
        assert 0 < c.num_accepted_tokens == _accepted(theirs, tokens, len(ids)), (prompts[i], c.num_accepted_tokens)


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_requests_aborted_with_drafts_in_flight_leave_the_others_and_the_counters_whole(pair, async_scheduling):
    """Requests aborted with MTP drafts in flight (made for their next step, or in the step launched), beside
    requests that go on, with and without asynchronous scheduling: check_aborts_mid_speculation."""
    from helpers import check_aborts_mid_speculation

    _, _, path, drafter_dir, base = pair
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in base.generate(PROMPTS, params)]
    engine = LLM.from_config(EngineConfig(model=path, page_size=4, async_scheduling=async_scheduling,
                                          speculative_config=_mtp(drafter_dir)), base).engine
    check_aborts_mid_speculation(engine, PROMPTS, params, want)


def test_config_and_checkpoint_errors_are_clear(pair, tmp_path):
    _, _, path, drafter_dir, base = pair
    for bad, match in [({"method": "mtp", "num_speculative_tokens": 2}, 'needs "model"'),
                       ({**_mtp(drafter_dir), "prompt_lookup_max": 3}, "takes no prompt_lookup_max")]:
        with pytest.raises(UserInputError, match=match):
            EngineConfig(speculative_config=bad)

    def build(drafter: str, model: str = path):
        return LLM.from_config(EngineConfig(model=model, page_size=4, speculative_config=_mtp(drafter)),
                               base if model == path else None)

    with pytest.raises(UserInputError, match="no config.json"):
        build(str(tmp_path / "missing"))
    with pytest.raises(UserInputError, match="not a Gemma 4 MTP drafter"):
        build(path)   # the target itself
    other = tiny_gemma4_assistant(3, "e2b")   # made for another target: its KV shapes differ
    other.save_pretrained(tmp_path / "e2b_drafter")
    with pytest.raises(UserInputError, match="expects KV of"):
        build(str(tmp_path / "e2b_drafter"))
    wrong_size = tmp_path / "wide"
    shutil.copytree(drafter_dir, wrong_size)
    cfg = json.loads((wrong_size / "config.json").read_text())
    cfg["backbone_hidden_size"] = 128
    (wrong_size / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserInputError, match="target of hidden size 128"):
        build(str(wrong_size))
    gemma3 = save_checkpoint(tiny_hf_model(3), tmp_path / "gemma3")
    with pytest.raises(UserInputError, match="Gemma 4 targets only"):
        build(drafter_dir, str(gemma3))
    damaged = tmp_path / "damaged"
    shutil.copytree(drafter_dir, damaged)
    for f in damaged.glob("*.safetensors"):
        f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(UserInputError, match="cannot read"):
        build(str(damaged))


def test_drafts_the_grammar_forbids_are_cut_before_verification(pair):
    """Structured output: a request carries only drafts its grammar allows after what it has emitted (so
    the target never verifies a forbidden one), and its text is what it is without drafts."""
    from gemmaserve.engine.structured.structured_output import StructuredOutput

    _, _, path, drafter_dir, base = pair
    so = {"kind": "regex", "spec": "(ab|cd|aa|bb)+x"}
    params = SamplingParams(max_tokens=16, structured_output=so)
    want = [o.outputs[0].text for o in base.generate(PROMPTS[:3], params)]
    engine = LLM.from_config(EngineConfig(model=path, page_size=4, speculative_config=_mtp(drafter_dir)), base).engine
    ids = [engine.add_request(p, params) for p in PROMPTS[:3]]
    done, kept, cut = {}, 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].text
        for req in engine._scheduler.running:
            if not req.sampling_sent:
                continue
            matcher = engine._grammars.matcher(StructuredOutput.parse(so))
            for t in req.output_token_ids:
                matcher.accept(t)
            assert matcher.allowed_prefix(req.drafts) == len(req.drafts), (req.output_token_ids, req.drafts)
            kept += len(req.drafts)
            cut += len(req.drafts) < 3
    assert [done[i] for i in ids] == want
    assert kept > 0 and cut > 0, (kept, cut)


def test_a_drafter_that_guesses_nothing_pauses_and_retries(pair, tmp_path):
    """A random drafter for the same target: every draft rejected, so each request stops drafting after
    MISSES_BEFORE_PAUSE steps, for 8 steps, then 16, ... and tries again in between; the tokens stay."""
    from gemmaserve.engine.scheduler import MISSES_BEFORE_PAUSE

    _, _, path, _, base = pair
    tiny_gemma4_assistant(5, "31b").save_pretrained(tmp_path / "random")
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ref, _ = _generate(path, base, {}, params, None)
    got, engine = _generate(path, base, {}, params, _mtp(str(tmp_path / "random")))
    st = engine._scheduler.spec_stats
    assert got == ref and st.accepted <= 2, st   # a random guess is right once in a while
    # 39 decode steps per request: drafting 4, pause 8, drafting 4, pause 16, drafting 4, pause 32
    decode_steps = 39 * len(PROMPTS)
    assert 2 * MISSES_BEFORE_PAUSE * len(PROMPTS) < st.steps < 0.4 * decode_steps, st
