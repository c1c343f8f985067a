"""Int8 dense weights (horizon/quant/int8.py): the per-row format, Int8Linear's fast path against its
reference, the swap on a whole model, torch.compile, and the load-time opt-in (`load(dense="int8")`)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from horizon.checkpoint import load, open_model, save
from horizon.cli import build_parser
from horizon.model import HorizonForCausalLM
from horizon.model.moe import Experts, Router
from horizon.quant import (
    Int8Linear,
    MXFP4Experts,
    MXFP4Linear,
    dequantize_int8,
    quantize_dense_int8,
    quantize_int8,
    quantize_model,
)
from horizon.quant import int8 as int8_module
from horizon.quant.int8 import fast_kernel_available, int8_linear_reference
from horizon.quant.kernels import FEW_ROWS, FUSED_ONE_ROW_MAX, kernel_available
from tests.conftest import rows_matmul_calls, tiny

KERNEL_ROWS = FEW_ROWS[torch.int8]  # most rows Int8Linear sends to the CPU kernel

# The op's path (more than KERNEL_ROWS rows, or no CPU kernels) rounds x to bf16 (relative <= 2^-8 per
# element) and its pre-scale output to bf16 (<= 2^-8 of |y|), so |fast - reference| <= 2^-8 * (2 + 2^-8) *
# (|x| @ |W_hat|^T); 2^-7 * 1.01 covers that, plus fp32 accumulation slack.
BF16_BOUND = 2**-7 * 1.01


HALF_STEP_SLACK = 1 + 1e-4  # |w - q * scale| <= scale / 2 up to fp32 rounding of w / scale and q * scale


def _random_matrix(out: int, inp: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # rows of very different magnitudes: the scale is per row
    return torch.randn(out, inp, generator=gen) * torch.logspace(-4, 2, out)[:, None]


# --- the format ------------------------------------------------------------------------------------
def test_round_trip_error_is_at_most_half_a_step_per_row():
    w = _random_matrix(40, 96)
    w[7] = 0.0  # an all-zero row
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and scale.dtype == torch.float32 and scale.shape == (40,)
    assert int(q.abs().max()) <= 127 and int(q.min()) >= -127
    err = (dequantize_int8(q, scale) - w).abs()
    assert bool((err <= scale[:, None] / 2 * HALF_STEP_SLACK).all())
    # each nonzero row's largest magnitude uses the whole grid
    nonzero = torch.arange(40) != 7
    assert bool((q[nonzero].abs().amax(1) == 127).all())
    assert float(scale[7]) == 1.0 and bool((q[7] == 0).all())  # documented: zero rows get scale 1
    assert bool((dequantize_int8(q, scale)[7] == 0).all())


def test_integer_multiples_of_the_scale_are_exact():
    gen = torch.Generator().manual_seed(1)
    k = torch.randint(-127, 128, (6, 64), generator=gen)
    k[:, 0] = 127  # so amax / 127 is the row's step
    steps = torch.tensor([2.0**-20, 2.0**-7, 0.25, 1.0, 8.0, 2.0**10])  # powers of two: every product exact
    w = k.float() * steps[:, None]
    q, scale = quantize_int8(w)
    assert torch.equal(q.long(), k)
    assert torch.equal(scale, steps)
    assert torch.equal(dequantize_int8(q, scale), w)
    # other steps: the scale is within an ulp, and the codes are still the integers
    q, _ = quantize_int8(k.float() * torch.tensor([0.3, 1.7, 1e-3, 3.3, 0.01, 7.0])[:, None])
    assert torch.equal(q.long(), k)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused(bad):
    w = torch.randn(4, 32)
    w[2, 5] = bad
    with pytest.raises(ValueError, match=r"non-finite.*\[2, 5\]"):
        quantize_int8(w)
    linear = nn.Linear(32, 4)
    with torch.no_grad():
        linear.weight.copy_(w)
    with pytest.raises(ValueError, match="non-finite"):
        Int8Linear.from_linear(linear)


def test_dequantize_in_other_dtypes_and_the_weight_property():
    linear = nn.Linear(64, 16)
    m = Int8Linear.from_linear(linear)
    assert m.weight.dtype == torch.float32 and m.weight.shape == (16, 64)
    assert torch.equal(m.weight, dequantize_int8(m.weight_int8, m.weight_scale))
    assert torch.equal(dequantize_int8(m.weight_int8, m.weight_scale, torch.bfloat16), m.weight.bfloat16())
    assert set(m.state_dict()) == {"weight_int8", "weight_scale", "bias"}  # the unit scales are not saved


def test_a_dtype_cast_keeps_the_scales_fp32():
    m = Int8Linear.from_linear(nn.Linear(64, 16))
    scale = m.weight_scale.clone()
    m.to(torch.bfloat16)
    assert m.weight_scale.dtype == torch.float32 and torch.equal(m.weight_scale, scale)  # not rounded
    assert m.bias.dtype == torch.bfloat16 and m.weight_int8.dtype == torch.int8
    assert m(torch.randn(3, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16
    m.float()
    assert torch.equal(m.weight_scale, scale) and m._unit_scale.dtype == torch.bfloat16


# --- Int8Linear: fast path against the reference ----------------------------------------------------
def _fast_module(bias: bool, out: int = 48, inp: int = 96) -> Int8Linear:
    if not fast_kernel_available("cpu"):
        pytest.skip("aten._weight_int8pack_mm is not available on this CPU build")
    torch.manual_seed(0)
    m = Int8Linear.from_linear(nn.Linear(inp, out, bias=bias))
    if bias:
        with torch.no_grad():
            m.bias.normal_()
    assert m.uses_fast_path("cpu")
    return m


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 96), (5, 96), (2, 3, 96), (KERNEL_ROWS, 96)])
def test_few_rows_take_the_cpu_kernel_with_the_references_numbers(bias, shape, monkeypatch):
    if not kernel_available():
        pytest.skip("the CPU kernels are not built here")
    m = _fast_module(bias)
    calls = []
    kernel = int8_module.rows_matmul
    monkeypatch.setattr(int8_module, "rows_matmul", lambda *a: calls.append(a[0].shape) or kernel(*a))
    x = torch.randn(*shape) * 3
    fast, ref = m(x), m(x, reference=True)
    assert calls == [(x.numel() // 96, 96)]  # the kernel ran, once, on the rows as they are (fp32)
    assert fast.shape == ref.shape == (*shape[:-1], 48) and fast.dtype == torch.float32
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5 * float(ref.detach().abs().max()))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(KERNEL_ROWS + 1, 96), (3, 30, 96)])
def test_more_rows_take_the_op_within_bf16_rounding(bias, shape):
    m = _fast_module(bias)
    x = torch.randn(*shape) * 3
    fast, ref = m(x), m(x, reference=True)
    assert fast.shape == ref.shape == (*shape[:-1], 48) and fast.dtype == torch.float32
    assert torch.equal(ref, int8_linear_reference(x, m.weight_int8, m.weight_scale, m.bias))
    bound = BF16_BOUND * (x.abs() @ m.weight.abs().T) + 1e-6
    assert bool(((fast - ref).abs() <= bound).all()), float(((fast - ref).abs() / bound).max())
    assert not torch.equal(fast, ref)  # the op did run (it rounds x to bf16)
    m.reference = True  # the module attribute selects the reference too
    assert torch.equal(m(x), ref)


def test_fast_path_applies_the_scales_in_fp32():
    # one-hot rows are exact in bf16 and so is each q (|q| <= 127 < 2^8): the kernel's sums are exact and
    # the output is W_hat's columns bit for bit, unless the scales were rounded to bf16 somewhere
    m = _fast_module(False)
    x = torch.eye(96)[:7]
    assert torch.equal(m(x), m.weight[:, :7].T.contiguous())


def test_fast_path_in_a_bf16_model_and_with_no_rows():
    m = _fast_module(True).to(torch.bfloat16)
    x = torch.randn(5, 96, dtype=torch.bfloat16)
    fast, ref = m(x), m(x, reference=True)
    assert fast.dtype == torch.bfloat16
    bound = BF16_BOUND * 1.5 * (x.float().abs() @ m.weight.abs().T) + 1e-3  # + the reference's own bf16 rounding
    assert bool(((fast.float() - ref.float()).abs() <= bound).all())
    assert m(torch.randn(0, 96)).shape == (0, 48)


def test_widths_the_kernel_is_not_trusted_with_take_the_reference():
    m = Int8Linear.from_linear(nn.Linear(24, 8))  # 24 is not a multiple of 32
    assert not m.uses_fast_path("cpu")
    x = torch.randn(3, 24)
    assert torch.equal(m(x), m(x, reference=True))


@pytest.mark.parametrize("shape", [(1, 96), (2, 3, 96), (KERNEL_ROWS + 6, 96)])
def test_torch_compile_fullgraph_matches_eager(shape):
    m = _fast_module(True)
    compiled = torch.compile(m, fullgraph=True)  # inductor; fullgraph: a graph break raises
    x = torch.randn(*shape)
    got = compiled(x)
    # one row: inductor's own loop against the eager kernel (or op); more: the same kernel or op in both
    torch.testing.assert_close(got, m(x), rtol=1e-5, atol=1e-5)
    if x.numel() // 96 > KERNEL_ROWS:
        assert not torch.equal(got, m(x, reference=True))  # the int8 op, not the dequantised fallback, was traced


@pytest.mark.parametrize("out", [48, FUSED_ONE_ROW_MAX + 32], ids=["fused-loop", "over-FUSED_ONE_ROW_MAX"])
def test_one_compiled_row_of_a_large_weight_takes_the_kernel(out):
    """In a compiled graph one row stays inductor's loop up to FUSED_ONE_ROW_MAX (an LM head goes to
    rows_matmul, faster there); both give eager's numbers."""
    if not kernel_available():
        pytest.skip("the CPU kernels are not built here")
    m = _fast_module(True, out=out)
    compiled = torch.compile(m, fullgraph=True)
    x = torch.randn(1, 96)
    compiled(x)
    got, calls = rows_matmul_calls(lambda: compiled(x))
    assert calls == (out > FUSED_ONE_ROW_MAX)
    want = m(x).detach()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


# --- the whole model ------------------------------------------------------------------------------
def _dense_linear_names(model: nn.Module) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not n.startswith("vision.")}


def test_quantize_dense_int8_swaps_exactly_the_dense_projections():
    full = open_model("tiny-random").model
    expected = _dense_linear_names(full)
    kinds = {n.rsplit(".", 1)[-1] for n in expected}
    assert kinds == {"q_proj", "k_proj", "v_proj", "o_proj", "f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj", "b_proj",
                     "wq_a", "wq_b", "wkv_a", "wkv_b", "wo", "gate_a", "gate_b", "wq", "wk", "weights_proj",
                     "gate_proj", "up_proj", "down_proj", "lm_head"}
    assert any(".shared_experts." in n for n in expected) and any(".indexer." in n for n in expected)
    quant = quantize_dense_int8(copy.deepcopy(full))
    swapped = {n for n, m in quant.named_modules() if isinstance(m, Int8Linear)}
    assert swapped == expected
    before, after = dict(full.named_modules()), dict(quant.named_modules())
    for name in swapped:  # built from the original weights
        err = (after[name].weight - before[name].weight).abs()
        assert bool((err <= after[name].weight_scale[:, None] / 2 * HALF_STEP_SLACK).all()), name
    # untouched: the router, routed experts, norms, embeddings and the whole vision encoder
    for name, m in full.named_modules():
        if isinstance(m, (Router, Experts, nn.Embedding)) or name.startswith("vision") or "norm" in name.split(".")[-1]:
            assert type(after[name]) is type(m), name
            for p, t in m.named_parameters(recurse=False):
                assert torch.equal(getattr(after[name], p), t), f"{name}.{p}"
    assert quantize_dense_int8(quant) is quant  # a second pass finds nothing left to swap
    assert {n for n, m in quant.named_modules() if isinstance(m, Int8Linear)} == expected


def test_a_tied_lm_head_stays_the_embedding():
    torch.manual_seed(0)
    model = quantize_dense_int8(HorizonForCausalLM(tiny(tie_word_embeddings=True)).eval())
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.embed.weight
    assert isinstance(model.layers[0].attn.q_proj, Int8Linear)


def test_mxfp4_modules_already_there_are_left_alone():
    model = quantize_model(open_model("tiny-random").model, attention=True)
    quantize_dense_int8(model)
    assert isinstance(model.layers[0].attn.q_proj, MXFP4Linear)  # MXFP4 attention projection
    assert isinstance(model.layers[0].attn.f_a_proj, Int8Linear)  # left full precision by MXFP4: int8 now
    assert isinstance(model.layers[1].mlp.experts, MXFP4Experts)
    assert isinstance(model.layers[1].mlp.shared_experts.up_proj, Int8Linear)


@torch.inference_mode()
def test_int8_logits_are_close_to_the_full_models():
    full = open_model("tiny-random").model
    quant = quantize_dense_int8(copy.deepcopy(full))
    ids = torch.randint(0, full.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    a, b = full(ids), quant(ids)  # fp32 logits [2, 16, V]
    rel = [float((a[i] - b[i]).norm() / a[i].norm()) for i in range(2)]
    agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())  # greedy next tokens
    # measured 0.018-0.026 relative RMS and 0.875-1.0 greedy agreement on this model; bounds with margin
    assert max(rel) < 0.06, rel
    assert agree >= 0.75, agree


# --- load, open_model, save, the CLI ---------------------------------------------------------------
def test_load_with_dense_int8(tmp_path):
    torch.manual_seed(0)
    model = HorizonForCausalLM(tiny(vision_layers=0)).eval()
    save(model, tmp_path / "ckpt")
    quant = load(tmp_path / "ckpt", dense="int8")
    assert {n for n, m in quant.named_modules() if isinstance(m, Int8Linear)} == _dense_linear_names(model)
    want = quantize_dense_int8(model).state_dict()  # the same bytes as quantising the saved model directly
    got = quant.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert not quant.training
    assert not any(isinstance(m, Int8Linear) for m in load(tmp_path / "ckpt").modules())  # default: as stored
    for bad in ("fp8", "full", "INT8"):
        with pytest.raises(ValueError, match=r"dense=.*allowed: None.*'int8'"):
            load(tmp_path / "ckpt", dense=bad)


def test_open_model_with_dense_int8():
    bundle = open_model("tiny-random", dense="int8")
    assert isinstance(bundle.model.lm_head, Int8Linear) and not bundle.model.training
    with pytest.raises(ValueError, match="allowed"):
        open_model("tiny-random", dense="int4")


def test_save_refuses_an_int8_model(tmp_path):
    model = open_model("tiny-random", dense="int8").model
    with pytest.raises(ValueError, match="int8 dense weights are a load-time format; save the full-precision model"):
        save(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_the_cli_flag():
    parser = build_parser()
    assert parser.parse_args(["serve", "--dense-weights", "int8"]).dense_weights == "int8"
    assert parser.parse_args(["serve"]).dense_weights == "full"
    assert parser.parse_args(["generate", "--prompt", "hi", "--dense-weights", "int8"]).dense_weights == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--dense-weights", "fp8"])
