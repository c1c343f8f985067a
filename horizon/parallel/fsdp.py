"""FSDP2 data-parallel training: N ranks hold 1/N of every weight, gradient and AdamW moment each, and
together take exactly the step one process takes on the same batch (`horizon train` under torchrun).

Why FSDP2 (torch's `fully_shard`) and not a sharding of our own: training needs every weight whole only
for the layer being computed, which is what per-module all-gather / reduce-scatter gives; the forward and
backward code stay the single-process code. `shard_for_training` wraps the embedding, each transformer
Block and the vision encoder, then the root, on an explicit 1-D CPU mesh (gloo).

How N ranks equal one process (docs/parallel.md):
- every rank draws the same global batch from the same `Mixture` and keeps the rows `rank::world`
  (`rank_rows`), so the data stream and the sampler state do not depend on the world size;
- each rank divides its summed token loss by the GLOBAL target count (all-reduced), so the ranks' losses
  add up to the one-process loss; FSDP would then average the gradients over ranks, so its divide factor
  is set to 1 and the reduce-scatter sums them: the one-process gradient, sharded;
- every rank reduces the same gradients in the same order: when another rank's rows hold an image and
  this rank's none, it encodes one of theirs and uses none of it (trainer.Trainer.loss), so its vision
  encoder takes part with a zero gradient (a gradient that exists on one rank only would mismatch the
  reduce-scatter);
- clip_grad_norm_ on the sharded (DTensor) gradients computes the global norm;
- buffers are not sharded: the MoE balancing bias is replicated and stays identical because every rank
  applies the update from loads all-reduced over ranks (horizon.model.moe.MoE.update_bias).

Checkpoints keep the one-process layout: `gathered_model` rebuilds a plain HorizonForCausalLM from the
full weights (gathered with torch.distributed.checkpoint.state_dict, full_state_dict + cpu_offload) for
horizon.checkpoint.save, and `full_optimizer_state` gathers AdamW's moments by parameter name;
`load_optimizer_state` puts such full state back, each rank keeping its own shard. No
torch.distributed.checkpoint metadata, no pickles.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, distribute_tensor

from horizon.model.model import HorizonForCausalLM
from horizon.parallel.group import all_reduce, broadcast_object, rank, world_size
from horizon.quant.layers import MXFP4Experts, MXFP4Linear, empty_quantized_model


def shard_for_training(model: HorizonForCausalLM) -> HorizonForCausalLM:
    """Shard `model` in place over the running process group (horizon.parallel.group.init_group first);
    returns it. Rank 0's weights and buffers are broadcast first, as DDP does, so the shards come from one
    model even if the ranks built theirs differently. The trainer must be built after this (its AdamW
    holds the sharded parameters)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("FSDP training needs the process group: run under torchrun (init_group first)")
    if any(p.dtype not in (torch.float32, torch.float64, torch.bfloat16) for p in model.parameters()):
        raise ValueError("FSDP training needs floating-point weights; load MXFP4 / int8 checkpoints unquantised")
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            dist.broadcast(t.data, src=0)
    mesh = init_device_mesh("cpu", (world_size(),))
    # Units, chosen so that every rank runs the same collectives in the same order whatever its rows hold.
    # A unit reduce-scatters its gradients when the gradient of its inputs is complete (its inputs' autograd
    # hook), or at the end of the backward when its inputs need none; the image embeddings enter the root's
    # forward, so the root holds only what the backward reaches before them (the final norm, the LM head).
    # The embedding (token ids in) and the vision encoder are units of their own, reduced at the end.
    fully_shard(model.embed, mesh=mesh)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    if model.vision is not None:
        # gathered once per step and kept until the backward: a rank encodes as many images as its rows hold,
        # and re-gathering per image would all-gather a different number of times on each rank
        fully_shard(model.vision, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)
    # the trainer encodes images before the forward: through the root's hooks, so the root is set up first,
    # as FSDP requires
    register_fsdp_forward_method(model, "encode_images")
    # FSDP warns that the logits it returns may be a view (Batch.pad reshapes): in-place ops on them would skip
    # its backward hook; the trainer only reads them out of place
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # sum, do not average: each rank's loss is already divided by the global target count. A plain
            # SUM reduce-scatter: a custom factor otherwise becomes NCCL's PREMUL_SUM, which gloo lacks
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def rank_rows(items: list, rank: int, world: int) -> list:
    """This rank's share of a global batch: rows rank, rank + world, ... (every rank gets at least one row
    when len(items) >= world; the counts differ by at most one)."""
    return items[rank::world]


def check_same_on_every_rank(digest: str, what: str) -> None:
    """ValueError on every rank (not a hang on some) unless each rank's `digest` equals rank 0's."""
    differs = torch.tensor([float(broadcast_object(digest) != digest)])
    if all_reduce(differs).item():
        raise ValueError(f"{what} differs between the ranks: every rank must build the same one "
                         f"(the same files and seeds; with several nodes, the same --out and data on each)")


def replicated(t: torch.Tensor) -> torch.Tensor:
    """A value every rank holds whole (e.g. clip_grad_norm_'s total norm, a DTensor under FSDP) as a tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def gathered_model(model: HorizonForCausalLM, everywhere: bool = False) -> HorizonForCausalLM | None:
    """An unsharded plain copy of a sharded model, on CPU: on rank 0 (None on the others), or on every rank.
    Every rank must call it (it all-gathers). It shares nothing with `model`: horizon.checkpoint.save
    writes it and the engine decodes through it (an engine must never run FSDP modules: ranks that run
    different numbers of forwards wait on each other's all-gathers forever)."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=not everywhere))
    if not everywhere and rank() != 0:
        return None
    with torch.device("meta"):
        copy = HorizonForCausalLM(model.config, init=False)
    # a model trained from an MXFP4 checkpoint keeps its routed experts (and any MXFP4 projections) packed and
    # frozen, as replicated buffers: the copy takes the same modules
    kinds = {type(m) for m in model.modules()}
    if MXFP4Experts in kinds or MXFP4Linear in kinds:
        empty_quantized_model(copy, attention=MXFP4Linear in kinds)
    copy.load_state_dict(full, assign=True)
    if model.config.tie_word_embeddings:  # assign gave the two names two tensors
        copy.lm_head.weight = copy.embed.weight
    # the buffers a state dict leaves out (the MoE load counts) come from this rank, unsharded anyway
    persistent = set(full)
    for name, buf in model.named_buffers():
        if name not in persistent:
            owner, _, leaf = name.rpartition(".")
            copy.get_submodule(owner).register_buffer(leaf, buf.detach().clone(), persistent=False)
    copy.cache_config = model.cache_config
    return copy.train(model.training)


def copy_weights(model: HorizonForCausalLM, into: HorizonForCausalLM) -> None:
    """Copy a sharded model's full weights into `into`, an unsharded copy (gathered_model(everywhere=True))
    every rank holds, in place: an engine built over `into` keeps decoding the current weights (RL's
    rollouts after each update) without being rebuilt. Every rank must call it (it all-gathers)."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    with torch.no_grad():
        into.load_state_dict(full)


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """The optimizer's state by parameter name, unsharded, on rank 0 ({} on the others): what the same
    optimizer holds in one process. Every rank must call it."""
    if not optimizer.state:
        # before the first step there is nothing to gather (and the library would create a zero step)
        return {}
    osd = get_optimizer_state_dict(model, optimizer,
                                   options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return dict(osd.get("state", {}))


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                         state: dict[str, dict[str, Any]]) -> None:
    """Put full (unsharded) per-name optimizer state onto the sharded optimizer: every rank holds `state`
    (read from the checkpoint) and keeps its own shard of each tensor, cut as its parameter is; scalars
    (AdamW's step) stay plain. A parameter missing from `state` stays without state, as it was in the run
    that saved it (torch.distributed.checkpoint's set_optimizer_state_dict would start it at step 1)."""
    params = dict(model.named_parameters())
    unknown = set(state) - set(params)
    if unknown:
        raise ValueError(f"optimizer state for parameters the model does not have: {sorted(unknown)[:3]}")
    for name, entry in state.items():
        p = params[name]
        optimizer.state[p] = {
            key: (distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None)
                  if isinstance(p, DTensor) and value.dim() > 0 else value)
            for key, value in entry.items()}
