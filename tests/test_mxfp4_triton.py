"""The Triton MXFP4 kernel (horizon.quant.kernels.mxfp4_triton) against the PyTorch reference.

On a CUDA GPU where triton imports: parity, the routing of CUDA calls to it, and a CUDA graph capturing it.
Where triton imports but there is no GPU: parity under Triton's interpreter on CPU tensors, in a subprocess
(the interpreter is chosen when the kernel is defined, and triton stays out of this process), and the kernel
compiled ahead of time for sm_80 and sm_90. Skipped where triton is missing: it is not a dependency, and CI's
CPU machines have none.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from horizon.quant.kernels import expert_tiles, mxfp4_expert_matmul_reference
from horizon.quant.mxfp4 import quantize

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()


def _packed(E, N, K, g, device):
    blocks, scales = quantize(torch.randn(E, N, K, generator=g))
    return blocks.to(device), scales.to(device)


def check_parity(device: str) -> None:
    """The kernel == the reference (fp32, up to summation order) over shapes with K off the block size,
    x narrower than the weights, int32 and int64 ids, NaN (0xFF) and subnormal (0) scale bytes, nonzero codes
    and infinities in the padding past K."""
    from horizon.quant.kernels.mxfp4_triton import mxfp4_expert_matmul_triton as kernel

    g = torch.Generator().manual_seed(0)
    for E, N, K, M in [(4, 40, 64, 3), (8, 64, 200, 7), (3, 33, 31, 1), (2, 96, 512, 5), (5, 17, 100, 9),
                       (2, 40, 64, 50)]:  # the last: several tiles of rows for one expert
        blocks, scales = _packed(E, N, K, g, device)
        x = torch.randn(M, K, generator=g).to(device)
        for dtype in (torch.int64, torch.int32):
            expert = torch.randint(0, E, (M,), generator=g).to(device, dtype)
            got, want = kernel(x, blocks, scales, expert), mxfp4_expert_matmul_reference(x, blocks, scales, expert)
            assert got.dtype == torch.float32 and got.shape == (M, N)
            err = ((got - want).abs().max() / want.abs().max()).item()
            assert err < 1e-5, (E, N, K, M, dtype, err)
    blocks, scales = _packed(3, 24, 200, g, device)  # x narrower than the weights by more than a block
    x, expert = torch.randn(5, 150, generator=g).to(device), torch.tensor([2, 0, 1, 2, 2], device=device)
    torch.testing.assert_close(kernel(x, blocks, scales, expert),
                               mxfp4_expert_matmul_reference(x, blocks, scales, expert), rtol=1e-5, atol=1e-5)
    blocks, scales = _packed(2, 8, 96, g, device)
    scales[0, 1, 0] = 0xFF  # a NaN block: row 0's output 1 is NaN
    scales[1, 2, 1] = 0  # the subnormal scale 2^-127
    blocks[1, 4, 2, 3:] = 0x77  # 6.0s in the padding past x's 70 columns (bytes 3-15 of block 2): never count,
    blocks[1, 5, 2, :3], blocks[1, 5, 2, 3:], scales[1, 5, 2] = 0, 0x77, 254  # nor do infinities there (6 * 2^127)
    x = torch.randn(4, 70, generator=g).to(device)
    expert = torch.tensor([0, 1, 1, 0], device=device)
    got, want = kernel(x, blocks, scales, expert), mxfp4_expert_matmul_reference(x, blocks, scales, expert)
    assert torch.equal(got.isnan(), want.isnan()) and bool(got[0, 1].isnan()) and int(got.isnan().sum()) == 2
    torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=1e-5, atol=1e-5)
    empty = kernel(x[:0], blocks, scales, expert[:0])
    assert empty.shape == (0, 8)
    # ids outside [0, E) (another rank's experts, or a bug): zeros for those rows, the others unchanged
    blocks, scales = _packed(3, 40, 64, g, device)
    x, expert = torch.randn(6, 64, generator=g).to(device), torch.tensor([2, 3, 0, -1, 2, 7], device=device)
    got = kernel(x, blocks, scales, expert)
    ok = torch.tensor([True, False, True, False, True, False], device=device)
    assert torch.equal(got[~ok], torch.zeros_like(got[~ok]))
    torch.testing.assert_close(got[ok], mxfp4_expert_matmul_reference(x[ok], blocks, scales, expert[ok]), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("M, E, block_m", [(0, 4, 16), (1, 4, 16), (64, 64, 16), (300, 8, 16), (17, 3, 4),
                                           (5, 100, 16), (40, 1, 16)])
def test_expert_tiles_put_every_routed_row_in_one_tile_of_its_expert(M, E, block_m):
    """The kernel's grouping (plain PyTorch, so checked everywhere): fixed shapes; each row with an id in
    [0, E) in exactly one slot of a tile of its expert, in row order within the expert; rows of other ids
    nowhere; the filled tiles first, in expert order, none without a row."""
    g = torch.Generator().manual_seed(M * 1000 + E)
    for dtype in (torch.int64, torch.int32):
        ids = torch.randint(-1, E + 2, (M,), generator=g).to(dtype)
        tile_expert, slot_row = expert_tiles(ids, E, block_m)
        T = -(-M // block_m) + min(E, M)
        assert tile_expert.shape == (T,) and slot_row.shape == (T * block_m,)
        assert tile_expert.dtype == slot_row.dtype == torch.int32
        slots = slot_row.view(T, block_m).tolist()
        where = {row: t for t, tile in enumerate(slots) for row in tile if row >= 0}
        assert sorted(where) == [m for m in range(M) if 0 <= ids[m] < E]  # each routed row once, no other
        assert len(where) == sum(r >= 0 for tile in slots for r in tile)
        assert all(tile_expert[t] == ids[m] for m, t in where.items())
        te = tile_expert.tolist()
        assert te == sorted(te) and all(0 <= e <= E for e in te)
        assert [any(r >= 0 for r in tile) for tile in slots] == [e < E for e in te]  # filled tiles: an expert
        for e in set(te) - {E}:  # an expert's rows fill its tiles in row order, leaving at most the last partial
            rows = [r for t, tile in enumerate(slots) if te[t] == e for r in tile]
            filled = [r for r in rows if r >= 0]
            assert filled == sorted(filled) and rows[:len(filled)] == filled


@pytest.mark.skipif(not HAS_TRITON or HAS_CUDA, reason="triton is not installed (not a dependency); or a GPU "
                    "is here, where the CUDA test runs")
def test_triton_kernel_interpreted_on_cpu():
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip().endswith("ok")


COMPILE_FOR_GPUS = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from horizon.quant.kernels.mxfp4_triton import BLOCK_B, BLOCK_M, BLOCK_N, _kernel
signature = {"x_ptr": "*fp32", "blocks_ptr": "*u8", "scales_ptr": "*u8", "tile_expert_ptr": "*i32",
             "slot_row_ptr": "*i32", "out_ptr": "*fp32", "E": "i32", "N": "i32", "K": "i32", "nb": "i32",
             "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_B": "constexpr"}
constexprs = {"BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "BLOCK_B": BLOCK_B}
source = ASTSource(fn=_kernel, signature=signature, constexprs=constexprs)
for capability in (80, 90):  # A100, H100 / H200
    assert triton.compile(source, target=GPUTarget("cuda", capability, 32)).asm["cubin"]
print("ok")
"""


@pytest.mark.skipif(not HAS_TRITON or HAS_CUDA, reason="triton is not installed (not a dependency); or a GPU "
                    "is here, where the kernel compiles and runs in the CUDA test")
def test_triton_kernel_compiles_for_sm80_and_sm90():
    """Compiled to cubin ahead of time (triton's own ptxas; no GPU needed), in a subprocess: the interpreter
    checks the arithmetic, this that the kernel lowers for real GPUs. (Written against triton 3.9's
    ahead-of-time API, which other versions may spell differently: on a GPU the CUDA test covers it.)"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", COMPILE_FOR_GPUS], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip().endswith("ok")


@pytest.mark.skipif(not (HAS_TRITON and HAS_CUDA), reason="needs a CUDA GPU and triton")
def test_triton_kernel_on_cuda(monkeypatch):
    import horizon.quant.kernels as kernels

    check_parity("cuda")
    g = torch.Generator().manual_seed(1)
    blocks, scales = _packed(8, 256, 512, g, "cuda")
    x = torch.randn(12, 512, generator=g).cuda()
    expert = torch.randint(0, 8, (12,), generator=g).cuda()
    want = mxfp4_expert_matmul_reference(x, blocks, scales, expert)
    want_q8 = mxfp4_expert_matmul_reference(x, blocks, scales, expert, int8_activations=True)

    # CUDA calls go to the kernel (the reference would fail here), through the module path and the custom op
    def no_reference(*args, **kwargs):
        raise AssertionError("a CUDA call took the reference")

    monkeypatch.setattr(kernels, "mxfp4_expert_matmul_reference", no_reference)
    torch.testing.assert_close(kernels.mxfp4_matmul(x, blocks, scales, expert), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(kernels.mxfp4_expert_matmul(x, blocks, scales, expert), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(kernels.mxfp4_matmul(x, blocks, scales, expert, int8_activations=True), want_q8,
                               rtol=1e-5, atol=1e-4)
    # so do the MXFP4 modules (they never expand the matrix where the kernel runs)
    import horizon.quant.layers as layers
    from horizon.model.moe import Experts
    from horizon.quant import MXFP4Experts, MXFP4Linear

    lin = MXFP4Linear.from_linear(torch.nn.Linear(512, 96).cuda())
    dense = Experts(4, 512, 64).cuda()
    torch.nn.init.normal_(dense.gate_up_proj, std=0.05), torch.nn.init.normal_(dense.down_proj, std=0.05)
    experts = MXFP4Experts.from_experts(dense)
    with torch.no_grad():
        want_lin = torch.nn.functional.linear(x, lin.weight, lin.bias)
        want_e = [layers.F.linear(layers.F.silu(g) * u, experts.weight("down_proj", e, torch.float32))
                  for e in range(4)
                  for g, u in [layers.F.linear(x, experts.weight("gate_up_proj", e, torch.float32)).chunk(2, -1)]]
        monkeypatch.setattr(layers, "dequantize", no_reference)
        assert kernels.mxfp4_kernel_runs_on(x.device)
        torch.testing.assert_close(lin(x), want_lin, rtol=1e-5, atol=1e-4)
        for e in range(4):
            torch.testing.assert_close(experts.expert(e, x), want_e[e], rtol=1e-5, atol=1e-4)

    # a CUDA graph captures it (the ids stay on the device) and replays it on new inputs
    static_x, static_ids = x.clone(), expert.clone()
    kernels.mxfp4_matmul(static_x, blocks, scales, static_ids)  # warm-up: the kernel compiles outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = kernels.mxfp4_matmul(static_x, blocks, scales, static_ids)
    x2 = torch.randn(12, 512, generator=g).cuda()
    ids2 = torch.randint(0, 8, (12,), generator=g).cuda()
    static_x.copy_(x2)
    static_ids.copy_(ids2)
    graph.replay()
    monkeypatch.undo()
    torch.testing.assert_close(static_out, mxfp4_expert_matmul_reference(x2, blocks, scales, ids2), rtol=1e-5,
                               atol=1e-4)


if __name__ == "__main__":  # the interpreted run (TRITON_INTERPRET=1), from the test above
    check_parity("cpu")
    print("ok")
