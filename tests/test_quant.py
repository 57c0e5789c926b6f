"""Quantised CPU weights (models/quant.py): exact Q4_K groups, the packed kernels against dequantised
references, the model-level swap, and the embedded 270M's quantised path against its fp32 one."""

import numpy as np
import pytest
import torch
from helpers import fresh_seed, ours_from_hf, paged_logits, tiny_hf_model

from gemmaserve.models.quant import (GROUP, FbgemmTensors, Int4Groups, Int8Kernel, Int8Matmul, QuantEmbedding,
                                     QuantLinear, Rotation, WeightFormat, int8_blocks, int8_rows, q4_k_groups,
                                     quantize_model, row_affine)

# fbgemm quantises activations per call (uint8, per tensor): a few tenths of a percent more error than
# the weight-only kernel's bf16 activations.
KERNELS = [pytest.param(Int8Kernel.WEIGHT_ONLY, 1e-2, id="weight-only"),
           pytest.param(Int8Kernel.FBGEMM_DYNAMIC, 3e-2, id="fbgemm", marks=pytest.mark.skipif(
               "fbgemm" not in torch.backends.quantized.supported_engines, reason="no fbgemm in this PyTorch"))]


def _random_q4_k(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Valid Q4_K blocks: any bytes are, given finite fp16 d and dmin."""
    blocks = rng.integers(0, 256, size=(n * k // 256, 144), dtype=np.uint8)
    blocks[:, 0:2] = np.float16(rng.uniform(1e-3, 2e-2, len(blocks))).view(np.uint8).reshape(-1, 2)
    blocks[:, 2:4] = np.float16(rng.uniform(1e-3, 2e-2, len(blocks))).view(np.uint8).reshape(-1, 2)
    return blocks


def test_q4_k_groups_are_exact():
    import gguf

    rng = np.random.default_rng(fresh_seed())
    raw = _random_q4_k(rng, 48, 512)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K).reshape(48, 512)
    groups = q4_k_groups(raw, (48, 512))
    assert groups.q.dtype == torch.uint8 and int(groups.q.max()) <= 15
    assert torch.equal(groups.dequantize(), torch.from_numpy(ref))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_q4_0_and_q4_1_groups_are_exact(qtype):
    """Google's QAT GGUFs are Q4_0: its blocks (and Q4_1's) are the CPU's INT4 groups exactly, not INT8 rows."""
    import gguf

    from gemmaserve.models.quant import q4_0_groups, q4_1_groups

    rng = np.random.default_rng(fresh_seed())
    w = (rng.standard_normal((48, 512)) * rng.uniform(0.01, 0.1, (48, 1))).astype(np.float32)
    t = getattr(gguf.GGMLQuantizationType, qtype)
    raw = gguf.quants.quantize(w, t)
    ref = gguf.quants.dequantize(raw, t).reshape(48, 512)
    groups = (q4_0_groups if qtype == "Q4_0" else q4_1_groups)(raw, (48, 512))
    assert groups.q.dtype == torch.uint8 and int(groups.q.max()) <= 15 and int(groups.q.min()) >= 0
    assert torch.equal(groups.dequantize(), torch.from_numpy(ref))


@pytest.mark.parametrize("rows", [1, 3, 16, 80])
def test_int4_linear_matches_its_groups(rows):
    rng = np.random.default_rng(fresh_seed())
    groups = q4_k_groups(_random_q4_k(rng, 64, 256), (64, 256))
    lin = QuantLinear.from_int4(groups)
    assert lin.format is WeightFormat.INT4
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(int(rng.integers(1 << 30))))
    ref = x.to(torch.bfloat16).double() @ groups.dequantize().double().t()
    y = lin(x)
    assert y.dtype == torch.float32 and y.shape == (rows, 64)
    # bf16 scales, a bf16 output: a few bf16 roundings
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("kernel,tol", KERNELS)
def test_int8_rows_fit_bf16_scales(kernel, tol):
    gen = torch.Generator().manual_seed(fresh_seed())
    w = torch.randn(300, 96, generator=gen) * torch.rand(300, 1, generator=gen) * 3
    q, s = int8_rows(w, chunk=64)
    assert q.dtype == torch.int8 and s.dtype == torch.bfloat16
    assert int(q.abs().max()) <= 127
    err = (q.float() * s.float()[:, None] - w).abs()
    assert bool((err <= s.float()[:, None] / 2 + 1e-7).all())
    lin = QuantLinear.from_float(w, kernel)
    assert lin.int8.kernel is kernel
    for rows in (1, 5, 70):
        x = torch.randn(rows, 96, generator=gen)
        ref = x.double() @ (q.double() * s.double()[:, None]).t()
        assert ((lin(x).double() - ref).norm() / ref.norm()).item() < tol


@pytest.mark.parametrize("width", [640, 2048, 96, 32, 1152])
def test_rotation_is_orthogonal_and_undone(width):
    rot = Rotation.for_width(width)
    r = rot.apply(torch.eye(width).double().float())
    torch.testing.assert_close(r @ r.t(), torch.eye(width), atol=1e-5, rtol=0)
    x = torch.randn(3, width, generator=torch.Generator().manual_seed(fresh_seed()))
    torch.testing.assert_close(rot.apply(x), x @ r, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(rot.undo(rot.apply(x)), x, atol=1e-5, rtol=1e-5)
    # what activations go through: the butterflies, then each row mapped onto [0, 1] and back
    xn, lo, span = row_affine(x, rot)
    assert float(xn.amin()) == 0.0 and torch.equal(xn.amax(-1), torch.ones(3))
    torch.testing.assert_close(xn * span + lo, x @ r, atol=1e-4, rtol=1e-4)
    one_hot = torch.zeros(width)
    one_hot[width // 3] = 1.0   # an outlier channel is spread over every channel
    assert float(rot.apply(one_hot).abs().max()) < 3 / width ** 0.5


@pytest.mark.skipif("fbgemm" not in torch.backends.quantized.supported_engines, reason="no fbgemm in this PyTorch")
def test_layer_int8_rotates_and_steps_per_row():
    """The layers' int8 path: weights rotated and packed once, the input rotated per call and quantised
    per row, so an outlier channel and a loud neighbouring row cost no accuracy; `dequantize` gives the
    weight back in the inputs' basis."""
    gen = torch.Generator().manual_seed(fresh_seed())
    w = torch.randn(256, 640, generator=gen) * 0.05
    lin = QuantLinear.from_float(w)
    assert lin.int8.kernel is Int8Kernel.FBGEMM_DYNAMIC and lin.int8.rotation is not None
    assert ((lin.dequantize() - w).abs().max() / w.abs().max()).item() < 1e-2
    for rows in (1, 5, 67):
        x = torch.randn(rows, 640, generator=gen)
        x[:, 17] *= 300          # Gemma-like outlier channel
        x[0] *= 1e4              # a row far louder than the others
        ref = x.double() @ w.double().t()
        err = (lin(x).double() - ref).norm(dim=-1) / ref.norm(dim=-1)
        assert err.max().item() < 2e-2, err
    unrotated = QuantLinear.from_float(w, Int8Kernel.FBGEMM_DYNAMIC)
    assert unrotated.int8.rotation is None
    x = torch.randn(1, 640, generator=gen)
    x[:, 17] *= 300
    ref = x.double() @ w.double().t()
    rel = lambda m: ((m(x).double() - ref).norm() / ref.norm()).item()   # noqa: E731
    assert rel(lin) < rel(unrotated) / 3   # the outlier sets the step unless rotated away


@pytest.mark.parametrize("fmt", ["int8-rotated", "int8-plain", "int8-quantized-tensors", "int8-weight-only", "int4"])
def test_every_row_is_its_own_whatever_the_batch(fmt):
    """A row's product is the same bits alone, in a batch of any size and at any place in it, beside
    rows of any range (a loud row, a constant row): greedy tokens must not depend on the batch. The
    int8 activations are quantised per call, so this holds only because each row is mapped onto
    [0, 1] first: without that the same checks fail (mutation-checked: dropping the affine map in
    `Int8Matmul.__call__` fails every int8-fbgemm case here)."""
    gen = torch.Generator().manual_seed(fresh_seed())
    w = torch.randn(96, 640, generator=gen) * 0.05
    if fmt == "int4":
        rng = np.random.default_rng(fresh_seed())
        lin = QuantLinear.from_int4(q4_k_groups(_random_q4_k(rng, 96, 640), (96, 640)))
    elif fmt == "int8-weight-only":
        lin = QuantLinear.from_float(w, Int8Kernel.WEIGHT_ONLY)
    else:
        if "fbgemm" not in torch.backends.quantized.supported_engines:
            pytest.skip("no fbgemm in this PyTorch")
        lin = QuantLinear.from_float(w) if fmt == "int8-rotated" else QuantLinear.from_float(w, Int8Kernel.FBGEMM_DYNAMIC)
        if fmt == "int8-quantized-tensors":
            q, sc = int8_rows(w)
            lin.int8 = Int8Matmul(q, sc, Int8Kernel.FBGEMM_DYNAMIC, fbgemm_tensors=False)
    others = torch.randn(70, 640, generator=gen)
    others[:, 17] *= 300
    others[3] *= 1e4     # a loud row
    others[5] = 0.25     # a constant row
    row = torch.randn(1, 640, generator=gen)
    alone = lin(row)
    for n, at in ((2, 0), (2, 1), (5, 3), (8, 7), (64, 20), (71, 70)):
        batch = torch.cat([others[:at], row, others[at:n - 1]])
        assert torch.equal(lin(batch)[at:at + 1], alone), (fmt, n, at)
    assert torch.equal(lin(others[5:6]), lin(others)[5:6])   # a constant row too


@pytest.mark.skipif(not FbgemmTensors.available(), reason="needs fbgemm with VNNI and its tensor-packed linear")
def test_fbgemm_tensor_packed_linear_equals_linear_dynamic():
    """The two ways into fbgemm's int8 linear (plain tensors, quantized tensors) quantise activations the
    same way and give the same products at every row count; the tensor-packed weight reads back exactly."""
    gen = torch.Generator().manual_seed(fresh_seed())
    q, s = int8_rows(torch.randn(384, 640, generator=gen) * 0.05)
    tensors = Int8Matmul(q, s, Int8Kernel.FBGEMM_DYNAMIC, keep_rows=False)
    quantized = Int8Matmul(q, s, Int8Kernel.FBGEMM_DYNAMIC, fbgemm_tensors=False)
    assert tensors._tensors is not None and quantized._packed is not None
    for rows in (1, 8, 69):
        x = torch.randn(rows, 640, generator=gen)
        x[:, 3] *= 50
        a, b = tensors(x), quantized(x)
        # (the quantized-tensor kernel folds the weight scale into its output: an ulp apart, which mapping
        # the row back from [0, 1] scales by its range)
        assert (a - b).abs().max() <= 1e-5 * b.abs().max(), rows
    assert torch.allclose(tensors.dequantize(), q.float() * s.float()[:, None], rtol=1e-6, atol=0)


def test_cpp_kernels_equal_the_python_ones():
    """The C++ kernels (models/cpu_kernels.py) that eager steps and compiled graphs call give the Python
    kernels' results exactly: `row_affine` at every width the models use (rotated or not, a constant
    row, a loud one), and the fbgemm op at one row and several. (The Python kernels serve where the
    library cannot be built: the results must not depend on which one ran.)"""
    from gemmaserve.models import cpu_kernels, cpu_library
    from gemmaserve.models.quant import _fbgemm_int8_product

    assert cpu_library.load() is None   # built with inductor's toolchain (compiled decode needs it too)
    for op in ("row_affine", "fbgemm_int8_linear"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"gemmaserve::{op}", "CPU"), op
    gen = torch.Generator().manual_seed(fresh_seed())
    for width in (640, 2048, 1152, 96, 128, 256, 32):
        rot = Rotation.for_width(width)
        for rows in (1, 3, 9):
            x = torch.randn(rows, width, generator=gen) * 5
            x[:, 3] *= 100
            x[rows // 2] = -0.5   # constant: maps to zeros
            for a_t, block in ((rot.a_t, rot.block), (torch.empty(0, 0), 0)):
                got = torch.ops.gemmaserve.row_affine(x, a_t, block)
                want = cpu_kernels.row_affine_reference(x, a_t, block)
                assert all(torch.equal(g, w) for g, w in zip(got, want)), (width, rows, block)
    if FbgemmTensors.available():
        q, s = int8_rows(torch.randn(384, 640, generator=gen) * 0.05)
        t = FbgemmTensors.pack(q, s)
        for rows in (1, 5):
            x = torch.rand(rows, 640, generator=gen)
            want = _fbgemm_int8_product(x, t.shape, t.packed, t.col_offsets, t.bias)
            got = torch.ops.gemmaserve.fbgemm_int8_linear(x, t.shape, t.packed, t.col_offsets, t.bias)
            assert torch.equal(got, want), rows


@pytest.mark.parametrize("kernel,tol", KERNELS)
def test_quant_embedding_lookup_and_head(kernel, tol):
    """A table whose width is not a multiple of 32 (one int8 block per row, fp16 scales) is kept exactly:
    lookups and the head's highest logits are the table's own; the head's scan is per-row int8 within
    `tol`. (Wider tables scan in 4 bits: tests/test_cpu_head.py.)"""
    gen = torch.Generator().manual_seed(fresh_seed())
    n, k = 1008, 80
    q8 = torch.randint(-126, 127, (n, k), generator=gen, dtype=torch.int8)
    q8[:, 7] = 127   # as int8_blocks quantises: each block's largest value is +-127 times its scale
    d = (torch.rand(n, 1, generator=gen) * 0.01 + 1e-3).half()
    w = q8.float() * d.float()
    emb = QuantEmbedding(w, kernel)
    assert torch.equal(emb.qweight, q8) and torch.equal(emb.scales, d)
    assert emb.head4 is None and emb.head is not None
    ids = torch.tensor([0, n - 1, 5, 5])
    assert torch.equal(emb(ids), w[ids])
    h = torch.randn(2, k, generator=gen)
    ref = h.double() @ w.double().t()
    got = emb.as_head(h)
    assert ((got.double() - ref).norm() / ref.norm()).item() < tol
    top = emb.head(h).topk(QuantEmbedding.REFINE, dim=-1).indices   # the rows the scan ranked highest
    torch.testing.assert_close(got.gather(1, top).double(), ref.gather(1, top), rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert not torch.equal(emb.head.dequantize(), w)   # (the scan itself is per row: not the table)
    # every row the same bits alone and in batches of any size
    one = emb.as_head(h[:1])[0]
    many = torch.cat([torch.randn(4, k, generator=gen), h[:1], torch.randn(6, k, generator=gen)])
    assert torch.equal(emb.as_head(many)[4], one) and torch.equal(emb.as_head(h)[0], one)


def test_int8_blocks_fall_back_to_rows_for_odd_widths():
    w = torch.randn(10, 24, generator=torch.Generator().manual_seed(fresh_seed()))
    q, s = int8_blocks(w)
    assert s.shape == (10, 1) and s.dtype == torch.float16
    assert ((q.float() * s.float() - w).abs() <= s.float() / 2 + 1e-7).all()


def test_quantize_model_swaps_every_matrix_and_keeps_logits_close():
    """Tiny Gemma 3: o_proj of layer 0 and both parts of layer 1's gate/up come as exact 4-bit groups,
    layer 0's gate/up has only one part in 4 bits (so INT8), everything else INT8."""
    seed = fresh_seed()
    hf = tiny_hf_model(seed, hidden_size=64, intermediate_size=128, head_dim=32)
    ours = ours_from_hf(hf)
    gen = torch.Generator().manual_seed(seed)

    def groups(n: int, k: int) -> Int4Groups:
        return Int4Groups(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
                          torch.rand(n, k // GROUP, generator=gen) * 0.02, torch.rand(n, k // GROUP, generator=gen) * 0.1)

    params = dict(ours.named_parameters())
    o_name = "model.layers.0.self_attn.o_proj.weight"
    int4 = {o_name: groups(*params[o_name].shape)}
    params[o_name].data.copy_(int4[o_name].dequantize())
    inter = hf.config.intermediate_size
    for layer, parts in ((1, ("gate_proj", "up_proj")), (0, ("gate_proj",))):
        fused = params[f"model.layers.{layer}.mlp.gate_up_proj.weight"]
        for i, part in enumerate(parts):
            int4[f"model.layers.{layer}.mlp.{part}.weight"] = g = groups(inter, fused.shape[1])
            fused.data[i * inter:(i + 1) * inter] = g.dequantize()
    seqs = [[2] + torch.randint(3, hf.config.vocab_size, (20,), generator=gen).tolist()]
    ref = paged_logits(ours, seqs)[0]
    counts = quantize_model(ours, int4, Int8Kernel.WEIGHT_ONLY)   # fbgemm's head is judged on the real model
    n_layers = hf.config.num_hidden_layers
    assert counts == {"int8": 4 * n_layers - 2, "int4": 2, "embedding_int8": 1, "float32": 0}
    layers = ours.model.layers
    assert layers[0].self_attn.o_proj.format is WeightFormat.INT4
    assert layers[1].mlp.gate_up_proj.format is WeightFormat.INT4
    assert layers[0].mlp.gate_up_proj.format is WeightFormat.INT8
    if "fbgemm" in torch.backends.quantized.supported_engines:   # int8 activations in the MLP only
        assert layers[0].mlp.gate_up_proj.int8.rotation is not None and layers[1].mlp.down_proj.int8.rotation is not None
        # one rotation per input width, shared (q/k/v and the gate/up read the same width)
        assert layers[1].self_attn.qkv_proj.int8.rotation is layers[0].mlp.gate_up_proj.int8.rotation
    assert isinstance(ours.model.embed_tokens, QuantEmbedding) and ours.model.embed_tokens.head4 is not None
    assert not any(p.numel() > 64 * 64 for p in ours.parameters())   # no fp32 matrix left
    got = paged_logits(ours, seqs)[0]
    # 21 rows: int8 weights and int8 activations (rotated, per row) everywhere: a few percent on a random
    # model, which amplifies rounding (a wrong rotation or scale would be off by ~100%)
    assert ((got - ref).norm() / ref.norm()).item() < 0.15


@pytest.mark.slow
def test_embedded_model_quantised_path_agrees_with_fp32(llm_270m):
    """`--dtype auto` on the CPU: the GGUF's weights stay quantised. Teacher-forced on fp32's own greedy
    continuation, the quantised model picks the same token wherever fp32's top-2 margin is clear."""
    from gemmaserve import LLM, SamplingParams
    from gemmaserve.models.loader import load_model

    quant = load_model("gemma3-270m", torch.float32, torch.device("cpu"), quantized=True)
    assert quant.weight_formats["int4"] > 0 and quant.weight_formats["embedding_int8"] == 1
    assert LLM.from_config(type(llm_270m.engine.config)(dtype="auto"), quant).engine.info.weights.startswith("int8")
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    params = SamplingParams(max_tokens=24, temperature=0)
    agree = total = clear = 0
    for prompt, out in zip(prompts, llm_270m.generate(prompts, params)):
        ids = llm_270m.engine.inputs.tokenize(prompt) + list(out.outputs[0].token_ids)
        ref = paged_logits(llm_270m.engine._model, [ids])[0][-25:-1]
        got = paged_logits(quant.model, [ids])[0][-25:-1]
        top2 = ref.topk(2, dim=-1).values
        decided = (top2[:, 0] - top2[:, 1]) > 1.0
        same = got.argmax(-1) == ref.argmax(-1)
        assert bool(same[decided].all()), f"{prompt!r}: a clear fp32 decision flipped"
        agree, total, clear = agree + int(same.sum()), total + len(same), clear + int(decided.sum())
        assert ((got - ref).norm() / ref.norm()).item() < 0.1
    assert clear >= total // 2 and agree >= 0.9 * total


def test_scoring_equals_paged_logits():
    """testing/scoring.py (perplexity and agreement figures) reads the same logits as the engine path."""
    from gemmaserve.testing.scoring import score

    hf = tiny_hf_model(fresh_seed())
    ours = ours_from_hf(hf)
    ids = [2] + torch.randint(3, hf.config.vocab_size, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    logits = paged_logits(ours, [ids])[0]
    s = score(ours, ids, chunk=16)
    ref = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(s.logprobs, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(s.argmax, logits[:-1].argmax(-1))
    assert s.perplexity == pytest.approx(float(torch.exp(-ref.double().mean())), rel=1e-5)
    # KL from a reference: zero against itself (any chunking), positive against another model
    kept = score(ours, ids, chunk=7, keep_logprobs=True)
    assert kept.full_logprobs.shape == (len(ids) - 1, hf.config.vocab_size)
    same = score(ours, ids, chunk=1, reference=kept)
    assert same.kl.shape == (len(ids) - 1,) and same.mean_kl < 1e-6
    other = ours_from_hf(tiny_hf_model(fresh_seed() + 1))
    assert score(other, ids, chunk=5, reference=kept).mean_kl > 1e-3


def test_decode_bench_runs_and_notes_a_missing_reference(tmp_path):
    """`bench decode` on a checkpoint directory: no GGUF, so llama.cpp is skipped with a note; the
    decode rows and the prompt-processing row are filled."""
    import argparse
    import json

    from helpers import save_checkpoint

    from gemmaserve.bench import decode
    from gemmaserve.config.engine import EngineConfig
    from gemmaserve.config.options import add_options

    path = save_checkpoint(tiny_hf_model(fresh_seed()), tmp_path / "m")
    parser = argparse.ArgumentParser()
    decode.add_arguments(parser)
    add_options(parser, EngineConfig, "engine")
    out = tmp_path / "decode.json"
    # --cpu-compile off: a benchmark's steady state would build compiled steps for it (~35 s here).
    args = parser.parse_args(["--model", str(path), "--batch-sizes", "1,2", "--new-tokens", "4", "--repeats", "1",
                              "--no-hf", "--prefill-tokens", "24", "--cpu-compile", "off", "--out", str(out)])
    assert decode.run(args) == 0
    res = json.loads(out.read_text())
    assert [r["batch"] for r in res["rows"]] == [1, 2] and all(r["ours_tok_s"] > 0 for r in res["rows"])
    assert res["prefill"]["prompt_tokens"] == 24 and res["prefill"]["ours_tok_s"] > 0
    assert res["llama_cpp"].startswith("skipped") and res["weights"] == "float32"


def test_cpu_rms_norm_is_hf_norm_to_the_last_bits():
    """The CPU norm (one C++ pass per row, models/cpu_kernels.py) against HF's op-by-op Gemma 3 RMSNorm
    in fp64: within a few fp32 roundings, at every width and scale (its sum runs in 16 lanes, not ATen's
    order, so not bit for bit), and the ATen kernel it replaces no closer."""
    from gemmaserve.models.fused_ops import NormKind, _norm_ref, rms_norm

    gen = torch.Generator().manual_seed(fresh_seed())
    for h in (256, 640, 1152, 40):
        for scale in (1e-2, 1.0, 1e3):
            x = torch.randn(5, h, generator=gen) * scale
            w = torch.randn(h, generator=gen) * 0.3
            exact = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w.double())
            ours = (rms_norm(x, w, NormKind(1e-6, 1.0)).double() - exact).abs().max() / exact.abs().max()
            aten = (_norm_ref(x, w, NormKind(1e-6, 1.0)).double() - exact).abs().max() / exact.abs().max()
            assert ours < 4e-7 and ours <= 2 * aten + 1e-7, (h, scale, ours, aten)


@pytest.mark.parametrize("qtype", ["Q5_0", "Q8_0"])
def test_int8_rows_are_nearer_than_int4_groups_for_finer_types(qtype):
    """The format choice: a type finer than 4 bits (here Q5_0, Q8_0, which gguf can write) is closer to
    its own values as int8 rows than as 4-bit groups of 32 fitted to them."""
    import gguf

    rng = np.random.default_rng(fresh_seed())
    w = (rng.standard_normal((64, 512)) * rng.uniform(0.01, 0.1, (64, 1))).astype(np.float32)
    t = getattr(gguf.GGMLQuantizationType, qtype)
    src = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w, t), t).reshape(64, 512))
    q, s = int8_rows(src)
    int8_err = (q.float() * s.float()[:, None] - src).norm()
    g = src.view(64, -1, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q4 = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15)
    int4_err = (Int4Groups(q4.to(torch.uint8).view(64, 512), scale, -lo).dequantize() - src).norm()
    assert int8_err < int4_err / 4


def test_only_the_tied_output_table_gets_a_head_copy():
    """Gemma 4 E2B-like: the per-layer embedding table is quantised for lookups only (no matmul copy of
    a table that can be larger than the whole rest of the model); logits stay close."""
    from helpers import tiny_gemma4_hf

    hf = tiny_gemma4_hf(fresh_seed(), "e2b")
    ours = ours_from_hf(hf)
    ids = [2] + torch.randint(3, hf.config.get_text_config().vocab_size, (20,),
                              generator=torch.Generator().manual_seed(5)).tolist()
    ref = paged_logits(ours, [ids])[0]
    counts = quantize_model(ours, {}, Int8Kernel.WEIGHT_ONLY)
    assert counts["embedding_int8"] == 2
    assert counts["float32"] >= 1 and type(ours.model.layers[0].per_layer_projection).__name__ == "Linear"  # width 8
    assert ours.model.embed_tokens.head4 is not None and ours.model.embed_tokens_per_layer.head4 is None
    assert ours.model.embed_tokens_per_layer.head is None
    with pytest.raises(RuntimeError, match="lookups only"):
        ours.model.embed_tokens_per_layer.as_head(torch.zeros(1, ours.model.embed_tokens_per_layer.embedding_dim))
    got = paged_logits(ours, [ids])[0]
    assert ((got - ref).norm() / ref.norm()).item() < 0.15   # int8 activations too, as above


@pytest.mark.slow
def test_cached_quantised_weights_give_the_same_model(tmp_path, monkeypatch):
    """models/quant_cache.py: the first quantised load writes what each module was built from; the next
    one builds the model from it without quantising, and its logits are the first one's bits."""
    from gemmaserve.models import quant_cache
    from gemmaserve.models.loader import load_model

    monkeypatch.setenv("GEMMASERVE_CACHE_DIR", str(tmp_path))
    quantise = quantize_model
    calls = []
    monkeypatch.setattr("gemmaserve.models.quant.quantize_model", lambda *a, **k: calls.append(1) or quantise(*a, **k))
    first = load_model("gemma3-270m", torch.float32, torch.device("cpu"), quantized=True)
    cached = quant_cache.cache_path(first.source.path)
    for _ in range(600):   # written on a thread
        if cached.is_file():
            break
        import time
        time.sleep(0.1)
    assert cached.is_file() and calls == [1]
    second = load_model("gemma3-270m", torch.float32, torch.device("cpu"), quantized=True)
    assert calls == [1] and second.weight_formats == first.weight_formats
    ids = [[2] + list(range(1000, 1040))]
    assert torch.equal(paged_logits(second.model, ids)[0], paged_logits(first.model, ids)[0])
    # a damaged file is dropped and the weights quantised again
    cached.write_bytes(b"damaged")
    third = load_model("gemma3-270m", torch.float32, torch.device("cpu"), quantized=True)
    assert calls == [1, 1] and torch.equal(paged_logits(third.model, ids)[0], paged_logits(first.model, ids)[0])
