"""Loading other model families' Hugging Face checkpoints onto the one Horizon model.

Each family is a module with two functions, used by `horizon.load`:

    config_from_hf(raw: dict) -> ModelConfig
        translate the family's config.json into Horizon config options (no model forks);
    convert_tensors(store: TensorStore, config: ModelConfig) -> Iterator[(name, tensor, source file)]
        yield Horizon state-dict tensors from the folder's tensors (renamed, split, dequantised), or
        (name, tensor, source file, index) to fill part `index` of a tensor (one expert of a stack);
    quantization(raw: dict) -> str | None   (optional)
        "mxfp4" where the family's routed experts stay packed (the model is built with MXFP4 experts).
    READS_RANK_PARTS = True   (optional)
        convert_tensors also takes layout= and splits= and reads only a tensor / expert-parallel rank's
        part itself; otherwise `load` reads each tensor whole and cuts it.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

FAMILIES = {
    "kimi_k3": "horizon.interop.kimi_k3",  # Kimi K3 as released: the model Horizon implements
    "kimi_linear": "horizon.interop.kimi_linear",  # KDA + MLA + MoE: the previous generation
    "deepseek_v32": "horizon.interop.deepseek_v32",  # MLA + DSA indexer + MoE
}


def family(model_type: str | None, source: str | Path) -> ModuleType:
    if model_type not in FAMILIES:
        raise ValueError(f"{source}: model_type {model_type!r} is not supported; "
                         f"supported: horizon, {', '.join(FAMILIES)}")
    return importlib.import_module(FAMILIES[model_type])
