"""The greedy pick's kernel (horizon/quant/kernels/argmax.cpp): on both code paths (AVX-512 and portable) it
returns exactly what torch.argmax does, ties (the first maximum), NaN (the first NaN), infinities and row
lengths around the vector width included; `argmax_rows` falls back to torch.argmax where the kernel does not
apply; the engine's greedy tokens go through it."""

import os

import pytest
import torch

import horizon.quant.kernels as kernels
from horizon.quant.kernels import argmax_rows, kernel_available

DISABLED = os.environ.get("HORIZON_KERNELS", "1").strip() == "0"
pytestmark = pytest.mark.skipif(DISABLED, reason="HORIZON_KERNELS=0: the kernel is disabled")
# "simd": the CPU's vector path; "portable": the portable C++ path
PATHS = [pytest.param(False, id="simd"), pytest.param(True, id="portable")]


def kernel(x, portable):
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


def test_the_engines_greedy_tokens_go_through_the_kernel(monkeypatch):
    """Two greedy sequences decode through one argmax_rows call a step; the tokens are those torch.argmax picks."""
    from torch.profiler import profile

    from horizon.chat import load_tokenizer
    from horizon.engine import Engine, EngineConfig, Request, SamplingParams
    from tests.conftest import tiny_model

    assert kernel_available()
    tok = load_tokenizer()

    def run() -> tuple[list[list[int]], int]:
        engine = Engine(tiny_model(), tok, EngineConfig(max_num_seqs=2, max_batch_tokens=32, max_model_len=64,
                                                         compile=False))
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        with profile() as prof:
            results = engine.generate([Request([5, 6, 7], params), Request([9, 10], params)])
        calls = sum(e.count for e in prof.key_averages() if e.key == "horizon_kernels::argmax_rows")
        return [r.token_ids for r in results], calls

    tokens, calls = run()
    assert calls >= 5  # one a step once both decode (the first step may prefill one row)
    monkeypatch.setattr(kernels, "_built", False)
    assert run() == (tokens, 0)
