"""The embedded 270M on its default path (quantised GGUF weights) gives every prompt the same tokens and
logprobs, bit for bit, alone and in any batch: batches of 1, 5, 7, 8, 13 and 16 whose prompts have different
lengths (chunked prefills beside other requests' decode rows) and finish at different steps, on eager steps
(`--cpu-compile off`), with `--enforce-eager`, and in a fresh process. (Where it broke: on an AMX Xeon the
BLAS rounded a row of a 13-row product otherwise, and 4 of 8 prompts changed their greedy tokens in a batch;
the products now sum in an order of our own, models/cpu_products.py.) The matrix is `gemmaserve bench
batches`' (bench/batches.py), which also runs it on compiled steps and across the switch to them, whose
packages take minutes to build on 2 cores: CI checks those paths on a small model (tests/test_aot_decode.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gemmaserve import LLM
from gemmaserve.bench import batches

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def eager():
    """The default path with eager steps, its prefills chunked, and each prompt alone."""
    llm = LLM(max_num_seqs=16, cpu_compile="off", max_num_batched_tokens=batches.CHUNK)
    assert llm.engine.info.weights.startswith("int8") and "int4" in llm.engine.info.weights
    return llm, batches.alone(llm)


def test_each_prompt_alone_and_in_batches_of_1_to_16(eager):
    llm, alone = eager
    assert len(set(map(json.dumps, alone))) == len(alone) and all(len(a[0]) > 3 for a in alone)
    assert batches.differing(alone, llm) == {str(n): [] for n in batches.BATCHES}


def test_enforce_eager_and_a_warm_prefix_cache_keep_every_bit(eager):
    """`--enforce-eager` (no compiled steps, whatever `--cpu-compile` says) and the prompts' prefixes
    cached by the runs before: the same bits as alone."""
    llm, alone = eager
    forced = LLM.from_config(llm.engine.config.replace(enforce_eager=True, cpu_compile="on"), llm)
    assert forced.engine.info.cpu_compile == "off"
    hits = forced.engine._kv.stats().prefix_hit_tokens
    assert batches.differing(alone, forced, (13, 13)) == {"13": []}
    assert forced.engine._kv.stats().prefix_hit_tokens > hits


def test_a_fresh_process_gives_the_same_bits(eager):
    """Another process (its own threads, allocations and kernel library load): batches of 16 and 7 give each
    prompt its bits from this process, alone."""
    _, alone = eager
    got = batches.in_process("off", alone, (16, 7))
    assert got.get("differ") == {"16": [], "7": []}, got


def test_the_check_fails_when_a_prompt_changes(eager):
    """The comparison sees one flipped bit of one logprob (what a batch-dependent rounding does first)."""
    llm, alone = eager
    changed = json.loads(json.dumps(alone))
    value = float.fromhex(changed[3][1][2][1])
    changed[3][1][2][1] = float(value + abs(value) * 2 ** -23).hex()
    assert batches.differing(changed, llm, (5,)) == {"5": [3]}


def test_bench_batches_reports_every_difference():
    """`gemmaserve bench batches`' verdict: a prompt that differs in any batch of any path, a path whose steps
    were not what it checks (compiled steps that never loaded, a switch that never came) or one that failed."""
    same = {str(n): [] for n in batches.BATCHES}
    good = {"eager": {"differ": same}, "enforce-eager": {"cpu_compile": "off", "differ": same},
            "switch": {"rounds": [{"batch": 5, "spanned_switch": True, "differ": []}], "switched_in_batch": 5,
                       "after": same},
            "compiled": {"cpu_compile": "ready", "differ": same},
            "process": {"off": {"cpu_compile": "off", "differ": same}, "on": {"cpu_compile": "ready", "differ": same}}}
    assert batches._failures(good) == []
    bad = json.loads(json.dumps(good))
    bad["eager"]["differ"]["13"] = [4]
    bad["switch"]["rounds"][0]["differ"] = [3]
    bad["compiled"]["cpu_compile"] = "building"
    bad["process"]["on"] = {"error": "Traceback ..."}
    found = batches._failures(bad)
    assert any("eager batch 13: prompts [4]" in f for f in found)
    assert any("switch batch 5: prompts [3]" in f for f in found)
    assert any("compiled: steps were building" in f for f in found)
    assert any(f.startswith("process on:") for f in found)
    assert batches._failures({"switch": {"rounds": [], "switched_in_batch": None}}) == [
        "switch: no batch spanned the switch"]
