"""The README starts with the two commands, and CI runs exactly the second."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _commands() -> list[str]:
    lines = (ROOT / "README.md").read_text().splitlines()
    blocks, inside = [], False
    for line in lines:
        if line.startswith("```"):
            inside = not inside
            continue
        if inside:
            blocks.append(line)
        if len(blocks) == 2:
            break
    return blocks


def test_readme_starts_with_run_and_test_commands():
    run, test = _commands()
    assert 'gemmaserve generate "The capital of France is"' in run
    assert "pytest" in test


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _commands()[1] in ci
