"""`gemmaserve cache list|prune` over a cache directory laid out as the engine writes it: entries by kind (a
compiled step's folder and its log are one entry), last use from file times, pruning by age, unfinished writes
removed once an hour old, a dry run removing nothing, and bad options refused."""

import os
import time

import pytest

from gemmaserve.cli import main

DAY = 86400.0


def _touch(path, nbytes: int, age_s: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * nbytes)
    t = time.time() - age_s
    os.utime(path, (t, t))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMASERVE_CACHE_DIR", str(tmp_path))
    _touch(tmp_path / "quantized" / "aaaa.safetensors", 3000, 40 * DAY)   # old key
    _touch(tmp_path / "quantized" / "bbbb.safetensors", 5000, 0.1 * DAY)  # in use
    _touch(tmp_path / "quantized" / ".tmpOLD", 700, 2 * 3600)             # an interrupted write
    _touch(tmp_path / "quantized" / ".tmpNEW", 800, 60)                   # a write maybe still running
    _touch(tmp_path / "decode-graphs" / "cccc" / "step.pt2", 2000, 40 * DAY)
    _touch(tmp_path / "decode-graphs" / "cccc.log", 10, 40 * DAY)
    _touch(tmp_path / "decode-graphs" / "dddd" / "step.pt2", 2000, 50 * DAY)
    _touch(tmp_path / "decode-graphs" / "dddd.log", 10, 1 * DAY)          # its build log was read lately
    _touch(tmp_path / "tokenizers" / "eeee.gemma4.v1.json", 100, 10 * DAY)
    for folder, age in (("cccc", 40 * DAY), ("dddd", 50 * DAY)):   # a step's folder: as old as its build
        t = time.time() - age
        os.utime(tmp_path / "decode-graphs" / folder, (t, t))
    return tmp_path


def test_list_shows_each_entry_once_with_its_kind_size_and_last_use(cache, capsys):
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == str(cache)
    assert len(out.splitlines()[2:-1]) == 7
    assert "compiled decode steps" in out and "quantised weights" in out and "unfinished write" in out
    assert "2.0 KB" in next(line for line in out.splitlines() if "cccc" in line)   # folder + log, one entry
    assert out.splitlines()[-1].startswith("7 entries")


def test_prune_by_age_and_unfinished_writes(cache, capsys):
    assert main(["cache", "prune", "--older-than", "30", "--dry-run"]) == 0
    assert "would remove 3 of 7 entries" in capsys.readouterr().out
    assert (cache / "quantized" / "aaaa.safetensors").exists()   # a dry run removes nothing
    assert main(["cache", "prune", "--older-than", "30"]) == 0
    assert "removed 3 of 7 entries" in capsys.readouterr().out
    left = sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file())
    assert left == ["decode-graphs/dddd.log", "decode-graphs/dddd/step.pt2", "quantized/.tmpNEW",
                    "quantized/bbbb.safetensors", "tokenizers/eeee.gemma4.v1.json"]
    assert main(["cache", "prune"]) == 0   # every entry, but not a write that may still be running
    assert sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file()) == ["quantized/.tmpNEW"]


def test_bad_cache_options_are_refused(cache, capsys):
    assert main(["cache", "prune", "--older-than", "-1"]) == 2
    assert "--older-than must be" in capsys.readouterr().err
    assert main(["cache", "list", "--dry-run"]) == 2
    assert "go with `gemmaserve cache prune`" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["cache", "shrink"])
