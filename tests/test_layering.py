"""Package arrows point one way (DESIGN.md §3): a package imports only packages below it.

    errors, units, device, hostmem, rowops, opaque  <-  kv  <-  attention, transfer  <-  models  <-  config  <-  engine  <-  server, bench, cli
"""

import ast
from pathlib import Path

RANK = {"errors": 0, "units": 0, "device": 0, "hostmem": 0, "rowops": 0, "opaque": 0, "kv": 1, "attention": 2, "transfer": 2, "models": 3, "config": 4, "engine": 5,
        "server": 6, "bench": 6, "cli": 6, "__main__": 7}
ROOT = Path(__file__).resolve().parents[1] / "gemmaserve"


def _imports(path: Path, source: str | None = None) -> list[str]:
    """First-level gemmaserve packages a module imports (relative or absolute, at any depth)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    out = []
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(parts[:len(parts) - node.level])   # the package the dots lead to
            target = base + (node.module.split(".") if node.module else [])
            if target:
                out.append(target[0])
            else:
                out.extend(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gemmaserve."):
            out.append(node.module.split(".")[1])
    return out


def test_package_imports_point_down():
    bad = []
    for path in ROOT.rglob("*.py"):
        own = path.relative_to(ROOT).parts[0].removesuffix(".py")
        if own == "__init__":
            continue   # the package root re-exports the public API
        for target in _imports(path):
            if target != own and RANK[target] > RANK[own]:
                bad.append(f"{path.relative_to(ROOT)} imports {target}")
    assert not bad, bad


def test_the_check_sees_a_violation():
    probe = ROOT / "kv" / "probe.py"
    assert _imports(probe, "from ..models import base\nfrom .spec import LayerSpec\n") == ["models", "kv"]
    assert _imports(probe, "def f():\n    from gemmaserve.engine import llm\n") == ["engine"]
