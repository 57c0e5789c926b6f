import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def llm_270m():
    from gemmaserve import LLM

    return LLM(max_num_seqs=16)


@pytest.fixture(scope="session")
def hf_270m(llm_270m):
    from gemmaserve.bench.hf_reference import build_hf_model

    return build_hf_model(llm_270m.engine.model)
