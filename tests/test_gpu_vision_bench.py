"""The GPU vision benchmark (benchmarks/gpu_vision.py) without a GPU: every section on tiny configs on
the CPU writes sane figures, and the real-size configs line up with our models (built on the meta device)."""

import json

import pytest
import torch

from benchmarks import gpu_vision


def test_tiny_cpu_run_writes_every_section(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_vision.main(["--device", "cpu", "--tiny"]) == 0
    res = json.loads((tmp_path / "gpu_vision.json").read_text())
    assert not [k for k in res if k.endswith("_error")], res
    work = gpu_vision.TINY_WORKLOAD
    shapes = list(gpu_vision.TINY_SHAPES)

    assert {r["variant"] for r in res["check"]} == {"gemma3", "gemma4 e2b", "gemma4 31b"}
    assert all(r["logits_ok"] and r["max_abs_logit_err"] < gpu_vision.LOGIT_TOL for r in res["check"])

    ttft = res["ttft"]
    assert [(r["shape"], r["images"]) for r in ttft] == [(s, n) for s in shapes for n in work.image_counts]
    for r in ttft:
        assert r["ours_ms"] > 0 and r["ours_e2e_ms"] > 0 and r["hf_ms"] > 0 and r["hf_over_ours"] > 0
        assert r["prompt_tokens"] > r["image_tokens"] > 0
    for s in shapes:   # more images, more image tokens
        tokens = [r["image_tokens"] for r in ttft if r["shape"] == s]
        assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)

    media = res["media"]   # the Gemma 4 shape has an audio tower: clips and a video, ours against HF
    assert [r["input"] for r in media] == [f"{n} x 2 s audio" for n in work.clip_counts] + ["4-frame video"]
    for r in media:
        assert r["ours_ms"] > 0 and r["ours_e2e_ms"] > 0 and r["hf_ms"] > 0 and r["prompt_tokens"] > r["media_tokens"] > 0
    assert media[1]["media_tokens"] == 2 * media[0]["media_tokens"] == 2 * 50   # 25 tokens a second

    rows = {(r["shape"], r["encoder_cache"]): r for r in res["throughput"]}
    assert set(rows) == {(s, mode) for s in shapes for mode in ("on", "off")}
    for s in shapes:
        on, off = rows[s, "on"], rows[s, "off"]
        for r in (on, off):
            assert r["new_tokens"] == work.requests * work.new_tokens and r["out_tok_s"] > 0 and r["wall_s"] > 0
            assert r["images_encoded"] == r["cache_encoded"] and r["image_requests"] == work.requests // 2
        assert on["images_encoded"] == work.pool            # each distinct image once
        assert on["encoder_calls"] <= off["encoder_calls"] and on["images_encoded"] <= off["images_encoded"]
        assert off["cache_shared_hits"] == 0 and on["tok_s_on_over_off"] > 0


@pytest.mark.parametrize("name", gpu_vision.REAL_SHAPES + ("gemma4-e2b",))
def test_real_shapes_map_onto_our_models(name):
    """Every tensor of transformers' real-size model has its place in ours (shapes checked by the loader)."""
    shape = gpu_vision.SHAPES[name]
    cfg = gpu_vision.hf_config(shape)
    meta = torch.device("meta")
    ours = gpu_vision.ours_from_hf(gpu_vision.hf_model(cfg, torch.bfloat16, meta), cfg, torch.bfloat16, meta)
    assert ours.image_layout.max_tokens == shape.tokens_per_image
    assert (ours.mm_config.boi_token_id, ours.mm_config.eoi_token_id, ours.mm_config.image_token_id) == shape.specials
    assert ours.vocab_size == shape.text["vocab_size"]
