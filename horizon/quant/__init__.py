"""Quantised weights: the MXFP4 format (`horizon.quant.mxfp4`), the fused kernel that computes from the
packed bytes (`horizon.quant.kernels`), and the modules built on them (docs/design.md §2)."""

from horizon.quant.int8 import Int8Linear, dequantize_int8, quantize_dense_int8, quantize_int8
from horizon.quant.kernels import kernel_available, mxfp4_expert_matmul, mxfp4_expert_matmul_reference
from horizon.quant.layers import (
    ATTENTION_PROJECTIONS,
    MXFP4Experts,
    MXFP4Linear,
    canonical_name,
    canonical_state_dict,
    empty_quantized_model,
    quantize_model,
    set_int8_activations,
)
from horizon.quant.mxfp4 import dequantize, quantize

__all__ = [
    "ATTENTION_PROJECTIONS", "MXFP4Experts", "MXFP4Linear", "canonical_name", "canonical_state_dict",
    "dequantize", "empty_quantized_model", "quantize", "quantize_model", "set_int8_activations",
    "Int8Linear", "dequantize_int8", "quantize_dense_int8", "quantize_int8",
    "kernel_available", "mxfp4_expert_matmul", "mxfp4_expert_matmul_reference",
]
