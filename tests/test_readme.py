"""The README starts with the two commands, CI runs exactly the second, and what the README points to
is in a clone."""

import re
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


def test_readme_points_only_to_what_a_clone_has():
    """A clone holds the repository alone: every relative link resolves inside it, no path leaves it,
    and no test count (stale with the next test) is stated."""
    text = (ROOT / "README.md").read_text()
    assert "../" not in text, "a path outside the repository"
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://", "#")):
            continue
        path = (ROOT / target.split("#")[0]).resolve()
        assert path.is_relative_to(ROOT) and path.exists(), target
    assert not re.search(r"\b\d+ tests\b", text), "a test count"
