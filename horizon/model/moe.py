"""DeepSeek-V3-style Mixture of Experts with auxiliary-loss-free balancing (docs/design.md §1.3).

Router: s = sigmoid(x W_r) in fp32; experts are chosen by top-k of s + b, where b is a per-expert
bias that is not a gradient parameter; optionally only inside the best `topk_group` of `n_group`
groups (groups ranked by the sum of their two best s + b). Gate weights are the chosen s (without
b), normalised to sum 1, times `routed_scaling_factor`. Shared experts see every token.

Balancing: after each optimiser step the trainer calls `balance_moe_bias(model, gamma)`, which
moves each bias by gamma * sign(mean load - load) (centred, so the biases do not drift), using
the token loads counted since the previous call (all-reduced when torch.distributed is running).

Dispatch sorts the (token, expert) assignments by expert and runs one matmul per expert that has
tokens: a loop over experts, never over tokens. That loop needs the counts on the host (one sync a
layer), so inside a compiled graph (horizon.engine.runner's decode step) it runs as one opaque custom
op (`horizon::routed_experts`), which the trace does not enter. A compiled step avoids it where it can
(`Experts.sync_free`): the CPU kernels, a fused gather for few pairs, and on CUDA in bf16 (sm90+) one
grouped matmul whose group ends stay on the device (`grouped_experts`), so CUDA graphs capture it.

Experts are GLU MLPs with the model's activation (SwiGLU, or Kimi K3's SiTU: horizon.model.layers.GLU).
Latent MoE (Kimi K3, `moe_latent_size` > 0): the router reads the full hidden state, but the routed
experts run on z = latent_down_proj(x); their weighted sum is RMS-normed (`moe_latent_norm`) and
latent_up_proj maps it back to the hidden width. The shared experts stay on the full-width x.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from horizon.config import ModelConfig
from horizon.model.layers import GLU, MLP, SWIGLU, RMSNorm
from horizon.parallel.group import all_reduce


def glu_expert(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor, act: GLU = SWIGLU) -> torch.Tensor:
    """One GLU expert: gate_up [2f, d], down [d, f], x [n, d] -> [n, d]."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(act(gate, up), down)


def dispatch(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, n_experts: int,
             expert) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, d], weights / idx [N, k] -> (sum_k weight * expert(e, x) [N, d], tokens per expert [E]).

    Sorts the assignments by expert and calls `expert(e, rows)` once per expert that has tokens.
    Indices >= n_experts (another rank's experts, under expert parallelism: `local_assignments`) sort
    last and are skipped.
    """
    k = idx.shape[1]
    flat = idx.flatten()
    order = flat.argsort(stable=True)  # assignments grouped by expert
    counts = torch.bincount(flat, minlength=n_experts)[:n_experts]
    per_expert = counts.tolist()  # one host sync; a loop over experts, not tokens
    order = order[:sum(per_expert)]
    token = order // k
    xs = x[token]
    out = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(per_expert):
        if n:
            out[start:start + n] = expert(e, xs[start:start + n])
            start += n
    out = out * weights.flatten()[order, None].to(out.dtype)
    return torch.zeros_like(x).index_add_(0, token, out), counts


def local_assignments(experts: nn.Module, weights: torch.Tensor, idx: torch.Tensor):
    """Under expert parallelism (`experts.expert_range` = (first, total), set by horizon.parallel.shard)
    the router's choices in this rank's numbering: idx - first for its own experts, n_local (a sentinel
    `dispatch` skips) with weight 0 for the others. Without it, the choices as they are."""
    if experts.expert_range is None:
        return weights, idx
    local = idx - experts.expert_range[0]
    mine = (local >= 0) & (local < experts.n_experts)
    return weights * mine, torch.where(mine, local, experts.n_experts)


def expert_loads(experts: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """Tokens per expert [E] for the router's choices idx, over every expert (all ranks' under expert parallelism)."""
    total = experts.n_experts if experts.expert_range is None else experts.expert_range[1]
    return torch.bincount(idx.flatten(), minlength=total)


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, act: GLU = SWIGLU) -> torch.Tensor:
    """`dispatch` over stacked experts (gate_up [E, 2f, d], down [E, d, f]) with nothing read back to the host:
    the (token, expert) pairs sorted by expert on the device, each expert's rows one group of
    `torch._grouped_mm`, whose group ends are a device tensor. On CUDA in bf16 from compute capability 9.0
    that is one fused kernel, so a CUDA graph captures the step at any batch (`_grouped_mm_takes`); its
    fallback elsewhere (the CPU, on which the tests check this) loops over the groups on the host. idx may
    hold E (another rank's expert, weight 0): those pairs sort last, outside every group, and give zeros."""
    from horizon.quant.kernels import sort_by_expert  # here: horizon.quant's modules import this one

    N, k = idx.shape
    E = gate_up.shape[0]
    order, counts = sort_by_expert(idx.flatten(), E)  # pairs grouped by expert
    ends = counts[:E].cumsum(0, dtype=torch.int32)
    token = order // k
    gate, up = torch._grouped_mm(x[token], gate_up.transpose(1, 2), offs=ends).chunk(2, dim=-1)
    ys = torch._grouped_mm(act(gate, up), down.transpose(1, 2), offs=ends)  # rows past ends[-1]: undefined
    ys = torch.where((torch.arange(N * k, device=x.device) < ends[-1])[:, None], ys, 0)
    ys = ys * weights.flatten()[order, None].to(ys.dtype)
    return torch.zeros_like(x).index_add_(0, token, ys.to(x.dtype))


def _grouped_mm_takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `grouped_experts` runs without a host sync here: CUDA, bf16, compute capability >= 9.0 (where
    torch._grouped_mm has its fused kernel)."""
    return (x.device.type == "cuda" and x.dtype == w.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


@torch.library.custom_op("horizon::routed_experts", mutates_args=())
def routed_experts(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, act: str, beta: float, linear_beta: float) -> torch.Tensor:
    """`dispatch` over stacked experts as one opaque op: inside a compiled graph (horizon.engine.runner's
    decode step) its host sync (the counts) and its loop stay out of the trace, so the graph has no break.
    The loop is already the fastest CPU form (torch._grouped_mm visits all E groups). act, beta,
    linear_beta: the GLU activation's fields (a custom op takes plain values)."""
    glu = GLU(act, beta, linear_beta)
    return dispatch(x, weights, idx, gate_up.shape[0], lambda e, xs: glu_expert(gate_up[e], down[e], xs, glu))[0]


@routed_experts.register_fake
def _(x, weights, idx, gate_up, down, act, beta, linear_beta):
    return torch.empty_like(x)


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.n_experts = cfg.num_experts_per_tok, cfg.n_routed_experts
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.n_experts, cfg.hidden_size))
        # the selection bias b: a buffer (no gradient), kept in fp32 whatever the model dtype
        self.register_buffer("e_score_correction_bias", torch.zeros(self.n_experts, dtype=torch.float32))

    def _apply(self, fn, recurse=True):
        # model.to(bfloat16) must not round the bias (its updates are gamma-sized steps): after any
        # conversion it follows the weight's device and stays fp32
        bias = self.e_score_correction_bias
        super()._apply(fn, recurse)
        if self.e_score_correction_bias.dtype != torch.float32:  # a dtype cast: redo it from the fp32 original
            self.e_score_correction_bias = bias.to(self.e_score_correction_bias.device)
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, d] -> gate weights [N, k] (fp32) and expert indices [N, k]."""
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))  # s [N, E]
        idx = self.select(scores)
        weights = scores.gather(1, idx)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, idx

    def select(self, scores: torch.Tensor) -> torch.Tensor:
        """The experts of scores [N, E] (fp32): select_reference's, through the CPU kernel
        (horizon/quant/kernels/router.cpp: one pass a row where the reference's three torch.topk calls take
        ~0.8 ms for 512 rows of `small`) where it runs. The indices carry no gradient, so training takes it too."""
        from horizon.quant import kernels  # here: horizon.quant's modules import this package

        if kernels.kernels_run_on(scores.device):
            return torch.ops.horizon_kernels.grouped_topk(scores.detach(), self.e_score_correction_bias, self.top_k,
                                                          self.n_group, self.topk_group)
        return self.select_reference(scores)

    def select_reference(self, scores: torch.Tensor) -> torch.Tensor:
        """idx [N, k]: with choice = scores + bias, the top_k experts by choice (largest first) among the
        topk_group groups whose two largest choices sum highest (all experts when n_group is 1)."""
        choice = scores + self.e_score_correction_bias
        if self.n_group > 1:
            grouped = choice.view(-1, self.n_group, self.n_experts // self.n_group)
            group_score = grouped.topk(2, dim=-1).values.sum(-1)  # [N, G]
            keep = torch.zeros_like(group_score, dtype=torch.bool)
            keep.scatter_(1, group_score.topk(self.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).flatten(1)
        return choice.topk(self.top_k, dim=-1).indices


class Experts(nn.Module):
    """E GLU experts stored stacked: gate_up_proj [E, 2f, d], down_proj [E, d, f]; act: their activation."""

    def __init__(self, n_experts: int, dim: int, hidden: int, act: GLU = SWIGLU):
        super().__init__()
        self.n_experts, self.act = n_experts, act
        self.expert_range: tuple[int, int] | None = None  # (first, total) under expert parallelism
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, hidden))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return glu_expert(self.gate_up_proj[e], self.down_proj[e], x, self.act)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, d], weights / idx [N, k] -> (sum_k weight * expert(x) [N, d], tokens per expert [E] or None).

        Touches the weights only through `self.expert(e, x)`: MXFP4Experts (horizon.quant) reuses
        this dispatch. Inside a compiled graph the same computation runs as one opaque op (`sync_free`).
        """
        if torch.compiler.is_compiling():
            return self.sync_free(x, weights, idx), None
        if self.expert_range is None:
            return dispatch(x, weights, idx, self.n_experts, self.expert)
        y, _ = dispatch(x, *local_assignments(self, weights, idx), self.n_experts, self.expert)
        return y, expert_loads(self, idx)

    def sync_free(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """forward's sum with nothing read back to the host (for compiled graphs).

        On the CPU with the kernels built, horizon_kernels.rows_matmul: it groups the (token, expert) pairs by
        expert inside and reads each routed expert once, at about a one-row product's memory speed. It beat the
        fused form below at every batch size (engines of `small` in fp32 compiled each way in one process,
        alternating, a Xeon, 2 threads; ms a decode step): 17.2 -> 16.1 at 1 sequence, 33.6 -> 28.9 at 4,
        59.5 -> 45.3 at 8, 112.9 -> 73.5 at 16. Without it, few pairs (N * k <= 2E) each become a
        product-and-sum that indexes the expert's rows directly, which inductor fuses into one loop streaming
        the weights (no host sync, so CUDA graphs can hold it); it reads an expert once per pair, which is
        why it loses once pairs share experts. Past 2E pairs, on CUDA in bf16 (compute capability 9.0+) the
        grouped matmul (`grouped_experts`); on the CPU the opaque per-expert loop (`routed_experts`), whose host
        sync a CUDA graph could not capture, so other CUDA steps keep the per-pair form.
        """
        N, k = idx.shape
        weights, idx = local_assignments(self, weights, idx)
        rows_kernel = _rows_kernel_takes(x, self.gate_up_proj)
        if not rows_kernel and N * k > 2 * self.n_experts:  # these take the assignments as they are
            if _grouped_mm_takes(x, self.gate_up_proj):
                return grouped_experts(x, weights, idx, self.gate_up_proj, self.down_proj, self.act)
            if x.device.type != "cuda":  # its host sync: a CUDA graph cannot hold it (there the form below)
                return routed_experts(x, weights, idx, self.gate_up_proj, self.down_proj, self.act.kind,
                                      self.act.beta, self.act.linear_beta)
        flat = idx.flatten().clamp(max=self.n_experts - 1)  # another rank's experts: any row, weight 0
        xs = x.repeat_interleave(k, dim=0)  # row t * k + j: token t for its j-th expert
        if rows_kernel:
            rows_matmul = torch.ops.horizon_kernels.rows_matmul
            # rounded to x's dtype between the matmuls, as the eager loop's F.linear rounds its output
            gate, up = rows_matmul(xs, self.gate_up_proj, flat).to(x.dtype).chunk(2, dim=-1)
            out = rows_matmul(self.act(gate, up), self.down_proj, flat).to(x.dtype)
        else:
            gate, up = (xs[:, None, :] * self.gate_up_proj[flat]).sum(-1).chunk(2, dim=-1)
            out = (self.act(gate, up)[:, None, :] * self.down_proj[flat]).sum(-1)
        return (out.view(N, k, -1) * weights[..., None].to(out.dtype)).sum(1)


def _rows_kernel_takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether horizon_kernels.rows_matmul computes x against w here: fp32 or bf16 weights, where the CPU
    kernels run."""
    from horizon.quant import kernels  # here: horizon.quant's modules import this one

    return w.dtype in (torch.float32, torch.bfloat16) and kernels.kernels_run_on(x.device)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        act, d, latent = GLU.of(cfg), cfg.hidden_size, cfg.moe_latent_size
        self.gate = Router(cfg)
        self.latent = latent > 0
        if self.latent:  # K3's latent MoE: experts on z = W_down x, RMSNorm after the combine, W_up back
            self.latent_down_proj = nn.Linear(d, latent, bias=False)
            self.latent_norm = RMSNorm(latent, cfg.rms_norm_eps) if cfg.moe_latent_norm else None
            self.latent_up_proj = nn.Linear(latent, d, bias=False)
        self.experts = Experts(cfg.n_routed_experts, latent or d, cfg.moe_intermediate_size, act)
        self.shared_experts = (MLP(d, cfg.moe_intermediate_size * cfg.n_shared_experts, act)
                               if cfg.n_shared_experts else None)
        # set by horizon.parallel.shard for a latent MoE under tensor / expert parallelism: this rank's index.
        # The routed experts' partial sums are then completed (all-reduced) before the norm, which is not
        # linear; the norm and the replicated up-projection run on rank 0 only, the others add zeros, so the
        # block's one all-reduce adds the routed part once beside the shared experts' partial sums.
        self.latent_tp_rank: int | None = None
        # tokens routed to each expert since the last bias update (counted in training mode)
        # (int64: model.to(dtype) leaves integer buffers alone, so counts never round)
        self.register_buffer("load", torch.zeros(cfg.n_routed_experts, dtype=torch.long), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, idx = self.gate(x)
        y, counts = self.experts(self.latent_down_proj(x) if self.latent else x, weights, idx)
        if self.training and counts is not None:
            self.load += counts
        if self.latent:
            if self.latent_tp_rank is not None:
                y = all_reduce(y)
            if self.latent_tp_rank:  # not the driver: rank 0 adds the routed part
                y = x.new_zeros(x.shape)
            else:
                y = self.latent_up_proj(self.latent_norm(y) if self.latent_norm is not None else y)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y

    @torch.no_grad()
    def update_bias(self, gamma: float) -> None:
        """b += gamma * sign(mean_load - load), centred; then start counting afresh."""
        load = self.load.float()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(load)
        delta = gamma * torch.sign(load.mean() - load)
        self.gate.e_score_correction_bias += delta - delta.mean()
        self.load.zero_()


def balance_moe_bias(model: nn.Module, gamma: float = 1e-3) -> None:
    """The auxiliary-loss-free balancing step: call after every optimiser step."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.update_bias(gamma)
