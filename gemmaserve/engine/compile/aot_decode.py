"""CPU decode steps compiled ahead of time (AOTInductor) and kept in the cache directory.

compiled_decode.py compiles the decode step in the engine's own process with torch.compile: minutes
the first time on a small CPU, and ~25 s of tracing on every later start, during which the engine
cannot step (tracing holds the GIL). Here the same step is exported and compiled once per model,
weights format, KV layout and machine, by a separate process (engine/aot_builder.py), into AOTInductor
packages that hold code and no weights:

    build   torch.export the step (DecodeStep: the model with the traced decode attention of
            attention/traced.py) for 1 row, 8 rows and any 2..63 rows (one dynamic graph); AOTInductor
            compiles each to a package whose constants stay outside it; a map says which attribute
            path of the model holds each constant
    load    the packages, bound to the live model's own tensors (`user_managed`: no copy), in about
            a second; a step builds its tables (DecodeTables), calls the package, commits the new K/V

The numerically sensitive work of a step runs in ops the graph calls as they are (models/cpu_kernels.py),
so a package gives an eager step's bits (tests/test_aot_decode.py), and the engine may switch to it
between any two steps. The package calls those ops' C shims (models/cpu_shims.py) where this torch has
`aot_inductor.custom_ops_to_c_shims`, else (or where that build fails) through its proxy executor, ~7 us
a call more; the manifest records which, and the log says so. Where a step's layout cannot be exported
(one arena of one geometry is needed, as for the traced attention; the packed fbgemm objects of CPUs
without VNNI are Python objects) the engine says why and stays eager unless `--cpu-compile on` asks for
compiled_decode.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import time
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...attention.base import AttentionMetadata
from ...attention.traced import MIN_WIDTH, DecodeLayout, DecodeTables, TracedDecodeAttention
from ...kv.base import GroupTables
from ...models.base import ModelInputs
from ...models.cpu_isa import cpu_class
from ...models.embedded import cache_dir
from ...models.quant_cache import code_fingerprint

log = logging.getLogger(__name__)

FORMAT = 3             # of the packages and their manifest: a change makes every old one stale (3: C shims)
MAX_ROWS = 63          # the dynamic graph's rows (2..MAX_ROWS); larger decode batches run eagerly
STATIC_SIZES = (1, 8)  # graphs for exactly this many rows (other batches run the dynamic one)
# CPU features that change what inductor writes or what our kernels do
_CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_int8",
              "amx_bf16", "asimd", "sve")


class DecodeStep(nn.Module):
    """What a package computes: logits and hidden states of a decode batch, every owning layer's new K/V."""

    def __init__(self, model: nn.Module, layout: DecodeLayout):
        super().__init__()
        self.model = model
        self.layout = layout

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor,
                keys: list[torch.Tensor], state: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        attention = TracedDecodeAttention(self.layout, kv, keys, state)
        hidden = self.model(ModelInputs(input_ids, positions, attention))
        return self.model.compute_logits(hidden), hidden, attention.new_kv()


def tensor_paths(root: Any) -> dict[str, torch.Tensor]:
    """Every tensor reachable from `root` by attribute, dataclass field, list index or dict key, by the
    first path that reaches it (a deterministic walk: the same structure gives the same paths)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()

    def walk(obj: Any, path: str) -> None:
        if isinstance(obj, torch.Tensor):
            out.setdefault(path, obj)
            return
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None), torch.dtype, torch.device)):
            return
        seen.add(id(obj))
        if isinstance(obj, nn.Module):
            items = [*obj._parameters.items(), *obj._buffers.items(), *obj._modules.items()]
            items += [(k, v) for k, v in sorted(vars(obj).items()) if not k.startswith("_")]
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            items = [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
        elif isinstance(obj, (list, tuple)):
            items = list(enumerate(obj))
        elif isinstance(obj, dict):
            items = [(k, v) for k, v in obj.items() if isinstance(k, (str, int))]
        elif type(obj).__module__.startswith("gemmaserve") and hasattr(obj, "__dict__"):
            items = sorted(vars(obj).items())
        else:
            return
        for k, v in items:
            if v is not None:
                walk(v, f"{path}.{k}" if path else str(k))

    walk(root, "")
    return out


def _cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    words = set(re.findall(r"^flags\s*:(.*)$", text, re.M)[0].split()) if "flags" in text else set()
    return sorted(words & set(_CPU_FLAGS))


def artifact_key(source_path: Path, weights: str, layout: DecodeLayout) -> dict:
    """What the packages depend on: the model file, its weights format, the KV layout, this machine,
    torch and gemmaserve's code. Two engines with equal keys can share packages."""
    st = source_path.stat()
    return {
        "format": FORMAT, "code": code_fingerprint(), "torch": torch.__version__,
        "machine": platform.machine(), "cpu": _cpu_flags(),
        # the kernels' class (models/cpu_isa.py: forced ones too) and PyTorch's (ATEN_CPU_CAPABILITY), which
        # the graphs' code follows: a forced class never loads another class's packages
        "isa": cpu_class().value, "aten_isa": torch.backends.cpu.get_cpu_capability(),
        "model": [str(source_path.resolve()), st.st_size, st.st_mtime_ns], "weights": weights,
        "layout": {"kv": list(layout.kv.shape[1:]), "kv_dtype": str(layout.kv.dtype),
                   "tokens_per_page": layout.tokens_per_page, "kinds": [list(k) for k in layout.kinds],
                   "slot": [list(s) for s in layout.slot], "owners": list(layout.owners),
                   "source": list(layout.source)},
        "graphs": {"static": list(STATIC_SIZES), "max_rows": MAX_ROWS},
    }


def store_dir(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / "decode-graphs" / digest


# -- building (in the builder process) ---------------------------------------------------------------
def _example(layout: DecodeLayout, rows: int) -> tuple:
    """A decode batch of `rows` null-page rows, each kind's table at a block count of its own (distinct
    from the others and from any batch size: export would tie equal sizes into one symbol)."""
    null_page = layout.null_row // layout.tokens_per_page
    columns: dict[int, int] = {}   # group -> its layer columns
    for kind, col in layout.slot:
        group = layout.kinds[kind][0]
        columns[group] = max(columns.get(group, 0), col + 1)
    tables: list[GroupTables | None] = [None] * (max(columns) + 1)
    for group, n in columns.items():   # every row at position 0, its one block on the null page
        tables[group] = GroupTables(None, [0] * rows, [1] * rows, torch.zeros(rows, 1, dtype=torch.long),
                                    torch.full((1, n), null_page, dtype=torch.int32))
    md = AttentionMetadata([1] * rows, [1] * rows, tables, ())
    widths = [MIN_WIDTH + 3 + 2 * i for i in range(len(layout.kinds))]
    t = DecodeTables.build(layout, md, rows, widths)
    ids = torch.zeros(rows, dtype=torch.long)
    return (ids, ids.clone(), layout.kv, list(t.keys), list(t.state))


def _constants_info(package: Path) -> list[dict]:
    """The package's constants as its C++ wrapper lists them (name, original name, shape)."""
    with zipfile.ZipFile(package) as z:
        cpp = z.read(next(n for n in z.namelist() if n.endswith("wrapper.cpp"))).decode()
    info: dict[int, dict] = {}
    for m in re.finditer(r"constants_info_\[(\d+)\]\.(name|original_fqn|shape) = (.*?);", cpp):
        info.setdefault(int(m.group(1)), {})[m.group(2)] = m.group(3)
    return [{"name": d["name"].strip('"'), "fqn": d["original_fqn"].strip('"'),
             "shape": [int(x) for x in d["shape"].strip("{}").split(",") if x.strip()]}
            for _, d in sorted(info.items())]


def _constant_paths(ep, package: Path, step: DecodeStep) -> dict[str, str]:
    """Package constant name -> the attribute path (from the DecodeStep) of the tensor it stands for.
    AOTInductor names parameters and buffers by their names, lifted tensor constants
    `_tensor_constant<i>` in the order of the export's signature; each is checked by its shape."""
    sig = ep.graph_signature
    tensors = dict(ep.state_dict)
    lifted = list(sig.lifted_tensor_constants)
    tensors.update((name, t) for name, t in ep.constants.items() if name not in lifted)
    tensors.update((f"_tensor_constant{i}", ep.constants[name]) for i, name in enumerate(lifted))
    path_of = {id(t): p for p, t in reversed(list(tensor_paths(step).items()))}
    paths = {}
    for c in _constants_info(package):
        t = tensors.get(c["fqn"])
        if t is None or list(t.shape) != c["shape"] or id(t) not in path_of:
            raise RuntimeError(f"package constant {c['name']} ({c['fqn']}, {c['shape']}) is not a model tensor")
        paths[c["fqn"]] = path_of[id(t)]
    return paths


def _proxy_calls(package: Path) -> int:
    """How many op calls of the package's generated code go through the proxy executor."""
    with zipfile.ZipFile(package) as z:
        cpp = z.read(next(n for n in z.namelist() if n.endswith("wrapper.cpp"))).decode()
    return cpp.count("aoti_torch_proxy_executor_call_function(")


def shim_configs() -> dict:
    """Inductor's options for calling the ops' C shims, or {} (with a log line saying why) where they
    cannot be used: the ops' library does not build here, or this torch has no such option."""
    from ...models import cpu_library, cpu_shims
    from ...models.cpu_kernels import OPS

    why = cpu_library.load()
    configs = cpu_shims.inductor_configs(OPS) if why is None else {}
    if why is None and not configs:
        why = f"torch {torch.__version__} has no aot_inductor.custom_ops_to_c_shims"
    if why is not None:
        log.info("compiled decode graphs call the ops through the proxy executor (no C shims: %s)", why)
    return configs


def _compile(ep, package: Path, shims: dict) -> bool:
    """AOTInductor-compile `ep` into `package`, calling the ops' C shims where `shims` names them. False where
    it was compiled without them (their build failed: logged), True where with them."""
    base = {"aot_inductor.package_constants_in_so": False}
    if shims:
        try:
            torch._inductor.aoti_compile_and_package(ep, package_path=str(package), inductor_configs={**base, **shims})
            return True
        except Exception as e:   # a torch whose generated calls do not match the shims' convention
            log.warning("compiling with the ops' C shims failed (%s: %s); compiling with the proxy executor",
                        type(e).__name__, str(e)[:500])
    torch._inductor.aoti_compile_and_package(ep, package_path=str(package), inductor_configs=base)
    return False


def build(model: nn.Module, layout: DecodeLayout, key: dict, out: Path) -> None:
    """Export and compile every graph into `out` (written elsewhere first, then moved into place). A build of
    the same key that was interrupted (the builder killed, the machine stopped) left its finished graphs beside
    `out` with a record of them (`PARTIAL`): this one keeps those and compiles the rest."""
    from torch.export import Dim

    start = time.perf_counter()
    shims = shim_configs()
    tmp = out.with_name(out.name + ".tmp")
    graphs = _finished_graphs(tmp, key)
    if not graphs:
        shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True, exist_ok=True)
    if graphs:
        log.info("keeping %s from an interrupted build of these packages", ", ".join(graphs))
        shims = shims if all(g["shims"] for g in graphs.values()) else {}
    step = DecodeStep(model, layout).eval()
    for size in (*STATIC_SIZES, None):
        if (f"rows{size}" if size else "dynamic") in graphs:
            continue
        rows = size or 3
        args = _example(layout, rows)
        nb = [Dim(f"blocks{i}", min=MIN_WIDTH, max=1 << 18) for i in range(len(layout.kinds))]
        batch = {} if size else {0: Dim("rows", min=2, max=MAX_ROWS)}
        keys = [{2: b, **({1: batch[0]} if batch else {})} for b in nb]
        state = [{1: b, **batch} for b in nb]
        dynamic = (batch or None, batch or None, {0: Dim("kv_rows", min=2, max=1 << 40)}, keys, state)
        name = f"rows{size}" if size else "dynamic"
        t = time.perf_counter()
        package = tmp / f"{name}.pt2"
        with warnings.catch_warnings():
            # torch's own deprecation notes from inside export (pytree specs), nothing a user can act on
            warnings.filterwarnings("ignore", category=FutureWarning, module="copyreg")
            with torch.inference_mode():
                ep = torch.export.export(step, args, dynamic_shapes=dynamic, strict=False)
            shimmed = _compile(ep, package, shims)
        shims = shims if shimmed else {}   # a failed shim build fails for the next graphs too
        graphs[name] = {"rows": size, "constants": _constant_paths(ep, package, step), "shims": shimmed,
                        "proxy_calls": _proxy_calls(package)}
        record = tmp / (PARTIAL + ".new")   # replaced whole: a build killed while writing it keeps the last one
        record.write_text(json.dumps({"key": key, "graphs": graphs}))
        os.replace(record, tmp / PARTIAL)
        log.info("compiled decode graph %s in %.0f s (%s; %d op calls through the proxy executor)", name,
                 time.perf_counter() - t, "C shims" if shimmed else "no C shims", graphs[name]["proxy_calls"])
    manifest = {"key": key, "graphs": graphs, "build_seconds": round(time.perf_counter() - start, 1)}
    (tmp / PARTIAL).unlink(missing_ok=True)
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


PARTIAL = "finished_graphs.json"   # an unfinished build's record of the graphs it has compiled


def _finished_graphs(tmp: Path, key: dict) -> dict:
    """The graphs an interrupted build of `key` finished in `tmp` (their packages there), else none."""
    try:
        record = json.loads((tmp / PARTIAL).read_text())
    except (OSError, ValueError):
        return {}
    if record.get("key") != key:
        return {}
    return {name: g for name, g in record.get("graphs", {}).items() if (tmp / f"{name}.pt2").is_file()}


# -- loading and running (in the engine) -----------------------------------------------------------
class AotDecode:
    """The packages of one store directory, bound to a live model and KV layout."""

    def __init__(self, model: nn.Module, layout: DecodeLayout, directory: Path, max_rows: int):
        """`max_rows`: the most rows the engine's decode batches have (ModelRunner.max_decode_rows: verification
        steps as decode rows included)."""
        from ...models import cpu_library   # the ops' C++ kernels (the packages call them by name)

        why = cpu_library.load()
        manifest = json.loads((directory / "manifest.json").read_text())
        if why is not None and any(g["shims"] for g in manifest["graphs"].values()):
            raise RuntimeError(f"the packages call the ops' C shims, whose library does not load ({why})")
        live = tensor_paths(DecodeStep(model, layout))
        self.layout = layout
        self.max_rows = min(MAX_ROWS, max_rows)
        self.graphs: dict[int | None, Any] = {}
        self.load_seconds = 0.0
        start = time.perf_counter()
        for name, g in manifest["graphs"].items():
            package = torch._inductor.aoti_load_package(str(directory / f"{name}.pt2"))
            missing = [p for p in g["constants"].values() if p not in live]
            if missing:
                raise RuntimeError(f"the model has no tensor at {missing[0]} (the packages are stale)")
            package.load_constants({fqn: live[p] for fqn, p in g["constants"].items()}, check_full_update=True,
                                   user_managed=True)
            self.graphs[g["rows"]] = package
        self.load_seconds = time.perf_counter() - start
        self.sizes = sorted(s for s in self.graphs if s is not None)

    def _size_for(self, b: int) -> int | None:
        return b if b in self.sizes else None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(logits [B, V], hidden states [B, H]) of a decode batch, or None where no graph takes it (the
        caller runs it eagerly)."""
        b = input_ids.shape[0]
        if not 1 <= b <= self.max_rows:
            return None
        size = self._size_for(b)
        if size is None and (b < 2 or None not in self.graphs):
            return None
        rows = size or b
        if rows > b:   # a larger static graph (benchmarks/compiled_rows.py compares): padding rows read and write the null page
            input_ids = torch.cat([input_ids, input_ids.new_zeros(rows - b)])
            positions = torch.cat([positions, positions.new_zeros(rows - b)])
        tables = DecodeTables.build(self.layout, metadata, rows)
        logits, hidden, new_kv = self.graphs[size](input_ids, positions, self.layout.kv, tables.keys, tables.state)
        tables.commit(self.layout, new_kv)
        return logits[:b], hidden[:b]
