"""The DSA indexer's exact top-k kernel (horizon/quant/kernels/topk.cpp, dsa.topk_recent_first): it selects
exactly the set the (score, position) reference selects, on rows with many exact ties, -0.0 beside 0.0, -inf
(masked) positions, rows masked past a short prefix, NaNs, scores in a narrow band, the largest scores where its
sample does not look, k of 1 and of the whole row, on both code paths (AVX-512 and portable); its positions
come in increasing order; torch.compile calls it with a dynamic row length; without the kernel the PyTorch
paths run."""

import os

import pytest
import torch

import horizon.quant.kernels as kernels
from horizon.model.dsa import _topk_by_score_then_position, topk_recent_first

DISABLED = os.environ.get("HORIZON_KERNELS", "1").strip() == "0"
pytestmark = pytest.mark.skipif(DISABLED, reason="HORIZON_KERNELS=0: the kernel is disabled")


def rows_of(kind: str, R: int, L: int, k: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "ties":  # few distinct values: the cut falls inside a run of equal scores
        return torch.randint(-2, 3, (R, L), generator=gen).float()
    if kind == "one_bucket":  # every score within a hair of 1.0
        return 1.0 + torch.rand(R, L, generator=gen) * 2**-8
    if kind == "masked":  # visible prefixes of k / 2 and 3 k / 2 scores, the rest -inf (short rows in a batch)
        s = torch.full((R, L), float("-inf"))
        for r in range(R):
            v = min(L, k // 2 + (r % 2) * k)
            s[r, :v] = torch.randn(v, generator=gen)
        return s
    if kind == "rising":  # the largest scores where the strided sample does not look: its threshold misses
        s = torch.full((R, L), -1.0)
        s[:, -k:] = torch.arange(k, dtype=torch.float32)
        s[:, ::max(1, L // 1024)] = -5.0
        return s
    s = torch.randn(R, L, generator=gen)
    s[:, ::7] = float("-inf")  # masked positions
    s[:, 3::11] = -0.0
    s[:, 5::11] = 0.0
    return s


def as_sets(idx: torch.Tensor) -> list[list[int]]:
    return [sorted(r) for r in idx.tolist()]


@pytest.mark.parametrize("portable", [False, True], ids=["avx512", "portable"])
@pytest.mark.parametrize("kind", ["spread", "ties", "one_bucket", "rising", "masked"])
@pytest.mark.parametrize("R,L,k", [(3, 50, 10), (2, 4097, 2048), (1, 70000, 2048), (2, 20000, 64), (4, 9, 1),
                                   (2, 33, 33)])
def test_the_kernel_selects_what_the_reference_selects(portable, kind, R, L, k):
    assert kernels.kernel_available(), "the kernels did not build (see the logged warning)"
    s = rows_of(kind, R, L, k, torch.Generator().manual_seed(R * L + k))
    got = torch.ops.horizon_kernels.topk_recent_first_rows(s, k, portable)
    assert got.shape == (R, k) and got.dtype == torch.int64
    assert as_sets(got) == as_sets(_topk_by_score_then_position(s, k))
    assert as_sets(topk_recent_first(s, k)) == as_sets(got)


def test_nan_scores_sort_by_their_bits_as_in_the_reference():
    s = torch.tensor([[1.0, float("nan"), 3.0, -float("nan"), 2.0, float("inf")]])
    for k in range(1, 7):
        assert as_sets(torch.ops.horizon_kernels.topk_recent_first_rows(s, k)) == \
            as_sets(_topk_by_score_then_position(s, k)), k


@pytest.mark.parametrize("portable", [False, True], ids=["avx512", "portable"])
def test_the_positions_come_in_increasing_order(portable):
    s = torch.tensor([[5.0, 1.0, 7.0, 1.0, 1.0, 6.0, 1.0]])
    assert torch.ops.horizon_kernels.topk_recent_first_rows(s, 5, portable).tolist() == [[0, 2, 4, 5, 6]]
    s = torch.randn(2, 50000, generator=torch.Generator().manual_seed(3))
    got = torch.ops.horizon_kernels.topk_recent_first_rows(s, 2048, portable)
    assert torch.equal(got, got.sort(-1).values)


def test_compile_calls_it_with_a_dynamic_length():
    def f(s):
        return topk_recent_first(s, 8) + 1

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    gen = torch.Generator().manual_seed(0)
    for L in (20, 57, 300):
        s = torch.randint(0, 5, (2, 1, L), generator=gen).float()
        got = compiled(s) - 1
        assert got.shape == (2, 1, 8)
        assert as_sets(got.view(2, 8)) == as_sets(_topk_by_score_then_position(s, 8).view(2, 8))


def test_bad_arguments_are_refused_and_other_inputs_take_pytorch(monkeypatch):
    with pytest.raises(RuntimeError, match="k must be within"):
        torch.ops.horizon_kernels.topk_recent_first_rows(torch.zeros(1, 4), 5)
    s = torch.randint(0, 3, (2, 40), generator=torch.Generator().manual_seed(1)).float()
    want = as_sets(_topk_by_score_then_position(s, 6))
    assert as_sets(topk_recent_first(s.double(), 6)) == want  # fp64: PyTorch's top-k with the tie check
    monkeypatch.setattr(kernels, "_built", False)
    assert as_sets(topk_recent_first(s, 6)) == want
