"""Package arrows point one way (DESIGN.md §3): a package imports only packages below it.

    errors, units, device, hostmem, rowops, opaque  <-  kv, quantization  <-  attention, transfer  <-  models  <-  config  <-  engine  <-  testing  <-  server, bench, cli

`testing` (what tests and benchmarks build on) is imported by `bench` alone: the engine and the server never
depend on it.
"""

import ast
from pathlib import Path

RANK = {"errors": 0, "units": 0, "device": 0, "hostmem": 0, "rowops": 0, "opaque": 0, "kv": 1, "quantization": 1, "attention": 2, "transfer": 2, "models": 3, "config": 4, "engine": 5,
        "testing": 6, "server": 7, "bench": 7, "cli": 7, "__main__": 8}
TESTING_USERS = {"testing", "bench"}   # of the package, only the benchmarks import testing/
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
            upward = target != own and RANK[target] > RANK[own]
            if upward or (target == "testing" and own not in TESTING_USERS):
                bad.append(f"{path.relative_to(ROOT)} imports {target}")
    assert not bad, bad


def test_the_check_sees_a_violation():
    probe = ROOT / "kv" / "probe.py"
    assert _imports(probe, "from ..models import base\nfrom .spec import LayerSpec\n") == ["models", "kv"]
    assert _imports(probe, "def f():\n    from gemmaserve.engine import llm\n") == ["engine"]


# -- modules: no import cycle at run time, counting imports inside functions -------------------------
def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.AST) -> list[ast.ImportFrom | ast.Import]:
    """Every import statement at any depth, except those under `if TYPE_CHECKING:` (never run)."""
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for stmt in node.body for n in ast.walk(stmt)}
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in typing_only]


def _module_imports(name: str, path: Path, source: str, modules: set[str]) -> set[str]:
    """The gemmaserve modules `name` imports (a name imported from a package counts as its module if it is one)."""
    own = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in _runtime_imports(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = ".".join(own[:len(own) - node.level + 1] + (node.module.split(".") if node.module else [])) \
                if node.level else (node.module or "")
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for t in targets:
            while t not in modules and "." in t:
                t = t.rsplit(".", 1)[0]
            if t in modules and t != name:
                out.add(t)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _import_graph(overrides: dict[str, str] | None = None) -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    sources = {name: path.read_text() for name, path in paths.items()} | (overrides or {})
    return {name: _module_imports(name, paths.get(name, ROOT / "probe.py"), src, set(paths)) for name, src in sources.items()}


def test_no_module_import_cycle_even_through_function_level_imports():
    assert _cycles(_import_graph()) == []


def test_the_cycle_check_sees_one_hidden_in_a_function():
    """kv/base.py importing, inside a function, a module that imports kv.base makes a cycle."""
    probe = "def f():\n    from ..engine import scheduler\n"
    cycles = _cycles(_import_graph({"gemmaserve.kv.base": (ROOT / "kv" / "base.py").read_text() + probe}))
    assert any({"gemmaserve.kv.base", "gemmaserve.engine.scheduler"} <= set(c) for c in cycles), cycles
    typing_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..engine import scheduler\n"
    assert _cycles(_import_graph({"gemmaserve.kv.base": (ROOT / "kv" / "base.py").read_text() + typing_only})) == []


ENGINE_ROOMS = ("spec_decode", "compile", "media", "executor", "structured", "connectors")
ENGINE_ABOVE_ROOMS = ("llm", "llm_engine", "factory", "aot_builder")   # assemble or drive the engine: they use the rooms


def test_engine_rooms_do_not_import_what_assembles_the_engine():
    """ARCHITECTURE.md: a room imports the core's plain data and lower packages, never the engine or its assembly."""
    graph = _import_graph()
    bad = [f"{m} imports {t}" for m, targets in graph.items() if m.split(".")[:2] == ["gemmaserve", "engine"]
           and len(m.split(".")) > 3 and m.split(".")[2] in ENGINE_ROOMS
           for t in targets if t in {f"gemmaserve.engine.{a}" for a in ENGINE_ABOVE_ROOMS}]
    assert not bad, bad
    probe = {"gemmaserve.engine.media.items": (ROOT / "engine" / "media" / "items.py").read_text()
             + "def f():\n    from ..llm_engine import LLMEngine\n"}
    assert "gemmaserve.engine.llm_engine" in _import_graph(probe)["gemmaserve.engine.media.items"]


# -- LLMEngine.internals(): for benchmarks and tests, never for the engine's own users ------------------------
INTERNALS_HOME = ("engine/llm_engine.py", "engine/internals.py")   # where the view is defined and built


def _internals_uses(source: str) -> list[int]:
    """Lines of `source` reaching for `.internals` (a call, or the bound method kept for later)."""
    return sorted({n.lineno for n in ast.walk(ast.parse(source))
                   if isinstance(n, ast.Attribute) and n.attr == "internals"
                   or isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "getattr"
                   and any(isinstance(a, ast.Constant) and a.value == "internals" for a in n.args[1:2])})


def test_server_cli_and_engine_rooms_do_not_use_internals():
    """internals.py: the server, the CLI and the engine's own modules use LLMEngine's methods, not its parts."""
    paths = [*(ROOT / "server").rglob("*.py"), *(ROOT / "engine").rglob("*.py"), *ROOT.glob("cli*.py"),
             *ROOT.glob("cli/**/*.py"), ROOT / "__main__.py"]
    bad = [f"{path.relative_to(ROOT)}:{line}" for path in paths if path.relative_to(ROOT).as_posix() not in INTERNALS_HOME
           for line in _internals_uses(path.read_text())]
    assert not bad, f"engine.internals() outside benchmarks and tests: {bad}"


def test_the_internals_check_sees_a_use():
    assert _internals_uses("def f(engine):\n    return engine.internals().kv\n") == [2]
    assert _internals_uses("parts = self.async_engine._engine.internals\n") == [1]
    assert _internals_uses("x = getattr(engine, 'internals')()\n") == [1]
    assert _internals_uses("from .internals import EngineInternals\nfrom . import internals\n") == []
