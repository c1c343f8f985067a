"""Quantised weights: the MXFP4 format (`horizon.quant.mxfp4`) and the modules that compute from it
(docs/design.md §2)."""

from horizon.quant.layers import (
    ATTENTION_PROJECTIONS,
    MXFP4Experts,
    MXFP4Linear,
    canonical_name,
    canonical_state_dict,
    empty_quantized_model,
    quantize_model,
)
from horizon.quant.mxfp4 import dequantize, quantize

__all__ = [
    "ATTENTION_PROJECTIONS", "MXFP4Experts", "MXFP4Linear", "canonical_name", "canonical_state_dict",
    "dequantize", "empty_quantized_model", "quantize", "quantize_model",
]
