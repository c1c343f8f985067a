"""The Horizon model: KDA and Gated DSA layers, the MoE, the decoder stack and its decode cache."""

from horizon.model.batch import Batch
from horizon.model.cache import HorizonCache
from horizon.model.model import HorizonForCausalLM
from horizon.model.moe import balance_moe_bias

__all__ = ["Batch", "HorizonCache", "HorizonForCausalLM", "balance_moe_bias"]
