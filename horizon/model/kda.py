"""Kimi Delta Attention (KDA): delta-rule linear attention with channel-wise decay (docs/design.md §1.1).

Per head the state S is a d_k x d_v matrix (fp32). For token t:

    S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T q_t                       (q scaled by d_k^-1/2)

Two computations of the same thing:
- `kda_recurrent`: the formula token by token (decode, and the reference);
- `kda_chunkwise_reference`: chunks of C tokens; inside a chunk the UT transform turns the recurrence
  into a lower-triangular solve, and only the state crosses chunk boundaries (training / prefill).
Where the CPU kernels run (horizon/quant/kernels/kda.cpp), `kda_chunkwise` (prefill) and `kda_decode`
(a decode step on the cached states in place) go through them, the two above as their references.

Shapes: q, k [B, T, H, K]; v [B, T, H, V]; g (log alpha) [B, T, H, K]; beta [B, T, H];
state [B, H, K, V]. A position with beta = 0 and g = 0 leaves the state unchanged exactly; padded
positions are set so, which makes a padded batch carry each sequence's state through its padding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from horizon.config import ModelConfig
from horizon.model.batch import Batch
from horizon.model.layers import gated_rms_norm, l2_normalize


def kda_recurrent(q, k, v, g, beta, scale: float | None = None, initial_state=None):
    """Reference: the recurrence one token at a time. Returns (o [B, T, H, V], final state)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float().clone()
    o = q.new_empty(B, T, H, V)
    for t in range(T):
        S = S * g[:, t].exp()[..., None]  # Diag(alpha_t) S
        predicted = torch.einsum("bhk,bhkv->bhv", k[:, t], S)  # what the state already says about k_t
        S = S + torch.einsum("bhk,bhv->bhkv", beta[:, t, :, None] * k[:, t], v[:, t] - predicted)
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S)
    return o, S


def _needs_grad(*tensors) -> bool:
    """Whether autograd records an op on these (None entries ignored): the kernels have no backward."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def kda_decode_reference(state, slots, q, k, v, g, beta, scale: float | None = None) -> torch.Tensor:
    """One token per sequence against cached states, updated in place: o [B, H, V] from q, k, g [B, H, K],
    v [B, H, V], beta [B, H] and state [slots, H, K, V] (fp32), sequence b at row slots[b]. It gathers the
    states, runs `kda_recurrent` and scatters them back: the reference of the kernel in `kda_decode`. Real
    sequences have distinct slots; rows that share one (padding, g = beta = 0) leave it unchanged."""
    o, new = kda_recurrent(*(t[:, None] for t in (q, k, v, g, beta)), scale=scale, initial_state=state[slots])
    state[slots] = new
    return o[:, 0]


def kda_decode(state, slots, q, k, v, g, beta, scale: float | None = None, force_portable: bool = False):
    """kda_decode_reference's result and state update, done where the states lie when the CPU kernels run
    (horizon/quant/kernels/kda.cpp: each state read and written once, where a compiled PyTorch step gathers
    them, passes over them and scatters them back; 16 sequences x 8 heads of 64 x 64: 66 against ~390 us).
    Called straight through the dispatcher, eagerly and in compiled graphs (the op declares that it writes
    `state`). Anything else takes the reference: off the CPU, kernels not built, a non-fp32 cache, or inputs
    that need a gradient (the op has no backward)."""
    from horizon.quant import kernels  # here: horizon.quant's modules import this package

    if (not _needs_grad(state, q, k, v, g, beta) and state.dtype == torch.float32 and state.is_contiguous()
            and kernels.kernels_run_on(state.device)):
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return torch.ops.horizon_kernels.kda_decode_(state, slots, q.float(), k.float(), v.float(), g.float().exp(),
                                                     beta.float(), scale, force_portable)
    return kda_decode_reference(state, slots, q, k, v, g, beta, scale)


def decayed_scores(a: torch.Tensor, b: torch.Tensor, G: torch.Tensor, sub: int = 8) -> torch.Tensor:
    """M[m, i, j] = sum_d a[m]_i[d] b_j[d] exp(G_i[d] - G_j[d]) for j <= i, 0 above the diagonal.

    a [M, ..., C, K] (M left operands sharing one decay), b and G [..., C, K] with G
    non-increasing along C (a cumulative log-decay). Computed on
    sub-chunks of `sub` rows so no [C, C, K] tensor is formed: diagonal blocks use the explicit
    pairwise decay, and an off-diagonal block (I > J) factorises through the last position r of
    block J as (a_I exp(G_I - G_r)) (b_J exp(G_r - G_J))^T. Every exponent is <= 0: nothing
    overflows, however strong the decay. Returns [..., C, C] in fp32.
    """
    M, *lead, C, K = a.shape
    sub = min(sub, C)
    n = C // sub
    a = a.reshape(M, *lead, n, sub, K)
    b, G = (t.reshape(*lead, n, sub, K) for t in (b, G))
    lower = torch.ones(sub, sub, dtype=torch.bool, device=a.device).tril()
    # diagonal blocks [..., n, sub, sub]; masked before exp so the upper triangle cannot overflow
    decay = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~lower[..., None], -math.inf).exp()
    bd = b[..., None, :, :] * decay  # [..., n, sub(i), sub(j), K]
    diag = (a[..., :, None, :] * bd).sum(-1)
    # off-diagonal blocks [..., n(I), n(J), sub, sub], kept where I > J
    ref = G[..., -1:, :]  # [..., n, 1, K]: last position of each block J
    right = b * (ref - G).exp()  # [..., n(J), sub, K]
    below = torch.ones(n, n, dtype=torch.bool, device=a.device).tril(-1)  # I > J
    rel = (G[..., :, None, :, :] - ref[..., None, :, :, :])  # [..., n(I), n(J), sub, K]
    left = a[..., :, None, :, :] * rel.masked_fill(~below[:, :, None, None], -math.inf).exp()
    off = torch.einsum("...IJid,...Jjd->...IJij", left, right)
    eye = torch.eye(n, dtype=torch.bool, device=a.device)
    blocks = torch.where(eye[:, :, None, None], diag[..., :, None, :, :], off)  # [..., n, n, sub, sub]
    return blocks.transpose(-3, -2).reshape(M, *lead, C, C)


# Chunks whose intra-chunk terms are computed together (bounds memory at long context).
CHUNK_GROUP = 16


def kda_chunkwise(q, k, v, g, beta, scale: float | None = None, initial_state=None, chunk_size: int = 64):
    """kda_chunkwise_reference's (o, final state), through the CPU kernel (horizon/quant/kernels/kda.cpp: each
    (sequence, head) chunk after chunk in L1/L2, where the reference makes ~30 PyTorch calls a group of chunks
    over [..., C, C, K]-sized temporaries) where it runs: AVX-512 or AVX2, K = V in {16, 32, 64, 128}, chunk_size a
    multiple of 16, nothing that needs a gradient (the op has no backward: training takes the reference)."""
    from horizon.quant import kernels  # here: horizon.quant's modules import this package

    B, T, H, K = q.shape
    if (not _needs_grad(q, k, v, g, beta, initial_state) and v.shape[-1] == K and K in (16, 32, 64, 128)
            and chunk_size % 16 == 0 and kernels.kernels_run_on(q.device) and kernels.vector_path() != "portable"):
        state = (q.new_zeros(B, H, K, K, dtype=torch.float32) if initial_state is None
                 else initial_state.float().clone().contiguous())
        scale = K**-0.5 if scale is None else scale
        o = torch.ops.horizon_kernels.kda_chunk_forward_(state, q.float(), k.float(), v.float(), g.float(),
                                                         beta.float(), scale, chunk_size)
        return o, state
    return kda_chunkwise_reference(q, k, v, g, beta, scale, initial_state, chunk_size)


def kda_chunkwise_reference(q, k, v, g, beta, scale: float | None = None, initial_state=None, chunk_size: int = 64):
    """The same function as `kda_recurrent`, computed chunk by chunk. Returns (o, final state).

    Inside a chunk, with G the cumulative log-decay from the chunk start and S the state entering it:
        A[i, j]   = beta_i sum_d k_i[d] k_j[d] exp(G_i[d] - G_j[d])      (j < i)
        (I + A) X = diag(beta) [k * exp(G) | v]   -> X = [W | U]          (UT transform)
        V'        = U - W S                       (values minus what the state already predicts)
        o         = (q * exp(G)) S + Aqk V',       Aqk[i, j] = sum_d q_i k_j exp(G_i - G_j)  (j <= i)
        S_next    = exp(G_C) * S + (k * exp(G_C - G))^T V'
    A, Aqk, W and U do not depend on S, so they are computed for a group of chunks at once; only
    the last three lines run chunk after chunk. Every exponent is <= 0.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    scale = K**-0.5 if scale is None else scale
    n_chunks = max(1, math.ceil(T / C))
    pad = n_chunks * C - T  # zero g and beta: the padded tail leaves the state untouched

    def chunks(x):  # [B, T, H, ...] -> [B, H, n, C, ...]
        x = F.pad(x.float(), (0, 0) * (x.dim() - 3) + (0, 0, 0, pad))
        return x.reshape(B, n_chunks, C, H, *x.shape[3:]).transpose(1, 3).transpose(2, 3)

    q, k, v, g, beta = chunks(q) * scale, chunks(k), chunks(v), chunks(g), chunks(beta)
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float().clone()
    eye = torch.eye(C, device=q.device)
    o = q.new_empty(B, H, n_chunks, C, V)
    for g0 in range(0, n_chunks, CHUNK_GROUP):
        grp = slice(g0, g0 + CHUNK_GROUP)
        qn, kn, vn, bn = q[:, :, grp], k[:, :, grp], v[:, :, grp], beta[:, :, grp]
        G = g[:, :, grp].cumsum(-2)  # [B, H, n, C, K]
        A, Aqk = decayed_scores(torch.stack((kn, qn)), kn, G)  # one decay for both
        A = A * bn[..., None]
        # (I + strictly-lower A) X = rhs by forward substitution; unitriangular ignores A's diagonal
        rhs = bn[..., None] * torch.cat((kn * G.exp(), vn), dim=-1)
        W, U = torch.linalg.solve_triangular(eye + A.tril(-1), rhs, upper=False, unitriangular=True).split((K, V), -1)
        q_decayed = qn * G.exp()
        G_last = G[..., -1, :]  # [B, H, n, K]
        k_to_end = (G_last[..., None, :] - G).exp() * kn
        for j in range(qn.shape[2]):
            v_new = U[:, :, j] - W[:, :, j] @ S
            o[:, :, g0 + j] = q_decayed[:, :, j] @ S + Aqk[:, :, j] @ v_new
            S = S * G_last[:, :, j].exp()[..., None] + k_to_end[:, :, j].transpose(-1, -2) @ v_new
    o = o.reshape(B, H, n_chunks * C, V)[:, :, :T].transpose(1, 2)
    return o, S


def short_conv(x: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor, lens: torch.Tensor):
    """Causal depthwise convolution continuing from carried inputs.

    x [B, T, C] new inputs (padded past lens), tail [B, kernel-1, C] the inputs before them,
    weight [C, kernel] (last tap = current token). Returns (silu(conv) [B, T, C], new tail [B, kernel-1, C]),
    the new tail being the kernel-1 inputs that end at each sequence's last real token.
    """
    C, kernel = weight.shape
    xx = torch.cat((tail.to(x.dtype), x), dim=1)  # [B, kernel-1+T, C]
    if x.shape[1] == 1:  # decode: one output per sequence; a multiply-add beats a conv1d call at this size
        # [B, kernel, C] taps -> [B, 1, C], accumulated in fp32 like conv1d, rounded once
        y = (xx.float() * weight.t().float()).sum(1, keepdim=True).to(x.dtype)
        return F.silu(y), xx[:, 1:]
    y = F.conv1d(xx.transpose(1, 2), weight[:, None, :].to(x.dtype), groups=C).transpose(1, 2)
    idx = lens[:, None] + torch.arange(kernel - 1, device=x.device)[None, :]  # [B, kernel-1]
    new_tail = xx.gather(1, idx[..., None].expand(-1, -1, C))
    return F.silu(y), new_tail


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim = H, dk = cfg.kda_num_heads, cfg.kda_head_dim
        self.chunk_size, self.eps = cfg.kda_chunk_size, cfg.rms_norm_eps
        d, P = cfg.hidden_size, H * dk
        self.q_proj = nn.Linear(d, P, bias=False)
        self.k_proj = nn.Linear(d, P, bias=False)
        self.v_proj = nn.Linear(d, P, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(3 * P, cfg.kda_conv_size))  # q | k | v channels
        # decay: log alpha = -exp(A_log[h]) * softplus(f_b(f_a(x)) + dt_bias), low-rank through d_k; with a
        # lower bound lb (Kimi K3) log alpha = lb * sigmoid(exp(A_log[h]) * (f_b(f_a(x)) + dt_bias)) instead
        self.lower_bound = cfg.kda_gate_lower_bound
        self.f_a_proj = nn.Linear(d, dk, bias=False)
        self.f_b_proj = nn.Linear(dk, P, bias=False)
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(P))
        self.b_proj = nn.Linear(d, H, bias=False)  # beta = sigmoid(b_proj x), one per head
        # output: o_proj(sigmoid(gate(x)) * RMSNorm_per_head(o)), gate low-rank g_b(g_a(x)) or full-rank g_proj(x)
        self.full_rank_gate = cfg.kda_gate_full_rank
        if self.full_rank_gate:
            self.g_proj = nn.Linear(d, P, bias=False)
        else:
            self.g_a_proj = nn.Linear(d, dk, bias=False)
            self.g_b_proj = nn.Linear(dk, P, bias=False)
        self.o_norm_weight = nn.Parameter(torch.ones(dk))
        self.o_proj = nn.Linear(P, d, bias=False)

    def use_decode_layout(self) -> None:
        """Keep conv_weight tap-major in memory: the same [C, kernel] tensor, stored as [kernel, C]. A decode
        step's convolution (short_conv) then reads each tap as a contiguous row, which inductor vectorises;
        over the [C, kernel] layout it reads taps at stride `kernel` and emits a scalar loop, its silu's exp
        included (at 16 sequences of `small`, 120-140 us against ~30 a KDA layer, the kernel alone)."""
        w = self.conv_weight
        if not w.t().is_contiguous():
            w.data = w.data.t().contiguous().t()

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        """log alpha [N, H, d_k] in fp32."""
        raw = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()).view(-1, self.num_heads, self.head_dim)
        rate = self.A_log.float().exp()[:, None]
        if self.lower_bound is not None:  # K3: in (lb, 0) whatever the input; not a clamp of the form below
            return self.lower_bound * torch.sigmoid(rate * raw)
        return -rate * F.softplus(raw)

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        """The output gate's logits [N, H * d_k] (sigmoid is applied with the norm)."""
        return self.g_proj(x) if self.full_rank_gate else self.g_b_proj(self.g_a_proj(x))

    def _mixed(self, q, k, v, g, beta, state, lens):
        """A forward that mixes decode steps (one token) with prefill chunks: the decodes run the
        recurrence on their one token, the prefills chunkwise padded to the longest prefill only (not
        every decode row padded to the prefill's length, which cost a whole chunk per decode)."""
        B, T = q.shape[:2]
        o = q.new_zeros(B, T, *v.shape[2:])
        new_state = torch.empty_like(state)
        short = lens <= 1
        dec, pre = short.nonzero()[:, 0], (~short).nonzero()[:, 0]
        Tp = int(lens[pre].max())
        od, new_state[dec] = kda_recurrent(*(t[dec, :1] for t in (q, k, v, g, beta)), initial_state=state[dec])
        op, new_state[pre] = kda_chunkwise(*(t[pre, :Tp] for t in (q, k, v, g, beta)), initial_state=state[pre],
                                           chunk_size=self.chunk_size)
        o[dec, :1], o[pre, :Tp] = od, op
        return o, new_state

    def forward(self, x: torch.Tensor, batch: Batch, cache=None, options=None) -> torch.Tensor:
        """x [N, d] (flat tokens) -> [N, d]; reads and updates this layer's state in `cache` if given.

        options (horizon.model.options) holds the DSA layers' per-call modes: KDA has none, and takes it
        only so every mixer is called alike."""
        H, dk = self.num_heads, self.head_dim
        P = H * dk
        layer_cache = cache.layers[self.layer_idx] if cache is not None else None
        qkv = batch.pad(torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1))  # [B, T, 3P]
        B, T = qkv.shape[:2]
        decode = layer_cache is not None and T == 1  # the states are updated where they lie (kda_decode)
        if layer_cache is None:
            state, tail = None, qkv.new_zeros(B, self.conv_weight.shape[1] - 1, 3 * P)
        elif decode:
            state, tail = None, layer_cache.read_conv(batch.slots)
        else:
            state, tail = layer_cache.read(batch.slots)
        qkv, new_tail = short_conv(qkv, tail, self.conv_weight, batch.lens)
        q, k, v = (t.reshape(B, T, H, dk) for t in qkv.split(P, dim=-1))
        q, k = l2_normalize(q.float()), l2_normalize(k.float())
        # padded positions get g = 0 and beta = 0: they leave the state exactly as it was
        g = batch.pad(self.decay(x))
        beta = batch.pad(torch.sigmoid(self.b_proj(x).float()))
        if decode:
            o = kda_decode(layer_cache.state, batch.slots, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])[:, None]
            layer_cache.write_conv(batch.slots, new_tail)
        else:
            if layer_cache is not None and bool((batch.lens <= 1).any()):
                o, state = self._mixed(q, k, v, g, beta, state, batch.lens)
            else:
                o, state = kda_chunkwise(q, k, v, g, beta, initial_state=state, chunk_size=self.chunk_size)
            if layer_cache is not None:
                layer_cache.write(batch.slots, state, new_tail)
        o = batch.unpad(o)  # [N, H, dk] fp32
        gate = self.output_gate(x).view(-1, H, dk)
        o = gated_rms_norm(o, gate, self.o_norm_weight, self.eps).to(x.dtype)
        return self.o_proj(o.reshape(-1, P))
