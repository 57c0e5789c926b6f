"""Gemma 3 with images (issue 12) against transformers' Gemma3ForConditionalGeneration on a tiny random
checkpoint: preprocessing, logits (images before, between and after text; chunks that would cut
through an image), greedy tokens across cache modes and mixed batches, one encoder call per image,
and prefix-cache keys that know the image."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gemmaserve import LLM, SamplingParams
from gemmaserve.attention.base import AttentionMetadata
from gemmaserve.attention.torch_backend import TorchAttentionBackend
from gemmaserve.config.engine import EngineConfig
from gemmaserve.engine.media.images import ImageLimits, load_image
from gemmaserve.engine.scheduler import Scheduler
from gemmaserve.errors import UserInputError
from gemmaserve.models.base import ModelInputs

from helpers import (BOI, EOI, IMG, VISION_TOKENS_PER_IMAGE as TOKENS_PER_IMAGE, assert_image_prompt_matches,
                     hf_vision_processor, make_manager, save_vision_checkpoint as _save, tiny_hf_vision)

TOL = 1e-4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    hf = tiny_hf_vision(1234)
    path = _save(hf, tmp_path_factory.mktemp("g3v"))
    llm = LLM(model=str(path), page_size=4, max_num_batched_tokens=64, kv_cache_memory=8 << 20)
    return hf, path, llm


@pytest.fixture(scope="module")
def processor(setup):
    """transformers' Gemma3Processor over the checkpoint's tokenizer: the reference prompt ids."""
    return hf_vision_processor(setup[1], "gemma3")


def _images(n: int, seed: int = 0):
    from PIL import Image

    rng = np.random.default_rng(seed)
    sizes = [(40, 30), (17, 23), (28, 28), (64, 20)]
    return [Image.fromarray(rng.integers(0, 256, (sizes[i % 4][1], sizes[i % 4][0], 3), dtype=np.uint8))
            for i in range(n)]


# -- preprocessing ------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [28, 896])
def test_preprocessing_equals_hf_processor(size):
    from PIL import Image
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from gemmaserve.models.image_processing import ImageProcessor

    rng = np.random.default_rng(size)
    hf = Gemma3ImageProcessorPil(size={"height": size, "width": size}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    ours = ImageProcessor(size)
    rgba = rng.integers(0, 256, (31, 45, 4), dtype=np.uint8)
    images = [Image.fromarray(rng.integers(0, 256, (50, 70, 3), dtype=np.uint8)),
              Image.fromarray(rgba, "RGBA"), Image.fromarray(rng.integers(0, 256, (20, 9), dtype=np.uint8), "L"),
              Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))]
    ref = hf(images, return_tensors="np")["pixel_values"]
    got = np.stack([ours.pixels(im) for im in images])
    assert got.dtype == np.float32 and got.shape == ref.shape
    np.testing.assert_array_equal(got, ref)   # bit for bit: x / 255 in float32 is float64 x * (1 / 255) rounded


# -- logits -----------------------------------------------------------------------------------------
def _prompt(layout: str, seed: int) -> tuple[list[int], int]:
    """Token ids with images where `layout` has an "I" (text tokens elsewhere), and the image count."""
    rng = np.random.default_rng(seed)
    ids = [2]
    for ch in layout:
        if ch == "I":
            ids += [10, BOI] + [IMG] * TOKENS_PER_IMAGE + [EOI, 10]
        else:
            ids += rng.integers(4, 290, 3).tolist()
    return ids, layout.count("I")


def _hf_logits(hf, ids, pixels):
    ids_t = torch.tensor([ids])
    with torch.no_grad():
        out = hf(input_ids=ids_t, pixel_values=pixels if len(pixels) else None,
                 token_type_ids=(ids_t == IMG).long())
    return out.logits[0]


def _our_logits(model, ids, pixels, chunk, backend=None):
    """Prefill `ids` in chunks of `chunk` tokens, cut by the scheduler's rule (never inside an image)."""
    from gemmaserve.engine.media.items import MediaItem, token_spans

    layout = model.image_layout
    items = [MediaItem(s, n, "", p.numpy()) for (s, n), p in zip(token_spans(ids, layout.token_id), pixels)]
    feats = model.encode_images(pixels) if len(pixels) else None
    specs = model.kv_layer_specs(torch.float32)
    kv = make_manager("v2", specs, 4, 256, enable_prefix_caching=False)
    backend = backend or TorchAttentionBackend()
    cache = backend.allocate_kv_cache(specs, kv.layout, torch.device("cpu"))
    req = SimpleNamespace(max_chunk_tokens=None, media=items)
    done, outs = 0, []
    while done < len(ids):
        n = Scheduler._chunk(req, done, len(ids) - done, chunk)
        assert n > 0
        end = done + n
        assert kv.allocate("0", ids, done, end, prefill=n > 1)
        t = torch.tensor(ids[done:end])
        embeds = model.embed(t)
        for i, im in enumerate(items):
            lo, hi = max(im.start, done), min(im.end, end)
            if lo < hi:
                embeds[lo - done:hi - done] = feats[i, lo - im.start:hi - im.start]
        spans = [[(im.start, im.end) for im in items if im.start < end and im.end > done]]
        md = AttentionMetadata([n], [end], kv.group_tables(["0"]), kv.layer_slot, image_spans=spans)
        with torch.inference_mode():
            hidden = model(ModelInputs(t, torch.arange(done, end), backend.begin_batch(md, cache),
                                       inputs_embeds=embeds))
            outs.append(model.compute_logits(hidden))
        kv.commit("0", ids, end)
        done = end
    return torch.cat(outs)


@pytest.mark.parametrize("layout", ["IT", "TIT", "TIIT", "TITIT", "TTI"])
@pytest.mark.parametrize("chunk", [5, 9, 64])
def test_logits_match_transformers(setup, layout, chunk):
    hf, _, llm = setup
    model = llm.engine._model
    ids, n = _prompt(layout, seed=len(layout) * 7 + chunk)
    pixels = torch.randn(n, 3, 28, 28, generator=torch.Generator().manual_seed(chunk))
    ref = _hf_logits(hf, ids, pixels)
    got = _our_logits(model, ids, pixels, chunk)
    err = (got - ref).abs().max().item()
    assert err < TOL, f"{layout} chunk={chunk}: {err}"


def test_mask_matters():
    """The tolerance sees the bidirectional image mask: a causal-only run differs."""
    hf = tiny_hf_vision(99)
    ids, n = _prompt("TIT", 3)
    pixels = torch.randn(n, 3, 28, 28, generator=torch.Generator().manual_seed(3))
    ids_t = torch.tensor([ids])
    with torch.no_grad():
        bidi = hf(input_ids=ids_t, pixel_values=pixels, token_type_ids=(ids_t == IMG).long()).logits
        causal = hf(input_ids=ids_t, pixel_values=pixels).logits
    assert (bidi - causal).abs().max().item() > 100 * TOL


def test_triton_kernel_honours_the_image_mask(setup):
    from gemmaserve.attention.triton_backend import TritonAttentionBackend, triton_available

    if triton_available(torch.device("cpu")) is not None:
        pytest.skip("triton interpreter not available")
    hf, _, llm = setup
    ids, n = _prompt("TITIT", 5)
    pixels = torch.randn(n, 3, 28, 28, generator=torch.Generator().manual_seed(5))
    ref = _hf_logits(hf, ids, pixels)
    got = _our_logits(llm.engine._model, ids, pixels, 9, backend=TritonAttentionBackend())
    assert (got - ref).abs().max().item() < TOL


# -- the engine -------------------------------------------------------------------------------------
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def _hf_greedy(hf, processor, prompt, images, n=6):
    """transformers end to end: its processor expands the prompt's placeholders and prepares the pixels."""
    inputs = processor(text=prompt, images=images, return_tensors="pt")
    ids_t = inputs["input_ids"]
    with torch.no_grad():
        out = hf.generate(input_ids=ids_t, pixel_values=inputs["pixel_values"], token_type_ids=inputs["token_type_ids"],
                          attention_mask=inputs["attention_mask"], max_new_tokens=n, do_sample=False, pad_token_id=0,
                          eos_token_id=[])
    return out[0, ids_t.shape[1]:].tolist()


CASES = [("<start_of_image> describe it", 1), ("two: <start_of_image> and <start_of_image> then", 2),
         ("a picture follows <start_of_image>", 1)]


def _run(llm, cases=CASES, seed=0, extra_text=()):
    prompts = [p for p, _ in cases] + list(extra_text)
    images = [_images(n, seed + i) for i, (_, n) in enumerate(cases)] + [None] * len(extra_text)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False, images=images)]


@pytest.mark.parametrize("prompt, n", CASES + [
    ("<start_of_image><start_of_image>", 2), ("line one\n<start_of_image>\nline two", 1),
    ("x <start_of_image> y <start_of_image> z <start_of_image> w <start_of_image>", 4)])
def test_prompt_ids_equal_transformers_processor(setup, processor, prompt, n):
    """Our placeholder expansion is transformers': "\n\n<start_of_image>", the soft tokens, "<end_of_image>\n\n"
    in the same ids, the images' spans where its token types say, and the same pixels."""
    _, _, llm = setup
    images = _images(n, 3)
    ids, items = llm.engine.inputs.prepare_images(prompt, images)
    assert_image_prompt_matches(ids, items, processor(text=prompt, images=images, return_tensors="np"), "token_type_ids")
    assert [it.length for it in items] == [TOKENS_PER_IMAGE] * n


def test_greedy_equals_transformers_generate(setup, processor):
    hf, _, llm = setup
    got = _run(llm)
    for (prompt, n), tokens, i in zip(CASES, got, range(len(CASES))):
        assert tokens == _hf_greedy(hf, processor, prompt, _images(n, i)), prompt


@pytest.mark.parametrize("options", [
    dict(kv_cache_manager="v1"), dict(max_num_batched_tokens=9), dict(max_num_batched_tokens=13, max_num_seqs=2),
    dict(max_num_batched_tokens=TOKENS_PER_IMAGE),   # decodes must leave a whole step to an image
    dict(attention_backend="triton", max_num_batched_tokens=9),   # Triton interpreted on the CPU
    dict(enable_prefix_caching=False), dict(kv_cache_manager="v2", swa_scratch_reuse="on", max_num_batched_tokens=9),
])
def test_greedy_tokens_equal_across_cache_modes_and_mixed_batches(setup, options):
    _, path, llm = setup
    expected = _run(llm, extra_text=["just text here", "more text"])
    other = LLM.from_config(EngineConfig(model=str(path), page_size=4, kv_cache_memory=8 << 20,
                                         **{"max_num_batched_tokens": 64, **options}), llm)
    assert not llm.engine.info.swa_scratch_reuse   # off by default for a multimodal checkpoint
    assert other.engine.info.swa_scratch_reuse == (options.get("swa_scratch_reuse") == "on")
    for _ in range(2):   # cold, then warm prefix cache
        assert _run(other, extra_text=["just text here", "more text"]) == expected
    other.engine._kv.check_integrity()


def test_drafted_tokens_leave_image_requests_unchanged(setup):
    """Speculative decoding (prompt lookup) over prompts with images, cold and warm prefix cache: the same
    tokens as without drafts."""
    _, path, llm = setup
    expected = _run(llm, extra_text=["just text here", "more text"])
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "disable_by_batch_size": 64}
    other = LLM.from_config(EngineConfig(model=str(path), page_size=4, kv_cache_memory=8 << 20,
                                         max_num_batched_tokens=64, speculative_config=spec), llm)
    for _ in range(2):
        assert _run(other, extra_text=["just text here", "more text"]) == expected
    assert other.engine._scheduler.spec_stats.drafted > 0
    other.engine._kv.check_integrity()


def test_encoder_runs_once_per_image(setup):
    _, path, llm = setup
    small = LLM.from_config(EngineConfig(model=str(path), page_size=4, kv_cache_memory=8 << 20,
                                         max_num_batched_tokens=7, enable_prefix_caching=False), llm)
    calls = []
    model = small.engine._model
    original = model.encode_images
    model.encode_images = lambda px, pos=None: (calls.append(px.shape[0]), original(px, pos))[1]
    try:
        _run(small, cases=[("x <start_of_image> y <start_of_image> z <start_of_image> w", 3)])
    finally:
        del model.encode_images
    assert sum(calls) == 3, calls      # however many 7-token chunks cover the prompt
    assert small.engine._runner.media.cache.encoded == 3
    _run(small, cases=[("again <start_of_image> and <start_of_image> x <start_of_image> w", 3)])
    assert sum(calls) == 3, calls      # the same images in a new request: the content-keyed cache serves them


def test_each_image_is_encoded_alone_and_its_request_keeps_its_bits_in_a_batch(setup):
    """An image's soft tokens must not depend on what else a step encodes (the tower's products run on the
    BLAS, whose rounding can follow the rows of a call): CPU engines (and --batch-invariant ones on CUDA)
    encode each image alone, so a request's tokens and logprobs are the same bits alone and beside other
    image requests whose images are new in the same step."""
    _, path, llm = setup
    engines = [LLM.from_config(EngineConfig(model=str(path), page_size=4, kv_cache_memory=8 << 20,
                                            enable_prefix_caching=False), llm) for _ in range(2)]
    calls = []
    model = llm.engine._model   # (the engines share it)
    original = model.encode_images
    model.encode_images = lambda px, pos=None: (calls.append(px.shape[0]), original(px, pos))[1]
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True)
    prompts = ["x <start_of_image> y <start_of_image> z", "a picture: <start_of_image> of", "<start_of_image> b"]
    images = [_images(2, 7), _images(1, 8), _images(1, 9)]

    def bits(outs):
        return [(o.outputs[0].token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in o.outputs[0].logprobs])
                for o in outs]

    try:
        alone = [bits(engines[0].generate(p, params, images=im, use_tqdm=False))[0] for p, im in zip(prompts, images)]
        assert calls == [1, 1, 1, 1]
        calls.clear()   # the second engine's encoder cache is empty: all four images are new in its first step
        assert bits(engines[1].generate(prompts, params, images=images, use_tqdm=False)) == alone
    finally:
        del model.encode_images
    assert calls == [1, 1, 1, 1]   # four new images in one step, each in a call of its own


def test_prefix_cache_keys_include_the_image(setup):
    _, path, llm = setup
    fresh = LLM.from_config(EngineConfig(model=str(path), page_size=4, kv_cache_memory=8 << 20), llm)
    prompt = "some words first <start_of_image> and after it a long tail of words"
    a, b = _images(2, 42)
    first = fresh.generate(prompt, PARAMS, images=[a])[0]
    ids, items = fresh.engine.inputs.prepare_images(prompt, [a])
    same = fresh.generate(prompt, PARAMS, images=[a])[0]
    other = fresh.generate(prompt, PARAMS, images=[b])[0]
    assert same.num_cached_tokens > items[0].end           # the same image: hits past it
    assert other.num_cached_tokens <= items[0].start       # another image: never its KV
    assert same.outputs[0].token_ids == first.outputs[0].token_ids
    fresh.engine._kv.check_integrity()


def test_image_inputs_and_errors(setup, tmp_path):
    _, _, llm = setup
    from PIL import Image

    arr = np.random.default_rng(0).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    Image.fromarray(arr).save(tmp_path / "a.png")
    keys = {llm.engine.inputs.prepare_images("x", [im])[1][0].key
            for im in (arr, Image.fromarray(arr), str(tmp_path / "a.png"), (tmp_path / "a.png").read_bytes())}
    assert len(keys) == 1
    with pytest.raises(UserInputError, match="decoded"):
        load_image(b"not an image", ImageLimits())
    with pytest.raises(UserInputError, match="pixels"):
        load_image(arr, ImageLimits(max_pixels=100))
    with pytest.raises(UserInputError, match="placeholders"):
        llm.generate("<start_of_image> <start_of_image>", PARAMS, images=[arr])
    with pytest.raises(UserInputError, match="at most"):
        llm.engine.inputs.prepare_images("x", [arr] * 3, ImageLimits(max_images=2))


# -- the chat API ------------------------------------------------------------------------------------
def test_chat_api_takes_data_url_images(setup):
    import base64
    import io

    openai = pytest.importorskip("openai")
    from gemmaserve.engine.llm_engine import LLMEngine
    from gemmaserve.server.app import ServerConfig
    from gemmaserve.server.background import BackgroundServer

    _, path, llm = setup
    image = _images(1, 7)[0]
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    engine = LLMEngine(EngineConfig(model=str(path), page_size=4, kv_cache_memory=8 << 20), llm.engine._loaded)
    content = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": url}},
               {"type": "text", "text": "what"}]
    with BackgroundServer(engine, ServerConfig(max_images_per_request=2)) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=300)
        got = client.chat.completions.create(model=str(path), messages=[{"role": "user", "content": content}],
                                             max_tokens=6, temperature=0)
        bad = [("https://example.com/cat.png", "data: URLs"), ("data:image/png;base64,AAAA", "decoded"),
               ("data:image/png;base64,@@", "base64")]
        for bad_url, words in bad:
            with pytest.raises(openai.BadRequestError, match=words):
                client.chat.completions.create(model=str(path), max_tokens=2, messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": bad_url}}]}])
        with pytest.raises(openai.BadRequestError, match="at most 2"):
            client.chat.completions.create(model=str(path), max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}] * 3}])
        again = client.chat.completions.create(model=str(path), messages=[{"role": "user", "content": content}],
                                               max_tokens=6, temperature=0)
        srv.server.async_engine.call_blocking(lambda e: e.check_integrity())
    prompt = "<start_of_turn>user\nlook<start_of_image>what<end_of_turn>\n<start_of_turn>model\n"
    want = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0), images=[image])[0].outputs[0].text
    assert got.choices[0].message.content == again.choices[0].message.content == want


def test_cli_image_flag(setup, tmp_path, capsys):
    from gemmaserve.cli import main

    _, path, llm = setup
    image = _images(1, 11)[0]
    image.save(tmp_path / "pic.png")
    argv = ["generate", "--model", str(path), "--page-size", "4", "--kv-cache-memory", "8MiB", "--json",
            "--max-tokens", "4", "--ignore-eos", "--image", str(tmp_path / "pic.png"), "what is <start_of_image>"]
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    want = llm.generate("what is <start_of_image>", SamplingParams(max_tokens=4, ignore_eos=True), images=[image])[0]
    assert got["token_ids"] == want.outputs[0].token_ids
    assert main(argv[:-3] + ["--image", str(tmp_path / "missing.png"), "x"]) == 2


def test_llm_chat_takes_images_as_parts(setup):
    """LLM.chat: the same conversation gives the same tokens whether its image comes as an object, a
    data URL or through the HTTP chat path's own rendering; text-only parts still work."""
    import base64
    import io

    _, path, llm = setup
    image = _images(1, 7)[0]
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    def content(part):
        return [{"role": "user", "content": [{"type": "text", "text": "look"}, part, {"type": "text", "text": "what"}]}]

    by_object = llm.chat(content({"type": "image", "image": image}), params)
    by_url = llm.chat(content({"type": "image_url", "image_url": {"url": url}}), params)
    assert by_object.outputs[0].token_ids == by_url.outputs[0].token_ids
    assert by_object.prompt_token_ids == by_url.prompt_token_ids
    rendered = "<start_of_turn>user\nlook<start_of_image>what<end_of_turn>\n<start_of_turn>model\n"   # Gemma's turns
    assert llm.generate(rendered, params, images=[image])[0].outputs[0].token_ids == by_object.outputs[0].token_ids
    layout = llm.engine.inputs.image_layout
    assert by_object.prompt_token_ids.count(layout.token_id) == layout.max_tokens
    text = llm.chat([{"role": "user", "content": "hello"}], params)
    assert len(text.outputs[0].token_ids) == 6
    with pytest.raises(UserInputError, match="role"):
        llm.chat([{"role": "robot", "content": "hi"}], params)
