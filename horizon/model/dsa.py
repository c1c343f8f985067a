"""Gated DSA: DeepSeek Sparse Attention over a multi-head latent cache, with a sigmoid output gate
(docs/design.md §1.2).

MLA projections: c_q = RMSNorm(W_qa x), q = W_qb c_q (or q = W_q x without a query latent);
c_kv = RMSNorm(W_kva x) with a decoupled key slice k_pe shared by all heads; W_kvb maps c_kv to
per-head k_nope and v. The cache keeps only [c_kv | k_pe] and the indexer key per token.

Attention in two equivalent forms (softmax scale (d_nope + d_rope)^-1/2 in both):
- expanded: apply W_kvb to the context rows, then ordinary multi-head attention (prefill);
- absorbed: fold W_kvb's key part into the query and its value part into the output, so
  attention runs against the latent rows themselves (MQA over the latent) and W_kvb never
  touches a cached row (decode, and the sparse path).

The lightning indexer scores every visible past position,
    I(t, s) = sum_j w_tj * d_I^-1/2 * ReLU(q^I_tj . k^I_s),
in tiles of queries (memory O(tile * L), never [T, H_I, T]) and keeps `index_topk` positions per
query, ties broken toward the more recent position. Attention then reads exactly those rows (a decode
step reads them where they lie in the paged cache: paged_latent_attention; elsewhere they are gathered).
When every query sees at most `index_topk` positions the selection is everything visible, so the
layer runs plain dense causal attention and skips the indexer.

Finally each head's output is multiplied by sigmoid(G x) before W_o: G low-rank (gate_b gate_a, the
articles' form) or one full-rank matrix (Kimi K3's g_proj, `dsa_gate_full_rank`), or no gate.

The layers hold no per-call state: the attention form, the selection rule and the probes a caller
wants (recorded selections, coverage, the indexer's training inputs) come in a `ForwardOptions`
(horizon.model.options), and results go back through its dicts. The indexer's training objective
lives with the trainer (horizon.train.indexer).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from horizon.config import ModelConfig
from horizon.model.batch import Batch
from horizon.model.cache import LatentCache, StepContext, gather_rows
from horizon.model.layers import RMSNorm, apply_rope, rope_softmax_factor
from horizon.model.options import ForwardOptions, IndexerTap

# Elements of one query tile's working set ([B, tile, H_I, L] indexer scores, [B, tile, k, width]
# gathered rows); bounds the sparse path's memory whatever the context length.
INDEX_TILE_ELEMENTS = 1 << 23
SMALL_QUERY_ROWS = 128  # indexer query rows (tokens x heads) up to which scores are computed keys-first


def topk_recent_first(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores along the last dim; equal scores prefer the larger index.

    Reference semantics: sort by (score, position) descending and keep k. Fast path: a plain top-k,
    which is already exact for every row without a tie at the cut (fewer than two elements share the
    k-th largest value on both sides of it); only rows with such a tie are redone by
    `_topk_by_score_then_position`. Rows whose k-th value is -inf see fewer than k positions: they
    keep all of them whatever the tie order, and their remaining picks are invisible (masked out).
    Where the CPU kernels run, fp32 scores take the exact selection in one kernel (a sampled threshold,
    then nth_element over the few candidates; horizon/quant/kernels/topk.cpp: ~0.06 against ~0.5 ms over
    64K scores), eagerly and in compiled graphs.
    """
    L = scores.shape[-1]
    if scores.dtype == torch.float32 and 0 < k <= L and _kernel_runs(scores.device):
        rows = torch.ops.horizon_kernels.topk_recent_first_rows(scores.reshape(-1, L), k)
        return rows.view(*scores.shape[:-1], k)
    if torch.compiler.is_compiling():  # no host sync inside a graph: always the exact integer top-k
        return _topk_by_score_then_position(scores, k)
    top = scores.topk(k, dim=-1, sorted=False)
    cut = top.values.min(-1, keepdim=True).values  # the k-th largest value of each row
    tied = ((scores >= cut).sum(-1) > k) & (cut.squeeze(-1) > -math.inf)
    if not bool(tied.any()):
        return top.indices
    idx = top.indices.clone()
    idx[tied] = _topk_by_score_then_position(scores[tied], k)
    return idx


def _topk_by_score_then_position(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Exact (score, position) top-k: each fp32 score is mapped to an integer of the same order
    (negative floats get their magnitude bits flipped), paired with its position as
    key * 2^32 + position, and one integer top-k orders by score, then recency. A pure function of
    the scores, so prefill, decode and batched runs break ties identically.
    """
    s = scores.float() + 0.0  # -0.0 -> +0.0 so equal values have equal bits
    bits = s.view(torch.int32).long()
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    pos = torch.arange(s.shape[-1], device=s.device)
    keys = key * (1 << 32) + pos
    if keys.shape[:-1].numel() > 1:
        keys = _interleave_halves(keys)
    return keys.topk(k, dim=-1, sorted=False).values & 0xFFFFFFFF


def _interleave_halves(keys: torch.Tensor) -> torch.Tensor:
    """keys [..., n] in the order 0, m, 1, m + 1, ... (m = ceil(n / 2)).

    Why: the selected set does not depend on the order, but aten's CPU top-k degenerates on long rising runs,
    and a batched step's rows have them: the scores span the longest context, so a short sequence's row is
    -inf past its own, one run of keys rising with position. Compiled, k = 2,048, 16 x 64K rows with 15
    visible to 1K: 37 ms in order, ~2-3 ms interleaved. (Reading the row back to front does as well, but
    inductor fails on a reversed index of a dynamic length.) One row has no such runs and keeps its order.
    An odd n gets one pad key, the int64 minimum: no real key is below it, and the only one that can equal
    it (an all-ones NaN at position 0) decodes to the same position, so the picks are unchanged for k <= n.
    """
    n = keys.shape[-1]
    m = (n + 1) // 2
    padded = torch.nn.functional.pad(keys, (0, 2 * m - n), value=torch.iinfo(torch.int64).min)
    return padded.view(*keys.shape[:-1], 2, m).transpose(-1, -2).reshape(*keys.shape[:-1], 2 * m)


def gather_selected(ctx, batch: Batch, idx: torch.Tensor) -> torch.Tensor:
    """The sparse path's only read of the latent: rows at idx [B, T, k] -> [B, T, k, width]."""
    return ctx.gather(batch, idx)


# what a forward without options does: never written to (every output flag is off)
DEFAULT_OPTIONS = ForwardOptions()


def masked_softmax(scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim (fp32) restricted to `visible`; rows with nothing visible give zeros."""
    scores = scores.float().masked_fill(~visible, -math.inf)
    probs = torch.softmax(scores, dim=-1)
    return torch.where(visible.any(-1, keepdim=True), probs, torch.zeros_like(probs))


def indexer_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """I [B, t, L] (fp32) for queries q [B, t, H_I, d_I], weights w [B, t, H_I], keys [B, L, d_I]:
    sum_h w_h d_I^-1/2 relu(q_h . k).

    The q.k products run in the keys' dtype (bf16 in a bf16 model, as DeepSeek runs its indexer in FP8);
    the ReLU and the weighted sum over heads in fp32.
    """
    B, t, H, d = q.shape
    q = q.to(keys.dtype).reshape(B, t * H, d)
    if t * H <= SMALL_QUERY_ROWS:
        # few queries (decode): [B, L, d] @ [B, d, t*H] reads the keys in their stored layout; the
        # other order would first copy the transposed keys (14x slower at 32K on a CPU, measured)
        s = torch.matmul(keys, q.transpose(1, 2)).transpose(1, 2).float().relu_().reshape(B * t, H, -1)
    else:
        # [B, t*H, d] @ [B, d, L] lands directly in [B, t, H, L] order (an einsum would permute-copy it)
        s = torch.matmul(q, keys.transpose(1, 2)).view(B * t, H, -1).float().relu_()
    w = (w.float() * d**-0.5).reshape(B * t, 1, H)
    return torch.bmm(w, s).view(B, t, -1)  # sum over heads: [B*t, 1, H] @ [B*t, H, L]


def paged_rows(table: torch.Tensor, pos: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pool rows, assigned) of positions pos [B, n] under the block table [B, nb]: position p of sequence b is
    row table[b, p // block_size] * block_size + p % block_size. Positions outside the table or in an
    unassigned block (-1) are not assigned and map to row 0 (a harmless stand-in that keeps a gather in
    bounds)."""
    span = table.shape[1] * block_size
    safe = pos.clamp(0, span - 1)
    block = table.gather(1, safe // block_size)
    assigned = (pos >= 0) & (pos < span) & (block >= 0)
    return torch.where(assigned, block * block_size + safe % block_size, 0), assigned


def paged_index_scores_reference(pool: torch.Tensor, table: torch.Tensor, q: torch.Tensor, w: torch.Tensor,
                                 L: int, block_size: int) -> torch.Tensor:
    """One query per sequence against its first L cached keys: [B, L] = indexer_scores over the rows the
    block table [B, nb] maps positions to (pool [R, d_I]; q [B, H_I, d_I]; w [B, H_I]). Positions in
    unassigned blocks (-1: past a sequence's end, masked by every caller) score 0. It gathers every key
    row of the context first: the reference the in-place kernel is tested against."""
    rows, assigned = paged_rows(table, torch.arange(L, device=pool.device).expand(table.shape[0], L), block_size)
    keys = gather_rows(pool, rows)
    return indexer_scores(q[:, None], w[:, None], keys)[:, 0].masked_fill(~assigned, 0.0)


def _kernel_runs(device: torch.device) -> bool:
    """Whether the CPU kernels serve tensors on `device` (horizon.quant.kernels.kernels_run_on)."""
    from horizon.quant import kernels  # here: horizon.quant's modules import this one

    return kernels.kernels_run_on(device)


def _kernel_takes(pool: torch.Tensor) -> bool:
    """Whether the compiled kernels read this pool in place (fp32, where the CPU kernels run)."""
    return pool.dtype == torch.float32 and _kernel_runs(pool.device)


def _reads_in_place(ctx, T: int, form: str) -> bool:
    """Whether a step's absorbed attention reads the paged pool in place (GatedDSA._absorbed_paged): one query
    per sequence (decode) over a cache whose pool the kernel takes."""
    return T == 1 and form != "expanded" and isinstance(ctx, LatentCache) and _kernel_takes(ctx.latent)


def paged_index_scores(pool: torch.Tensor, table: torch.Tensor, q: torch.Tensor, w: torch.Tensor, L: int,
                       block_size: int, force_portable: bool = False) -> torch.Tensor:
    """paged_index_scores_reference's result, read in place from the pool: an fp32 pool on the CPU takes
    the compiled kernel (horizon/quant/kernels/indexer.cpp: each key row read once, where it lies, instead
    of gathered into a new tensor and read again), called straight through the dispatcher, eagerly and in
    compiled graphs (its fake is registered with the build); anything else, the reference (traced into
    the graph when compiling). force_portable skips the kernel's AVX-512 path."""
    if _kernel_takes(pool):
        scaled = w.float() * q.shape[-1] ** -0.5  # indexer_scores' d_I^-1/2, on the weights
        return torch.ops.horizon_kernels.index_scores_paged(pool, table, q.float().contiguous(), scaled, L,
                                                            block_size, force_portable)
    return paged_index_scores_reference(pool, table, q, w, L, block_size)


def decode_index_scores(cache: LatentCache, batch: Batch, q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[B, 1, L]: a decode step's indexer scores (q [B, 1, H_I, d_I], w [B, 1, H_I]) over the paged cache,
    L = the batch's longest context (paged_index_scores)."""
    return paged_index_scores(cache.index, cache.block_table[batch.slots], q[:, 0], w[:, 0], batch.max_ctx,
                              cache.block_size)[:, None]


def latent_mqa(q: torch.Tensor, rows: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of q [B, T, H, width] over latent rows [B, T, S, width] per query (sparse) or [B, S, width]
    shared (dense), restricted to visible [B, T, S]: [B, T, H, width] (fp32; the k_pe part of the output is
    the caller's to drop). Products with the rows run in the rows' dtype (bf16 in a bf16 model, fp32
    accumulation), the softmax in fp32; a query that sees nothing gets zeros."""
    dt = rows.dtype
    sub = "btsr" if rows.dim() == 4 else "bsr"
    B, T, H, R = q.shape
    if T * H <= SMALL_QUERY_ROWS:  # decode: rows first, in their stored layout (see indexer_scores)
        if rows.dim() == 3:
            scores = torch.matmul(rows, q.reshape(B, T * H, R).transpose(1, 2)).transpose(1, 2).view(B, T, H, -1)
        else:
            scores = torch.matmul(rows, q.transpose(-1, -2)).transpose(-1, -2)
        scores = scores.float() * scale
    else:
        scores = torch.einsum(f"bthr,{sub}->bths", q, rows).float() * scale
    probs = masked_softmax(scores, visible[:, :, None, :]).to(dt)
    # contract with whole rows (a slice would copy every gathered row)
    return torch.einsum(f"bths,{sub}->bthr", probs, rows).float()


def paged_latent_attention_reference(pool: torch.Tensor, table: torch.Tensor, q: torch.Tensor, limit: torch.Tensor,
                                     L: int, block_size: int, scale: float, v_width: int,
                                     idx: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence (q [B, H, width]) over its rows in the paged pool [R, width] (block table
    [B, nb]): [B, H, v_width] = latent_mqa over positions 0..L-1, or over the positions idx [B, k] when
    given, where a position p is visible when 0 <= p < limit[b] and its block is assigned. It gathers the
    rows first: the reference the in-place kernel (attention.cpp) is tested against."""
    pos = torch.arange(L, device=pool.device).expand(q.shape[0], L) if idx is None else idx
    rows, assigned = paged_rows(table, pos, block_size)
    visible = assigned & (pos < limit[:, None])
    return latent_mqa(q[:, None], gather_rows(pool, rows), visible[:, None], scale)[:, 0, :, :v_width]


def paged_latent_attention(pool: torch.Tensor, table: torch.Tensor, q: torch.Tensor, limit: torch.Tensor, L: int,
                           block_size: int, scale: float, v_width: int, idx: torch.Tensor | None = None,
                           force_portable: bool = False) -> torch.Tensor:
    """paged_latent_attention_reference's result, read in place: an fp32 pool on the CPU takes the compiled
    kernel (horizon/quant/kernels/attention.cpp: one pass over the rows where they lie, online softmax),
    eagerly and in compiled graphs, as paged_index_scores does; anything else, the reference."""
    if _kernel_takes(pool):
        return torch.ops.horizon_kernels.latent_attention_paged(pool, table, q.float().contiguous(), limit, idx, L,
                                                                block_size, scale, v_width, force_portable)
    return paged_latent_attention_reference(pool, table, q, limit, L, block_size, scale, v_width, idx)


class LightningIndexer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.rope_dim, self.rope_theta, self.rope_scaling = cfg.index_rope_dim, cfg.rope_theta, cfg.rope_scaling
        q_in = cfg.q_lora_rank or cfg.hidden_size  # c_q, or the (already RMS-normed) layer input
        self.wq = nn.Linear(q_in, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if not self.rope_dim:
            return x
        r = self.rope_dim
        rotated = apply_rope(x[..., :r], positions, self.rope_theta, interleaved=False, scaling=self.rope_scaling)
        return torch.cat((rotated, x[..., r:]), -1)

    def keys(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """k^I [N, d_I]: one key per token shared by all index heads; cached."""
        return self._rope(self.k_norm(self.wk(x)), positions)

    def queries(self, x: torch.Tensor, c_q: torch.Tensor, positions: torch.Tensor):
        """q^I [N, H_I, d_I] and the per-head weights w [N, H_I] (with the H_I^-1/2 factor)."""
        q = self._rope(self.wq(c_q).view(-1, self.n_heads, self.head_dim), positions)
        w = self.weights_proj(x).float() * self.n_heads**-0.5
        return q, w

    def scores(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """I [B, t, L] (fp32) for queries q [B, t, H_I, d_I], weights w [B, t, H_I], keys [B, L, d_I]
        (indexer_scores)."""
        return indexer_scores(q, w, keys)

    def select(self, q, w, keys, q_pos, ctx_len, k: int, selection: str = "indexer",
               scores: torch.Tensor | None = None) -> torch.Tensor:
        """Top-k visible positions [B, t, k] for queries q [B, t, H_I, d_I] at positions q_pos [B, t].

        Position s is visible to a query at p when s <= p and s < ctx_len[b]; invisible positions
        score -inf, so they are chosen only when fewer than k positions are visible. selection
        "recent" ignores the scores and keeps the k most recent visible positions (the ablation
        baseline that shows what the learned selection is worth: `horizon eval --selection recent`).
        scores: [B, t, L] already computed (a decode step over the paged cache: decode_index_scores),
        in place of scoring `keys` (then None).
        """
        L = keys.shape[1] if scores is None else scores.shape[-1]
        s_pos = torch.arange(L, device=q_pos.device)
        visible = (s_pos <= q_pos[..., None]) & (s_pos < ctx_len[:, None, None])
        if selection == "recent":  # score = position: the top-k are the most recent visible ones
            return topk_recent_first(s_pos.float().expand_as(visible).masked_fill(~visible, -math.inf), k)
        sc = self.scores(q, w, keys) if scores is None else scores  # [B, t, L]
        return topk_recent_first(sc.masked_fill(~visible, -math.inf), k)


class GatedDSA(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, H = cfg.num_heads, cfg.num_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank, self.q_rank = cfg.kv_lora_rank, cfg.q_lora_rank
        self.mla_rope, self.rope_theta, self.rope_scaling = cfg.mla_rope, cfg.rope_theta, cfg.rope_scaling
        # (d_nope + d_rope)^-1/2, times YaRN's mscale^2 when the rotary embedding is extended
        self.scale = cfg.qk_head_dim**-0.5 * rope_softmax_factor(cfg.rope_scaling)
        d = cfg.hidden_size
        if self.q_rank:
            self.wq_a = nn.Linear(d, self.q_rank, bias=cfg.attention_bias)
            self.q_norm = RMSNorm(self.q_rank, cfg.mla_eps)
            self.wq_b = nn.Linear(self.q_rank, H * cfg.qk_head_dim, bias=False)
        else:
            self.wq = nn.Linear(d, H * cfg.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(d, self.kv_rank + self.rope, bias=cfg.attention_bias)
        self.kv_norm = RMSNorm(self.kv_rank, cfg.mla_eps)
        self.wkv_b = nn.Linear(self.kv_rank, H * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(H * self.v_dim, d, bias=cfg.attention_bias)
        self.gate_rank, self.full_rank_gate = cfg.dsa_gate_rank, cfg.dsa_gate_full_rank
        if self.gate_rank:
            self.gate_a = nn.Linear(d, self.gate_rank, bias=False)
            self.gate_b = nn.Linear(self.gate_rank, H * self.v_dim, bias=False)
        elif self.full_rank_gate:  # Kimi K3's g_proj: one full-rank matrix on the layer's normed input
            self.gate = nn.Linear(d, H * self.v_dim, bias=False)
        self.indexer = LightningIndexer(cfg) if cfg.index_n_heads else None

    # --- projections -------------------------------------------------------------------------
    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """Queries (q_nope [N, H, nope], q_pe [N, H, rope]), c_q, and the latent row [N, kv_rank + rope]."""
        if self.q_rank:
            c_q = self.q_norm(self.wq_a(x))
            q = self.wq_b(c_q)
        else:
            c_q = x
            q = self.wq(x)
        q_nope, q_pe = q.view(-1, self.num_heads, self.nope + self.rope).split((self.nope, self.rope), -1)
        c_kv, k_pe = self.wkv_a(x).split((self.kv_rank, self.rope), -1)
        if self.mla_rope != "none":
            inter = self.mla_rope == "interleaved"
            q_pe = apply_rope(q_pe, positions, self.rope_theta, inter, self.rope_scaling)
            k_pe = apply_rope(k_pe, positions, self.rope_theta, inter, self.rope_scaling)
        return q_nope, q_pe, c_q, torch.cat((self.kv_norm(c_kv), k_pe), dim=-1)

    def _w_kvb(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_kvb split per head: key part [H, nope, kv_rank] and value part [H, v, kv_rank]."""
        w = self.wkv_b.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_rank)
        return w[:, : self.nope], w[:, self.nope:]

    # --- attention forms -----------------------------------------------------------------------
    def _expanded_dense(self, q_nope, q_pe, rows, visible, plain_causal: bool = False):
        """Dense attention after expanding the context rows [B, L, width] with W_kvb.

        plain_causal: `visible` is exactly the causal triangle (every row full, no cache), so SDPA
        can use its causal kernel instead of reading a mask.
        """
        B, L = rows.shape[:2]
        kv = self.wkv_b(rows[..., : self.kv_rank]).view(B, L, self.num_heads, self.nope + self.v_dim)
        k_nope, v = kv.split((self.nope, self.v_dim), -1)
        k_pe = rows[..., self.kv_rank:][:, :, None, :].expand(-1, -1, self.num_heads, -1)
        q = torch.cat((q_nope, q_pe), -1).transpose(1, 2)  # [B, H, T, dq]
        k = torch.cat((k_nope, k_pe), -1).transpose(1, 2)  # [B, H, L, dq]
        v = v.transpose(1, 2)  # [B, H, L, v]
        # SDPA's fused (flash) kernels need one head dim for q, k and v; otherwise it falls back to
        # materialising [B, H, T, L] scores (50x slower at 16K on CPU). Zero padding changes nothing.
        dq, dv = q.shape[-1], v.shape[-1]
        if dv < dq:
            v = F.pad(v, (0, dq - dv))
        elif dq < dv:
            q, k = F.pad(q, (0, dv - dq)), F.pad(k, (0, dv - dq))
        if plain_causal:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
            return out.transpose(1, 2)[..., :dv]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None], scale=self.scale)
        # a query that sees nothing (only padding rows can) gives NaN from SDPA; zero it
        return torch.where(visible.any(-1)[:, :, None, None], out.transpose(1, 2)[..., :dv], 0.0)

    def _expanded_sparse(self, q_nope, q_pe, rows, idx, visible):
        """Sparse attention with expanded keys: W_kvb on every context row, then gather k per query."""
        B, L = rows.shape[:2]
        kv = self.wkv_b(rows[..., : self.kv_rank]).view(B, L, self.num_heads, self.nope + self.v_dim)
        k_nope, v = kv.split((self.nope, self.v_dim), -1)
        b = torch.arange(B, device=idx.device)[:, None, None]
        k_pe = rows[..., self.kv_rank:][b, idx]  # [B, T, k, rope]
        scores = (torch.einsum("bthd,btshd->bths", q_nope.float(), k_nope[b, idx].float())
                  + torch.einsum("bthe,btse->bths", q_pe.float(), k_pe.float())) * self.scale
        probs = masked_softmax(scores, visible[:, :, None, :])
        return torch.einsum("bths,btshv->bthv", probs, v[b, idx].float())

    def _absorbed_query(self, q_nope, q_pe, dtype: torch.dtype) -> torch.Tensor:
        """[B, T, H, kv_rank + rope]: W_kvb's key part folded into q_nope, beside q_pe (against [c_kv | k_pe])."""
        w_uk, _ = self._w_kvb()
        q_lat = torch.einsum("bthd,hdr->bthr", q_nope.float(), w_uk.float())
        return torch.cat((q_lat, q_pe.float()), -1).to(dtype)

    def _absorbed_output(self, o_lat: torch.Tensor) -> torch.Tensor:
        """[B, T, H, v]: W_kvb's value part on the attended latent o_lat [B, T, H, kv_rank]."""
        _, w_uv = self._w_kvb()
        return torch.einsum("bthr,hvr->bthv", o_lat.float(), w_uv.float())

    def _absorbed(self, q_nope, q_pe, rows, visible):
        """MQA over the latent: rows [B, T, S, width] per query (sparse) or [B, S, width] shared (dense)."""
        q = self._absorbed_query(q_nope, q_pe, rows.dtype)
        return self._absorbed_output(latent_mqa(q, rows, visible, self.scale)[..., : self.kv_rank])

    def _absorbed_paged(self, q_nope, q_pe, cache: LatentCache, batch: Batch, q_pos, ctx_len,
                        idx: torch.Tensor | None = None):
        """A decode step's absorbed attention read in place from the paged pool (paged_latent_attention):
        every visible position, or the selection idx [B, 1, k]; what _absorbed over the gathered rows gives."""
        q = self._absorbed_query(q_nope, q_pe, cache.latent.dtype)[:, 0]  # [B, H, width]
        limit = torch.minimum(ctx_len, q_pos[:, 0] + 1)  # positions < limit are visible to the query
        o_lat = paged_latent_attention(cache.latent, cache.block_table[batch.slots], q, limit, batch.max_ctx,
                                       cache.block_size, self.scale, self.kv_rank,
                                       None if idx is None else idx[:, 0])
        return self._absorbed_output(o_lat[:, None])

    def _sparse(self, x, c_q, q_nope, q_pe, ctx, batch, q_pos, ctx_len, form, options: ForwardOptions,
                keep_picks: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Indexer selection + attention over the selected rows, a tile of queries at a time; returns the
        output and, with keep_picks, the selection [B, T, k] (else None).

        A tile's working set is [B, tile, H_I, L] for the scores and [B, tile, k, width] for the
        gathered rows, so memory stays O(T * k) however long the context. With options.measure_coverage
        the share of dense attention mass the selection keeps goes to options.coverage[layer_idx]
        (averaged over the tiles by their query count).
        """
        k = self.indexer.topk
        qi, wi = self.indexer.queries(x, c_q, batch.positions)
        qi, wi = batch.pad(qi), batch.pad(wi)
        B, T = q_pos.shape[0], q_pos.shape[1]
        if T == 1 and isinstance(ctx, LatentCache) and options.selection == "indexer":
            # a decode step over the paged cache scores the keys where they lie (no [B, L, d_I] copy)
            keys, scores = None, decode_index_scores(ctx, batch, qi, wi)
            L = scores.shape[-1]
        else:
            keys, scores = ctx.index_keys(batch), None  # [B, L, d_I]
            L = keys.shape[1]
        width = self.kv_rank + self.rope
        if form == "expanded":  # gathers expanded keys and values: H * (nope + rope + v) per row
            width = self.num_heads * (self.nope + self.rope + self.v_dim)
        # one tile for a decode step: T = 1, and a loop bound computed from the context length would tie a
        # compiled graph to that length
        tile = 1 if T == 1 else max(1, INDEX_TILE_ELEMENTS // max(1, B * max(self.indexer.n_heads * L, k * width)))
        rows = ctx.rows(batch) if form == "expanded" else None
        paged = _reads_in_place(ctx, T, form)
        outs, picks, covered = [], [], 0.0
        for t0 in range(0, T, tile):
            sl = slice(t0, t0 + tile)
            idx = self.indexer.select(qi[:, sl], wi[:, sl], keys, q_pos[:, sl], ctx_len, k, options.selection,
                                      scores)  # [B, t, k]
            visible = (idx <= q_pos[:, sl, None]) & (idx < ctx_len[:, None, None])
            if form == "expanded":
                outs.append(self._expanded_sparse(q_nope[:, sl], q_pe[:, sl], rows, idx, visible))
            elif paged:  # a decode step: the selected rows read where they lie
                outs.append(self._absorbed_paged(q_nope[:, sl], q_pe[:, sl], ctx, batch, q_pos[:, sl], ctx_len, idx))
            else:
                outs.append(self._absorbed(q_nope[:, sl], q_pe[:, sl], gather_selected(ctx, batch, idx), visible))
            if keep_picks:
                picks.append(idx)
            if options.measure_coverage:
                covered += idx.shape[1] * self._coverage(q_nope[:, sl], q_pe[:, sl], ctx.rows(batch), idx,
                                                         q_pos[:, sl], ctx_len)
        if options.measure_coverage:
            options.coverage[self.layer_idx] = covered / T
        return torch.cat(outs, dim=1), (torch.cat(picks, dim=1) if keep_picks else None)

    def _dense_probs(self, q_nope, q_pe, rows, q_pos, ctx_len) -> tuple[torch.Tensor, torch.Tensor]:
        """(dense attention probabilities [B, t, H, L] in fp32, visible [B, t, L]): what full attention does."""
        w_uk, _ = self._w_kvb()
        q_lat = torch.einsum("bthd,hdr->bthr", q_nope.float(), w_uk.float())
        q = torch.cat((q_lat, q_pe.float()), -1)
        scores = torch.einsum("bthr,bsr->bths", q, rows.float()) * self.scale
        s_pos = torch.arange(rows.shape[1], device=rows.device)
        visible = (s_pos <= q_pos[..., None]) & (s_pos < ctx_len[:, None, None])
        return masked_softmax(scores, visible[:, :, None, :]), visible

    def _coverage(self, q_nope, q_pe, rows, idx, q_pos, ctx_len) -> float:
        """Mean over queries and heads of the dense attention probability mass on the selected positions."""
        probs, visible = self._dense_probs(q_nope, q_pe, rows, q_pos, ctx_len)
        chosen = torch.zeros_like(visible).scatter_(-1, idx.clamp(max=rows.shape[1] - 1), True) & visible
        return float((probs * chosen[:, :, None, :]).sum(-1).mean())

    # --- forward -------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, batch: Batch, cache=None, options: ForwardOptions | None = None) -> torch.Tensor:
        """x [N, d] (flat tokens) -> [N, d]; appends this step's rows to `cache` if given.

        options (None: the defaults) says how to attend and what to report (horizon.model.options);
        this writes into its dicts only when the matching flag is set.
        """
        if options is None:
            options = DEFAULT_OPTIONS
        q_nope, q_pe, c_q, latent = self.project(x, batch.positions)
        index_keys = self.indexer.keys(x, batch.positions) if self.indexer is not None else None
        if cache is not None:
            ctx = cache.layers[self.layer_idx]
            ctx.write(batch, latent, index_keys)
            L = batch.max_ctx
        else:
            ctx = StepContext(batch, latent, index_keys)
            L = batch.max_len
        q_nope, q_pe = batch.pad(q_nope), batch.pad(q_pe)  # [B, T, H, .]
        q_pos = batch.padded_positions()  # [B, T]
        ctx_len = batch.start + batch.lens  # [B]
        decode = cache is not None and batch.max_len == 1
        # "auto": expanded for dense prefill, absorbed for decode and for sparse selection
        form = options.attn_form
        selected = None
        if self.indexer is None or self.indexer.topk >= L or options.selection == "dense":
            # every visible position is selected (or the caller attends to all of them): dense causal attention
            if _reads_in_place(ctx, batch.max_len, form):
                o = self._absorbed_paged(q_nope, q_pe, ctx, batch, q_pos, ctx_len)  # the rows where they lie
            else:
                s_pos = torch.arange(L, device=x.device)
                visible = (s_pos <= q_pos[..., None]) & (s_pos < ctx_len[:, None, None])  # [B, T, L]
                if form == "absorbed" or (form == "auto" and decode):
                    o = self._absorbed(q_nope, q_pe, ctx.rows(batch), visible)
                else:
                    # every sequence starts at position 0 with the same length: `visible` is the causal triangle
                    plain_causal = batch.uniform and batch.max_ctx == batch.max_len
                    o = self._expanded_dense(q_nope, q_pe, ctx.rows(batch), visible, plain_causal=plain_causal)
        else:
            tap = options.indexer_inputs and cache is None
            o, selected = self._sparse(x, c_q, q_nope, q_pe, ctx, batch, q_pos, ctx_len, form, options,
                                       keep_picks=options.record_selection or tap)
            if options.record_selection:
                options.selections[self.layer_idx] = selected
        if options.indexer_inputs and cache is None and self.indexer is not None:
            # what the indexer's objective (horizon.train.indexer) needs; the trainer computes the loss
            options.indexer_taps[self.layer_idx] = IndexerTap(x, c_q, q_nope, q_pe, ctx.rows(batch), batch, q_pos,
                                                              ctx_len, selected)
        o = batch.unpad(o).to(x.dtype)  # [N, H, v]
        if self.gate_rank:
            o = o * torch.sigmoid(self.gate_b(self.gate_a(x))).view_as(o)
        elif self.full_rank_gate:
            o = o * torch.sigmoid(self.gate(x)).view_as(o)
        return self.wo(o.flatten(1))
