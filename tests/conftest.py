"""Shared test helpers: the tiny config, seeded models, and a tensor-memory tracker."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from horizon import ModelConfig
from horizon.model import HorizonForCausalLM

torch.set_num_threads(2)


def rows_matmul_calls(fn) -> tuple[object, int]:
    """(fn(), how many horizon_kernels::rows_matmul calls it made), counted by the profiler, so calls from
    inside compiled graphs count too."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, sum(e.count for e in prof.key_averages() if e.key == "horizon_kernels::rows_matmul")


# Kimi K3's pieces on tiny's shapes: attention residuals, SiTU, K3's KDA decay and full-rank gates, plain gated
# MLA (no indexer), a latent MoE without routing groups; experts 64 wide (two MXFP4 blocks: TP=2 splits them)
K3_PIECES = dict(hidden_act="situ", attn_res_block_size=2, kda_gate_lower_bound=-5.0, kda_gate_full_rank=True,
                 dsa_gate_rank=0, dsa_gate_full_rank=True, index_n_heads=0, moe_latent_size=32, moe_latent_norm=True,
                 n_group=1, topk_group=1, moe_intermediate_size=64, vision_layers=0)


def tiny(**changes) -> ModelConfig:
    return ModelConfig.preset("tiny").replace(**changes)


def tiny_model(seed: int = 0, **changes) -> HorizonForCausalLM:
    torch.manual_seed(seed)
    return HorizonForCausalLM(tiny(**changes)).eval()


@pytest.fixture
def model() -> HorizonForCausalLM:
    return tiny_model()


class TensorMemory(TorchDispatchMode):
    """Tracks tensors created inside the block: the peak of live bytes and the largest single tensor.

    Each new storage is counted when an op first returns it and uncounted when that tensor object
    is freed; in-place results and views of a counted storage are not counted again.
    """

    def __init__(self):
        super().__init__()
        self.live = self.peak = self.largest = 0
        self._counted: dict[int, int] = {}

    def _free(self, key: int) -> None:
        self.live -= self._counted.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                key, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
                if size and key not in self._counted:
                    self._counted[key] = size
                    self.live += size
                    self.peak = max(self.peak, self.live)
                    self.largest = max(self.largest, size)
                    weakref.finalize(t, self._free, key)
        return out
