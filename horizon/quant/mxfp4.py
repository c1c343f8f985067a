"""MXFP4 (OCP Microscaling v1.0): the storage format of Horizon's quantised weights (docs/design.md §2).

Blocks of 32 consecutive elements along the last (input) dimension share one E8M0 scale; each element
is FP4 E2M1 (sign in bit 3, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6). Stored as in the public gpt-oss
checkpoints: `blocks` uint8 [..., n_blocks, 16] (element 2i in the low nibble of byte i, 2i+1 in the
high nibble) and `scales` uint8 [..., n_blocks] (value 2^(byte - 127)). 4.25 bits per weight.

    blocks, scales = quantize(w)                           # w [..., n] float -> packed bytes
    w_hat = dequantize(blocks, scales, torch.bfloat16, n)   # exact on representable values

Quantising (`quantize`), per block:
- shared exponent e = floor(log2(amax)) - 2, with floor(log2) read from the fp32 exponent bits (an fp32
  log2 rounds up just below powers of two), clamped to E8M0's range [-127, 127]; scale byte e + 127;
- elements x * 2^-e rounded to nearest on the E2M1 grid, ties to the even code, saturating at +-6; the
  sign bit is kept, so negative values that round to zero (and -0.0) store code 0x8 (-0), as torchao does.

Edge cases, decided here:
- last dimension not a multiple of 32: the input is zero-padded to whole blocks; pass the logical size
  `n` to `dequantize` to drop the padding (without it you get the padded width). The byte counts in
  `horizon.plan.mxfp4_nbytes` count the padding.
- all-zero block: scale byte 0 (2^-127, the clamp of floor(log2(0)) = -inf) and zero nibbles, as
  torchao writes it; any scale decodes a zero block to zeros.
- the clamp: blocks whose amax is below 2^-125 use the smallest scale 2^-127, so their elements keep
  up to their own precision on the grid (tiny values may round to zero); finite fp32 input never
  needs an exponent above 125, so the upper clamp at 127 only guards the formula.
  (torchao divides by 2^-126 instead of 2^-127 when the scale byte is 0, a workaround for its
  kernels; the bytes then differ from ours for blocks with amax < 2^-125 only.)
- NaN or +-Inf anywhere in the input: `quantize` raises ValueError (weights must be finite; MXFP4
  could only mark a whole 32-element block NaN, so nothing is written rather than a poisoned block).
- scale byte 0xFF (NaN in the spec): `dequantize` decodes the whole block to NaN, as the spec says;
  `quantize` never writes it. (transformers' gpt-oss dequantiser gives +-inf and NaN there instead.)
"""

from __future__ import annotations

import functools
import math

import torch

BLOCK = 32  # elements per scale
BLOCK_BYTES = BLOCK // 2  # packed bytes per block: two 4-bit codes a byte
E8M0_BIAS = 127
E8M0_NAN = 0xFF
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
QUANTIZABLE = (torch.float32, torch.bfloat16, torch.float16)
_SLICE_ELEMENTS = 1 << 21  # elements quantised at once: bounds the fp32 temporaries (~8 MB each)


def _rounding_bounds() -> torch.Tensor:
    """Midpoints between consecutive grid magnitudes, for round-to-nearest-even by counting.

    The code of m >= 0 is the number of bounds strictly below m. A value exactly on a midpoint must go
    to the neighbour with the even code: at 0.25, 1.25, 2.5 and 5 that is the lower one (the midpoint
    itself is the bound: not below, so not counted); at 0.75, 1.75 and 3.5 it is the upper one (the
    bound is one ulp below the midpoint, so it is counted).
    """
    mid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    up = torch.tensor([False, True, False, True, False, True, False])
    return torch.where(up, torch.nextafter(mid, torch.zeros(())), mid)


_BOUNDS = _rounding_bounds()


@torch.no_grad()
def quantize(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t [..., n] float -> (blocks uint8 [..., ceil(n/32), 16], scales uint8 [..., ceil(n/32)]).

    Zero-pads n to whole blocks; raises ValueError on NaN/Inf (edge cases: the module docstring).
    """
    if t.dtype not in QUANTIZABLE:
        raise ValueError(f"quantize takes a float32, bfloat16 or float16 tensor, got {t.dtype}")
    if t.dim() == 0:
        raise ValueError("quantize needs at least one dimension (blocks run along the last one)")
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        first = [int(i) for i in bad.nonzero()[0]]
        raise ValueError(f"quantize got {int(bad.sum())} non-finite value(s) (NaN/Inf), the first at index {first}: "
                         "MXFP4 weights must be finite")
    *lead, n = t.shape
    n_blocks = -(-n // BLOCK)
    x = t.reshape(math.prod(lead), n)
    if n_blocks * BLOCK != n:
        x = torch.nn.functional.pad(x, (0, n_blocks * BLOCK - n))  # zero padding: it never raises amax
    x = x.view(x.shape[0], n_blocks, BLOCK)
    blocks = torch.empty(x.shape[0], n_blocks, BLOCK_BYTES, dtype=torch.uint8, device=t.device)
    scales = torch.empty(x.shape[0], n_blocks, dtype=torch.uint8, device=t.device)
    step = max(1, _SLICE_ELEMENTS // max(1, n_blocks * BLOCK))
    for r in range(0, x.shape[0], step):  # slices of whole rows, not a loop over blocks
        rows = slice(r, r + step)
        blocks[rows], scales[rows] = _quantize_blocks(x[rows].float())
    return blocks.view(*lead, n_blocks, BLOCK_BYTES), scales.view(*lead, n_blocks)


def _quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x fp32 [R, nb, 32] -> (blocks [R, nb, 16], scales [R, nb])."""
    amax = x.abs().amax(-1)  # [R, nb]
    # floor(log2(amax)) is the unbiased exponent field (subnormals and 0 read as -127: the clamp covers them)
    floor_log2 = ((amax.view(torch.int32) >> 23) & 0xFF) - E8M0_BIAS
    exp = (floor_log2 - 2).clamp_(-E8M0_BIAS, E8M0_BIAS)  # 2 = floor(log2(6)), E2M1's largest power of two
    # 2^-exp built from its bits: exact, and a normal fp32 for every exp <= 126 (finite input keeps exp <= 125)
    inv_scale = ((E8M0_BIAS - exp) << 23).view(torch.float32)
    m = x * inv_scale[..., None]  # exact: a power-of-two scaling into [0, 8)
    code = torch.bucketize(m.abs(), _BOUNDS.to(x.device), out_int32=True)  # magnitude code 0..7, RNE, saturated
    code |= torch.signbit(m).int() << 3
    code = code.to(torch.uint8)
    return code[..., 0::2] | (code[..., 1::2] << 4), (exp + E8M0_BIAS).to(torch.uint8)


@functools.cache
def _table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The decoding table: (scale byte s, packed byte b) -> (FP4[b & 15], FP4[b >> 4]) * 2^(s - 127).

    Each pair is stored as one 2-element word (int32 for bf16, int64 for fp32), so one gather decodes two
    elements and applies their scale; 65,536 words (256 or 512 KB). Built in fp64, where every product
    is exact, and rounded once to `dtype` (float32 or bfloat16). Row s = 0xFF is NaN, as the spec says.
    """
    values = torch.tensor(FP4_VALUES, dtype=torch.float64)
    byte = torch.arange(256)
    pairs = torch.stack((values[byte & 0xF], values[byte >> 4]), dim=-1)  # [256 bytes, 2] (low, high)
    powers = torch.ldexp(torch.ones(256, dtype=torch.float64), byte - E8M0_BIAS)  # [256 scales]
    powers[E8M0_NAN] = float("nan")
    table = (powers[:, None, None] * pairs[None]).to(dtype)  # [256 scales, 256 bytes, 2]
    word = torch.int32 if dtype.itemsize == 2 else torch.int64
    return table.view(word).reshape(256 * 256).to(device)


def check_packed(blocks: torch.Tensor, scales: torch.Tensor, size: int | None = None) -> None:
    """Raise ValueError unless (blocks, scales) is an MXFP4 pair, and `size` fits its blocks."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK_BYTES or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks must be [..., n_blocks, {BLOCK_BYTES}] with scales [..., n_blocks], got "
                         f"blocks {list(blocks.shape)} and scales {list(scales.shape)}")
    if size is not None and -(-size // BLOCK) != blocks.shape[-2]:
        raise ValueError(f"size={size} does not fit {blocks.shape[-2]} blocks of {BLOCK}: allowed "
                         f"{BLOCK * blocks.shape[-2] - BLOCK + 1} to {BLOCK * blocks.shape[-2]}")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32,
               size: int | None = None) -> torch.Tensor:
    """(blocks [..., nb, 16], scales [..., nb]) -> values [..., size] (default nb * 32) in `dtype`.

    One lookup per byte in a table indexed by (scale byte, packed byte) gives both elements already
    multiplied by 2^(scale - 127): the exact value rounded once to `dtype` (no multiply pass, which costs
    more than the gather on CPU).
    """
    check_packed(blocks, scales, size)
    if not dtype.is_floating_point:
        raise ValueError(f"dequantize returns a floating-point tensor, got dtype={dtype}")
    *lead, nb, _ = blocks.shape
    compute = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32  # fp16 cannot hold 2^+-127
    row = blocks.int()  # [..., nb, 16]: (scale, byte) -> table row scale * 256 + byte (in place: fewest passes)
    row.add_(scales.int().unsqueeze(-1), alpha=256)
    # index_select with a flat int32 index is the fastest gather torch has on CPU
    words = torch.index_select(_table(compute, blocks.device), 0, row.reshape(-1))
    values = words.view(compute).view(*lead, nb * BLOCK)
    if size is not None and size != nb * BLOCK:
        values = values[..., :size]
    return values.to(dtype)


def packed_nbytes(blocks: torch.Tensor, scales: torch.Tensor) -> int:
    """Resident bytes of one packed tensor."""
    return blocks.numel() * blocks.element_size() + scales.numel() * scales.element_size()
