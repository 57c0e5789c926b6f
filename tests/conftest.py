import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):   # `-n 2`: the workers share the cores, one thread each
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# No test starts a background build of compiled decode steps (minutes of both cores); the tests of that
# path ask for it themselves.
os.environ.setdefault("GEMMASERVE_BACKGROUND_COMPILE", "0")


def pytest_sessionstart(session):
    """The CPU ops' C++ kernels before any test (models/cpu_kernels.py: the norms round their own way;
    every test then sees the one set of kernels a real process runs, whatever the order)."""
    from gemmaserve.models import cpu_library

    cpu_library.load()
# Without a GPU, Triton kernels run in its interpreter (numpy): set before any kernel is defined.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass


@pytest.fixture(scope="session")
def llm_270m():
    from gemmaserve import LLM

    return LLM(max_num_seqs=16, dtype="float32")   # the exact path: HF parity is measured on it


@pytest.fixture(scope="session")
def llm_270m_q():
    """The default CPU path users run (weights kept quantised, cached after the first load): ~7x faster per
    token than the fp32 path on 2 cores. For tests of what surrounds the model (streaming, the server,
    speculation, grammars), not of parity with transformers."""
    from gemmaserve import LLM

    return LLM(max_num_seqs=16)


@pytest.fixture(scope="session")
def gguf_read_once():
    """transformers' GGUF reader (`load_gguf_checkpoint`), remembering what it read: its config and its tokenizer
    loaders each parse the 270M's 262k-entry vocabulary (~13 s on 2 cores); this way the file is parsed once."""
    import functools

    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_utils, "load_gguf_checkpoint", functools.lru_cache(maxsize=4)(gguf_utils.load_gguf_checkpoint))
        yield


@pytest.fixture(scope="session")
def hf_270m(llm_270m):
    from gemmaserve.testing.hf_reference import build_hf_model

    return build_hf_model(llm_270m.engine._model)


@pytest.fixture
def row_invariant_dot(monkeypatch):
    """Triton's interpreter computes tl.dot as numpy's matmul of the tile, and OpenBLAS's AVX2 kernels round a
    row by its place in the tile (blocks of rows take different code; AVX-512 machines do not). A GPU's tile
    configuration gives a row the same K order wherever it sits, which is what the bitwise tests pin: here each
    row of a tile is multiplied alone."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    tile_dot = builder.create_dot

    def create_dot(self, a, b, d, *args):
        if a.data.ndim != 2:
            return tile_dot(self, a, b, d, *args)
        rows = [tile_dot(self, interpreter.TensorHandle(a.data[i:i + 1], a.dtype.scalar), b,
                         interpreter.TensorHandle(d.data[i:i + 1], d.dtype.scalar), *args).data
                for i in range(a.data.shape[0])]
        return interpreter.TensorHandle(interpreter.np.concatenate(rows), d.dtype.scalar)

    monkeypatch.setattr(builder, "create_dot", create_dot)
