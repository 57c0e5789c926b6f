"""Incremental detokenizer and stop strings, on the real Gemma vocabulary (byte-fallback)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gemmaserve.engine.detokenizer import IncrementalDetokenizer, StopStringFilter


@pytest.fixture(scope="module")
def tok():
    from gemmaserve.models.embedded import cache_dir
    from gemmaserve.models.gguf_file import GGUFFile
    from gemmaserve.models.loader import resolve_model
    from gemmaserve.models.tokenizer import Tokenizer

    path = resolve_model("gemma3-270m").path
    import hashlib

    st_ = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st_.st_size}|{st_.st_mtime_ns}".encode()).hexdigest()[:16]
    return Tokenizer.from_gguf(GGUFFile(path), cache_dir() / "tokenizers" / f"{key}.json")


def _pieces(tok) -> dict[str, list[int]]:
    enc = lambda text: tok.encode(text)[1:]  # noqa: E731  (drop BOS)
    byte = lambda data: [tok.backend.token_to_id(f"<0x{b:02X}>") for b in data]  # noqa: E731
    return {
        "ascii": enc("Hello world, this is fine."),
        "cjk": enc("日本語の文章と中文"),
        "combining": enc("e\u0301 a\u0308 n\u0303"),
        "emoji_tokens": enc("😀🎉👩‍👩‍👧"),
        "emoji_bytes": byte("😀".encode()) + byte("€".encode()),
        "stray_bytes": byte(b"\x80\xe2\x82") + byte(b"\xff"),
        "special": [tok.bos_token_id, tok.eos_token_id, tok.token_to_id("<start_of_turn>"),
                    tok.token_to_id("<end_of_turn>")],
        "whitespace": enc("   \n\n\t  \n") + [tok.token_to_id("\n"), 138, 139],
    }


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_deltas_concatenate_to_the_full_decode(tok, data):
    pieces = _pieces(tok)
    ids: list[int] = []
    for _ in range(data.draw(st.integers(1, 12))):
        kind = data.draw(st.sampled_from(sorted(pieces)))
        chunk = pieces[kind]
        start = data.draw(st.integers(0, len(chunk) - 1))
        ids += chunk[start:start + data.draw(st.integers(1, len(chunk)))]
    for skip in (True, False):
        d = IncrementalDetokenizer(tok, skip)
        deltas = [d.step([t]) for t in ids] + [d.finish()]
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip), ids
        # Nothing is emitted early: every prefix of the stream is a prefix of the final text.
        assert all(tok.decode(ids, skip_special_tokens=skip).startswith("".join(deltas[:k]))
                   for k in range(len(deltas)))


def test_byte_run_is_held_until_final(tok):
    euro = [tok.backend.token_to_id(f"<0x{b:02X}>") for b in "€".encode()]
    d = IncrementalDetokenizer(tok)
    assert [d.step([t]) for t in euro] == ["", "", ""]   # a later byte could still change the run
    assert d.step(tok.encode(" ok")[1:]) == "€ ok"
    stray = [tok.backend.token_to_id("<0x80>")]
    d2 = IncrementalDetokenizer(tok)
    out = "".join(d2.step([t]) for t in euro + stray) + d2.finish()
    assert out == tok.decode(euro + stray)                 # four U+FFFD: the run was invalid after all


def test_recovers_where_decodestream_fails(tok):
    """A sequence on which tokenizers' DecodeStream raises "Invalid prefix": our stream is exact."""
    ids = [284, 236781, 361, 334, 9259, 3729, 283, 238582, 9259, 139, 138, 358, 1, 2, 420, 297, 409, 163543, 376]
    try:
        from tokenizers.decoders import DecodeStream

        ds = DecodeStream(skip_special_tokens=True)
        with pytest.raises(Exception, match="Invalid prefix"):
            for t in ids:
                ds.step(tok.backend, t)
    except ImportError:
        pass
    d = IncrementalDetokenizer(tok)
    assert "".join(d.step([t]) for t in ids) + d.finish() == tok.decode(ids)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="ab.\n XY", max_size=40), cuts=st.lists(st.integers(0, 40), max_size=8),
       stops=st.lists(st.text(alphabet="ab.\nX", min_size=1, max_size=4), min_size=1, max_size=3))
def test_stop_strings_never_leak(text, cuts, stops):
    f = StopStringFilter(tuple(stops))
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    # The stop string that completes first wins (earliest end, then earliest start).
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    first = min(hits) if hits else None
    expected = text[:first[1]] if first else text
    emitted = ""
    for a, b in zip(bounds, bounds[1:]):
        emitted += f.feed(text[a:b])
        assert expected.startswith(emitted)       # never a character beyond the cut
        for s in stops:                          # never the start of a stop string at the edge
            assert s not in emitted
    emitted += f.flush()
    assert emitted == expected
    assert f.matched == (first[2] if first else None)
