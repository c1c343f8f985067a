"""The DSA indexer's training objective (docs/design.md §1.2): KL from the head-summed dense attention
distribution to the indexer's scores, with its recall statistics.

A forward with `ForwardOptions(indexer_inputs=True)` leaves one `IndexerTap` per DSA layer with an
indexer (forwards without cache only); `indexer_objective(layer, tap)` turns it into that layer's loss.
The model never computes it: only the training stages that train the indexers ask for it.
"""

from __future__ import annotations

import math

import torch

from horizon.model.dsa import GatedDSA, topk_recent_first
from horizon.model.options import IndexerTap


def indexer_objective(layer: GatedDSA, tap: IndexerTap) -> tuple[torch.Tensor, dict[str, float]]:
    """The indexer's training loss and its recall statistics for one layer's forward without cache.

    Target: the dense attention distribution summed over heads (renormalised), detached. The
    indexer sees detached inputs, so this loss trains the indexer alone. tap.selected=None (warm-up,
    or a layer that attended densely): KL over every visible position; else (sparse stage) over the
    selected positions only, both distributions renormalised on them. Recall: the target's mass on
    the indexer's top-k, and on the index_topk most recent positions (the baseline), averaged over
    queries that see more than index_topk positions.
    """
    x, c_q, batch, q_pos, ctx_len, selected = tap.x, tap.c_q, tap.batch, tap.q_pos, tap.ctx_len, tap.selected
    indexer = layer.indexer
    with torch.no_grad():
        probs, visible = layer._dense_probs(tap.q_nope.detach(), tap.q_pe.detach(), tap.rows.detach(), q_pos,
                                            ctx_len)
        target = probs.sum(2)
        target = target / target.sum(-1, keepdim=True).clamp_min(1e-30)  # [B, t, L]
    qi, wi = indexer.queries(x.detach(), c_q.detach(), batch.positions)
    keys = batch.pad(indexer.keys(x.detach(), batch.positions))  # [B, L, d_I]
    scores = indexer.scores(batch.pad(qi), batch.pad(wi), keys)  # [B, t, L]
    real = torch.arange(q_pos.shape[1], device=x.device)[None, :] < batch.lens[:, None]  # [B, t]
    on = visible if selected is None else visible & torch.zeros_like(visible).scatter_(
        -1, selected.clamp(max=visible.shape[-1] - 1), True)
    t = torch.where(on, target, 0.0)
    t = t / t.sum(-1, keepdim=True).clamp_min(1e-30)
    log_q = torch.log_softmax(scores.float().masked_fill(~on, -math.inf), -1)
    kl = torch.where(on & (t > 0), t * (t.clamp_min(1e-30).log() - log_q), 0.0).sum(-1)  # [B, t]
    loss = (kl * real).sum() / real.sum().clamp_min(1)
    stats = {}
    with torch.no_grad():
        k = indexer.topk
        crowded = real & (visible.sum(-1) > k)
        if bool(crowded.any()):
            top = topk_recent_first(scores.detach().float().masked_fill(~visible, -math.inf), k)
            mass = torch.gather(target, -1, top.clamp(max=visible.shape[-1] - 1)).sum(-1)
            recent = (q_pos[..., None] - torch.arange(k, device=x.device)).clamp_min(0)
            base = torch.gather(target, -1, recent).sum(-1)
            stats = {"recall": float(mass[crowded].mean()), "recent_recall": float(base[crowded].mean()),
                     "queries": int(crowded.sum())}
    return loss, stats


def indexer_losses(layers: list[GatedDSA], taps: dict[int, IndexerTap]) -> tuple[torch.Tensor, list[dict[str, float]]]:
    """One forward's indexer loss, averaged over `layers` (the DSA layers with an indexer), and the
    non-empty statistics of each layer, from the forward's taps (ForwardOptions.indexer_taps)."""
    losses, stats = [], []
    for layer in layers:
        if layer.layer_idx in taps:
            loss, st = indexer_objective(layer, taps[layer.layer_idx])
            losses.append(loss)
            if st:
                stats.append(st)
    if not losses:
        return torch.zeros(()), stats
    return sum(losses) / max(1, len(layers)), stats
