"""Per-call forward options: how the Gated DSA layers attend in one forward, and what they report.

The layers hold weights only; whatever changes from one call to the next (the attention form a test
forces, the selection rule, the probes the engine samples, the trainer's indexer inputs) travels in a
`ForwardOptions` passed down through `HorizonForCausalLM.forward` / `forward_batch`. A layer writes
into the output dicts only when the matching flag is set, so a forward with the defaults (the one
`torch.compile` sees) mutates nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from horizon.model.batch import Batch

ATTN_FORMS = ("auto", "expanded", "absorbed")
SELECTIONS = ("indexer", "recent", "dense")


@dataclass(eq=False)  # holds tensors: compared by identity, never element-wise
class IndexerTap:
    """What the indexer's training objective (horizon.train.indexer) needs from one DSA layer's forward
    without cache: the layer input, the projections and the latent rows, the batch layout, and the
    sparse picks [B, T, k] when the layer ran sparse (None when it attended densely)."""

    x: torch.Tensor  # [N, d] the layer's (normed) input
    c_q: torch.Tensor  # [N, q_lora_rank] the query latent (x itself without one)
    q_nope: torch.Tensor  # [B, T, H, nope]
    q_pe: torch.Tensor  # [B, T, H, rope]
    rows: torch.Tensor  # [B, L, kv_rank + rope] the latent rows [c_kv | k_pe]
    batch: Batch
    q_pos: torch.Tensor  # [B, T]
    ctx_len: torch.Tensor  # [B]
    selected: torch.Tensor | None


@dataclass
class ForwardOptions:
    """How the DSA layers attend in one forward (attn_form, selection) and what they report back (the
    flags, each filling its dict keyed by layer index). None where a forward takes options: the defaults."""

    attn_form: str = "auto"          # "auto" | "expanded" | "absorbed" (tests force one to compare)
    # "indexer" | "recent" (ablation: the index_topk most recent) | "dense" (attend to every visible position
    # whatever index_topk: the dense / indexer-warmup training stages)
    selection: str = "indexer"
    record_selection: bool = False   # fill `selections[layer_idx]` with the [B, T, k] picks
    # fill `coverage[layer_idx]` with the share of dense attention mass the selection keeps
    measure_coverage: bool = False
    # fill `indexer_taps[layer_idx]` with what the indexer's training objective needs (forwards without cache only)
    indexer_inputs: bool = False
    selections: dict[int, torch.Tensor] = field(default_factory=dict)
    coverage: dict[int, float] = field(default_factory=dict)
    indexer_taps: dict[int, IndexerTap] = field(default_factory=dict)

    def validate(self) -> None:
        if self.attn_form not in ATTN_FORMS:
            raise ValueError(f"ForwardOptions.attn_form={self.attn_form!r}: allowed {', '.join(ATTN_FORMS)}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"ForwardOptions.selection={self.selection!r}: allowed {', '.join(SELECTIONS)}")
