"""The greedy pick's kernel (horizon/quant/kernels/argmax.cpp): on both code paths (AVX-512 and portable) it
returns exactly what torch.argmax does, ties (the first maximum), NaN (the first NaN), infinities and row
lengths around the vector width included, and per row whether torch.isfinite holds for all of it;
`argmax_rows` and `argmax_and_finite` fall back to torch where the kernel does not apply; the engine's greedy
tokens and its finite check go through it."""

import os

import pytest
import torch

import horizon.quant.kernels as kernels
from horizon.quant.kernels import argmax_and_finite, argmax_rows, kernel_available

DISABLED = os.environ.get("HORIZON_KERNELS", "1").strip() == "0"
pytestmark = pytest.mark.skipif(DISABLED, reason="HORIZON_KERNELS=0: the kernel is disabled")
# "simd": the CPU's vector path; "portable": the portable C++ path
PATHS = [pytest.param(False, id="simd"), pytest.param(True, id="portable")]


def kernel(x, portable):
    return kernel_and_finite(x, portable)[0]


def kernel_and_finite(x, portable):
    assert kernel_available(), "the CPU kernels did not build (see the logged warning)"
    return torch.ops.horizon_kernels.argmax_rows(x, portable)


def rows_with_specials(V: int, seed: int) -> torch.Tensor:
    """Rows of random logits, each with a different trap: a repeated maximum, ties everywhere, -inf, +inf,
    NaN early / late, an all--inf row, values that differ only in sign of zero."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(10, V, generator=gen)
    x[1] = x[1].round()  # many ties at each integer: the first of the maxima
    x[1, V // 3] = x[1, V - 1] = x[1].max() + 1
    x[2] = 0.5  # all equal
    x[3, ::2] = float("-inf")
    x[4, V // 2] = float("inf")
    x[4, V - 1] = float("inf")
    x[5, V - 1] = float("nan")
    x[6, V // 4] = float("nan")
    x[6, V // 2] = float("nan")
    x[7] = float("-inf")
    x[8] = 0.0
    x[8, ::3] = -0.0
    x[9, -(V % 16 or 16):] = x[9].max() + 2  # the maximum in the tail past the last full vector
    return x


@pytest.mark.parametrize("portable", PATHS)
@pytest.mark.parametrize("V", [1, 5, 15, 16, 17, 31, 32, 33, 1000, 32768, 32771])
def test_equals_torch_argmax(portable, V):
    for seed in range(3):
        x = rows_with_specials(V, seed)
        assert torch.equal(kernel(x, portable), x.argmax(dim=-1)), (V, seed)


@pytest.mark.parametrize("portable", PATHS)
@pytest.mark.parametrize("V", [1, 15, 16, 17, 33, 32768, 32771])
def test_finite_flags_equal_torch_isfinite(portable, V):
    for seed in range(3):
        x = rows_with_specials(V, seed)
        x = torch.cat([x, torch.full((1, V), 3e38), -torch.full((1, V), 3e38)])  # sums overflow, values finite
        x[-1, V // 2] = float("-inf")
        _, finite = kernel_and_finite(x, portable)
        assert finite.dtype == torch.bool and torch.equal(finite, torch.isfinite(x).all(dim=-1)), (V, seed)
        assert finite[0] and not finite[3] and not finite[-1]  # spot checks: randn; -inf rows


@pytest.mark.parametrize("portable", PATHS)
def test_a_non_contiguous_batch_and_one_row(portable):
    x = torch.randn(40, 300)[::2, 7:250]  # strided rows
    assert torch.equal(kernel(x, portable), x.argmax(dim=-1))
    assert torch.equal(kernel(x[:1], portable), x[:1].argmax(dim=-1))


def test_bad_input_is_a_clear_error():
    with pytest.raises(RuntimeError, match="float32 \\[B, V\\]"):
        kernel(torch.randn(3, 8).double(), False)
    with pytest.raises(RuntimeError, match="0 elements has no argmax"):
        kernel(torch.randn(3, 0), False)


def test_argmax_rows_falls_back_to_torch_where_the_kernel_does_not_apply(monkeypatch):
    x = torch.randn(4, 50)
    assert kernel_available()
    for y in (x.double(), x.bfloat16(), x[0]):  # another dtype, a 1-D row
        assert torch.equal(argmax_rows(y), y.argmax(dim=-1))
    monkeypatch.setattr(kernels, "_built", False)  # not built in this process: torch.argmax, no build started
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_argmax_and_finite_match_torch_on_both_routes(monkeypatch):
    x = rows_with_specials(1000, 0)
    x = torch.cat([x, torch.full((1, 1000), 3e38)])  # all finite, but its sum overflows
    want = (x.argmax(dim=-1), torch.isfinite(x).all(dim=-1))
    assert kernel_available()
    for _ in range(2):  # the kernel, then torch's sum check and its exact recheck (_built False)
        best, finite = argmax_and_finite(x)
        assert torch.equal(best, want[0]) and torch.equal(finite, want[1]) and finite[-1]
        monkeypatch.setattr(kernels, "_built", False)
    finite_only = x[[0, 10]]  # no row needs the recheck
    assert argmax_and_finite(finite_only)[1].tolist() == [True, True]


def test_the_engines_greedy_tokens_go_through_the_kernel(monkeypatch):
    """Greedy sequences decode through one argmax_rows call a step, alone or two at once; the tokens are those
    torch.argmax picks."""
    from torch.profiler import profile

    from horizon.chat import load_tokenizer
    from horizon.engine import Engine, EngineConfig, Request, SamplingParams
    from tests.conftest import tiny_model

    assert kernel_available()
    tok = load_tokenizer()

    def run(prompts) -> tuple[list[list[int]], int, int]:
        engine = Engine(tiny_model(), tok, EngineConfig(max_num_seqs=2, max_batch_tokens=32, max_model_len=64,
                                                         compile=False))
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        with profile() as prof:
            results = engine.generate([Request(p, params) for p in prompts])
        count = {e.key: e.count for e in prof.key_averages()}
        calls, checks = count.get("horizon_kernels::argmax_rows", 0), count.get("aten::isfinite", 0)
        return [r.token_ids for r in results], calls, checks

    for prompts in ([[5, 6, 7], [9, 10]], [[5, 6, 7]]):  # two sequences, then one alone
        monkeypatch.setattr(kernels, "_built", True)
        tokens, calls, isfinite = run(prompts)
        assert calls >= 5 and isfinite == 0  # one call a step (the first may prefill one row), no other check
        monkeypatch.setattr(kernels, "_built", False)
        tokens_torch, calls, isfinite = run(prompts)
        assert tokens_torch == tokens and calls == 0 and isfinite >= 5
