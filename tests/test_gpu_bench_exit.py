"""The GPU bench scripts' exit status (bench/sections.py `exit_status`), without a GPU: 1 when a check row
fails or a section raised, with a summary line last; each script's `main` returns it."""

import json
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_bench, gpu_fp8, gpu_gemma4, gpu_vision
from gemmaserve.bench import gpu_check
from gemmaserve.bench.sections import check_failures, exit_status

DOCS = Path(__file__).resolve().parents[1] / "docs"
CHECKS = {"check": lambda r: r["ok"]}


def _last_line(capsys) -> str:
    return capsys.readouterr().out.strip().splitlines()[-1]


def test_exit_status_fails_on_a_failing_row_or_a_raised_section(capsys):
    good = {"check": [{"name": "a", "ok": True}, {"name": "b", "ok": True}], "timing": [{"ms": 3.0}]}
    assert exit_status(good, CHECKS) == 0
    assert _last_line(capsys) == "CHECKS PASSED: 2 check rows, no section raised"

    bad = {**good, "check": [{"name": "a", "ok": True}, {"name": "b", "ok": False}]}
    assert exit_status(bad, CHECKS) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["FAIL check: name=b, ok=False", "CHECKS FAILED: 1 failure(s) above (2 check rows)"]

    assert exit_status({**good, "check": [{"name": "a"}]}, CHECKS) == 1          # the checked field missing
    assert exit_status({**good, "throughput_error": "RuntimeError('oom')"}, CHECKS) == 1
    assert "throughput raised: RuntimeError('oom')" in capsys.readouterr().out
    assert exit_status({"check": "skipped: no CUDA"}, CHECKS) == 0                # skipped: nothing to fail
    assert exit_status({}, {}) == 0


@pytest.mark.parametrize("script, record, failures", [
    (gpu_check, "gpu_check_2026-12-05.json", []),
    (gpu_vision, "gpu_vision_2026-12-04.json", []),
    (gpu_gemma4, "gpu_gemma4_2026-12-03.json", ["check: variant=26b_a4b, engine=bf16 graphs vs eager, tokens_equal=False",
                                                 "throughput raised"]),
    (gpu_fp8, "gpu_fp8_2026-12-03.json", ["kernels: geometry=gemma3-4b", "kernels: geometry=gemma4-global"]),
])
def test_recorded_h200_runs_under_each_scripts_checks(script, record, failures):
    """The raw results of past H200 runs (docs/), judged by each script's CHECKS: the failures they held
    (the 26B-A4B bf16 graphs-vs-eager tokens, a section that raised, fp8 store bytes that differ from
    torch's in 81 places) now fail the run; one flipped check field in a passing run fails it too."""
    res = json.loads((DOCS / record).read_text())
    got = check_failures(res, script.CHECKS)
    assert len(got) == len(failures) and all(g.startswith(f) for g, f in zip(got, failures)), got
    if not failures:
        section, field = {gpu_check: ("engine", "tokens_equal"), gpu_vision: ("check", "greedy_tokens_equal")}[script]
        res[section][-1][field] = False
        assert len(check_failures(res, script.CHECKS)) == 1


def test_fp8_kernel_rows_check_exactness():
    row = json.loads((DOCS / "gpu_fp8_2026-12-03.json").read_text())["kernels"][0]
    assert not gpu_fp8.kernel_row_ok(row)                       # 81 stored bytes differ from torch's
    exact = {**row, "store_bytes_differing_from_torch": 0}
    assert gpu_fp8.kernel_row_ok(exact)                         # fp8 kernels as close to exact as bf16's
    assert not gpu_fp8.kernel_row_ok({**exact, "decode_window_fp8_vs_fake_quant_fp32": 2 * row["decode_window_native_vs_fp32"]})
    assert not gpu_fp8.kernel_row_ok({"store_bytes_differing_from_torch": 0})   # no parity figures at all


def _fake_cuda(monkeypatch, module):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    if hasattr(module, "copy_bandwidth"):
        monkeypatch.setattr(module, "copy_bandwidth", lambda: 1000.0)


def _filler(section: str, rows):
    def fill(res, *args, **kwargs):
        if isinstance(rows, Exception):
            raise rows
        res[section] = rows
    return fill


OK_ROW = {"variant": "x", "engine": "y", "backend": "z", "tokens_equal": True, "logits_ok": True,
          "greedy_tokens_equal": True, "max_abs_logit_err": 0.0}
# script -> (argv, the section function main calls, the section's result key)
MAINS = {
    "gpu_vision": (gpu_vision, ["check", "--device", "cpu", "--tiny"], "section_check", "check"),
    "gpu_gemma4": (gpu_gemma4, ["check"], "section_check", "check"),
    "gpu_bench": (gpu_bench, ["prefill"], "section_prefill", "prefill"),
    "gpu_fp8": (gpu_fp8, ["capacity"], "section_capacity", "capacity"),
}


@pytest.mark.parametrize("name", sorted(MAINS))
@pytest.mark.parametrize("outcome", ["pass", "fail", "raise"])
def test_each_script_main_returns_the_exit_status(name, outcome, monkeypatch, tmp_path, capsys):
    module, argv, function, section = MAINS[name]
    monkeypatch.setenv("OUT", str(tmp_path))
    _fake_cuda(monkeypatch, module)
    has_checks = section in module.CHECKS
    if outcome == "fail" and not has_checks:
        pytest.skip(f"{name}'s {section} section holds no check rows")
    row = {**OK_ROW, "tokens_equal": outcome != "fail", "greedy_tokens_equal": outcome != "fail"}
    rows = [row] if has_checks else []   # a measuring section's rows: not checked (and the summary reads their figures)
    monkeypatch.setattr(module, function, _filler(section, RuntimeError("boom") if outcome == "raise" else rows))
    assert module.main(argv) == (0 if outcome == "pass" else 1)
    assert _last_line(capsys).startswith("CHECKS PASSED" if outcome == "pass" else "CHECKS FAILED")


def test_fp8_main_fails_on_a_failing_kernel_row(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    _fake_cuda(monkeypatch, gpu_fp8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    row = json.loads((DOCS / "gpu_fp8_2026-12-03.json").read_text())["kernels"][0]
    monkeypatch.setattr(gpu_fp8, "section_kernels", _filler("kernels", [row]))
    assert gpu_fp8.main(["kernels"]) == 1
    monkeypatch.setattr(gpu_fp8, "section_kernels", _filler("kernels", [{**row, "store_bytes_differing_from_torch": 0}]))
    assert gpu_fp8.main(["kernels"]) == 0


@pytest.mark.parametrize("bad", ["kernels", "engine", "invariance"])
def test_gpu_check_main_fails_on_a_failing_row(bad, monkeypatch, tmp_path, capsys):
    pytest.importorskip("triton")
    monkeypatch.setenv("OUT", str(tmp_path))
    _fake_cuda(monkeypatch, gpu_check)
    kernel = {"kernel": "decode", "dtype": "bfloat16", "d": 128, "hq": 8, "hkv": 1, "window": None, "rel_err": 1e-3,
              "ok": True}
    engine = {"engine": "triton graphs", "tokens_equal": True, "cuda_graphs": True}
    monkeypatch.setattr(gpu_check, "decode_bandwidth", lambda hbm: [])
    monkeypatch.setattr(gpu_check, "kernel_checks", lambda: [kernel, {**kernel, "ok": bad != "kernels"}])
    monkeypatch.setattr(gpu_check, "engine_checks", lambda: [engine, {**engine, "tokens_equal": bad != "engine"}])
    invariance = {"check": "gemm rows", "ok": True}
    monkeypatch.setattr(gpu_check, "invariance_checks", lambda: [invariance, {**invariance, "ok": bad != "invariance"}])
    assert gpu_check.main([]) == 1
    assert _last_line(capsys).startswith("CHECKS FAILED")
    assert gpu_check.main(["engine"]) == (1 if bad == "engine" else 0)
    assert gpu_check.main(["invariance"]) == (1 if bad == "invariance" else 0)
    monkeypatch.setattr(gpu_check, "kernel_checks", lambda: [kernel])
    monkeypatch.setattr(gpu_check, "engine_checks", lambda: [engine])
    monkeypatch.setattr(gpu_check, "invariance_checks", lambda: [invariance])
    assert gpu_check.main([]) == 0
    assert _last_line(capsys) == "CHECKS PASSED: 3 check rows, no section raised"
