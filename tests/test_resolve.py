""""auto" resolution of the cache options: model defaults, explicit values win, each demotion is
logged with its reason, each impossible explicit choice is rejected."""

import logging

import pytest
import torch

from gemmaserve.attention.base import BackendCapabilities
from gemmaserve.config.engine import EngineConfig
from gemmaserve.config.resolve import resolve_cache_options
from gemmaserve.models.base import ModelPreferences
from gemmaserve.errors import UserInputError
from gemmaserve.kv.spec import AttentionKind, LayerSpec
from gemmaserve.testing.shapes import SHAPES

FULL_CAPS = BackendCapabilities("full", frozenset({"cpu"}), None, scratch_pages=True, shared_arena=True)
NO_SCRATCH = BackendCapabilities("noscratch", frozenset({"cpu"}), None, scratch_pages=False, shared_arena=True)
NO_ARENA = BackendCapabilities("flat", frozenset({"cpu"}), None, scratch_pages=False, shared_arena=False)
GEMMA = ModelPreferences(kv_cache_manager="v2", swa_scratch_reuse=True)
SPECS = SHAPES["gemma3-1b"].layer_specs(torch.float32)


def _resolve(caps=FULL_CAPS, prefs=GEMMA, specs=SPECS, **opts):
    return resolve_cache_options(EngineConfig(**opts), prefs, caps, specs)


def test_gemma_defaults_resolve_to_v2_scratch_and_prefix_caching():
    r = _resolve()
    assert (r.kv_cache_manager, r.swa_scratch_reuse, r.enable_prefix_caching, r.demotions) == ("v2", True, True, ())


def test_model_without_preference_gets_v1_and_demotes_caching():
    r = _resolve(prefs=ModelPreferences())
    assert (r.kv_cache_manager, r.swa_scratch_reuse, r.enable_prefix_caching) == ("v1", False, False)
    assert any("enable_prefix_caching" in d for d in r.demotions)


def test_explicit_values_win_in_both_directions():
    assert _resolve(kv_cache_manager="v1").kv_cache_manager == "v1"
    assert _resolve(prefs=ModelPreferences(), kv_cache_manager="v2").kv_cache_manager == "v2"
    assert _resolve(swa_scratch_reuse="off").swa_scratch_reuse is False
    assert _resolve(prefs=ModelPreferences("v2", False), swa_scratch_reuse="on").swa_scratch_reuse is True
    assert _resolve(enable_prefix_caching=False).enable_prefix_caching is False


def test_v1_demotes_auto_scratch_and_caching_with_reasons(caplog):
    with caplog.at_level(logging.INFO, logger="gemmaserve.config.resolve"):
        r = _resolve(kv_cache_manager="v1")
    assert (r.swa_scratch_reuse, r.enable_prefix_caching) == (False, False)
    assert any("swa_scratch_reuse auto -> off" in d and "v2" in d for d in r.demotions)
    assert "because" in caplog.text and "swa_scratch_reuse" in caplog.text


def test_backend_without_arena_demotes_auto_and_rejects_explicit_v2():
    r = _resolve(caps=NO_ARENA)
    assert r.kv_cache_manager == "v1"
    assert any("kv_cache_manager auto -> v1" in d and "flat" in d for d in r.demotions)
    with pytest.raises(UserInputError, match="v2 is not available.*flat"):
        _resolve(caps=NO_ARENA, kv_cache_manager="v2")


def test_backend_without_scratch_demotes_auto_and_rejects_explicit_on():
    r = _resolve(caps=NO_SCRATCH)
    assert r.kv_cache_manager == "v2" and r.swa_scratch_reuse is False
    assert any("does not support scratch" in d for d in r.demotions)
    with pytest.raises(UserInputError, match="--swa-scratch-reuse on is not possible.*noscratch"):
        _resolve(caps=NO_SCRATCH, swa_scratch_reuse="on")


def test_explicit_scratch_or_caching_with_v1_is_rejected():
    with pytest.raises(UserInputError, match="scratch-reuse on is not possible.*needs KV manager v2"):
        _resolve(kv_cache_manager="v1", swa_scratch_reuse="on")
    with pytest.raises(UserInputError, match="enable-prefix-caching is not available"):
        _resolve(kv_cache_manager="v1", enable_prefix_caching=True)


def test_kv_sharing_must_read_the_last_writer_for_scratch():
    good = SHAPES["gemma4-e2b"].layer_specs(torch.float32)   # consumers read the last layer of each kind
    assert _resolve(specs=good).swa_scratch_reuse is True
    f32 = torch.float32
    bad = [LayerSpec(AttentionKind.SLIDING, 1, 8, f32, window=4), LayerSpec(AttentionKind.SLIDING, 1, 8, f32, window=4),
           LayerSpec(AttentionKind.FULL, 1, 8, f32), LayerSpec(AttentionKind.SLIDING, 1, 8, f32, window=4, kv_source=0)]
    r = _resolve(specs=bad)
    assert r.swa_scratch_reuse is False and any("not the last layer" in d for d in r.demotions)
    with pytest.raises(UserInputError, match="not the last layer"):
        _resolve(specs=bad, swa_scratch_reuse="on")


def test_scratch_guard_groups_layers_at_the_real_page_size():
    """Layer 0 (3 KV heads) and layer 1 (2 KV heads) share a window. At page size 16 they hold 16 and
    24 tokens per page: two groups, layer 0 the last writer of its own, so its reader (layer 3) is safe.
    The guard used to group at page size 1 (1 token per page each: one group, layer 1 last) and
    turned scratch off for nothing; at page size 1 that is the real geometry, and it still does."""
    f32 = torch.float32
    specs = [LayerSpec(AttentionKind.SLIDING, 3, 8, f32, window=4), LayerSpec(AttentionKind.SLIDING, 2, 8, f32, window=4),
             LayerSpec(AttentionKind.FULL, 1, 8, f32), LayerSpec(AttentionKind.SLIDING, 3, 8, f32, window=4, kv_source=0)]
    assert _resolve(specs=specs, page_size=16).swa_scratch_reuse is True
    r = _resolve(specs=specs, page_size=1)
    assert r.swa_scratch_reuse is False and any("not the last layer" in d for d in r.demotions)


def test_engine_reports_resolution(tmp_path):
    from gemmaserve import LLM
    from helpers import fresh_seed, save_checkpoint, tiny_hf_model

    path = save_checkpoint(tiny_hf_model(fresh_seed()), tmp_path / "tiny")
    info = LLM(model=str(path)).engine.info
    assert (info.kv_manager, info.swa_scratch_reuse, info.prefix_caching) == ("v2", True, True)
    # A multimodal checkpoint keeps scratch off by default (an image must not be split across chunks).
    from helpers import save_vision_checkpoint, tiny_hf_vision

    path = save_vision_checkpoint(tiny_hf_vision(fresh_seed()), tmp_path / "mm")
    info = LLM(model=str(path)).engine.info
    assert (info.kv_manager, info.swa_scratch_reuse) == ("v2", False)
    assert LLM(model=str(path), swa_scratch_reuse="on").engine.info.swa_scratch_reuse is True


def _gemma4_prefs(multimodal: bool):
    from gemmaserve.models.gemma4 import Gemma4Config, Gemma4ForCausalLM
    from gemmaserve.testing.synthetic import GEMMA4_CONFIGS

    raw = GEMMA4_CONFIGS["gemma4-e2b"]
    if multimodal:
        raw = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "text_config": raw,
               "vision_config": {"hidden_size": 768}}
    cfg = Gemma4Config.from_hf(raw)
    with torch.device("meta"):   # preferences and specs come from the config: no weights needed
        model = Gemma4ForCausalLM(cfg, torch.bfloat16)
    return model.engine_preferences(), model.kv_layer_specs(torch.bfloat16)


@pytest.mark.parametrize("multimodal", [False, True])
def test_gemma4_prefers_v2_scratch_on_for_text_off_for_multimodal(multimodal, caplog):
    prefs, specs = _gemma4_prefs(multimodal)
    assert prefs == ModelPreferences(kv_cache_manager="v2", swa_scratch_reuse=not multimodal, kv_transfer_runtime="nixl")
    r = _resolve(prefs=prefs, specs=specs)
    assert (r.kv_cache_manager, r.swa_scratch_reuse, r.enable_prefix_caching, r.demotions) == (
        "v2", not multimodal, True, ())
    # An explicit value wins both ways.
    assert _resolve(prefs=prefs, specs=specs, swa_scratch_reuse="on").swa_scratch_reuse is True
    assert _resolve(prefs=prefs, specs=specs, swa_scratch_reuse="off").swa_scratch_reuse is False
    assert _resolve(prefs=prefs, specs=specs, kv_cache_manager="v1").kv_cache_manager == "v1"
    # Every demotion of an auto value is logged with its reason.
    with caplog.at_level(logging.INFO, logger="gemmaserve.config.resolve"):
        r = _resolve(caps=NO_ARENA, prefs=prefs, specs=specs)
    assert r.kv_cache_manager == "v1" and any("kv_cache_manager auto -> v1" in d for d in r.demotions)
    assert "because" in caplog.text
    if not multimodal:   # scratch was wanted: the backend without scratch pages demotes it, and says so
        r = _resolve(caps=NO_SCRATCH, prefs=prefs, specs=specs)
        assert r.swa_scratch_reuse is False and any("swa_scratch_reuse auto -> off" in d for d in r.demotions)
