"""Horizon: hybrid KDA + Gated DSA sparse Mixture-of-Experts language models for long-horizon agents."""

from horizon.config import ModelConfig

__version__ = "0.1.0"
__all__ = ["ModelConfig", "__version__"]
