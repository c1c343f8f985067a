"""The few-rows matmul kernel (horizon/quant/kernels/rows.cpp): it computes x @ W^T in fp32 for fp32, bf16 and
int8 weights, one matrix or stacked experts, on the CPU's vector path (AVX-512, else AVX2) and the portable one
and, for bf16 x against bf16 weights, on AMX tiles where the CPU has them (`HORIZON_AMX=0` turns that off); the
compiled decode step's graph pass routes batched projections to it (and leaves one-row and large products
alone); the dense experts' sync-free form built on it equals the eager dispatch."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import horizon.quant.kernels as kernels
from horizon.engine.runner import cpu_options
from horizon.model.moe import Experts
from horizon.quant.kernels import (
    FUSED_ONE_ROW_MAX,
    few_rows,
    has_amx,
    kernel_available,
    rows_matmul,
    rows_matmul_reference,
)
from tests.conftest import rows_matmul_calls

DISABLED = os.environ.get("HORIZON_KERNELS", "1").strip() == "0"
pytestmark = pytest.mark.skipif(DISABLED, reason="HORIZON_KERNELS=0: the kernel is disabled")
# "simd": the CPU's vector path (AVX-512, else AVX2, else portable); "portable": the portable C++ path
PATHS = [pytest.param(False, id="simd"), pytest.param(True, id="portable")]
DTYPES = [torch.float32, torch.bfloat16, torch.int8]


def kernel(x, w, expert, portable):
    """The compiled kernel itself (not the fallback): a build failure fails the test."""
    assert kernel_available(), "the CPU kernels did not build (see the logged warning)"
    return torch.ops.horizon_kernels.rows_matmul(x, w, expert, portable)


def weights(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.int8:
        return torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
    return torch.randn(shape, generator=gen).to(dtype)


def assert_matches(got, want):
    """Within rtol 1e-5 and atol 1e-6 of the output's scale (the kernel sums in another order)."""
    scale = want.abs().max().clamp_min(1e-30)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(scale))


@pytest.mark.parametrize("portable", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K", [(1, 7, 64), (2, 300, 512), (9, 33, 48), (17, 16, 40), (64, 70, 128), (5, 100, 1024),
                                   (6, 50, 2048), (33, 70, 256)])
def test_one_matrix_equals_the_reference(portable, dtype, M, N, K):
    # M 5 / 9 / 64: row tiles of 4 and a remainder, every pass over a tile at once (x's rows fit 32 KB);
    # M 6 / 33 with K 2048 / 256: x's rows past 32 KB, passes over weight slices of 8 to 168 rows (a whole
    # number of 8-row tiles where the last pass has one or two rows); N 7 / 33 / 50 / 70 / 100: weight-row
    # tails; K 40: not a multiple of 16 (the portable path whichever is asked)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(1))
    w = weights((N, K), dtype)
    got = kernel(x, w, None, portable)
    assert got.dtype == torch.float32 and got.shape == (M, N)
    assert_matches(got, x @ w.float().T)
    assert_matches(got, rows_matmul_reference(x, w))


@pytest.mark.parametrize("portable", PATHS)
@pytest.mark.parametrize("N", [300, 37])
def test_a_row_alone_equals_its_row_in_a_batch(portable, N):
    # the engine's batched == alone, bit for bit: a row's sums take the same order whatever tile its batch puts
    # it in (N 300 / 37: tail tiles of one weight row, at other columns for 1 row than for 4)
    M, K = 9, 512
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(4))
    w = weights((N, K), torch.float32)
    batched = kernel(x, w, None, portable)
    for i in range(M):
        assert torch.equal(kernel(x[i:i + 1].clone(), w, None, portable)[0], batched[i]), i


@pytest.mark.parametrize("portable", PATHS)
def test_x_off_a_cache_line_gives_the_same_sums(portable):
    # one matrix reads an aligned x in place and copies any other x to an aligned buffer first: same sums,
    # same order, bit for bit (a view one float into a buffer is contiguous but 4 bytes off its line)
    M, N, K = 9, 40, 512
    buf = torch.randn(M * K + 1, generator=torch.Generator().manual_seed(3))
    off = buf[1:].view(M, K)
    aligned = off.clone()
    assert off.data_ptr() % 64 != 0 and aligned.data_ptr() % 64 == 0
    w = weights((N, K), torch.float32)
    got = kernel(off, w, None, portable)
    assert torch.equal(got, kernel(aligned, w, None, portable))
    assert_matches(got, aligned @ w.T)


@pytest.mark.parametrize("portable", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_stacked_experts_group_rows_by_expert(portable, dtype):
    E, N, K, M = 6, 40, 96, 23
    gen = torch.Generator().manual_seed(2)
    w = weights((E, N, K), dtype)
    x = torch.randn(M, K, generator=gen)
    expert = torch.randint(0, E - 1, (M,), generator=gen)  # the last expert gets no rows
    expert[:10] = 2  # one group with more rows than a register tile
    want = torch.stack([x[m] @ w[int(e)].float().T for m, e in enumerate(expert)])
    assert_matches(kernel(x, w, expert, portable), want)
    assert_matches(kernel(x, w, expert.int(), portable), want)  # int32 ids too
    assert_matches(rows_matmul_reference(x, w, expert), want)


@pytest.mark.parametrize("portable", PATHS)
def test_experts_never_routed_are_never_read(portable):
    w = weights((4, 32, 64), torch.float32)
    w[1] = float("nan")
    w[3] = float("nan")
    x = torch.randn(5, 64)
    expert = torch.tensor([0, 2, 2, 0, 2])
    got = kernel(x, w, expert, portable)
    assert torch.isfinite(got).all()
    assert_matches(got, rows_matmul_reference(x, w, expert))


def test_bf16_activations_are_taken_exactly_and_empty_shapes_work():
    x, w = torch.randn(3, 32).bfloat16(), weights((8, 32), torch.float32)
    assert_matches(rows_matmul(x, w), x.float() @ w.T)
    assert rows_matmul(torch.randn(0, 32), w).shape == (0, 8)
    assert torch.equal(rows_matmul(torch.randn(2, 0), torch.randn(5, 0)), torch.zeros(2, 5))


def require_amx():
    assert kernel_available()
    if not has_amx():
        pytest.skip("no AMX here (the CPU lacks AMX-BF16, the OS refused its tile state, or HORIZON_AMX=0)")


@pytest.mark.parametrize("M,N,K", [(8, 64, 64), (16, 1024, 512), (17, 48, 96), (40, 80, 512), (64, 32, 2048),
                                   (9, 40, 48), (12, 20, 64), (3, 64, 64)])
def test_bf16_x_against_bf16_weights_on_amx_equals_the_reference(M, N, K):
    # AMX takes 8 rows of x or more, K a multiple of 32 and N of 16: 1-4 weight tiles a pass (N 48, 80: 3, and 5
    # split over the threads), x in chunks of 16 rows (M 17, 40, 64: 2-4 chunks); K 48, N 20 and 3 rows go to
    # the AVX-512 path
    require_amx()
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(M, K, generator=gen).bfloat16(), weights((N, K), torch.bfloat16)
    got = kernel(x, w, None, False)
    assert got.dtype == torch.float32 and got.shape == (M, N)
    assert_matches(got, x.float() @ w.float().T)
    assert_matches(got, kernel(x, w, None, True))  # the portable path's sums
    # a row's sums never depend on the batch around it, bit for bit, while the batch keeps it on AMX (8+ rows):
    # its last 8 rows alone, each at another column of another chunk
    if M >= 8:
        assert torch.equal(kernel(x[-8:].clone(), w, None, False), got[-8:])


def test_bf16_experts_on_amx_group_rows_and_skip_unrouted_experts():
    require_amx()
    E, N, K, M = 6, 48, 96, 45
    gen = torch.Generator().manual_seed(6)
    w = weights((E, N, K), torch.bfloat16)
    w[E - 1] = float("nan")  # never routed: never read
    x = torch.randn(M, K, generator=gen).bfloat16()
    expert = torch.randint(0, E - 1, (M,), generator=gen)
    expert[:20] = 2  # one group of two chunks of x
    got = kernel(x, w, expert, False)
    want = torch.stack([x[m].float() @ w[int(e)].float().T for m, e in enumerate(expert)])
    assert torch.isfinite(got).all()
    assert_matches(got, want)
    assert torch.equal(kernel(x[12:24].clone(), w, expert[12:24].clone(), False), got[12:24])


def test_horizon_amx_0_turns_the_amx_path_off():
    require_amx()
    code = ("import torch; from horizon.quant.kernels import has_amx, few_rows, kernel_available; "
            "assert kernel_available(); print(has_amx(), few_rows(torch.bfloat16))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "HORIZON_AMX": "0"}, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "8"]


@pytest.mark.parametrize("args,message", [
    ((torch.randn(2, 8), torch.randn(4, 8).half(), None), "float32, bfloat16 or int8"),
    ((torch.randn(2, 8), torch.randn(4, 6), None), "x has 8 columns, w 6"),
    ((torch.randn(2, 8), torch.randn(3, 4, 8), torch.tensor([0, 3])), "expert[1] = 3 is not in [0, 3)"),
    ((torch.randn(2, 8), torch.randn(3, 4, 8), None), "expert ids go with stacked weights"),
    ((torch.randn(2, 8), torch.randn(4, 8), torch.tensor([0, 0])), "expert ids go with stacked weights"),
    ((torch.randn(2, 8), torch.randn(3, 4, 8), torch.tensor([0.0, 1.0])), "expert must be int64"),
])
def test_bad_input_is_refused_with_what_was_wrong(args, message):
    assert kernel_available()
    with pytest.raises(RuntimeError, match=message.replace("[", r"\[").replace(")", r"\)")):
        torch.ops.horizon_kernels.rows_matmul(*args)


def random_experts(dtype, E=8, d=64, f=48):
    torch.manual_seed(0)
    m = Experts(E, d, f)
    with torch.no_grad():
        m.gate_up_proj.normal_(0, 0.1)
        m.down_proj.normal_(0, 0.1)
    return m.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_dense_experts_sync_free_equals_the_eager_dispatch(dtype, monkeypatch):
    m = random_experts(dtype)
    x = torch.randn(13, 64).to(dtype)
    weights_, idx = torch.rand(13, 2), torch.stack([torch.randperm(8)[:2] for _ in range(13)])
    want, _ = m.forward(x, weights_, idx)
    got = m.sync_free(x, weights_, idx)  # 13 tokens: the kernel
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * float(want.abs().max()))
    monkeypatch.setattr(kernels, "_built", False)  # without the kernel: the per-expert loop
    torch.testing.assert_close(m.sync_free(x, weights_, idx).float(), want.float(), rtol=tol,
                               atol=tol * float(want.abs().max()))


def compiled_calls(fn, *args) -> tuple[torch.Tensor, int]:
    """fn compiled with the decode step's graph pass: its output and how many rows_matmul calls one run makes."""
    compiled = torch.compile(fn, fullgraph=True, dynamic=False, options=cpu_options(kernels=True))
    compiled(*args)
    return rows_matmul_calls(lambda: compiled(*args))


@torch.no_grad()
def test_the_graph_pass_routes_few_row_projections_to_the_kernel():
    assert kernel_available()
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 96), nn.SiLU(), nn.Linear(96, 32, bias=False)).eval()
    x = torch.randn(4, 64)
    out, calls = compiled_calls(mlp, x)
    assert calls == 2  # both projections (the first with its bias added after)
    assert_matches(out, mlp(x))
    one, calls = compiled_calls(mlp, x[:1])  # one row: inductor's own multiply-and-sum loop
    assert calls == 0
    assert_matches(one, mlp(x[:1]))
    head = torch.randn(FUSED_ONE_ROW_MAX + 64, 64)  # one row of a weight past FUSED_ONE_ROW_MAX: the kernel
    one, calls = compiled_calls(lambda a: F.linear(a, head), x[:1])
    assert calls == 1
    assert_matches(one, F.linear(x[:1], head))
    half = mlp.to(torch.bfloat16)
    xb = torch.randn(4, 64).bfloat16()
    out, calls = compiled_calls(half, xb)  # bf16 weights, 4 rows: the kernel, rounded back to bf16
    assert calls == 2 and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), half(xb).float(), rtol=2e-2, atol=2e-2)
    # bf16 past 8 rows: the kernel where it runs on AMX tiles or its AVX2 path (up to 64 rows), else oneDNN's
    # matmul, faster there
    wide = has_amx() or kernels.has_avx2()
    _, calls = compiled_calls(lambda a: F.linear(a, half[0].weight), torch.randn(16, 64).bfloat16())
    assert calls == (1 if wide else 0) and few_rows(torch.bfloat16) == (64 if wide else 8)
    _, calls = compiled_calls(lambda a: F.linear(a, half[0].weight), torch.randn(65, 64).bfloat16())
    assert calls == 0
