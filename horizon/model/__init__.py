"""The Horizon model: KDA and Gated DSA layers, the MoE, the decoder stack, its decode cache and per-call
forward options."""

from horizon.model.batch import Batch
from horizon.model.cache import HorizonCache
from horizon.model.model import HorizonForCausalLM
from horizon.model.moe import balance_moe_bias
from horizon.model.options import ForwardOptions

__all__ = ["Batch", "ForwardOptions", "HorizonCache", "HorizonForCausalLM", "balance_moe_bias"]
