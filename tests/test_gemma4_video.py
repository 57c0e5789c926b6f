"""Gemma 4 video against transformers on tiny random checkpoints (31B-like: a frame's tokens see each other on
sliding layers; E2B-like: causal): frames decoded by PyAV, sampled, resized, rescaled and stamped "mm:ss" as
transformers' Gemma4Processor does it (its own PyAV loader, sampling and prompt layout, its video processor with
torchvision's two kernels stood in for: helpers.py), for clips of 2 s to 65 s; logits at every prompt position
and greedy tokens equal to its model given its processor's output, through LLM, the CLI and the server."""

import base64
import copy
import io
import re

import numpy as np
import pytest
import torch

from gemmaserve import LLM, SamplingParams
from gemmaserve.engine.media.video import VideoLimits, decode_video_bytes

from helpers import (BOI, EOI, GEMMA4_VISION_VARIANTS as VARIANTS, chunked_prompt_logits, hf_vision_processor,
                     save_gemma4_vision_checkpoint, tiny_hf_gemma4_vision)


def _video(frames: int = 10, fps: int = 5, size=(48, 64), seed: int = 0, codec: str = "ffv1") -> tuple[bytes, np.ndarray]:
    """An encoded video of smooth random frames (lossless with ffv1 in Matroska) and the frames."""
    import av

    rng = np.random.default_rng(seed)
    h, w = size
    small = rng.integers(0, 256, (frames, h // 8, w // 8, 3), dtype=np.uint8)
    pics = np.repeat(np.repeat(small, 8, axis=1), 8, axis=2)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="matroska" if codec == "ffv1" else "mp4") as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "bgr0" if codec == "ffv1" else "yuv420p"
        for pic in pics:
            for packet in stream.encode(av.VideoFrame.from_ndarray(pic, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue(), pics


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def setup(request, tmp_path_factory):
    hf = tiny_hf_gemma4_vision(99, request.param)
    path = save_gemma4_vision_checkpoint(hf, tmp_path_factory.mktemp(f"g4video_{request.param}"))
    llm = LLM(str(path), dtype="float32", page_size=4, kv_cache_memory=16 << 20, max_num_batched_tokens=400,
              cpu_compile="off")
    return request.param, hf, path, llm


def _hf_logits(hf, ref):
    """transformers' logits in float64 for its processor's output `ref`: the reference at higher precision (ours run
    in fp32; fp32 transformers is as far from the float64 logits as ours are, 3e-4 here)."""
    hf = copy.deepcopy(hf).double()
    with torch.no_grad():
        return hf(input_ids=torch.from_numpy(ref["input_ids"]),
                  pixel_values_videos=torch.from_numpy(ref["pixel_values_videos"]).double(),
                  video_position_ids=torch.from_numpy(ref["video_position_ids"]),
                  num_frames_per_video=torch.from_numpy(ref["num_frames_per_video"]),
                  mm_token_type_ids=torch.from_numpy(ref["mm_token_type_ids"])).logits[0]


def _hf_processed(path, monkeypatch, prompt: str, data: bytes, pics: np.ndarray, fps: float, codec: str,
                  max_frames: int, tmp_path):
    """transformers' Gemma4Processor on the clip: an MP4 read and sampled by its own PyAV loader, a Matroska (FFV1)
    clip, whose header gives that loader no frame count, as all its (losslessly decoded) frames and their rate for
    its video processor to sample. Its output, and the "mm:ss" stamps its prompt gives the frames."""
    from functools import partial

    from transformers.video_utils import VideoMetadata, load_video

    n = min(max_frames, len(pics))   # (transformers refuses to sample more frames than a clip has; ours takes all)
    proc = hf_vision_processor(path, "gemma4_video", monkeypatch, n)
    if codec == "ffv1":
        video, meta, sample = pics, VideoMetadata(total_num_frames=len(pics), fps=float(fps)), True
    else:
        (tmp_path / "clip.mp4").write_bytes(data)
        video, meta = load_video(str(tmp_path / "clip.mp4"), backend="pyav",
                                 sample_indices_fn=partial(proc.video_processor.sample_frames, num_frames=n))
        sample = False
    ref = proc(text=[prompt], videos=[video], video_metadata=[meta], do_sample_frames=sample, return_tensors="np")
    ref["num_frames_per_video"] = np.asarray(ref["num_frames_per_video"])
    return ref, re.findall(r"(\d\d:\d\d) <\|image>", proc.tokenizer.decode(ref["input_ids"][0]))


# name: (frames, fps, size, codec, frames sampled, the last one's stamp): 2 s upscaled, 10 s downscaled from
# 120 x 160, 65 s whose stamps pass a minute
CLIPS = {"short": (10, 5, (48, 64), "ffv1", 4, "00:01"), "seconds": (40, 4, (120, 160), "mpeg4", 8, "00:08"),
         "minute": (130, 2, (240, 320), "mpeg4", 32, "01:02")}


@pytest.mark.parametrize("clip", sorted(CLIPS))
def test_frames_pixels_and_stamps_equal_transformers_processor(setup, clip, monkeypatch, tmp_path):
    """transformers' Gemma4Processor and its video processor given the same clip (helpers.hf_gemma4_video_processor:
    transformers' code throughout but torchvision's resize and normalize kernels): the same frames sampled, the
    same pixel values bit for bit (resized to the target size, rescaled, patched, padded), positions and token
    types, and the same prompt ids (each frame's "mm:ss" stamp, its begin, soft and end tokens)."""
    name, _, path, llm = setup
    if name != "e2b":
        pytest.skip("the variants' processors are the same")
    frames, fps, size, codec, sampled, last = CLIPS[clip]
    data, pics = _video(frames, fps, size, seed=frames, codec=codec)
    prompt = "what happens in <|video|> here"
    limits = VideoLimits(max_frames=sampled)
    ids, items = llm.engine.inputs.prepare(prompt, videos=[data], video_limits=limits)
    ref, stamps = _hf_processed(path, monkeypatch, prompt, data, pics, fps, codec, sampled, tmp_path)
    assert len(items) == sampled and stamps[-1] == last and decode_video_bytes(data, limits).stamps() == stamps
    assert ids == ref["input_ids"][0].tolist()
    types = np.zeros(len(ids), dtype=np.int64)
    for it in items:
        assert ids[it.start - 1] == BOI and ids[it.end] == EOI
        types[it.start:it.end] = 2
    np.testing.assert_array_equal(ref["mm_token_type_ids"][0], types)
    np.testing.assert_array_equal(np.stack([it.data for it in items]), ref["pixel_values_videos"])
    np.testing.assert_array_equal(np.stack([it.extra for it in items]), ref["video_position_ids"])
    if clip == "short":   # lossless: the frames decoded are the frames encoded, sampled as transformers samples
        assert np.array_equal(decode_video_bytes(data, limits).frames, pics[[0, 2, 5, 7]])


def test_logits_and_greedy_tokens_equal_transformers(setup, monkeypatch, tmp_path):
    """Logits at every position (one chunk, and chunks that stop before frames) and greedy tokens, alone and
    batched with text and an image request, equal transformers' given its own processor's prompt and pixels."""
    name, hf, path, llm = setup
    data, pics = _video(frames=7, fps=2, seed=3)
    prompt = "clip: <|video|> say"
    ids, items = llm.engine.inputs.prepare(prompt, videos=[data])
    assert len(items) == 7
    ref, _ = _hf_processed(path, monkeypatch, prompt, data, pics, 2, "ffv1", 32, tmp_path)
    assert ids == ref["input_ids"][0].tolist()
    want = _hf_logits(hf, ref)
    for chunk in (len(ids), items[0].length + 5):
        got = chunked_prompt_logits(llm.engine._model, ids, items, chunk)
        err = (got - want).abs().max().item()
        assert err < 2e-4 * max(1.0, want.abs().max().item()), (name, chunk, err)
    with torch.no_grad():
        names = ("input_ids", "pixel_values_videos", "video_position_ids", "num_frames_per_video", "mm_token_type_ids",
                 "attention_mask")
        tensors = {k: torch.from_numpy(ref[k]) for k in names}
        ref = hf.generate(**tensors, max_new_tokens=5, do_sample=False, pad_token_id=0,
                          eos_token_id=[])[0, len(ids):].tolist()
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    outs = llm.generate([prompt, "plain text", prompt], params, videos=[[data], None, [data]], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == ref == outs[2].outputs[0].token_ids
    again = llm.generate(prompt, params, videos=[data], use_tqdm=False)[0]   # its KV blocks are keyed by content
    assert again.outputs[0].token_ids == ref and again.num_cached_tokens >= len(ids) // 2
    llm.engine._kv.check_integrity()


def test_video_through_the_cli_and_server_and_bad_videos(setup, tmp_path, capsys):
    openai = pytest.importorskip("openai")
    from gemmaserve.cli import main
    from gemmaserve.config.engine import EngineConfig
    from gemmaserve.engine.llm_engine import LLMEngine
    from gemmaserve.errors import UserInputError
    from gemmaserve.server.background import BackgroundServer
    from gemmaserve.server.config import ServerConfig

    name, _, path, llm = setup
    if name != "e2b":
        pytest.skip("one variant is enough for the entry points")
    data, _ = _video(frames=6, fps=3, seed=5, codec="mpeg4")   # lossy MP4 with its frame count in the header
    (tmp_path / "v.mp4").write_bytes(data)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    want = llm.generate("see <|video|>", params, videos=[str(tmp_path / "v.mp4")])[0].outputs[0].token_ids
    argv = ["generate", "--model", str(path), "--dtype", "float32", "--page-size", "4", "--kv-cache-memory", "16MiB",
            "--max-num-batched-tokens", "400", "--json", "--max-tokens", "4", "--ignore-eos", "--video",
            str(tmp_path / "v.mp4"), "see <|video|>"]
    assert main(argv) == 0
    assert __import__("json").loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"] == want

    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", page_size=4, kv_cache_memory=16 << 20,
                                    max_num_batched_tokens=400), llm.engine._loaded)
    part = {"type": "video_url", "video_url": {"url": url}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "see "}, part]}]
    chat = llm.chat(messages, SamplingParams(max_tokens=4, temperature=0)).outputs[0].text
    silent = io.BytesIO()
    import soundfile

    soundfile.write(silent, np.zeros(8000, dtype=np.float32), 16000, format="WAV")
    with BackgroundServer(engine, ServerConfig(max_videos_per_request=1)) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=300)
        got = client.chat.completions.create(model=str(path), messages=messages, max_tokens=4, temperature=0)
        assert got.choices[0].message.content == chat
        bad = [("https://example.com/v.mp4", "data: URLs"), ("data:video/mp4;base64,AAAA", "could not be decoded"),
               ("data:audio/wav;base64," + base64.b64encode(silent.getvalue()).decode(), "no video stream")]
        for bad_url, words in bad:
            with pytest.raises(openai.BadRequestError, match=words):
                client.chat.completions.create(model=str(path), max_tokens=2, messages=[{"role": "user", "content": [
                    {"type": "video_url", "video_url": {"url": bad_url}}]}])
        with pytest.raises(openai.BadRequestError, match="at most 1"):
            client.chat.completions.create(model=str(path), max_tokens=2,
                                           messages=[{"role": "user", "content": [part, part]}])
        srv.server.async_engine.call_blocking(lambda e: e.check_integrity())
    with pytest.raises(UserInputError, match="uint8 array"):
        llm.generate("x", params, videos=[(np.zeros((0, 8, 8, 3), dtype=np.uint8), 5)])
    with pytest.raises(UserInputError, match="frame rate"):
        llm.generate("x", params, videos=[(np.zeros((2, 8, 8, 3), dtype=np.uint8), 0)])
    with pytest.raises(UserInputError, match="video placeholders"):
        llm.generate("<|video|> <|video|>", params, videos=[data])
