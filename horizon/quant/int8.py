"""Int8 weights for the dense projections: per-output-channel scales (the Q8_0 class), a load-time format.

    q, scale = quantize_int8(w)                  # w [out, in] float -> int8 [out, in], fp32 [out]
    w_hat = dequantize_int8(q, scale)            # q * scale[:, None]
    quantize_dense_int8(model)                   # every dense nn.Linear of the decoder -> Int8Linear
    horizon.load(path, dense="int8")             # the same, after loading (horizon serve --dense-weights int8)

Quantising, per output row r: scale_r = amax(|w_r|) / 127 and q = round(w / scale_r) (half to even, as
torch.round) clamped to [-127, 127]; -128 is never written, so the grid is symmetric. Edge cases, decided:
- an all-zero row gets scale 1.0 (any positive value decodes zeros to zeros; 1.0 keeps the scale finite
  and the row exact);
- NaN or +-Inf anywhere: ValueError naming how many and the first index (nothing is written);
- rounding error: |w - q * scale| <= scale / 2 elementwise (up to fp32 rounding), i.e. <= amax(|row|) / 254
  (0.39% of the row's largest magnitude); for Gaussian rows of 512 that is ~0.7% relative RMS.
1 byte per weight plus 4 per row: ~1/4 of fp32's bytes, ~1/2 of bf16's.

`Int8Linear` computes with the int8 matrix resident (the fp32 one is gone), on one of two fast paths:
- up to few_rows(torch.int8) (64) rows where the CPU kernels run (decode): `horizon_kernels.rows_matmul`
  (rows.cpp: each int8 weight row read once for all rows, widened exactly, x in fp32, fp32 sums; in a
  compiled graph one row is a multiply-and-sum inductor fuses into one loop over the int8 bytes). These
  give the reference's numbers (`F.linear` on the dequantised matrix) up to the fp32 summation order.
- otherwise (prefill, other devices): `aten._weight_int8pack_mm` on bf16 activations (measured for
  [1, 512] x [32768, 512]^T on 2 threads: fp32 F.linear ~7.4 ms, the op with fp32 input ~10 ms, with
  bf16 input ~0.8 ms). The activation is rounded to bf16 (relative error <= 2^-8 per element) and so
  is the op's output (<= 2^-8 per element). The op is given unit scales and the fp32 row scales are
  applied to its output in fp32, so the scales are never rounded to bf16 (that would add up to 2^-8 per
  row); bias is added in fp32 before the one final cast to the activation dtype. Against the reference
  the output differs by <~ 2^-7 * sum_k |x_k| |w_hat_rk| per element, ~0.2% relative RMS in practice,
  below int8's own ~0.7% weight error. At M >= ~256 rows the op is no faster than fp32 F.linear
  (measured on 2 threads): prefill pays some speed for the bytes.
So a token's logits differ between a decode step and a prefill by at most those bf16 roundings (a
compiled loop could not keep them anyway: inductor drops a cast to bf16 that is cast straight back).
Either fast path is used where `fast_kernel_available(device)` (a one-time probe per device type: the op
must exist, not raise NotImplementedError/RuntimeError, and give exact results on a small integer
product) and in_features is a multiple of 32 (on this CPU's op other widths read past the row: wrong
results or a crash, measured at in=8, 24, 33); otherwise, or with `reference=True`, the reference path
`F.linear(x, dequantize_int8(q, scale, x.dtype), bias)` runs, which materialises the matrix per call.

`quantize_dense_int8(model)` swaps in place every `nn.Linear` of the decoder: attention projections
(KDA q/k/v/o, f_a/f_b, g_a/g_b, b_proj; DSA wq_a/wq_b/wq/wkv_a/wkv_b/wo, gate_a/gate_b, the indexer's
wq/wk/weights_proj), the dense MLP, the shared experts and the LM head (unless tied to the embedding).
All of them, small ones included: they are a negligible share of bytes either way, and one rule
(every dense projection is int8) is easier to reason about than a size threshold. Untouched: the router
(not an nn.Linear), routed experts (stacked parameters or MXFP4), norms, embeddings, the vision encoder
(`model.vision`, runs once per image) and modules already quantised (MXFP4Linear, Int8Linear).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from horizon.quant.kernels import FUSED_ONE_ROW_MAX, few_rows, kernels_run_on, rows_matmul
from horizon.quant.layers import PackedLinear

INT8_MAX = 127
FAST_IN_MULTIPLE = 32  # in_features the fast kernel is trusted with (see the module docstring)
QUANTIZABLE = (torch.float32, torch.bfloat16, torch.float16)


@torch.no_grad()
def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] float -> (q int8 [out, in], scale fp32 [out]); symmetric per row, zero rows get scale 1."""
    if w.dtype not in QUANTIZABLE:
        raise ValueError(f"quantize_int8 takes a float32, bfloat16 or float16 matrix, got {w.dtype}")
    if w.dim() != 2:
        raise ValueError(f"quantize_int8 takes a matrix [out, in], got shape {list(w.shape)}")
    if w.device.type == "meta":
        raise ValueError("quantize_int8 needs real weights, got a tensor on the meta device")
    bad = ~torch.isfinite(w)
    if bool(bad.any()):
        first = [int(i) for i in bad.nonzero()[0]]
        raise ValueError(f"quantize_int8 got {int(bad.sum())} non-finite value(s) (NaN/Inf), the first at index "
                         f"{first}: int8 weights must be finite")
    x = w.float()
    amax = x.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(x / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q int8 [out, in], scale [out]) -> q * scale[:, None] in `dtype` (computed in fp32, rounded once)."""
    if q.dtype != torch.int8 or q.dim() != 2 or scale.shape != q.shape[:1]:
        raise ValueError(f"dequantize_int8 takes int8 [out, in] and scales [out], got {q.dtype} "
                         f"{list(q.shape)} and {list(scale.shape)}")
    return (q.float() * scale.float()[:, None]).to(dtype)


_FAST: dict[str, bool] = {}


def _probe(device_type: str) -> bool:
    try:
        # small integers: every product and sum is exact in bf16, so a correct kernel matches bit for bit
        x = (torch.arange(2 * FAST_IN_MULTIPLE, device=device_type) % 7 - 3).view(2, -1).to(torch.bfloat16)
        q = (torch.arange(3 * FAST_IN_MULTIPLE, device=device_type) % 5 - 2).view(3, -1).to(torch.int8)
        y = torch.ops.aten._weight_int8pack_mm(x, q, torch.ones(3, dtype=torch.bfloat16, device=device_type))
        return bool(torch.equal(y.float(), x.float() @ q.float().T))
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


@torch.compiler.assume_constant_result  # a compiled graph bakes in the answer instead of tracing the probe
def fast_kernel_available(device_type: str) -> bool:
    """Whether `aten._weight_int8pack_mm` runs, and is right, on this device type (probed once)."""
    if device_type not in _FAST:
        _FAST[device_type] = _probe(device_type)
    return _FAST[device_type]


def int8_linear_reference(x: torch.Tensor, weight_int8: torch.Tensor, weight_scale: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """The parity baseline: F.linear on the dequantised matrix in x's dtype (no bf16 rounding of x)."""
    return F.linear(x, dequantize_int8(weight_int8, weight_scale, x.dtype),
                    None if bias is None else bias.to(x.dtype))


class Int8Linear(PackedLinear):
    """y = x W^T + b with W [out, in] held as int8 `weight_int8` and fp32 `weight_scale` [out]; b kept as is.

    `reference = True` (on an instance, or per call) selects the dequantise-and-F.linear path; see the
    module docstring for the fast path's rounding.
    """

    reference: bool = False

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight_int8", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        # the fast op's scales: ones in bf16, made once (the fp32 scales are applied to its output instead);
        # not persistent: nothing to save
        self.register_buffer("_unit_scale", torch.ones(out_features, dtype=torch.bfloat16, device=device),
                             persistent=False)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)  # as nn.Linear: `bias` exists and is None

    def _apply(self, fn, recurse=True):
        # model.to(bfloat16) casts every floating buffer: the scales must stay fp32 (redone from the
        # original, not from a rounded copy) and the unit scales bf16 (ones are exact in any dtype)
        scale = self.weight_scale
        super()._apply(fn, recurse)
        if self.weight_scale.dtype != torch.float32:
            source = self.weight_scale if scale.device.type == "meta" else scale
            self.weight_scale = source.to(device=self.weight_scale.device, dtype=torch.float32)
        if self._unit_scale.dtype != torch.bfloat16:
            self._unit_scale = self._unit_scale.to(torch.bfloat16)
        return self

    def _pack(self, weight: torch.Tensor) -> None:
        self.weight_int8, self.weight_scale = quantize_int8(weight)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised matrix [out, in] in fp32, for code that reads `.weight` itself (DSA's absorbed
        attention splits wkv_b per head); materialised on every access."""
        return dequantize_int8(self.weight_int8, self.weight_scale, torch.float32)

    def uses_fast_path(self, device_type: str) -> bool:
        """Whether forward on inputs of this device type ("cpu", "cuda", ...) takes the int8 kernel."""
        return self.in_features % FAST_IN_MULTIPLE == 0 and fast_kernel_available(device_type)

    def forward(self, x: torch.Tensor, reference: bool | None = None) -> torch.Tensor:
        if (self.reference if reference is None else reference) or not self.uses_fast_path(x.device.type):
            return int8_linear_reference(x, self.weight_int8, self.weight_scale, self.bias)
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] == 1 and torch.compiler.is_compiling() and \
                max(self.in_features, self.out_features) <= FUSED_ONE_ROW_MAX:
            # one row in a compiled graph (a batch-1 decode step): a multiply-and-sum inductor fuses into one
            # loop reading the int8 bytes directly (_weight_int8pack_mm is an opaque call there); in fp32, so
            # the reference's numbers up to summation order. A larger weight (the LM head) streams faster
            # through rows_matmul, below
            y = (rows.float()[:, None, :] * self.weight_int8).sum(-1)
        elif rows.shape[0] <= few_rows(torch.int8) and kernels_run_on(rows.device):
            # a few rows (decode): each int8 weight row read once for all of them, x in fp32 (rows.cpp)
            y = rows_matmul(rows, self.weight_int8)
        else:
            y = torch.ops.aten._weight_int8pack_mm(rows.to(torch.bfloat16).contiguous(), self.weight_int8,
                                                   self._unit_scale)
        y = y * self.weight_scale  # -> fp32: the scales at full precision (the op's output is bf16)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}, int8"


@torch.no_grad()
def quantize_dense_int8(model: nn.Module) -> nn.Module:
    """Replace, in place, every nn.Linear of the decoder by an Int8Linear built from its weights (the LM
    head too unless `config.tie_word_embeddings`; never the vision encoder); returns the model."""
    vision = getattr(model, "vision", None)
    skip = {id(m) for m in vision.modules()} if isinstance(vision, nn.Module) else set()
    config = getattr(model, "config", None)
    if getattr(config, "tie_word_embeddings", False):
        skip.add(id(getattr(model, "lm_head", None)))  # it is the embedding table
    for parent in list(model.modules()):
        if id(parent) in skip:
            continue
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and id(child) not in skip:
                setattr(parent, name, Int8Linear.from_linear(child))  # the fp32 module is freed
    return model
