"""The fused MXFP4 kernel (horizon.quant.kernels): it computes what dequantise-then-matmul computes, on its code
paths (AVX-512, AVX2, portable, and AMX tiles for bf16 activations), for every routing pattern and edge case of the
format; the MXFP4 modules built on it match their reference paths; torch.compile sees it as one opaque op; and
a missing or disabled kernel falls back to the reference with one warning."""

import fnmatch
import logging
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import horizon.quant.kernels as kernels
from horizon.model.moe import Experts
from horizon.quant import MXFP4Experts, MXFP4Linear, dequantize, quantize
from horizon.quant.kernels import kernel_available, mxfp4_expert_matmul, mxfp4_expert_matmul_reference

DISABLED = os.environ.get("HORIZON_KERNELS", "1").strip() == "0"
pytestmark = pytest.mark.skipif(DISABLED, reason="HORIZON_KERNELS=0: the kernel is disabled")
CPU_FLAGS = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
# "simd": the CPU's vector path (AVX-512, else AVX2, else portable); "portable": the portable C++ path
PATHS = [pytest.param(False, id="simd"), pytest.param(True, id="portable")]
NO_AVX512 = os.environ.get("HORIZON_AVX512") == "0"


def kernel(x, blocks, scales, expert, portable):
    """The compiled kernel itself (not the op's fallback): a build failure fails the test."""
    assert kernel_available(), "the MXFP4 kernel did not build (see the logged warning)"
    return torch.ops.horizon.mxfp4_expert_matmul(x, blocks, scales, expert, portable)


def assert_matches(got, want):
    """Within rtol 1e-5, and atol 1e-6 of the output's scale (the kernel sums in another order)."""
    scale = want.nan_to_num(0).abs().max().clamp_min(1e-30)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(scale), equal_nan=True)


def packed(E, N, K, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(E, N, K, generator=gen) * torch.rand(E, N, 1, generator=gen) * 4)


def test_the_kernel_builds_and_this_cpu_takes_its_vector_path():
    assert kernel_available()
    avx512 = {"avx512f", "avx512bw"} <= CPU_FLAGS and not NO_AVX512
    assert kernels.has_avx512() == avx512
    assert kernels.has_avx2() == (not avx512 and {"avx2", "fma"} <= CPU_FLAGS)


@pytest.mark.skipif(not {"avx512f", "avx512bw", "avx2", "fma"} <= CPU_FLAGS or NO_AVX512,
                    reason="needs a CPU with AVX-512 (elsewhere the other tests run the AVX2 path where it is)")
def test_the_avx2_paths_pass_the_same_checks_on_this_avx512_cpu():
    """HORIZON_AVX512=0 sends every kernel to its AVX2 path, which an AVX-512 CPU would otherwise never run: the
    kernels' checks of their vector paths (MXFP4, rows, decode attention, indexer, KDA decode and chunkwise prefill),
    again in a process that takes them."""
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-k", "simd or vector_path or chunkwise_kernel",
         "tests/test_mxfp4_kernel.py", "tests/test_rows_kernel.py", "tests/test_attention_kernel.py",
         "tests/test_indexer_kernel.py", "tests/test_kda.py"],
        cwd=root, env={**os.environ, "HORIZON_AVX512": "0"}, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout


@pytest.mark.parametrize("portable", PATHS)
@pytest.mark.parametrize("E, N, K, M", [
    (4, 48, 64, 1),      # batch-1 decode: one row, fused path
    (6, 37, 45, 64),     # K not a multiple of 32 (padding), N not a multiple of the tiles, repeats
    (3, 64, 100, 5),     # a few rows per expert
    (40, 72, 96, 64),    # many experts, most with one or two rows, some never routed
])
def test_kernel_equals_dequantize_then_matmul(portable, E, N, K, M):
    blocks, scales = packed(E, N, K)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(M, K, generator=gen)
    expert = torch.randint(0, E, (M,), generator=gen)
    got = kernel(x, blocks, scales, expert, portable)
    assert got.shape == (M, N) and got.dtype == torch.float32
    want = mxfp4_expert_matmul_reference(x, blocks, scales, expert)
    assert_matches(got, want)
    # and the reference is what its docstring says: each row against its own expert's dequantised matrix
    w = dequantize(blocks, scales, torch.float32, K)
    assert_matches(want, torch.einsum("mk,mnk->mn", x, w[expert]))


@pytest.mark.parametrize("portable", PATHS)
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 64])
def test_rows_of_one_expert_from_fused_to_buffered(portable, rows):
    """Up to 8 rows an expert is decoded straight into FMAs; beyond, once into a tile buffer."""
    E, N, K = 3, 41, 70
    blocks, scales = packed(E, N, K, seed=rows)
    x = torch.randn(rows + 3, K)
    expert = torch.tensor([1] * rows + [0, 2, 0])  # expert 1 takes `rows` rows, interleaved below
    perm = torch.randperm(rows + 3)
    x, expert = x[perm], expert[perm]
    want = mxfp4_expert_matmul_reference(x, blocks, scales, expert)
    assert_matches(kernel(x, blocks, scales, expert, portable), want)


@pytest.mark.parametrize("portable", PATHS)
def test_experts_never_routed_are_never_read(portable):
    E, N, K = 8, 24, 64
    blocks, scales = packed(E, N, K)
    x = torch.randn(16, K)
    expert = torch.tensor([2, 5] * 8)
    want = kernel(x, blocks, scales, expert, portable)
    poisoned = scales.clone()
    poisoned[[0, 1, 3, 4, 6, 7]] = 0xFF  # NaN everywhere in experts nobody routes to
    torch.testing.assert_close(kernel(x, blocks, poisoned, expert, portable), want, rtol=0, atol=0)
    assert torch.isfinite(want).all()


@pytest.mark.parametrize("portable", PATHS)
def test_all_zero_blocks_give_exact_zeros(portable):
    blocks, scales = quantize(torch.zeros(2, 20, 64))
    assert not blocks.any() and not scales.any()  # scale byte 0, the subnormal 2^-127
    out = kernel(torch.randn(9, 64), blocks, scales, torch.tensor([0, 1] * 4 + [1]), portable)
    assert torch.equal(out, torch.zeros(9, 20))


@pytest.mark.parametrize("portable", PATHS)
def test_smallest_scales_are_exact_subnormals(portable):
    """Blocks at scale bytes 0 and 1 (2^-127, 2^-126: subnormal products) decode exactly."""
    blocks, scales = packed(1, 16, 64)
    scales[0, :8] = 0
    scales[0, 8:] = 1
    x = torch.ones(1, 64)
    want = dequantize(blocks, scales, torch.float32, 64)[0].double().sum(-1).float()[None]  # exact: no rounding
    assert (want != 0).any()
    torch.testing.assert_close(kernel(x, blocks, scales, torch.zeros(1, dtype=torch.long), portable), want,
                               rtol=1e-6, atol=0)


@pytest.mark.parametrize("portable", PATHS)
@pytest.mark.parametrize("rows", [1, 12])
def test_nan_scale_gives_nan_where_the_reference_does(portable, rows):
    E, N, K = 3, 19, 70
    blocks, scales = packed(E, N, K)
    scales[1, 4, 2] = 0xFF  # the last, partly padded block of expert 1's output row 4
    scales[2, 7, 0] = 0xFF
    x = torch.randn(rows * 3, K)
    expert = torch.arange(3).repeat(rows)
    want = mxfp4_expert_matmul_reference(x, blocks, scales, expert)
    got = kernel(x, blocks, scales, expert, portable)
    nan = torch.zeros(rows * 3, N, dtype=torch.bool)
    nan[expert == 1, 4] = True
    nan[expert == 2, 7] = True
    assert torch.equal(want.isnan(), nan) and torch.equal(got.isnan(), nan)
    assert_matches(got, want)


def test_the_two_paths_agree_and_bad_input_is_refused():
    blocks, scales = packed(5, 33, 200)
    x, expert = torch.randn(30, 200), torch.randint(0, 5, (30,))
    assert_matches(kernel(x, blocks, scales, expert, False), kernel(x, blocks, scales, expert, True))
    with pytest.raises(RuntimeError, match="not in"):
        kernel(x, blocks, scales, torch.full((30,), 5), False)
    with pytest.raises(RuntimeError, match="225 columns"):
        mxfp4_expert_matmul(torch.randn(30, 225), blocks, scales, expert)
    # x narrower than the packed weights by more than a block (K <= nb * 32 is the contract): the padding is
    # never used, by either path or the reference (which once refused it: dequantize's size must end a block)
    narrow = x[:, :150].clone().requires_grad_()
    want = torch.einsum("mk,mnk->mn", narrow.detach(), dequantize(blocks, scales, torch.float32)[..., :150][expert])
    for portable in (False, True):
        assert_matches(kernel(narrow.detach(), blocks, scales, expert, portable), want)
    assert_matches(mxfp4_expert_matmul_reference(narrow.detach(), blocks, scales, expert), want)
    mxfp4_expert_matmul(narrow, blocks, scales, expert).sum().backward()  # the backward takes it too
    assert_matches(narrow.grad, dequantize(blocks, scales, torch.float32)[..., :150][expert].sum(1))
    assert mxfp4_expert_matmul(x[:0], blocks, scales, expert[:0]).shape == (0, 33)


def require_amx():
    assert kernel_available()
    if not kernels.has_amx():
        pytest.skip("no AMX here (the CPU lacks AMX-BF16, the OS refused its tile state, or HORIZON_AMX=0)")


def bf16_rows(M, K, seed):
    """x whose every value is a bf16 (as a bf16 model passes it, widened to fp32): the AMX path's input."""
    return torch.randn(M, K, generator=torch.Generator().manual_seed(seed)).bfloat16().float()


@pytest.mark.parametrize("E, N, K, rows", [
    (4, 64, 128, 3),     # the fewest rows an expert takes AMX with: one chunk of x, the decode-and-multiply ring
    (3, 48, 64, 5),      # 3 weight tiles: a panel of 2 and one of 1; one pair of blocks (the ring spans panels)
    (4, 1024, 512, 16),  # `small`'s gate_up, a whole chunk
    (2, 96, 100, 17),    # two chunks (prefill form, both accumulator pairs); K padded to 128
    (3, 32, 256, 40),    # three chunks: a pair, then one
])
def test_bf16_activations_on_amx_equal_the_reference(E, N, K, rows):
    require_amx()
    blocks, scales = packed(E, N, K, seed=rows)
    M = E * rows + 2
    x = bf16_rows(M, K, rows)
    # `rows` rows for every expert, one more for the first and the last
    expert = torch.cat([torch.arange(E).repeat_interleave(rows), torch.tensor([0, E - 1])])
    perm = torch.randperm(M, generator=torch.Generator().manual_seed(0))
    x, expert = x[perm], expert[perm]
    got = kernel(x, blocks, scales, expert, False)
    assert_matches(got, mxfp4_expert_matmul_reference(x, blocks, scales, expert))
    assert_matches(got, kernel(x, blocks, scales, expert, True))
    # a row's sums do not depend on the chunk or column the batch puts it in, while its expert stays on AMX
    keep = (expert == 0).nonzero().flatten()[:3]
    assert torch.equal(kernel(x[keep].clone(), blocks, scales, expert[keep].clone(), False), got[keep])


def test_amx_takes_subnormal_blocks_exactly_and_nan_scales_as_nan():
    """Blocks at scale bytes 0 and 1 with nonzero values decode to bf16 subnormals, which AMX flushes: their panel
    is computed exactly instead (the others stay on tiles). All-zero blocks decode to exact zeros either way."""
    require_amx()
    E, N, K = 2, 64, 64
    blocks, scales = packed(E, N, K)
    scales[0, 40:44] = 0  # rows 40-43 of expert 0 (its second panel of 32 rows)
    scales[0, 44, 1] = 1
    blocks[1, 5] = 0  # an all-zero row at scale 0 in expert 1: stays on AMX
    scales[1, 5] = 0
    scales[1, 20, 0] = 0xFF  # NaN
    x = torch.ones(6, K)
    expert = torch.tensor([0, 0, 0, 1, 1, 1])
    got = kernel(x, blocks, scales, expert, False)
    exact = (dequantize(blocks, scales, torch.float32, K).double().sum(-1)).float()[expert]
    nan = exact.isnan()
    assert nan[3:, 20].all() and nan.sum() == 3 and torch.equal(got.isnan(), nan)
    assert (exact[:3, 40:44] != 0).all() and exact[:3, 40:44].abs().max() < 1e-36  # subnormal sums
    torch.testing.assert_close(got[:3, 32:], exact[:3, 32:], rtol=1e-6, atol=0)  # that panel, no flushed terms
    assert_matches(got, exact)
    assert torch.equal(got[3:, 5], torch.zeros(3))


def random_experts(E=8, d=64, f=48, seed=0) -> tuple[Experts, MXFP4Experts]:
    torch.manual_seed(seed)
    full = Experts(E, d, f)
    nn.init.normal_(full.gate_up_proj, std=d ** -0.5)
    nn.init.normal_(full.down_proj, std=f ** -0.5)
    return full, MXFP4Experts.from_experts(full)


def routing(n, E, k=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.rand(n, E, generator=gen).argsort(-1)[:, :k]
    return torch.rand(n, k, generator=gen).softmax(-1), idx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_sync_free_equals_the_eager_dispatch(dtype):
    _, m = random_experts()
    x = torch.randn(13, 64).to(dtype)
    weights, idx = routing(13, 8)
    got = m.sync_free(x, weights, idx)
    want, counts = Experts.forward(m, x, weights, idx)  # the loop: expert(e, rows) per routed expert
    assert got.dtype == dtype and got.shape == x.shape
    assert counts.tolist() == torch.bincount(idx.flatten(), minlength=8).tolist()
    if dtype == torch.float32:
        assert_matches(got, want)
    else:  # both round each product to bf16, and a token's two experts add with one rounding either way
        assert torch.equal(got, want)
    # where the kernel runs, forward is the grouped form, eager too, and counts the same loads
    fwd, fwd_counts = m.forward(x, weights, idx)
    assert torch.equal(fwd, got) and torch.equal(fwd_counts, counts)
    # and the kernel's loop against the dequantising one (the kernel switched off: forward is the loop)
    kernels_on = kernels._built
    try:
        kernels._built = False
        ref, _ = m.forward(x, weights, idx)
    finally:
        kernels._built = kernels_on
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(want.float(), ref.float(), rtol=tol, atol=tol * float(ref.abs().max()))


@torch.no_grad()
def test_mxfp4_linear_equals_linear_with_dequantized_weights():
    torch.manual_seed(0)
    lin = nn.Linear(45, 40, bias=True)
    q = MXFP4Linear.from_linear(lin)
    x = torch.randn(2, 3, 45)
    want = F.linear(x, dequantize(q.weight_blocks, q.weight_scales, torch.float32, 45), lin.bias)
    assert_matches(q(x), want)
    q16 = MXFP4Linear.from_linear(lin.bfloat16())  # bf16 activations and bias, as a bf16 model has them
    w16 = dequantize(q16.weight_blocks, q16.weight_scales, torch.bfloat16, 45)
    got16, want16 = q16(x.bfloat16()), F.linear(x.bfloat16(), w16, lin.bias)
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16.float(), want16.float(), rtol=2e-2, atol=2e-2)


@torch.no_grad()
def test_the_modules_decode_in_the_kernel_where_it_runs_and_dequantise_only_elsewhere(monkeypatch):
    """MXFP4Linear and MXFP4Experts.expert take the fused kernel wherever `mxfp4_kernel_runs_on` says it runs
    (here the CPU kernel; on CUDA the Triton one: tests/test_mxfp4_triton.py) and never expand the matrix;
    where it does not, they dequantise, with the same result."""
    import horizon.quant.layers as layers

    torch.manual_seed(0)
    lin = MXFP4Linear.from_linear(nn.Linear(64, 20, bias=True))
    dense = Experts(3, 64, 32)
    nn.init.normal_(dense.gate_up_proj, std=0.1), nn.init.normal_(dense.down_proj, std=0.1)
    experts = MXFP4Experts.from_experts(dense)
    x = torch.randn(5, 64)
    want = F.linear(x, lin.weight, lin.bias)
    want_e = [experts.expert(e, x) for e in range(3)]
    assert kernels.mxfp4_kernel_runs_on(torch.device("cpu"))
    assert not kernels.mxfp4_kernel_runs_on(torch.device("meta"))

    def forbidden(*args, **kwargs):
        raise AssertionError("took the other path")

    with monkeypatch.context() as m:
        m.setattr(layers, "dequantize", forbidden)
        assert_matches(lin(x), want)
        for e in range(3):
            assert_matches(experts.expert(e, x), want_e[e])
    with monkeypatch.context() as m:
        m.setattr(kernels, "_built", False)  # as after a failed build
        m.setattr(layers, "mxfp4_matmul", forbidden)
        assert not kernels.mxfp4_kernel_runs_on(torch.device("cpu"))
        assert_matches(lin(x), want)
        for e in range(3):
            assert_matches(experts.expert(e, x), want_e[e])


@torch.no_grad()
def test_compiled_sync_free_is_one_graph_with_the_op_opaque():
    _, m = random_experts(E=4, d=32, f=32)
    x = torch.randn(6, 32)
    weights, idx = routing(6, 4)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(m.sync_free, backend=backend, fullgraph=True)  # fullgraph: a break raises
    got = compiled(x, weights, idx)
    assert len(graphs) == 1
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    # the kernel itself when it is built (no Python wrapper per call), else the custom op with its fallback
    op = torch.ops.horizon_kernels if kernel_available() else torch.ops.horizon
    assert targets.count(op.mxfp4_expert_matmul.default) == 2
    assert_matches(got, m.sync_free(x, weights, idx))
    assert_matches(got, m.forward(x, weights, idx)[0])


def test_disabled_or_failed_build_falls_back_with_one_warning(monkeypatch, caplog):
    blocks, scales = packed(3, 20, 64)
    x, expert = torch.randn(4, 64), torch.tensor([0, 2, 2, 1])
    want = mxfp4_expert_matmul_reference(x, blocks, scales, expert)
    caplog.set_level(logging.WARNING, logger=kernels.__name__)
    monkeypatch.setattr(kernels, "_built", None)
    monkeypatch.setenv("HORIZON_KERNELS", "0")
    assert not kernel_available() and not kernel_available()
    assert_matches(mxfp4_expert_matmul(x, blocks, scales, expert), want)
    monkeypatch.setattr(kernels, "_built", None)
    monkeypatch.setenv("HORIZON_KERNELS", "1")

    def no_compiler():
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(kernels, "_build", no_compiler)
    assert not kernel_available()
    assert_matches(mxfp4_expert_matmul(x, blocks, scales, expert), want)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2  # one each time the process tried
    assert "HORIZON_KERNELS=0" in messages[0] and "Ninja is required" in messages[1]


def test_cache_dir_and_packaging(monkeypatch):
    monkeypatch.setenv("HORIZON_KERNEL_CACHE", "/tmp/somewhere")
    assert kernels.cache_dir() == Path("/tmp/somewhere")
    monkeypatch.delenv("HORIZON_KERNEL_CACHE")
    assert kernels.cache_dir().name.startswith(torch.__version__ + "-")
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    # every file the build reads (and hashes) ships in the wheel: with grouping.h left out, a wheel install
    # could not build the kernels at all (FileNotFoundError), and every layer fell back to its reference
    globs = pyproject["tool"]["setuptools"]["package-data"]["horizon.quant"]
    for source in kernels.SOURCES + kernels.HEADERS:
        assert source.exists() and source.parent.name == "kernels", source
        assert any(fnmatch.fnmatch(f"kernels/{source.name}", glob) for glob in globs), (source.name, globs)


def test_a_lock_left_by_a_stopped_build_is_removed_and_builds_exclude_each_other(tmp_path, caplog):
    """torch's load() waits for its `lock` file as long as it exists; one left by a killed build made every later
    process hang. Inside _build_lock (an flock the OS drops with its holder) such a file is removed."""
    import fcntl

    (tmp_path / "lock").touch()
    with caplog.at_level(logging.WARNING, logger="horizon.quant.kernels"), kernels._build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
        assert "stopped before it finished" in caplog.text
        with open(tmp_path / "horizon-build.lock") as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a second builder waits for this one
    with open(tmp_path / "horizon-build.lock") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released on leaving


def test_gradients_flow_through_the_kernel_to_x():
    """Training a model with frozen MXFP4 experts backpropagates through them: d/dx of the kernel's output
    equals d/dx of dequantise-then-matmul (the C++ op alone has no backward; the custom op registers one)."""
    blocks, scales = packed(3, 24, 40)
    x = torch.randn(7, 40, requires_grad=True)
    expert = torch.tensor([0, 2, 2, 1, 0, 2, 1])
    g = torch.randn(7, 24)
    (kernels.mxfp4_matmul(x, blocks, scales, expert) * g).sum().backward()
    got, x.grad = x.grad, None
    w = dequantize(blocks, scales, torch.float32, 40)  # [E, N, K]
    (torch.einsum("mk,mnk->mn", x, w[expert]) * g).sum().backward()
    assert_matches(got, x.grad)


# --- int8 activations (opt-in) ------------------------------------------------------------------------
def q8_kernel(x, blocks, scales, expert, portable):
    assert kernel_available(), "the MXFP4 kernel did not build (see the logged warning)"
    return torch.ops.horizon.mxfp4_expert_matmul(x, blocks, scales, expert, portable, True)


def test_int8_activations_take_this_cpus_vector_path():
    """AVX-512 VNNI where the CPU has it (and HORIZON_AVX512 is not 0), else AVX2, else the portable C++."""
    assert kernel_available(), "the MXFP4 kernel did not build (see the logged warning)"
    if {"avx512f", "avx512bw", "avx512_vnni"} <= CPU_FLAGS and not NO_AVX512:
        assert kernels.int8_path() == "vnni"
    elif {"avx2", "fma"} <= CPU_FLAGS:
        assert kernels.int8_path() == "avx2"
    else:
        assert kernels.int8_path() == "portable"


def test_quantize_activations_is_what_its_docstring_says():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 70, generator=gen) * torch.tensor([1e-3, 1.0, 50.0])[:, None]
    x[1, 32:64] = 0  # an all-zero block
    x[2, 5] = float("nan")
    x[0, 66] = float("inf")  # in the last, 6-wide block
    q, scale = kernels.quantize_activations(x)
    assert q.dtype == torch.int8 and q.shape == (3, 70) and scale.shape == (3, 3)
    assert q.abs().max() <= 127 and scale[1, 1] == 0 and (q[1, 32:64] == 0).all()
    assert scale[2, 0].isnan() and (q[2, :32] == 0).all() and scale[0, 2].isnan() and (q[0, 64:] == 0).all()
    back = kernels.dequantize_activations(q, scale)
    ok = scale.isfinite().repeat_interleave(32, dim=1)[:, :70]
    bound = scale.nan_to_num(0).repeat_interleave(32, dim=1)[:, :70] / 2
    assert ((back - x).abs()[ok] <= bound[ok] * (1 + 1e-6)).all()  # half a step at most
    # each finite block's largest magnitude is exactly +-127 steps
    amax = q.abs().view(3, -1)[:, :64].reshape(3, 2, 32).amax(-1)
    assert (amax[scale[:, :2].isfinite() & (scale[:, :2] > 0)] == 127).all()


@pytest.mark.parametrize("portable", PATHS)
@pytest.mark.parametrize("E, N, K, M", [
    (4, 48, 512, 1),     # batch-1 decode at the small preset's width: one pass of 16 blocks
    (6, 37, 45, 64),     # K not a multiple of 32, N not a multiple of the tiles
    (3, 40, 700, 13),    # 22 blocks: a full pass and a partial one; groups of more than 4 rows
    (40, 72, 1024, 64),  # many experts, one to a few rows each, two passes
])
def test_int8_activations_equal_their_reference(portable, E, N, K, M):
    blocks, scales = packed(E, N, K)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(M, K, generator=gen) * torch.rand(M, 1, generator=gen) * 3
    expert = torch.randint(0, E, (M,), generator=gen)
    got = q8_kernel(x, blocks, scales, expert, portable)
    want = mxfp4_expert_matmul_reference(x, blocks, scales, expert, int8_activations=True)
    assert_matches(got, want)
    # the reference is dequantise-then-matmul on x rounded as quantize_activations defines
    x8 = kernels.dequantize_activations(*kernels.quantize_activations(x))
    assert_matches(want, mxfp4_expert_matmul_reference(x8, blocks, scales, expert))
    # and the rounding is small: int8 steps of amax / 127 per 32 values
    exact = mxfp4_expert_matmul_reference(x, blocks, scales, expert)
    assert float((got - exact).norm() / exact.norm()) < 0.02


@pytest.mark.parametrize("portable", PATHS)
def test_int8_activations_a_row_is_the_same_batched_or_alone(portable):
    """Bit for bit: how many rows share an expert (1-4 at a time, or more in chunks) never changes a row."""
    E, N, K = 3, 30, 600
    blocks, scales = packed(E, N, K, seed=3)
    x = torch.randn(11, K)
    expert = torch.tensor([1] * 9 + [0, 2])
    together = q8_kernel(x, blocks, scales, expert, portable)
    for m in range(11):
        alone = q8_kernel(x[m:m + 1], blocks, scales, expert[m:m + 1], portable)
        assert torch.equal(alone[0], together[m]), m


@pytest.mark.parametrize("portable", PATHS)
def test_int8_activations_nan_in_where_the_reference_has_it(portable):
    E, N, K = 2, 20, 100
    blocks, scales = packed(E, N, K)
    scales[1, 3, 3] = 0xFF  # a NaN weight block (the last, partial one) of expert 1's output row 3
    x = torch.randn(4, K)
    x[2, 40] = float("inf")  # a non-finite activation: its whole row is NaN
    expert = torch.tensor([0, 1, 0, 1])
    got = q8_kernel(x, blocks, scales, expert, portable)
    want = mxfp4_expert_matmul_reference(x, blocks, scales, expert, int8_activations=True)
    nan = torch.zeros(4, N, dtype=torch.bool)
    nan[2] = True
    nan[[1, 3], 3] = True
    assert torch.equal(want.isnan(), nan) and torch.equal(got.isnan(), nan)
    assert_matches(got, want)
    # all-zero activations and all-zero weights give exact zeros
    zb, zs = quantize(torch.zeros(1, 8, 64))
    assert torch.equal(q8_kernel(torch.randn(3, 64), zb, zs, torch.zeros(3, dtype=torch.long), portable),
                       torch.zeros(3, 8))
    assert torch.equal(q8_kernel(torch.zeros(2, K), blocks, scales, torch.tensor([0, 0]), portable), torch.zeros(2, N))


@torch.no_grad()
def test_mxfp4_modules_with_int8_activations_match_their_reference_paths():
    from horizon.quant import set_int8_activations

    _, m = random_experts()
    x = torch.randn(13, 64)
    weights, idx = routing(13, 8)
    exact = m.sync_free(x, weights, idx)
    holder = nn.Sequential(m, MXFP4Linear.from_linear(nn.Linear(64, 40)))
    assert set_int8_activations(holder) == 2 and m.int8_activations and holder[1].int8_activations
    got = m.sync_free(x, weights, idx)
    eager, _ = m.forward(x, weights, idx)
    assert_matches(eager, got)
    assert 0 < float((got - exact).norm() / exact.norm()) < 0.02
    kernels_on = kernels._built
    try:
        kernels._built = False  # the dequantising path rounds x the same way
        ref, _ = m.forward(x, weights, idx)
        lin_ref = holder[1](x)
    finally:
        kernels._built = kernels_on
    assert_matches(got, ref)
    assert_matches(holder[1](x), lin_ref)
    assert set_int8_activations(holder, False) == 2 and not m.int8_activations
    assert_matches(m.sync_free(x, weights, idx), exact)


def test_int8_activations_warn_where_the_cpu_has_no_vector_path_for_them(monkeypatch, caplog):
    """Their speed is AVX-512 VNNI's or AVX2's; elsewhere the kernel's portable path runs them, several times slower
    than fp32 activations: asking for them there says so once, at load time."""
    from horizon.quant import set_int8_activations

    holder = nn.Sequential(random_experts()[1])
    for path in ("vnni", "avx2", "portable", None):
        monkeypatch.setattr(kernels, "int8_path", lambda path=path: path)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="horizon.quant.layers"):
            set_int8_activations(holder)
            set_int8_activations(holder, False)  # turning them off never warns
        assert ("neither AVX-512 VNNI nor AVX2" in caplog.text) == (path == "portable"), caplog.text


@torch.no_grad()
def test_int8_activations_at_load_time_and_from_the_cli():
    from horizon.checkpoint import open_model
    from horizon.cli import _formats, build_parser

    plain = open_model().model  # the bundled model: MXFP4 experts
    q8 = open_model(mxfp4_activations="int8").model
    flags = [m.int8_activations for m in q8.modules() if isinstance(m, MXFP4Experts)]
    assert flags and all(flags)
    assert not any(m.int8_activations for m in plain.modules() if isinstance(m, MXFP4Experts))
    tokens = torch.randint(300, 3000, (1, 48), generator=torch.Generator().manual_seed(0))
    a, b = plain(tokens), q8(tokens)
    rel = float((a - b).norm() / a.norm())
    assert 0 < rel < 0.05, rel  # rounded, but close
    with pytest.raises(ValueError, match="has none"):
        open_model("tiny-random", mxfp4_activations="int8")  # full-precision experts: nothing to round
    with pytest.raises(ValueError, match=r"mxfp4_activations=.*allowed: None.*'int8'"):
        open_model(mxfp4_activations="int4")
    parser = build_parser()
    args = parser.parse_args(["serve", "--mxfp4-activations", "int8"])
    assert _formats(args) == {"dense": None, "mxfp4_activations": "int8"}
    assert _formats(parser.parse_args(["generate", "--prompt", "hi"])) == {"dense": None, "mxfp4_activations": None}
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--mxfp4-activations", "fp8"])
