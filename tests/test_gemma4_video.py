"""Gemma 4 video against transformers on tiny random checkpoints (31B-like: a frame's tokens see each other on
sliding layers; E2B-like: causal): frames decoded by PyAV and sampled as transformers samples them, stamped
"mm:ss" in transformers' prompt layout, logits at every prompt position and greedy tokens equal to its model
given the same frames, through LLM, the CLI and the server."""

import base64
import copy
import io
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gemmaserve import LLM, SamplingParams
from gemmaserve.engine.video import VideoLimits, decode_video_bytes

from helpers import (BOI, EOI, VID, GEMMA4_VISION_VARIANTS as VARIANTS, chunked_prompt_logits,
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


def _reference_prompt(prompt: str, frames: int, tokens: int, total: int, fps: float, max_frames: int) -> str:
    """transformers' own sampling (default_sample_indices_fn) and prompt layout (Gemma4Processor.replace_video_token)."""
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor
    from transformers.video_utils import VideoMetadata, default_sample_indices_fn

    meta = VideoMetadata(total_num_frames=total, fps=fps)
    meta.frames_indices = default_sample_indices_fn(meta, num_frames=min(max_frames, total))
    assert len(meta.frames_indices) == frames
    names = SimpleNamespace(boi_token="<|image>", eoi_token="<image|>", video_token="<|video|>")
    text = Gemma4Processor.replace_video_token(names, {"num_soft_tokens_per_video": [tokens],
                                                       "video_metadata": [meta]}, 0)
    return prompt.replace("<|video|>", text, 1)


def _hf_logits(hf, ids, items):
    """transformers' logits in float64: the reference at higher precision (ours run in fp32; fp32 transformers
    is as far from the float64 logits as ours are, 3e-4 here)."""
    hf = copy.deepcopy(hf).double()
    ids_t = torch.tensor([ids])
    types = torch.zeros_like(ids_t)
    types[ids_t == VID] = 2
    with torch.no_grad():
        return hf(input_ids=ids_t, pixel_values_videos=torch.from_numpy(np.stack([it.data for it in items])).double(),
                  video_position_ids=torch.from_numpy(np.stack([it.extra for it in items])),
                  num_frames_per_video=torch.tensor([len(items)]), mm_token_type_ids=types).logits[0]


def test_frames_are_sampled_stamped_and_placed_as_transformers_does(setup):
    """10 frames at 5 fps, 4 sampled: frames 0, 2, 5, 7 at 00:00, 00:00, 00:01, 00:01 (transformers' uniform
    sampling and stamps), decoded exactly (lossless), each a frame of the video token in transformers' layout; a
    frame already at its target size gives transformers' own patches and positions."""
    _, _, _, llm = setup
    data, pics = _video()
    video = decode_video_bytes(data, VideoLimits(max_frames=4))
    assert np.array_equal(video.frames, pics[[0, 2, 5, 7]]) and video.stamps() == ["00:00", "00:00", "00:01", "00:01"]
    prompt = "what happens in <|video|> here"
    ids, items = llm.engine.inputs.prepare(prompt, videos=[data], video_limits=VideoLimits(max_frames=4))
    n = items[0].length
    assert [it.length for it in items] == [n] * 4 and all(it.modality.value == "video" for it in items)
    assert ids == llm.tokenizer.encode(_reference_prompt(prompt, 4, n, 10, 5.0, 4))
    assert all(ids[it.start - 1] == BOI and ids[it.end] == EOI for it in items)

    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
    from PIL import Image

    proc = llm.engine.inputs.layouts[items[0].modality].processor
    frame = np.random.default_rng(1).integers(0, 256, (96, 96, 3), dtype=np.uint8)   # its target size: no resize
    ours = proc(frame)
    want = Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=70, pooling_kernel_size=3)([Image.fromarray(frame)],
                                                                                            return_tensors="np")
    assert proc.target_size(96, 96) == (96, 96)
    np.testing.assert_array_equal(ours.data, want["pixel_values"][0])
    np.testing.assert_array_equal(ours.extra, want["image_position_ids"][0])


def test_logits_and_greedy_tokens_equal_transformers(setup):
    """Logits at every position (one chunk, and chunks that stop before frames) and greedy tokens, alone and
    batched with text and an image request, equal transformers' given the same frames."""
    name, hf, _, llm = setup
    data, _ = _video(frames=7, fps=2, seed=3)
    prompt = "clip: <|video|> say"
    ids, items = llm.engine.inputs.prepare(prompt, videos=[data])
    assert len(items) == 7
    want = _hf_logits(hf, ids, items)
    for chunk in (len(ids), items[0].length + 5):
        got = chunked_prompt_logits(llm.engine.model, ids, items, chunk)
        err = (got - want).abs().max().item()
        assert err < 2e-4 * max(1.0, want.abs().max().item()), (name, chunk, err)
    ids_t = torch.tensor([ids])
    types = torch.zeros_like(ids_t)
    types[ids_t == VID] = 2
    with torch.no_grad():
        ref = hf.generate(input_ids=ids_t, pixel_values_videos=torch.from_numpy(np.stack([it.data for it in items])),
                          video_position_ids=torch.from_numpy(np.stack([it.extra for it in items])),
                          num_frames_per_video=torch.tensor([7]), mm_token_type_ids=types,
                          attention_mask=torch.ones_like(ids_t), max_new_tokens=5, do_sample=False, pad_token_id=0,
                          eos_token_id=[])[0, len(ids):].tolist()
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    outs = llm.generate([prompt, "plain text", prompt], params, videos=[[data], None, [data]], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == ref == outs[2].outputs[0].token_ids
    again = llm.generate(prompt, params, videos=[data], use_tqdm=False)[0]   # its KV blocks are keyed by content
    assert again.outputs[0].token_ids == ref and again.num_cached_tokens >= len(ids) // 2
    llm.engine.kv.check_integrity()


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
                                    max_num_batched_tokens=400), llm.engine.loaded)
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
        srv.server.async_engine.call_blocking(lambda e: e.kv.check_integrity())
    with pytest.raises(UserInputError, match="uint8 array"):
        llm.generate("x", params, videos=[(np.zeros((0, 8, 8, 3), dtype=np.uint8), 5)])
    with pytest.raises(UserInputError, match="frame rate"):
        llm.generate("x", params, videos=[(np.zeros((2, 8, 8, 3), dtype=np.uint8), 0)])
    with pytest.raises(UserInputError, match="video placeholders"):
        llm.generate("<|video|> <|video|>", params, videos=[data])
