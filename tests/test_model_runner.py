"""The model runner pairs logits with the right requests, whichever path runs the batch."""

from __future__ import annotations

import pytest

from gemmaserve.engine.llm import LLM
from gemmaserve.engine.sampling_params import SamplingParams
from gemmaserve.models.base import ModelInputs

from helpers import fresh_seed, save_checkpoint, tiny_hf_model


class _EagerAsGraphs:
    """Stands in for DecodeGraphs on the CPU: like a captured decode graph, it returns a logit row (and the
    hidden state) for every sequence of a batch whose rows are all one token long."""

    max_size = 64

    def __init__(self, runner):
        self.runner = runner

    def run(self, input_ids, positions, metadata, lora=None):
        attn = self.runner.backend.begin_batch(metadata, self.runner.kv_cache)
        hidden = self.runner.model(ModelInputs(input_ids, positions, attn, lora=lora))
        return self.runner.model.compute_logits(hidden), hidden


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    eng = llm.engine
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    ids = [eng.add_request("", params, prompt_ids=p) for p in prompts]
    for rid in ids:   # one prompt token per step: every prefill chunk is a one-token row
        eng._request(rid).max_chunk_tokens = 1
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[r] for r in ids]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_checkpoint(tiny_hf_model(fresh_seed(), sliding_window=8), tmp_path_factory.mktemp("tiny"))


def test_one_token_prefill_rows_in_a_graph_batch_are_not_sampled(tiny_dir):
    """A batch of one-token rows goes to the decode graph even when a row is a prefill chunk that does
    not finish its prompt; only the rows that finish are sampled, each with its own logits (before,
    a short prompt finishing beside a long one took the long one's logits)."""
    prompts = [[2, *range(10, 22)], [2, 40, 41, 42, 43], [2, 50, 51]]
    eager = LLM(model=str(tiny_dir), page_size=4)
    want = _generate(eager, prompts)
    graphs = LLM.from_config(eager.engine.config, eager)
    graphs.engine._runner.graphs = _EagerAsGraphs(graphs.engine._runner)
    assert _generate(graphs, prompts) == want


def test_warm_up_leaves_nothing_behind(tmp_path):
    """The startup warm-up (run on CUDA) frees its pages, forgets its cached blocks and hit counts,
    and leaves later outputs and request ids as if it never ran."""
    path = save_checkpoint(tiny_hf_model(fresh_seed(), sliding_window=8), tmp_path / "tiny")
    fresh = LLM(model=str(path), page_size=4, max_num_batched_tokens=40)
    warm = LLM(model=str(path), page_size=4, max_num_batched_tokens=40)
    assert warm.engine._warm_up() > 0
    eng = warm.engine
    assert not eng.has_unfinished_requests() and eng._kv.num_used_pages == 0
    st = eng._kv.stats()
    assert st.pages_cached == 0 and st.prefix_query_tokens == 0 and st.prefix_hit_tokens == 0
    prompts = ["abc def ghi", "jkl mno"]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    got, ref = warm.generate(prompts, params), fresh.generate(prompts, params)
    assert [o.request_id for o in got] == [o.request_id for o in ref]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert [o.num_cached_tokens for o in got] == [o.num_cached_tokens for o in ref]
