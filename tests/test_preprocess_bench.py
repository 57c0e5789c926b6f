"""`gemmaserve bench preprocess`: every case runs and reports outputs equal to transformers' processors (images
bit for bit at the two smaller photographs' sizes, audio within 1e-6)."""

import json


def test_preprocess_bench_runs_and_outputs_equal_transformers(tmp_path, monkeypatch):
    from gemmaserve.cli import main

    monkeypatch.setenv("OUT", str(tmp_path))
    assert main(["bench", "preprocess", "--repeat", "1", "--sizes", "2"]) == 0   # the bench itself runs 4 sizes
    rows = json.loads((tmp_path / "preprocess.json").read_text())["rows"]
    assert len(rows) == 4 + 2 + 1
    for r in rows:
        assert r["ours_ms"] > 0 and r["transformers_ms"] > 0 and r["ratio"] > 0
        assert r["max_abs_diff"] <= (1e-6 if r["what"].startswith("audio") else 0.0), r
        assert r.get("positions_equal", True) and r.get("mask_equal", True), r


def test_bytes_over_255_in_float32_equal_transformers_float64_rescale():
    """What the processors rely on to be bit-equal: x / 255 in float32 is float64 x * (1 / 255) rounded, for every
    byte value."""
    import numpy as np

    x = np.arange(256, dtype=np.uint8)
    assert np.array_equal(np.divide(x, np.float32(255), dtype=np.float32),
                          (x.astype(np.float64) * (1 / 255)).astype(np.float32))
