"""Our GGUF-built tokenizer against transformers' GGUF tokenizer for the same file."""

import random

import pytest

from helpers import fresh_seed

PIECES = ["Hello", " world", "  ", "   ", "\n", "\n\n", "\t", " \t ", "naïve", "café", "日本語", "の首都",
          "😀", "👩‍👩‍👧", "e\u0301", "Ω", "ß", "<start_of_turn>", "<end_of_turn>", "<bos>", "x=1;", "{}",
          "def f(a, b):\n    return a+b", "1234567", "ÆØÅ", "\u00a0", "ﬁ", "한국어", "مرحبا", "  leading", "trailing  "]


@pytest.fixture(scope="module")
def tokenizers_pair(llm_270m, gguf_read_once):
    from transformers import AutoTokenizer

    from gemmaserve.models.loader import resolve_model

    path = resolve_model("gemma3-270m").path
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return llm_270m.tokenizer, hf


def _random_texts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        parts = rng.choices(PIECES, k=rng.randint(1, 8))
        if rng.random() < 0.3:
            parts.append("".join(chr(rng.randint(0x20, 0x2FFF)) for _ in range(rng.randint(1, 6))))
        texts.append("".join(parts))
    return texts


def test_ids_match_transformers(tokenizers_pair):
    ours, hf = tokenizers_pair
    seed = fresh_seed()
    for text in _random_texts(seed, 300) + PIECES:
        assert ours.encode(text) == hf(text).input_ids, f"seed={seed} text={text!r}"


def test_decode_round_trips(tokenizers_pair):
    ours, hf = tokenizers_pair
    seed = fresh_seed()
    for text in _random_texts(seed, 200):
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
        plain = text.replace("<start_of_turn>", "").replace("<end_of_turn>", "").replace("<bos>", "")
        if plain == text:
            assert ours.decode(ids) == text, f"seed={seed}"


def test_stop_tokens_include_end_of_turn(llm_270m):
    tok = llm_270m.tokenizer
    assert tok.eos_token_id == 1
    assert tok.token_to_id("<end_of_turn>") in tok.stop_token_ids


def test_control_looking_gguf_tokens_are_special(llm_270m):
    """The GGUF types <start_of_image> and friends "user-defined"; HF's Gemma 3 tokenizer marks them
    special, so they are skipped with skip_special_tokens. HTML tags stay text."""
    tok = llm_270m.tokenizer
    for name in ("<start_of_image>", "<end_of_image>", "[multimodal]", "<start_of_turn>", "<end_of_turn>"):
        assert tok.is_special(tok.token_to_id(name)), name
    for name in ("<table>", "<b>", "</div>", "<bbox>"):
        assert not tok.is_special(tok.token_to_id(name)), name
    soi, eoi = tok.token_to_id("<start_of_image>"), tok.token_to_id("<end_of_image>")
    ids = tok.encode("An old pond") + [soi] * 3
    assert tok.decode(ids) == "An old pond" and "<start_of_image>" in tok.decode(ids, skip_special_tokens=False)
    # The embedded model is text-only: its media tokens are never sampled.
    assert tok.media_token_ids == {soi, eoi} and llm_270m.engine._suppressed_token_ids == sorted([soi, eoi])
