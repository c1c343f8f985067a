"""Tensor and expert parallelism: which slice of each weight a rank holds, and the modules' local sizes.

A `Layout` says how a model is spread over `tp` ranks (Megatron-style, as vLLM and SGLang shard these
layers):
- KDA: q/k/v, the decay and output-gate up-projections (f_b, g_b), b_proj (beta), A_log, dt_bias and the
  short-convolution channels split by head (column-parallel); the low-rank down-projections (f_a, g_a)
  and the per-head output norm replicated; o_proj row-parallel. The KDA state is sharded with its heads.
- Gated DSA: the latent down-projections (wq_a, wkv_a) and their norms replicated; wq_b (or wq), wkv_b
  and the gate up-projection split by head; wo row-parallel (its bias, when there is one, is added by
  rank 0 only). The lightning indexer is replicated, so its top-k is computed from identical inputs
  with identical weights on every rank; the latent + indexer-key cache is replicated too.
- MLPs (dense and shared experts): gate/up column-parallel, down row-parallel.
- Kimi K3's full-rank output gates (KDA g_proj, MLA gate) split by head like the heads they gate. A latent
  MoE's down-projection, norm and up-projection are replicated: the routed experts' partial sums are
  all-reduced in the latent (before the norm, which is not linear) and rank 0 adds the up-projected result.
- Attention residuals need nothing: they mix replicated, already-reduced sublayer outputs.
- Routed experts: tensor-parallel (each expert's hidden width split; `ep=False`) or expert-parallel
  (whole experts per rank, `ep=True`, vLLM's --enable-expert-parallel); the router is replicated, and a
  rank computes only the assignments to its own experts.
- Embedding, LM head and vision encoder replicated.
Each block then ends its attention and its MLP with one all-reduce (`Block.tp_reduce`), which also
carries the expert-parallel combine. Padded rows of a compiled batch pass through these sums like any
row; routing and load counting never see a rank-dependent input.

A weight's slice is a `Split(dim, pieces)`: along `dim` the full tensor is `pieces` equal segments (q|k|v
of the convolution, gate|up of an expert), each cut into `tp` parts, and rank r holds part r of every
segment. The same rule slices a full tensor (`shard_tensor`), reads a slice straight from a safetensors
file (`read_shard`, so no rank ever materialises the full model) and reassembles the full tensor from
every rank's part (`gather_state_dict`). MXFP4 tensors split on whole 32-value blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from horizon.config import ModelConfig
from horizon.model.dsa import GatedDSA
from horizon.model.kda import KimiDeltaAttention
from horizon.model.layers import MLP
from horizon.model.model import Block
from horizon.model.moe import Experts, MoE
from horizon.quant.int8 import Int8Linear
from horizon.quant.layers import MXFP4Experts, MXFP4Linear
from horizon.quant.mxfp4 import BLOCK as MXFP4_BLOCK


@dataclass(frozen=True)
class Split:
    dim: int
    pieces: int = 1


# A bias added after a row-parallel matmul: rank 0 holds it, the others zeros, so the all-reduce adds it once.
DRIVER_ONLY = "driver-only"


@dataclass(frozen=True)
class Layout:
    """tp ranks share every layer; this process is `rank`. ep: routed experts whole per rank."""

    tp: int = 1
    rank: int = 0
    ep: bool = False

    def __post_init__(self):
        if self.tp < 1 or not 0 <= self.rank < self.tp:
            raise ValueError(f"a layout needs tp >= 1 and 0 <= rank < tp, got tp={self.tp}, rank={self.rank}")

    @property
    def sharded(self) -> bool:
        return self.tp > 1

    def cache_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config a rank's decode cache is built from: KDA states hold this rank's heads only."""
        return cfg.replace(kda_num_heads=cfg.kda_num_heads // self.tp) if self.sharded else cfg

    def check(self, cfg: ModelConfig, mxfp4_experts: bool = False, mxfp4_attention: bool = False) -> None:
        """Every size the layout cuts must divide evenly (and MXFP4 on whole blocks): one error listing
        each that does not, raised before any weight is read."""
        tp, bad = self.tp, []

        def need(what: str, n: int, unit: int = 1) -> None:
            if n % (tp * unit):
                per = f" ({unit}-value MXFP4 blocks: {n // unit if n % unit == 0 else n / unit:g})" if unit > 1 else ""
                bad.append(f"{what}={n}{per}")

        if tp == 1:
            return
        need("kda_num_heads", cfg.kda_num_heads)
        need("num_heads", cfg.num_heads)
        need("intermediate_size", cfg.intermediate_size)
        if cfg.n_shared_experts:
            need("moe_intermediate_size * n_shared_experts", cfg.moe_intermediate_size * cfg.n_shared_experts)
        if self.ep:
            need("n_routed_experts", cfg.n_routed_experts)
        else:
            need("moe_intermediate_size", cfg.moe_intermediate_size, MXFP4_BLOCK if mxfp4_experts else 1)
        if mxfp4_attention:
            need("kda_num_heads * kda_head_dim (o_proj input)", cfg.kda_num_heads * cfg.kda_head_dim, MXFP4_BLOCK)
            need("num_heads * v_head_dim (wo input)", cfg.num_heads * cfg.v_head_dim, MXFP4_BLOCK)
        if bad:
            experts_too_narrow = any(b.startswith("moe_intermediate_size=") for b in bad)
            hint = (" (or spread whole experts: --enable-expert-parallel)"
                    if experts_too_narrow and cfg.n_routed_experts % tp == 0 else "")
            raise ValueError(f"--tensor-parallel-size {tp} must divide every sharded size, and does not divide: "
                             f"{', '.join(bad)}{hint}")


# --- which tensors split, and how ----------------------------------------------------------------------
COLUMN = {KimiDeltaAttention: ("q_proj", "k_proj", "v_proj", "f_b_proj", "b_proj", "g_b_proj", "g_proj"),
          GatedDSA: ("wq_b", "wq", "wkv_b", "gate_b", "gate"), MLP: ("gate_proj", "up_proj")}
ROW = {KimiDeltaAttention: ("o_proj",), GatedDSA: ("wo",), MLP: ("down_proj",)}
OWN = {KimiDeltaAttention: {"conv_weight": Split(0, 3), "A_log": Split(0), "dt_bias": Split(0)}}


def _linear_splits(linear: nn.Module, column: bool) -> dict[str, Split | str]:
    """A (possibly MXFP4) linear's tensors: output rows split (column-parallel) or input columns (row)."""
    if isinstance(linear, Int8Linear):
        raise ValueError("int8 dense weights are a load-time format applied after sharding; shard the "
                         "full-precision model, then quantize_dense_int8")
    names = ("weight_blocks", "weight_scales") if isinstance(linear, MXFP4Linear) else ("weight",)
    out: dict[str, Split | str] = {n: Split(0 if column else 1) for n in names}
    if linear.bias is not None:
        out["bias"] = Split(0) if column else DRIVER_ONLY
    return out


def _expert_splits(ep: bool, packed: bool) -> dict[str, Split]:
    suffixes = ("_blocks", "_scales") if packed else ("",)
    if ep:  # whole experts
        return {f"{w}{s}": Split(0) for w in ("gate_up_proj", "down_proj") for s in suffixes}
    # each expert's hidden width: gate | up rows of gate_up [E, 2f, d], columns (blocks) of down [E, d, f]
    return {**{f"gate_up_proj{s}": Split(1, 2) for s in suffixes}, **{f"down_proj{s}": Split(2) for s in suffixes}}


def module_splits(module: nn.Module, layout: Layout) -> dict[str, Split | str]:
    """The split tensors directly owned by `module` or its linear children (relative names)."""
    kind = type(module)
    if isinstance(module, (Experts, MXFP4Experts)):
        return _expert_splits(layout.ep, isinstance(module, MXFP4Experts))
    out: dict[str, Split | str] = dict(OWN.get(kind, {}))
    for column, table in ((True, COLUMN), (False, ROW)):
        for name in table.get(kind, ()):
            child = getattr(module, name, None)
            if child is not None:
                out.update({f"{name}.{k}": v for k, v in _linear_splits(child, column).items()})
    return out


def model_splits(model: nn.Module, layout: Layout) -> dict[str, Split | str]:
    """Every split tensor of the model by its state-dict name; what is not here is replicated."""
    out = {}
    for prefix, module in model.named_modules():
        for name, split in module_splits(module, layout).items():
            out[f"{prefix}.{name}" if prefix else name] = split
    return out


def _segments(size: int, split: Split, tp: int, rank: int) -> list[tuple[int, int]]:
    """(start, stop) along split.dim of rank's part of each segment."""
    seg = size // split.pieces
    part = seg // tp
    return [(p * seg + rank * part, p * seg + (rank + 1) * part) for p in range(split.pieces)]


def shard_tensor(t: torch.Tensor, split: Split | str, layout: Layout) -> torch.Tensor:
    """This rank's part of a full tensor."""
    if split == DRIVER_ONLY:
        return t.clone() if layout.rank == 0 else torch.zeros_like(t)
    size = t.shape[split.dim]
    if size % (split.pieces * layout.tp):
        raise ValueError(f"a dimension of size {size} cannot be cut into {split.pieces} x {layout.tp} equal parts")
    parts = [t.narrow(split.dim, a, b - a) for a, b in _segments(size, split, layout.tp, layout.rank)]
    return torch.cat(parts, split.dim).contiguous()


def read_shard(tensor_slice, shape: tuple[int, ...], split: Split | str, layout: Layout) -> torch.Tensor:
    """This rank's part read from a safetensors slice (`safe_open(...).get_slice(name)`): only those bytes."""
    if split == DRIVER_ONLY:
        full = tensor_slice[:]
        return full if layout.rank == 0 else torch.zeros_like(full)
    lead = (slice(None),) * split.dim
    parts = [tensor_slice[lead + (slice(a, b),)] for a, b in _segments(shape[split.dim], split, layout.tp,
                                                                      layout.rank)]
    return torch.cat(parts, split.dim).contiguous()


# --- a model's local form --------------------------------------------------------------------------------
def _set_tensor(module: nn.Module, name: str, value: torch.Tensor) -> None:
    if name in module._parameters:
        old = module._parameters[name]
        module._parameters[name] = nn.Parameter(value, requires_grad=old.requires_grad)
    else:
        module._buffers[name] = value


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (model.get_submodule(path) if path else model), leaf


def _resize_modules(model: nn.Module, layout: Layout) -> None:
    """Head counts, widths and expert ranges that follow the now-local tensors."""
    tp = layout.tp
    for module in model.modules():
        if isinstance(module, (KimiDeltaAttention, GatedDSA)):
            module.num_heads //= tp
        elif isinstance(module, (nn.Linear, MXFP4Linear)):
            w = module.weight if isinstance(module, nn.Linear) else None
            if w is not None:
                module.out_features, module.in_features = w.shape
            else:
                module.out_features = module.weight_blocks.shape[0]
                module.in_features = min(module.in_features, module.weight_blocks.shape[1] * MXFP4_BLOCK)
        elif isinstance(module, (Experts, MXFP4Experts)):
            if layout.ep:
                module.expert_range = (layout.rank * module.n_experts // tp, module.n_experts)
                module.n_experts //= tp
            elif isinstance(module, MXFP4Experts):
                module.hidden //= tp
        elif isinstance(module, Block):
            module.tp_reduce = True
        elif isinstance(module, MoE) and module.latent:
            module.latent_tp_rank = layout.rank


@torch.no_grad()
def shard_model(model: nn.Module, layout: Layout) -> nn.Module:
    """Cut, in place, a full model (real weights, or on the meta device for a loader to fill) to rank's
    part; returns it. The model remembers its layout (`model.layout`): the engine builds its cache from it."""
    if getattr(model, "layout", Layout()).sharded:
        raise ValueError("this model is already sharded")
    if layout.sharded:
        layout.check(model.config, mxfp4_experts=any(isinstance(m, MXFP4Experts) for m in model.modules()),
                     mxfp4_attention=any(isinstance(m, MXFP4Linear) for m in model.modules()))
        for name, split in model_splits(model, layout).items():
            module, leaf = _owner(model, name)
            _set_tensor(module, leaf, shard_tensor(getattr(module, leaf), split, layout))
        _resize_modules(model, layout)
        model.cache_config = layout.cache_config(model.config)
    model.layout = layout
    return model


@torch.no_grad()
def gather_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict, on every rank, from the ranks' parts (a collective: every rank calls it)."""
    layout: Layout = getattr(model, "layout", Layout())
    state = model.state_dict()
    if not layout.sharded:
        return state
    splits = model_splits(model, layout)
    out = {}
    for name, local in state.items():
        split = splits.get(name)
        if split is None:
            out[name] = local
            continue
        if split == DRIVER_ONLY:
            full = local.clone()
            dist.broadcast(full, src=0)
            out[name] = full
            continue
        parts = [torch.empty_like(local) for _ in range(layout.tp)]
        dist.all_gather(parts, local.contiguous())
        # each rank's part holds its share of every segment, in segment order
        per_rank = [p.chunk(split.pieces, split.dim) for p in parts]
        out[name] = torch.cat([torch.cat([r[s] for r in per_rank], split.dim) for s in range(split.pieces)],
                              split.dim)
    return out
