"""MXFP4 format: bytes equal torchao's FLOOR-scaled MXFP4, decoding equals transformers' gpt-oss dequantiser,
pack -> unpack is exact on representable values, and the spec's rounding, saturation and edge cases hold."""

import math

import pytest
import torch

from horizon.quant.mxfp4 import FP4_VALUES, dequantize, quantize

GRID = torch.tensor(FP4_VALUES[:8])  # magnitudes of codes 0..7


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def cases():
    """Named fp32 inputs for the torchao comparison (each [rows, multiple of 32])."""
    g = _gen(1)
    normal = torch.randn(64, 256, generator=g)
    student_t = torch.distributions.StudentT(1.5).sample((64, 256))  # heavy tails: one big value per block
    cauchy = torch.distributions.Cauchy(0.0, 1e-3).sample((64, 256))
    # one block exponent in 2^[-20, 20) per block, so scale bytes vary along rows and blocks
    ranged = torch.randn(32, 8, 32, generator=g) * torch.randint(-20, 20, (32, 8, 1), generator=g).float().exp2()
    zeros = torch.randn(16, 128, generator=g)
    zeros[::2, 32:64] = 0.0  # all-zero blocks between non-zero ones
    zeros[1::4, :32] = -0.0
    # at and beyond saturation: amax / 2^e in [4, 8), values up to just below 8 saturate to 6
    k = torch.randint(-10, 10, (16, 4, 1), generator=g).float().exp2()
    sat = torch.tensor([6.0, 7.0, 7.5, 7.999, 5.0, 5.5, 6.5, -6.0, -7.999, -5.0, 4.0, 8 - 2**-20])
    saturating = (sat[torch.randint(0, len(sat), (16, 4, 32), generator=g)] * k).view(16, 128)
    # amax just below a power of two: floor(log2) is one less than an fp32 log2 rounds to
    below = torch.nextafter(torch.ones(16, 4, 1) * k, torch.zeros(()))
    below_pow2 = torch.cat((below, torch.rand(16, 4, 31, generator=g) * below), -1).view(16, 128)
    midpoints = (torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])[torch.randint(0, 8, (8, 64), generator=g)]
                 * torch.where(torch.rand(8, 64, generator=g) < 0.5, -1.0, 1.0))
    midpoints[:, ::32] = 6.0  # fix the block scale at 2^0 so the values sit exactly on the midpoints
    return {"normal": normal, "student_t": student_t, "cauchy": cauchy, "ranged": ranged.view(32, 256),
            "zero_blocks": zeros, "saturating": saturating, "below_pow2": below_pow2, "midpoints": midpoints}


def torchao_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's MXFP4 (FLOOR scale) mapped to our layout: its packing is already low nibble = even element."""
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    scale, data = mx.to_mx(x.contiguous(), torch.float4_e2m1fn_x2, 32, ScaleCalculationMode.FLOOR)
    rows, n = x.shape
    return data.view(torch.uint8).reshape(rows, n // 32, 16), scale.view(torch.uint8).reshape(rows, n // 32)


@pytest.mark.parametrize("name", list(cases()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bytes_equal_torchao_floor_scaling(name, dtype):
    x = cases()[name].to(dtype)
    blocks, scales = quantize(x)
    want_blocks, want_scales = torchao_mxfp4(x)
    assert torch.equal(scales, want_scales)
    assert torch.equal(blocks, want_blocks)


def test_bytes_are_gpt_oss_layout():
    x = torch.zeros(2, 64)
    x[0, 0], x[0, 1], x[1, 33] = 6.0, -0.5, 1.5  # codes 7 (even element), 9 (odd); 1.5 = 6 * 2^-2: code 7
    blocks, scales = quantize(x)
    assert blocks.shape == (2, 2, 16) and scales.shape == (2, 2) and blocks.dtype == scales.dtype == torch.uint8
    assert blocks[0, 0, 0] == 0x97 and blocks[1, 1, 0] == 0x70
    assert scales.tolist() == [[127, 0], [0, 127 - 2]]  # 6 -> 2^0; 1.5 -> floor(log2 1.5) - 2 = -2; zeros -> 0


def random_packed(shape, gen, scale_range=(0, 253)):
    """Random bytes where each block holds a code of magnitude 4 or 6 (then quantize must pick the same scale)."""
    blocks = torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, generator=gen)
    big = torch.tensor([0x06, 0x07, 0x0E, 0x0F], dtype=torch.uint8)  # +-4, +-6 in the low nibble
    blocks[..., 0] = (blocks[..., 0] & 0xF0) | big[torch.randint(0, 4, shape, generator=gen)]
    scales = torch.randint(*scale_range, shape, dtype=torch.uint8, generator=gen)
    return blocks, scales


def test_quantize_of_dequantize_gives_back_every_byte():
    # scale bytes 0..252: 6 * 2^(253 - 127) = 2^128.58 would overflow fp32
    blocks, scales = random_packed((40, 6), _gen(2), (0, 253))
    scales[0, 0], scales[0, 1] = 0, 252  # the two ends of the range finite fp32 can reach
    x = dequantize(blocks, scales)
    assert torch.isfinite(x).all()
    b2, s2 = quantize(x)
    assert torch.equal(s2, scales) and torch.equal(b2, blocks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_quantize_is_exact_on_representable_values(dtype):
    # blocks of grid values times 2^e, with e inside dtype's range (fp16: values from 2^-14 to 6 * 2^12)
    lo, hi = (127 - 14, 127 + 12) if dtype == torch.float16 else (20, 230)
    blocks, scales = random_packed((24, 5), _gen(3), (lo, hi))
    x = dequantize(blocks, scales, dtype)
    assert x.dtype == dtype
    assert torch.equal(dequantize(*quantize(x), dtype), x)
    # blocks whose largest code is 0.5 or 1 come back too: the scale drops by two and the codes grow
    g = _gen(8)
    coarse = torch.tensor([0.0, 0.5, 1.0, -0.5, -1.0])[torch.randint(0, 5, (24, 5, 32), generator=g)]
    coarse = (coarse * torch.randint(-10, 10, (24, 5, 1), generator=g).float().exp2()).view(24, 160).to(dtype)
    assert torch.equal(dequantize(*quantize(coarse), dtype), coarse)


def test_decoding_matches_transformers_gpt_oss_dequantizer_bit_for_bit():
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    g = _gen(4)
    blocks = torch.randint(0, 256, (3, 24, 5, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 255, (3, 24, 5), dtype=torch.uint8, generator=g)  # every byte but 0xFF
    scales[0, 0, :] = torch.tensor([0, 1, 127, 253, 254], dtype=torch.uint8)  # extremes, overflow to inf included
    for dtype in (torch.bfloat16, torch.float32):
        # transformers returns the experts as [E, in, out] (gpt-oss's forward layout); ours are [E, out, in]
        want = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)
        got = dequantize(blocks, scales, dtype)
        assert got.dtype == dtype and got.shape == (3, 24, 5 * 32)
        assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8))


def test_scale_byte_0xff_decodes_its_block_to_nan_and_nothing_else():
    blocks, scales = random_packed((4, 3), _gen(5), (100, 150))
    scales[2, 1] = 0xFF
    x = dequantize(blocks, scales).view(4, 3, 32)
    assert x[2, 1].isnan().all()
    mask = torch.ones(4, 3, dtype=torch.bool)
    mask[2, 1] = False
    assert torch.isfinite(x[mask]).all()


def block_with(values: list[float]) -> torch.Tensor:
    """One 32-element block holding `values` then a 4.0 that fixes its scale at 2^0 (amax 4 -> e = 0)."""
    x = torch.zeros(32)
    x[: len(values)] = torch.tensor(values)
    x[31] = 4.0
    return x


def roundtrip(values: list[float]) -> list[float]:
    x = block_with(values)
    blocks, scales = quantize(x)
    assert scales.item() == 127
    return dequantize(blocks, scales)[: len(values)].tolist()


def test_round_to_nearest_even_at_the_exact_midpoints():
    # each midpoint goes to the neighbour whose code is even: 0(0) 1.0(2) 2.0(4) 4.0(6)
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    assert roundtrip(mids) == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert roundtrip([-m for m in mids]) == [-0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]
    # one ulp either side of a midpoint rounds to the nearer neighbour
    below = torch.nextafter(torch.tensor(mids), torch.tensor(0.0)).tolist()
    above = torch.nextafter(torch.tensor(mids), torch.tensor(8.0)).tolist()
    assert roundtrip(below) == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]
    assert roundtrip(above) == [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_values_beyond_six_saturate():
    x = torch.tensor([7.999, -7.5, 6.0, 6.5, 1.0] + [0.0] * 27)  # amax 7.999 -> e = 0
    blocks, scales = quantize(x)
    assert scales.item() == 127
    assert dequantize(blocks, scales)[:5].tolist() == [6.0, -6.0, 6.0, 6.0, 1.0]


@pytest.mark.parametrize("k", [-100, -3, 0, 1, 2, 10, 100])
def test_the_exponent_comes_from_the_bits_just_below_a_power_of_two(k):
    amax = torch.nextafter(torch.tensor(2.0**k), torch.tensor(0.0))  # 2^k minus one ulp: floor(log2) = k - 1
    x = torch.zeros(32)
    x[0] = amax
    blocks, scales = quantize(x)
    assert scales.item() == 127 + (k - 1) - 2
    assert dequantize(blocks, scales)[0].item() == 6.0 * 2.0 ** (k - 3)  # 8 - tiny saturates to 6 at scale 2^(k-3)
    if k == 10:  # the pitfall this guards against: fp32 log2 rounds up to k here
        assert torch.log2(amax).floor().item() == k


def test_a_last_dim_that_is_not_a_multiple_of_32_is_zero_padded():
    g = _gen(6)
    blocks, scales = random_packed((3, 2), g, (110, 140))
    x = dequantize(blocks, scales)[:, :45].clone()  # 45 = one block and 13 elements
    b, s = quantize(x)
    assert b.shape == (3, 2, 16) and s.shape == (3, 2)
    padded = torch.nn.functional.pad(x, (0, 19))
    assert torch.equal(b, quantize(padded)[0]) and torch.equal(s, quantize(padded)[1])
    assert torch.equal(dequantize(b, s, size=45), x)
    full = dequantize(b, s)
    assert full.shape == (3, 64) and not full[:, 45:].any()
    for bad in (32, 65, 0):
        with pytest.raises(ValueError, match="does not fit 2 blocks"):
            dequantize(b, s, size=bad)


def test_all_zero_blocks_get_scale_byte_zero():
    x = torch.zeros(2, 64)
    x[1, 32:] = -0.0
    x[1, :32] = 1.0
    blocks, scales = quantize(x)
    assert scales.tolist() == [[0, 0], [125, 0]]
    assert not blocks[0].any()
    assert (blocks[1, 1] == 0x88).all()  # -0.0 keeps its sign bit, as torchao writes it
    out = dequantize(blocks, scales)
    assert torch.equal(out, x) and out[1, 40].item() == 0.0 and math.copysign(1.0, out[1, 40].item()) == -1.0


def test_the_scale_exponent_clamps_to_e8m0s_range():
    # amax 2^-126 wants e = -128: clamped to -127 (byte 0), elements still on the grid relative to 2^-127
    x = torch.zeros(32)
    x[:4] = torch.tensor([2.0**-126, 1.5 * 2.0**-127, 0.5 * 2.0**-127, 2.0**-140])
    blocks, scales = quantize(x)
    assert scales.item() == 0
    assert dequantize(blocks, scales)[:4].tolist() == [2.0**-126, 1.5 * 2.0**-127, 0.5 * 2.0**-127, 0.0]
    # the largest float32 needs e = 125 (byte 252), well inside the range
    big = torch.full((32,), torch.finfo(torch.float32).max)
    blocks, scales = quantize(big)
    assert scales.unique().tolist() == [252]
    assert dequantize(blocks, scales).unique().tolist() == [6.0 * 2.0**125]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_raises_instead_of_writing_a_poisoned_block(bad):
    x = torch.randn(3, 64)
    x[1, 40] = bad
    with pytest.raises(ValueError, match=r"1 non-finite value\(s\).*index \[1, 40\]"):
        quantize(x)


def test_half_precision_inputs_quantize_like_their_fp32_values():
    x = torch.randn(16, 96, generator=_gen(7)) * 3
    for dtype in (torch.bfloat16, torch.float16):
        xh = x.to(dtype)
        for got, want in zip(quantize(xh), quantize(xh.float()), strict=True):
            assert torch.equal(got, want)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        quantize(torch.ones(32, dtype=torch.float64))
    with pytest.raises(ValueError, match="at least one dimension"):
        quantize(torch.tensor(1.0))
    blocks, scales = quantize(torch.randn(4, 64))
    with pytest.raises(ValueError, match="must be uint8"):
        dequantize(blocks.int(), scales)
    with pytest.raises(ValueError, match=r"\[..., n_blocks, 16\]"):
        dequantize(blocks, scales[:, :1])
    with pytest.raises(ValueError, match="floating-point"):
        dequantize(blocks, scales, torch.int32)


def test_quantizing_in_slices_gives_the_same_bytes(monkeypatch):
    import horizon.quant.mxfp4 as mxfp4

    x = torch.randn(37, 100, generator=_gen(9))  # 100: four blocks, the last padded
    whole = quantize(x)
    monkeypatch.setattr(mxfp4, "_SLICE_ELEMENTS", 300)  # 2 rows (of 128 padded elements) a slice
    for got, want in zip(quantize(x), whole, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("shape", [(3, 0), (0, 64), (5,)])
def test_empty_and_short_shapes_round_trip(shape):
    x = torch.linspace(-6, 6, math.prod(shape)).reshape(shape)
    blocks, scales = quantize(x)
    assert blocks.shape == (*shape[:-1], -(-shape[-1] // 32), 16)
    assert torch.equal(dequantize(blocks, scales, size=shape[-1]), x)
