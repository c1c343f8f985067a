"""Horizon: hybrid KDA + Gated DSA sparse Mixture-of-Experts language models for long-horizon agents.

    import horizon
    model = horizon.HorizonForCausalLM(horizon.ModelConfig.preset("tiny"))
    horizon.save(model, "ckpt/"); model = horizon.load("ckpt/")

Heavy pieces (torch, the model) are imported on first use, so `import horizon.chat` stays light.
"""

import os
from pathlib import Path

from horizon.config import ModelConfig

# inductor's caches (the compiled decode graphs, docs/engine.md) default to ~/.cache/horizon/inductor, which
# outlives a reboot where torch's /tmp default may not. Set on `import horizon`, before anything imports
# torch._dynamo: that import writes torch's own default into this variable, and a default set after it is
# never read (the runner once set it when making a graph, and every cache went to /tmp).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache" / "horizon" / "inductor"))

__version__ = "0.1.0"
__all__ = ["HorizonForCausalLM", "ModelConfig", "__version__", "load", "save"]

_LAZY = {"HorizonForCausalLM": "horizon.model", "load": "horizon.checkpoint", "save": "horizon.checkpoint"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'horizon' has no attribute {name!r}")
