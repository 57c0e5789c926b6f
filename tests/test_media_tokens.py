"""A text-only model never samples the tokenizer's image/audio/video tokens unless told to
(`suppress_media_tokens=False`); which tokens those are comes from the tokenizer, not a model name."""

from __future__ import annotations

import json

import pytest

from gemmaserve import LLM, SamplingParams

from helpers import save_checkpoint, tiny_hf_model

SEED = 4321


@pytest.fixture(scope="module")
def media_checkpoint(tmp_path_factory):
    """A tiny text-only checkpoint whose tokenizer has an <start_of_image> special token."""
    from tokenizers import Tokenizer

    path = save_checkpoint(tiny_hf_model(SEED), tmp_path_factory.mktemp("media") / "m")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens(["<start_of_image>"])
    tok.save(str(path / "tokenizer.json"))
    assert json.loads((path / "config.json").read_text())["vocab_size"] > tok.token_to_id("<start_of_image>")
    return path


def _favour(llm: LLM, token_id: int) -> None:
    """Make `token_id` the model's favourite at every position."""
    model = llm.engine._model
    compute = model.compute_logits

    def biased(hidden):
        logits = compute(hidden)
        logits[:, token_id] += 100.0
        return logits

    model.compute_logits = biased


@pytest.mark.parametrize("suppress", [None, False])
def test_media_tokens_are_suppressed_for_text_only_models(media_checkpoint, suppress):
    llm = LLM(model=str(media_checkpoint), page_size=4, suppress_media_tokens=suppress)
    soi = llm.tokenizer.token_to_id("<start_of_image>")
    assert llm.tokenizer.media_token_ids == {soi}
    _favour(llm, soi)
    out = llm.generate(["abc def"], SamplingParams(max_tokens=8, ignore_eos=True, seed=0))[0].outputs[0]
    if suppress is None:   # auto: the checkpoint has no vision tower
        assert soi not in out.token_ids and llm.engine._suppressed_token_ids == [soi]
    else:                  # asked for: the model may emit it (and decoding skips it as special)
        assert out.token_ids == [soi] * 8 and out.text == ""


def test_tiny_temperatures_are_greedy():
    """Dividing logits by a temperature below ~1e-38 overflows float32 (nan probabilities): such
    temperatures are greedy, as 0 is."""
    assert SamplingParams(temperature=1e-40).greedy and SamplingParams(temperature=5e-324).greedy
    assert not SamplingParams(temperature=1e-4).greedy
