"""The MXFP4 x activation matmul on CUDA GPUs: a Triton kernel that decodes the packed 4.25-bit weights in
registers, the GPU counterpart of mxfp4.cpp (same arguments, same result up to summation order).

    out = mxfp4_expert_matmul_triton(x, blocks, scales, expert)   # CUDA tensors; fp32 [M, N]

Imported only where CUDA is present: horizon.quant.kernels sends CUDA tensors here when triton imports, and
never imports this module otherwise (triton is not a dependency: on a CPU-only machine it would break
flash-linear-attention's CPU reference, which the tests use).

Why: without it a CUDA step dequantises every routed expert to fp32 (the reference), and the reference reads
the expert ids on the host, which a CUDA graph cannot capture. Here the rows are grouped by expert on the
device (horizon.quant.kernels.expert_tiles, fixed shapes), so a decode step with MXFP4 experts captures whole.

Layout of the work (as vLLM's fused MoE): rows of x grouped by expert into tiles of BLOCK_M rows of one
expert (a tile's empty slots masked); one program per (tile, BLOCK_N output rows). It walks K in steps of
BLOCK_B blocks (32 weights each): loads the step's bytes [BLOCK_N, 16 * BLOCK_B] and scales, decodes each
nibble to its E2M1 value through fp32 bit patterns (exact), scales it by its block's 2^(s - 127) (exact: the
products have at most 2 significant bits), and multiplies the low nibbles' weights with x's even elements and
the high nibbles' with the odd ones, two fp32 `tl.dot`s (IEEE precision, not TF32: the result is the
reference's up to summation order). So an expert's weights are read once per tile of its rows, not once per
row: at 16 decode sequences of `small` (64 rows over ~41 experts) 1.6x fewer bytes than a program per row,
at 256 sequences (1,024 rows over 64 experts) 16x fewer.

Checked against the reference under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors), compiled ahead
of time for sm_80 and sm_90, and on an H100 (tests/test_mxfp4_triton.py and tests/test_cuda.py, where there is
a GPU: parity, and inside the runner's CUDA graphs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from horizon.quant.kernels import expert_tiles
from horizon.quant.mxfp4 import BLOCK, BLOCK_BYTES, E8M0_NAN

BLOCK_M = 16  # rows of x per tile, the fewest tl.dot takes: a decode step gives an expert a few rows, more is padding
BLOCK_N = 32  # output rows per program
BLOCK_B = 4  # 32-weight blocks per step along K (128 weights; 64 a tl.dot)


@triton.jit
def _e2m1(code):
    """4-bit E2M1 codes (int32) -> fp32 values, exactly: sign in bit 3; magnitude code c = 2e + m gives
    0.5 m for e = 0, else 2^(e - 1) (1 + m / 2), built from fp32 bit patterns."""
    c = code & 7
    e = c >> 1
    m = c & 1
    bits = tl.where(e == 0, m * (126 << 23), ((e + 126) << 23) | (m << 22))
    bits = bits | ((code >> 3) << 31)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e8m0(s):
    """E8M0 scale bytes (int32) -> fp32 2^(s - 127) exactly (s = 0: the subnormal 2^-127), 0xFF -> NaN."""
    bits = tl.where(s == 0, 1 << 22, s << 23)
    bits = tl.where(s == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _kernel(x_ptr, blocks_ptr, scales_ptr, tile_expert_ptr, slot_row_ptr, out_ptr, E, N, K, nb,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    t = tl.program_id(0)
    e = tl.load(tile_expert_ptr + t)
    if e >= E:  # a tile past the ones the routing filled (their number is only known on the device)
        return
    rows = tl.load(slot_row_ptr + t * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # -1: an empty slot
    row_ok = rows >= 0
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    wrow = e.to(tl.int64) * N + n.to(tl.int64)  # the expert's weight rows
    i = tl.arange(0, BLOCK_B * 16)  # byte within the K step: block i // 16, byte i % 16
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for b0 in range(0, nb, BLOCK_B):
        blk = b0 + i // 16
        k = blk * 32 + 2 * (i % 16)  # byte j of a block: elements 2j (low nibble) and 2j + 1 (high)
        ok = n_ok[:, None] & (blk < nb)[None, :]
        byte = tl.load(blocks_ptr + (wrow[:, None] * nb + blk[None, :]) * 16 + (i % 16)[None, :], mask=ok,
                       other=0).to(tl.int32)
        scale = _e8m0(tl.load(scales_ptr + wrow[:, None] * nb + blk[None, :], mask=ok, other=127).to(tl.int32))
        # weights past K are zeros, whatever their block's scale (a NaN or infinite weight inside K counts)
        w_even = tl.where((k < K)[None, :], _e2m1(byte & 15) * scale, 0.0)
        w_odd = tl.where((k + 1 < K)[None, :], _e2m1(byte >> 4) * scale, 0.0)
        x_even = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=row_ok[:, None] & (k < K)[None, :],
                         other=0.0)
        x_odd = tl.load(x_ptr + rows[:, None] * K + k[None, :] + 1, mask=row_ok[:, None] & (k + 1 < K)[None, :],
                        other=0.0)
        acc += tl.dot(x_even, tl.trans(w_even), input_precision="ieee")
        acc += tl.dot(x_odd, tl.trans(w_odd), input_precision="ieee")
    tl.store(out_ptr + rows[:, None] * N + n[None, :], acc, mask=row_ok[:, None] & n_ok[None, :])


def mxfp4_expert_matmul_triton(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                               expert: torch.Tensor) -> torch.Tensor:
    """fp32 [M, N]: out[m, n] = sum_k x[m, k] * W_{expert[m]}[n, k], W = (blocks [E, N, nb, 16], scales
    [E, N, nb]) in MXFP4; x float [M, K] with K <= nb * 32 (taken as fp32), expert int [M]. A row whose id is
    outside [0, E) comes out zeros (the CPU op refuses it; checking here would read the ids on the host). The
    caller checks the shapes (horizon.quant.kernels._check) and applies int8 activation rounding first if
    asked."""
    M, K = x.shape
    E, N, nb = scales.shape
    assert blocks.shape == (E, N, nb, BLOCK_BYTES) and K <= nb * BLOCK and E8M0_NAN == 255
    out = torch.zeros(M, N, dtype=torch.float32, device=x.device)
    if M == 0 or N == 0 or K == 0:
        return out
    tile_expert, slot_row = expert_tiles(expert, E, BLOCK_M)
    grid = (tile_expert.shape[0], triton.cdiv(N, BLOCK_N))
    _kernel[grid](x.float().contiguous(), blocks.contiguous(), scales.contiguous(), tile_expert, slot_row, out,
                  E, N, K, nb, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_B=BLOCK_B)
    return out
