"""MXFP4 modules that keep the packed bytes resident, and the swaps that put them into a model.

- `MXFP4Experts` replaces `horizon.model.moe.Experts` (same `forward(x, weights, idx)` and
  `expert(e, x)`): the stacked gate_up_proj [E, 2f, d] and down_proj [E, d, f] are held as
  `<name>_blocks` uint8 [E, rows, ceil(cols/32), 16] and `<name>_scales` uint8 [E, rows, ceil(cols/32)]
  (transformers' gpt-oss naming). Compute goes through the fused kernel `horizon::mxfp4_expert_matmul`
  (horizon.quant.kernels), which decodes the packed bytes in registers, so the weights are never
  expanded; where the kernel is unavailable an expert is dequantised into the activation dtype only when
  a step routes tokens to it, one expert at a time, so no full-precision copy of all experts ever exists.
  `forward` is Experts' eager dispatch (a host sync for the counts); `sync_free` is the same MoE
  output as two kernel calls with no host sync, for compiled graphs.
- `MXFP4Linear` does the same for one `nn.Linear` (`weight_blocks` / `weight_scales`, bias kept as is).
- `quantize_model(model)` swaps every `Experts` in place for its MXFP4 form (and, with attention=True,
  the attention projections in `ATTENTION_PROJECTIONS`); `empty_quantized_model(model)` swaps in
  zero-filled modules of the right shapes (also on the meta device) for a checkpoint loader to fill.

Never quantised (docs/design.md §2): embeddings, norms, the router, every gate, the LM head (and the vision
encoder, which runs once per image).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from horizon.model.dsa import GatedDSA
from horizon.model.kda import KimiDeltaAttention
from horizon.model.layers import GLU, SWIGLU
from horizon.model.moe import Experts, expert_loads, local_assignments
from horizon.quant.kernels import mxfp4_kernel_runs_on, mxfp4_matmul, round_activations
from horizon.quant.mxfp4 import BLOCK, BLOCK_BYTES, dequantize, quantize

log = logging.getLogger(__name__)

# The attention projections `quantize_model(attention=True)` stores as MXFP4: the big q/k/v/output
# matrices. Left in full precision: KDA's f_a/f_b (the decay, its forget gate), b_proj (beta) and
# g_a/g_b (output gate); DSA's gate_a/gate_b (output gate) and the lightning indexer (it chooses the
# attended tokens, as the router chooses experts), besides the convolution, norms and scalars.
ATTENTION_PROJECTIONS: dict[type[nn.Module], tuple[str, ...]] = {
    KimiDeltaAttention: ("q_proj", "k_proj", "v_proj", "o_proj"),
    GatedDSA: ("wq_a", "wq_b", "wq", "wkv_a", "wkv_b", "wo"),
}


def _packed_buffers(module: nn.Module, name: str, lead: tuple[int, ...], cols: int, device) -> None:
    """Register zero-filled `<name>_blocks` / `<name>_scales` for a [*lead, cols] matrix stack."""
    nb = -(-cols // BLOCK)
    module.register_buffer(f"{name}_blocks", torch.zeros(*lead, nb, BLOCK_BYTES, dtype=torch.uint8, device=device))
    module.register_buffer(f"{name}_scales", torch.zeros(*lead, nb, dtype=torch.uint8, device=device))


def _rounded(x: torch.Tensor, int8_activations: bool) -> torch.Tensor:
    """x as the kernel takes it, for the dequantising path: rounded to int8 with int8_activations."""
    return round_activations(x) if int8_activations else x


def _quantized(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if weight.device.type == "meta":
        raise ValueError("quantize_model needs real weights, got a model on the meta device; "
                         "use empty_quantized_model to prepare one for loading packed weights")
    return quantize(weight.detach())


class MXFP4Experts(nn.Module):
    """E SwiGLU experts in MXFP4: gate_up_proj [E, 2f, d] and down_proj [E, d, f] as packed bytes.

    `int8_activations = True` (on an instance; `set_int8_activations(model)` for a whole model) rounds the
    experts' inputs to int8 per 32-wide block before the kernel multiplies them (horizon.quant.kernels.
    quantize_activations): an opt-in speed mode, not exact.
    """

    int8_activations: bool = False

    def __init__(self, n_experts: int, dim: int, hidden: int, device=None, act: GLU = SWIGLU):
        super().__init__()
        self.n_experts, self.dim, self.hidden, self.act = n_experts, dim, hidden, act
        self.expert_range: tuple[int, int] | None = None  # (first, total) under expert parallelism
        _packed_buffers(self, "gate_up_proj", (n_experts, 2 * hidden), dim, device)
        _packed_buffers(self, "down_proj", (n_experts, dim), hidden, device)

    @classmethod
    def empty_like(cls, experts: Experts) -> MXFP4Experts:
        E, d, f = experts.down_proj.shape
        return cls(E, d, f, device=experts.down_proj.device, act=experts.act)

    @classmethod
    @torch.no_grad()
    def from_experts(cls, experts: Experts) -> MXFP4Experts:
        new = cls.empty_like(experts)
        new.gate_up_proj_blocks, new.gate_up_proj_scales = _quantized(experts.gate_up_proj)
        new.down_proj_blocks, new.down_proj_scales = _quantized(experts.down_proj)
        return new

    def weight(self, name: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e's `name` matrix ("gate_up_proj" [2f, d] or "down_proj" [d, f]) dequantised to dtype."""
        cols = self.dim if name == "gate_up_proj" else self.hidden
        return dequantize(getattr(self, f"{name}_blocks")[e], getattr(self, f"{name}_scales")[e], dtype, cols)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        q8 = self.int8_activations
        if mxfp4_kernel_runs_on(x.device):
            # the kernel on expert e's slice (a view, ids all 0): the packed bytes are decoded in registers
            zeros = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
            gate, up = mxfp4_matmul(x, self.gate_up_proj_blocks[e:e + 1], self.gate_up_proj_scales[e:e + 1],
                                    zeros, q8).to(x.dtype).chunk(2, dim=-1)
            # rounded to x.dtype between the matmuls, as F.linear in that dtype rounds its output
            return mxfp4_matmul(self.act(gate, up), self.down_proj_blocks[e:e + 1], self.down_proj_scales[e:e + 1],
                                zeros, q8).to(x.dtype)
        gate, up = F.linear(_rounded(x, q8), self.weight("gate_up_proj", e, x.dtype)).chunk(2, dim=-1)
        return F.linear(_rounded(self.act(gate, up), q8), self.weight("down_proj", e, x.dtype))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts.forward's contract. Where the fused kernel runs (the CPU kernel; Triton on CUDA) an eager call
        is `sync_free` too: one kernel call per product over every routed row, which the kernel groups by expert
        itself, instead of Experts' loop (a host sync, then a gather and two kernel calls per routed expert).
        `python bench/mxfp4.py --eager-experts` (`small`, fp32, 2 CPU threads): eager decode steps 1.14x faster
        at 1 sequence (21.0 -> 18.5 ms), 1.34x at 16 (71.7 -> 53.7 ms), a 512-token prefill the same (820 ms);
        on CUDA the loop launched a grouping and two kernels per routed expert (an eager 16-sequence step took
        639 ms on an H100). Elsewhere Experts' loop, with expert(e, x) dequantising (the reference); experts
        nobody routes to are never read either way."""
        if torch.compiler.is_compiling() or not mxfp4_kernel_runs_on(x.device):
            return Experts.forward(self, x, weights, idx)
        if not self.training:  # the loads are counted in training only (MoE.load); bincount syncs on CUDA
            return self.sync_free(x, weights, idx), None
        return self.sync_free(x, weights, idx), expert_loads(self, idx)

    def sync_free(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """x [N, d], weights / idx [N, k] -> sum_k weight * expert(x) [N, d] in x's dtype, with no host sync.

        Two calls of the fused op over all N*k assignments (it groups rows by expert inside, so each
        routed expert is decoded once): the form torch.compile traces without a graph break. The kernel
        takes fp32 rows (bf16 converts exactly) and each product is rounded to x's dtype, as `expert` and a
        dense model in that dtype round (a bf16 model's MXFP4 experts equal its dense experts with the
        weights rounded to MXFP4, up to the order of the sum over a token's k experts). No token counts:
        `forward` adds them.
        """
        n, k = idx.shape
        weights, idx = local_assignments(self, weights, idx)
        xs = x.float().repeat_interleave(k, dim=0)  # row j*k + i is token j for its i-th expert
        flat = idx.flatten().clamp(max=self.n_experts - 1)  # another rank's experts: any one, weight 0
        q8 = self.int8_activations
        h = mxfp4_matmul(xs, self.gate_up_proj_blocks, self.gate_up_proj_scales, flat, q8)  # [N*k, 2f]
        gate, up = h.to(x.dtype).chunk(2, dim=-1)
        y = mxfp4_matmul(self.act(gate, up).float(), self.down_proj_blocks, self.down_proj_scales, flat, q8)
        y = y.to(x.dtype)  # [N*k, d]
        return (y.view(n, k, -1) * weights[..., None].to(y.dtype)).sum(1)


    def extra_repr(self) -> str:
        return f"n_experts={self.n_experts}, dim={self.dim}, hidden={self.hidden}, mxfp4"


class PackedLinear(nn.Module):
    """What the packed stand-ins for nn.Linear share (MXFP4Linear here, horizon.quant.int8.Int8Linear):
    built with nn.Linear's shape, filled by the subclass's `_pack(weight)`, the bias kept as it was."""

    @classmethod
    def empty_like(cls, linear: nn.Linear):
        w = linear.weight
        return cls(linear.in_features, linear.out_features, linear.bias is not None, w.device, w.dtype)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear):
        new = cls.empty_like(linear)
        new._pack(linear.weight.detach())
        if linear.bias is not None:
            new.bias = linear.bias
        return new

    def _pack(self, weight: torch.Tensor) -> None:
        raise NotImplementedError


class MXFP4Linear(PackedLinear):
    """y = x W^T + b with W [out, in] held as MXFP4 (`weight_blocks`, `weight_scales`); b stays as it was.
    `int8_activations` as in MXFP4Experts."""

    int8_activations: bool = False

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        _packed_buffers(self, "weight", (out_features,), in_features, device)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)  # as nn.Linear: `bias` exists and is None

    def _pack(self, weight: torch.Tensor) -> None:
        self.weight_blocks, self.weight_scales = _quantized(weight)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised matrix [out, in] in fp32, for code that reads `.weight` itself (DSA's absorbed
        attention splits wkv_b per head); materialised on every access."""
        return dequantize(self.weight_blocks, self.weight_scales, torch.float32, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if mxfp4_kernel_runs_on(x.device):
            # the fused kernel with one "expert": the matrix is never expanded
            rows = x.reshape(-1, x.shape[-1])
            zeros = torch.zeros(rows.shape[0], dtype=torch.long, device=x.device)
            y = mxfp4_matmul(rows, self.weight_blocks[None], self.weight_scales[None], zeros, self.int8_activations)
            y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        w = dequantize(self.weight_blocks, self.weight_scales, x.dtype, self.in_features)
        return F.linear(_rounded(x, self.int8_activations), w, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}, mxfp4"


def _eligible_linear(parent: nn.Module, name: str, child: nn.Module) -> bool:
    return isinstance(child, nn.Linear) and name in ATTENTION_PROJECTIONS.get(type(parent), ())


@torch.no_grad()
def _swap(model: nn.Module, attention: bool, empty: bool) -> nn.Module:
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Experts):
                new = MXFP4Experts.empty_like(child) if empty else MXFP4Experts.from_experts(child)
            elif attention and _eligible_linear(parent, name, child):
                new = MXFP4Linear.empty_like(child) if empty else MXFP4Linear.from_linear(child)
            else:
                continue
            setattr(parent, name, new)  # the full-precision module goes (and is freed unless held elsewhere)
    return model


def quantize_model(model: nn.Module, attention: bool = False) -> nn.Module:
    """Replace, in place, every routed-experts module (and with attention=True the projections in
    ATTENTION_PROJECTIONS) by its MXFP4 form built from its weights; returns the model."""
    return _swap(model, attention, empty=False)


def empty_quantized_model(model: nn.Module, attention: bool = False) -> nn.Module:
    """As quantize_model, but the MXFP4 modules are zero-filled (on each replaced module's device, the
    meta device included) and the weights are not read: the form a checkpoint loader fills."""
    return _swap(model, attention, empty=True)


def set_int8_activations(model: nn.Module, on: bool = True) -> int:
    """Switch every MXFP4 module of `model` (experts and linears) to int8 activations (or back); returns how
    many there are. A load-time choice (`horizon.load(..., mxfp4_activations="int8")`, `horizon serve
    --mxfp4-activations int8`): set it before a compiled graph is built, which bakes it in."""
    from horizon.quant import kernels

    modules = [m for m in model.modules() if isinstance(m, (MXFP4Experts, MXFP4Linear))]
    for m in modules:
        m.int8_activations = on
    if on and modules and kernels.int8_path() == "portable":
        # the kernel has AVX-512 VNNI and AVX2 paths for them; elsewhere its portable C++ runs, which
        # bench/mxfp4.py --kernel measured 6-15x slower than fp32 activations (a Zen 3 EPYC, 2 threads)
        log.warning("int8 activations for the MXFP4 layers: this CPU has neither AVX-512 VNNI nor AVX2, so they "
                    "run the kernel's portable path, several times slower than the default fp32 activations")
    return len(modules)


def canonical_name(name: str) -> str:
    """A state-dict name in Horizon's MXFP4 naming: gpt-oss's original `<name>.blocks` / `<name>.scales`
    become `<name>_blocks` / `<name>_scales` (transformers' layout, the one Horizon writes); others pass."""
    for suffix in ("blocks", "scales"):
        if name.endswith("." + suffix):
            return f"{name[: -len(suffix) - 1]}_{suffix}"
    return name


def canonical_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict with every name through `canonical_name`; a tensor stored under both namings is an error."""
    out, source = {}, {}
    for key, tensor in state_dict.items():
        name = canonical_name(key)
        if name in out:
            raise ValueError(f"{key!r} and {source[name]!r} both name {name!r}; keep one naming")
        out[name], source[name] = tensor, key
    return out
