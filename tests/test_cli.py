"""The README's first command, and --json output."""

import json
import shutil
import subprocess
import sys


def test_generate_json_one_object_per_prompt(llm_270m_q):
    res = subprocess.run([sys.executable, "-m", "gemmaserve", "generate", "--json", "--max-tokens", "6",
                          "The capital of France is", "1, 2, 3,"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == ["The capital of France is", "1, 2, 3,"]
    for r in rows:
        assert {"prompt", "text", "token_ids", "finish_reason"} <= set(r)
        assert r["finish_reason"] == "length" and len(r["token_ids"]) == 6
    # Same tokens as the Python API.
    from gemmaserve import SamplingParams

    api = llm_270m_q.generate(["The capital of France is"], SamplingParams(max_tokens=6))[0]
    assert rows[0]["token_ids"] == api.outputs[0].token_ids and rows[0]["text"] == api.outputs[0].text


def test_console_script_prints_prompt_and_continuation():
    exe = shutil.which("gemmaserve")
    assert exe, "console script not installed"
    res = subprocess.run([exe, "generate", "--max-tokens", "4", "The capital of France is"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("The capital of France is") and len(res.stdout.strip()) > len("The capital of France is")


HEAVY = ("torch", "transformers", "fastapi", "uvicorn", "numpy")


def test_help_and_argument_errors_do_not_import_torch():
    """`--help` and argument errors answer before any heavy import (torch alone takes ~1-2 s; how long
    `--help` takes is measured in benchmarks, not asserted here): in-process for each command, and for the
    real `python -m gemmaserve --help` every module the interpreter imported (`-X importtime`)."""
    probe = ("import sys\nfrom gemmaserve.cli import main\n"
             "for argv in (['--help'], ['serve', '--help'], ['generate', '--help'], ['serve', '--port', 'x']):\n"
             "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
             f"heavy = sorted(m for m in {HEAVY!r} if m in sys.modules)\n"
             "print('HEAVY', heavy, file=sys.stderr)\n")
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert "HEAVY []" in res.stderr, res.stderr[-2000:]
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "gemmaserve", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and "serve" in res.stdout, res.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in res.stderr.splitlines()
                if line.startswith("import time:")}
    assert "gemmaserve" in imported and "argparse" in imported   # the listing is what we think it is
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


def _words(line: str) -> list[str]:   # a table row without its column padding
    return line.split()


def _tiny_cli(path, *args: str) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-m", "gemmaserve", "generate", "--model", str(path), "--temperature", "0",
                          "--max-tokens", "4", "--logprobs", "2", *args], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return res


def test_logprobs_without_json_print_a_table_under_each_completion(tmp_path):
    """`--logprobs K` in the plain-text mode prints, under each completion, one row per generated token:
    the token (quoted), its logprob and its K best alternatives, the same values as --json gives."""
    from gemmaserve.engine.llm import LLM
    from helpers import fresh_seed, save_checkpoint, tiny_hf_model

    path = save_checkpoint(tiny_hf_model(fresh_seed()), tmp_path / "m")
    decode = LLM(model=str(path)).tokenizer.decode

    def rows(completion: dict) -> list[str]:
        def show(t):
            return json.dumps(decode([t], skip_special_tokens=False), ensure_ascii=False)
        return [_words(" ".join([show(lp["token_id"]), f"{lp['logprob']:.3f}"] +
                                [f"{show(t)} {p:.3f}" for t, p in lp["top"]])) for lp in completion["logprobs"]]

    # One --json run gives both cases' values: a prompt's tokens do not depend on its batch.
    run = _tiny_cli(path, "--json", "abc abc", "cab")
    both = [json.loads(line)["completions"][0] for line in run.stdout.splitlines()]
    for prompts in (["abc abc"], ["abc abc", "cab"]):   # one prompt streams; several print when done
        want = both[:len(prompts)]
        lines = _tiny_cli(path, *prompts).stdout.splitlines()
        tables = [i for i, line in enumerate(lines) if line.split() == ["token", "logprob", "top", "2"]]
        assert len(tables) == len(prompts), lines
        for start, completion in zip(tables, want):
            assert lines[start - 1].endswith(completion["text"])   # the table comes under its completion
            got = [_words(line) for line in lines[start + 1:start + 5]]
            assert got == rows(completion)
