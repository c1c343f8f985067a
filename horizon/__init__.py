"""Horizon: hybrid KDA + Gated DSA sparse Mixture-of-Experts language models for long-horizon agents.

    import horizon
    model = horizon.HorizonForCausalLM(horizon.ModelConfig.preset("tiny"))
    horizon.save(model, "ckpt/"); model = horizon.load("ckpt/")

Heavy pieces (torch, the model) are imported on first use, so `import horizon.chat` stays light.
"""

from horizon.config import ModelConfig

__version__ = "0.1.0"
__all__ = ["HorizonForCausalLM", "ModelConfig", "__version__", "load", "save"]

_LAZY = {"HorizonForCausalLM": "horizon.model", "load": "horizon.checkpoint", "save": "horizon.checkpoint"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'horizon' has no attribute {name!r}")
