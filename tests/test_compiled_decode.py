"""Decode steps compiled in the engine's process with torch.compile (engine/compile/compiled_decode.py: what
`--cpu-compile on` runs where the steps cannot be exported as packages, tests/test_aot_decode.py): the
same bits as the eager step, through the engine's real path, and eager whenever there is no graph (not
yet compiled, failed, mixed steps)."""

import copy
import pickle

import pytest
import torch

from gemmaserve import LLM, SamplingParams
from gemmaserve.config.engine import EngineConfig
from gemmaserve.engine.compile.compiled_decode import CompiledDecode, CompileState, unavailable
from gemmaserve.engine.compile.direct_graph import DirectGraph
from gemmaserve.models.quant import Int8Kernel, Int8Matmul, int8_rows, quantize_model
from gemmaserve.testing.scoring import score

from helpers import fresh_seed, ours_from_hf, save_checkpoint, tiny_hf_model

needs_compile = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
# 3 layers, a sliding and a full kind: graphs ~3x faster to compile than the usual 7 layers
LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]


@needs_compile
@pytest.mark.parametrize("kv_manager", ["v2", "v1"])
def test_compiled_quantised_decode_matches_the_eager_step(kv_manager):
    """Every kernel of the quantised path (fbgemm through its custom ops, the head's exact refinement)
    inside one graph, sliding and full layers: one token at a time, teacher-forced, the compiled step's
    log-probabilities are the eager step's bits (the numerically sensitive work runs as ops the graph
    calls as they are: models/cpu_kernels.py). With V2's one arena attention is traced into the graph;
    with V1 the graph calls it through the opaque op."""
    seed = fresh_seed()
    small = dict(hidden_size=64, intermediate_size=128, head_dim=32, num_hidden_layers=3, layer_types=LAYERS)
    hf = tiny_hf_model(seed, **small)
    ours = ours_from_hf(hf)
    quantize_model(ours, {})
    if "fbgemm" in torch.backends.quantized.supported_engines:
        assert ours.model.embed_tokens.head4 is not None   # the 4-bit head (cpu_head.py): an op the graph calls
        assert ours.model.layers[0].mlp.gate_up_proj.int8.rotation is not None
    ids = [2] + torch.randint(3, hf.config.vocab_size, (30,), generator=torch.Generator().manual_seed(seed)).tolist()
    eager = score(ours, ids, chunk=1, keep_logprobs=True)
    compiled = score(ours, ids, chunk=1, reference=eager, keep_logprobs=True, compiled=True, kv_manager=kv_manager)
    assert torch.equal(compiled.full_logprobs, eager.full_logprobs), compiled.kl
    # a wrong layer order, a stale handle or a missing KV write would move it by ~1 (a different model)
    other = score(ours_from_hf(tiny_hf_model(seed + 1, **small)), ids,
                  chunk=1, reference=eager)
    assert other.mean_kl > 1e-3


def _compiled_in_process(eager: LLM, **changes) -> LLM:
    """An engine on the same weights (options `changes`) whose runner compiled its decode steps with torch.compile."""
    comp = LLM.from_config(eager.engine.config.replace(**changes), eager)
    comp.engine._runner.compile_decode(required=True)
    return comp


def _small_checkpoint(tmp_path):
    return save_checkpoint(tiny_hf_model(fresh_seed(), sliding_window=4, num_hidden_layers=3, layer_types=LAYERS),
                           tmp_path / "tiny")


@needs_compile
def test_engine_runs_decode_and_verification_batches_through_the_graphs_and_keeps_tokens(tmp_path):
    """Compiled before the first step; decode-only steps of 1 and of several sequences run the graphs,
    and so do speculative verification steps (one decode row per token: a row sees its sequence's
    earlier rows through the step's new K/V, never the cache they are not in yet); prefill and mixed
    steps stay eager; every token and logprob is the eager non-speculative engine's, bit for bit."""
    from gemmaserve.testing.replay_drafts import ReplayDrafts

    eager = LLM(str(_small_checkpoint(tmp_path)), dtype="float32", cpu_compile="off", max_num_seqs=10)
    assert eager.engine._runner.compiled is None and eager.engine.info.cpu_compile == "off"
    comp = _compiled_in_process(eager, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                           "disable_by_batch_size": 10})
    runner, sched = comp.engine._runner, comp.engine._scheduler
    assert runner.compiled.attention_path == "traced"   # Gemma's default V2 arena: attention in the graph
    calls: list[tuple[int, int]] = []   # steps the graphs computed: (rows, most rows of one sequence before a row)
    run = runner.compiled.run

    def counted(ids, pos, md):   # (a step the graphs decline gives None and runs eagerly: not counted)
        out = run(ids, pos, md)
        if out is not None:
            calls.append((len(ids), max(md.new_before or [0])))
        return out

    runner.compiled.run = counted
    # each graph captured at compile time, checked against Dynamo's call, and called directly since
    assert set(runner.compiled._direct) == {1, 8, None}
    assert all(isinstance(d, DirectGraph) and d.verified for d in runner.compiled._direct.values())
    through_dynamo: list[int] = []
    for name in ("_static", "_dynamic"):
        graph = getattr(runner.compiled, name)
        setattr(runner.compiled, name, lambda *a, graph=graph: through_dynamo.append(len(a[0])) or graph(*a))
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)

    def tokens(outs):
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    words = "the cat sat on a mat by the door".split()
    sched.proposer = None   # plain decode steps first
    for n in (3, 8, 9):   # the dynamic graph, the 8-row one, the dynamic one again
        prompts = [f"{w} " * (2 + i) for i, w in enumerate(words[:n])]
        assert tokens(comp.generate(prompts, params)) == tokens(eager.generate(prompts, params))
    assert {3, 8, 9} <= {rows for rows, _ in calls} and runner.compiled.sizes == [1, 8] and runner.compiled.dynamic
    assert tokens(comp.generate(["hello world"], params)) == tokens(eager.generate(["hello world"], params))
    assert calls[-1] == (1, 0)
    # verification: 3 drafts of the eager engine's own continuation per step, each right 60% of the time
    sched.misses_before_pause = 1 << 30
    long = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    for n in (1, 3):
        prompts = [f"{w} " * (3 + i) for i, w in enumerate(words[:n])]
        want = eager.generate(prompts, long)
        sched.proposer = ReplayDrafts(3, {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in want}, 0.6,
                                      eager.engine._model.vocab_size)
        assert tokens(comp.generate(prompts, long)) == tokens(want)
    st = sched.spec_stats
    assert 0 < st.accepted < st.drafted and st.accepted_at[2] > 0, st
    assert {(4, 3), (12, 3)} <= set(calls)   # 1 and 3 sequences of 4 rows each
    assert runner.compiled.refused_recompiles == 0   # every batch ran the graphs compiled at start
    assert through_dynamo == []


@needs_compile
def test_a_graph_that_cannot_be_called_directly_runs_through_dynamo(monkeypatch, tmp_path):
    """A capture that fails (a graph layout not foreseen) costs the direct call only: the engine is
    compiled, its decode steps run the graphs through Dynamo, and the tokens are the eager engine's."""
    def unforeseen(cls, *args):
        raise RuntimeError("unforeseen layout")

    monkeypatch.setattr(DirectGraph, "capture", classmethod(unforeseen))
    eager = LLM(str(_small_checkpoint(tmp_path)), dtype="float32", cpu_compile="off", max_num_seqs=2)
    comp = _compiled_in_process(eager)
    compiled = comp.engine._runner.compiled
    assert compiled.state is CompileState.READY and compiled._direct
    assert all(isinstance(d, str) and "unforeseen layout" in d for d in compiled._direct.values())
    through_dynamo: list[int] = []
    graph = compiled._static
    compiled._static = lambda *a: through_dynamo.append(len(a[0])) or graph(*a)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = ["the cat sat", "on a mat by the door"]
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in comp.generate(prompts, params)] == want
    assert through_dynamo and set(through_dynamo) <= {1, 2} and compiled.refused_recompiles == 0



@needs_compile
def test_a_cached_graph_for_fewer_rows_is_compiled_again(monkeypatch, tmp_path):
    """Inductor's caches key a graph without its batch range: an engine whose dynamic graph was cached for
    2-10 rows (as an older build traced it, for its own largest batch) must not make another engine's
    compile fail. The second compile finds the narrow entry, compiles afresh, and its graph takes 40
    rows; the engine's largest batch no longer changes the range (MAX_ROWS)."""
    from gemmaserve.engine.compile import compiled_decode

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    eager = LLM(str(_small_checkpoint(tmp_path)), dtype="float32", cpu_compile="off", max_num_seqs=10)
    monkeypatch.setattr(compiled_decode, "MAX_ROWS", 10)
    narrow = _compiled_in_process(eager)
    assert narrow.engine._runner.compiled.max_rows == 10
    monkeypatch.setattr(compiled_decode, "MAX_ROWS", 63)
    wide = _compiled_in_process(eager, max_num_seqs=40)
    compiled = wide.engine._runner.compiled
    assert compiled.state is CompileState.READY and compiled.max_rows == 40
    prompts = [f"{w} " * (2 + i % 5) for i, w in enumerate(("the cat sat on a mat by the door " * 4).split())]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in wide.generate(prompts, params)] == want
    assert compiled.refused_recompiles == 0   # the 36-row steps ran the dynamic graph

def test_without_a_graph_the_caller_runs_eagerly():
    """Before compiling, after a failed compile, and for more rows than the graphs take: None (eager)."""
    compiled = CompiledDecode.__new__(CompiledDecode)
    compiled.state, compiled.max_rows = CompileState.WAITING, 8
    ids = torch.zeros(1, dtype=torch.long)
    assert compiled.run(ids, ids, None) is None
    compiled.state = CompileState.READY
    assert compiled.run(torch.zeros(9, dtype=torch.long), ids, None) is None


def test_a_failed_compile_leaves_the_steps_eager_and_says_why(monkeypatch, caplog, tmp_path):
    """A compile that fails where it may (`required=False`) leaves the steps eager and logs why; where it
    is required it raises."""
    def broken(self, size, dynamic):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(CompiledDecode, "_warm_up", broken)
    path = save_checkpoint(tiny_hf_model(fresh_seed()), tmp_path / "tiny")
    llm = LLM(str(path), dtype="float32", max_num_seqs=2, cpu_compile="off")
    llm.engine._runner.compile_decode(required=False)
    assert llm.engine._runner.compiled.state is CompileState.FAILED and "no C++ compiler" in caplog.text
    out = llm.generate(["hello world"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        llm.engine._runner.compile_decode(required=True)


def test_cpu_compile_mode_resolution():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    auto = EngineConfig()
    assert auto.cpu_compile_mode(cpu, quantized=True) == "background"   # serve, generate and LLM alike
    assert auto.replace(serving=True).cpu_compile_mode(cpu, quantized=True) == "background"
    assert auto.cpu_compile_mode(cpu, quantized=False) == "off"   # fp32 stays the exact eager path
    assert auto.cpu_compile_mode(cuda, quantized=True) == "off"   # CUDA graphs there
    assert auto.replace(cpu_compile="on").cpu_compile_mode(cpu, quantized=False) == "now"
    assert auto.replace(cpu_compile="on", enforce_eager=True).cpu_compile_mode(cpu, quantized=True) == "off"
    assert auto.replace(cpu_compile="off").cpu_compile_mode(cpu, quantized=True) == "off"
    with pytest.raises(Exception, match="cpu_compile must be one of"):
        EngineConfig(cpu_compile="yes")


def test_packed_weights_pickle_to_a_small_key():
    """The compile cache pickles graph inputs for its key: fbgemm's packed qint8 weights cannot be, and
    need not be (they are inputs, never baked into the graph)."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        pytest.skip("no fbgemm in this PyTorch")
    # quantized::linear_dynamic's packed weight (CPUs without VNNI; FbgemmTensors elsewhere: plain tensors)
    handle = Int8Matmul(*int8_rows(torch.randn(64, 32)), Int8Kernel.FBGEMM_DYNAMIC, fbgemm_tensors=False)._packed
    assert len(pickle.dumps(handle)) < 200
    assert copy.deepcopy(handle) is handle   # a reference to the live packed weight, never a broken copy
