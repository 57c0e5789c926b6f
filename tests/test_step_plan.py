"""The step description the scheduler hands the runner: plain data that survives JSON, and block-table
deltas that rebuild exactly the manager's tables, under prefix hits, scratch, sliding-window drops,
preemption and aborts."""

from __future__ import annotations

import json
import random

import pytest
import torch

from gemmaserve.engine.block_tables import BlockTables
from gemmaserve.engine.request import FinishReason, Request
from gemmaserve.engine.sampling_params import SamplingParams
from gemmaserve.engine.scheduler import Scheduler
from gemmaserve.engine.step import StepPlan, StepResult
from gemmaserve.kv.spec import AttentionKind, LayerSpec

from helpers import make_manager


def _specs(window: int):
    sl = LayerSpec(AttentionKind.SLIDING, 2, 8, torch.float32, window=window)
    fu = LayerSpec(AttentionKind.FULL, 1, 8, torch.float32)
    return [sl, fu, sl, LayerSpec(AttentionKind.SLIDING, 2, 8, torch.float32, window=window, kv_source=0)]


def _pages(tables, b: int) -> list[list[int]]:
    n = tables.num_blocks[b]
    return tables.slot_pages[tables.block_rows[b, :n]].tolist()


@pytest.mark.parametrize("manager,scratch,prefix,seed", [
    ("v2", True, True, 1), ("v2", False, True, 2), ("v2", True, False, 3), ("v1", False, False, 4),
])
def test_runner_tables_follow_the_manager_through_deltas(manager, scratch, prefix, seed):
    rng = random.Random(seed)
    specs = _specs(window=rng.choice([5, 8, 13]))
    page = rng.choice([2, 4])
    kw = {} if manager == "v1" else dict(enable_prefix_caching=prefix, enable_scratch=scratch)
    kv = make_manager(manager, specs, page, 40 if manager == "v2" else 24, **kw)
    sched = Scheduler(kv, 6, rng.choice([7, 16, 32]))
    runner_tables = BlockTables(kv.groups, 2, 256, kv.num_pages + 1 if kv.layout.identity_slots else None,
                                torch.device("cpu"))
    shared = [rng.randrange(3, 50) for _ in range(24)]   # a common prefix: prefix hits
    reqs = []
    for i in range(14):
        prompt = (shared if i % 2 else []) + [rng.randrange(3, 50) for _ in range(rng.randrange(2, 40))]
        params = SamplingParams(max_tokens=rng.randrange(1, 50), ignore_eos=True)
        req = Request(str(i), str(i), 0, "", prompt, params, frozenset(), 1 << 20)
        reqs.append(req)
        sched.add(req)
    steps = preempted = 0
    while sched.has_unfinished():
        plan = sched.schedule()
        plan = StepPlan.from_dict(json.loads(json.dumps(plan.to_dict())))   # plain data, nothing live
        for rid in plan.released + plan.finished:
            runner_tables.release(rid)
        runner_tables.update_slots(plan.slot_updates)
        for s in plan.seqs:
            runner_tables.apply(s.req_id, s.deltas, s.new_table)
        ids = [s.req_id for s in plan.seqs]
        if ids:
            got, want = runner_tables.tables(ids), kv.group_tables(ids)
            for g, w in zip(got, want):
                assert g.first_block == w.first_block and g.num_blocks == w.num_blocks
                for b in range(len(ids)):
                    assert _pages(g, b) == _pages(w, b), (steps, ids[b])
        preempted += len(plan.released)
        if steps == 6:   # an abort mid-flight: its table and sampling state go with the next plan
            victim = next(r for r in reversed(reqs) if not r.is_finished)
            victim.finish(FinishReason.ABORT)
            sched.finish(victim)
        sampled = [s.req_id for s in plan.seqs if s.sample]
        sched.update_from_output(plan, StepResult(sampled, [7] * len(sampled), [None] * len(sampled)))
        kv.check_integrity()
        steps += 1
        assert steps < 2000
    assert all(r.is_finished for r in reqs)
    print("steps", steps, "preempted", preempted)
    assert preempted > 0   # the pool is tight enough that tables are released and sent again


def test_a_plan_is_plain_data():
    kv = make_manager("v2", _specs(8), 4, 64, enable_prefix_caching=True, enable_scratch=True)
    sched = Scheduler(kv, 4, 16)
    sched.add(Request("a", "a", 0, "", list(range(3, 30)), SamplingParams(max_tokens=3, temperature=0.7, seed=3,
                                                                          stop=["x"]), frozenset(), 1 << 20))
    plan = sched.schedule()
    text = json.dumps(plan.to_dict())
    back = StepPlan.from_dict(json.loads(text))
    assert back == plan
    assert back.new_requests[0].params.temperature == 0.7 and back.seqs[0].new_table
    assert back.seqs[0].token_ids == list(range(3, 19))   # the first 16-token chunk
