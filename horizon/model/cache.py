"""Decode caches: what each layer keeps per sequence between forward passes.

- KDA layer: the delta-rule state S [H, d_k, d_v] (fp32) and the last (kernel - 1) inputs of the
  short convolution. Constant size, whatever the context length.
- Gated DSA layer: per token, only the latent c_kv with the decoupled key slice [kv_lora_rank +
  qk_rope_head_dim] and the indexer key [index_head_dim]. Keys and values per head are never
  cached: decode attends to the latent directly (absorbed form).

`HorizonCache` holds `num_slots` sequences of up to `max_len` tokens each; a sequence lives in
one slot and `lens[slot]` counts its cached tokens. Layers reach their part through the small
interfaces below (`read`/`write` for KDA, `write`/`rows`/`gather`/`index_keys` for the latent
cache), so a paged pool can replace the contiguous one without touching the layers.
"""

from __future__ import annotations

import torch

from horizon.config import ModelConfig
from horizon.model.batch import Batch


def gather_positions(rows: torch.Tensor, idx: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
    """rows [S, L, w], idx [B, T, k] positions of sequence b (held in slot slots[b], default b) -> [B, T, k, w].

    One index_select on the flattened rows: a plain row copy, faster on CPU than advanced indexing.
    """
    S, L, w = rows.shape
    slots = torch.arange(idx.shape[0], device=idx.device) if slots is None else slots
    flat = (slots[:, None, None] * L + idx).flatten()
    table = rows.reshape(S * L, w)
    if table.dtype.itemsize < 4 and (w * table.dtype.itemsize) % 4 == 0 and not table.requires_grad:
        # copy rows as 4-byte words: index_select's 16-bit path is ~7x slower per byte on CPU
        # (not under autograd: a dtype view has no gradient)
        return table.view(torch.int32).index_select(0, flat).view(rows.dtype).view(*idx.shape, w)
    return table.index_select(0, flat).view(*idx.shape, w)


class KDAStateCache:
    def __init__(self, cfg: ModelConfig, num_slots: int, dtype: torch.dtype, device):
        H, dk = cfg.kda_num_heads, cfg.kda_head_dim
        self.state = torch.zeros(num_slots, H, dk, dk, dtype=torch.float32, device=device)
        self.conv = torch.zeros(num_slots, cfg.kda_conv_size - 1, 3 * H * dk, dtype=dtype, device=device)

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.state[slots], self.conv[slots]

    def write(self, slots: torch.Tensor, state: torch.Tensor, conv: torch.Tensor) -> None:
        self.state[slots] = state.to(self.state.dtype)
        self.conv[slots] = conv.to(self.conv.dtype)

    def reset(self, slots: torch.Tensor) -> None:
        self.state[slots] = 0
        self.conv[slots] = 0


class LatentCache:
    """Per-token latent rows ([kv_lora_rank + qk_rope_head_dim]) and indexer keys of one DSA layer."""

    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype, device):
        width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        self.latent = torch.zeros(num_slots, max_len, width, dtype=dtype, device=device)
        self.index = (torch.zeros(num_slots, max_len, cfg.index_head_dim, dtype=dtype, device=device)
                      if cfg.index_n_heads else None)

    def write(self, batch: Batch, latent: torch.Tensor, index_keys: torch.Tensor | None) -> None:
        """Store the new tokens' rows ([N, ...]) at their (slot, position)."""
        where = (batch.slots[batch.seq_ids], batch.positions)
        self.latent[where] = latent.to(self.latent.dtype)
        if self.index is not None:
            self.index[where] = index_keys.to(self.index.dtype)

    def rows(self, batch: Batch) -> torch.Tensor:
        """[B, L, width]: every cached latent row up to the batch's longest context."""
        return self.latent[batch.slots, : batch.max_ctx]

    def gather(self, batch: Batch, idx: torch.Tensor) -> torch.Tensor:
        """[B, T, k, width]: the latent rows at positions idx [B, T, k] (the sparse selection)."""
        return gather_positions(self.latent, idx, batch.slots)

    def index_keys(self, batch: Batch) -> torch.Tensor:
        """[B, L, index_head_dim]: every cached indexer key up to the batch's longest context."""
        return self.index[batch.slots, : batch.max_ctx]

    def reset(self, slots: torch.Tensor) -> None:
        self.latent[slots] = 0
        if self.index is not None:
            self.index[slots] = 0


class StepContext:
    """The same read interface as LatentCache over this step's own tokens, for a forward without a cache."""

    def __init__(self, batch: Batch, latent: torch.Tensor, index_keys: torch.Tensor | None):
        self.latent = batch.pad(latent)  # [B, T, width]; zeros past each sequence's end
        self.index = batch.pad(index_keys) if index_keys is not None else None

    def rows(self, batch: Batch) -> torch.Tensor:
        return self.latent

    def gather(self, batch: Batch, idx: torch.Tensor) -> torch.Tensor:
        return gather_positions(self.latent, idx)

    def index_keys(self, batch: Batch) -> torch.Tensor:
        return self.index


class HorizonCache:
    """Every layer's decode state for up to `num_slots` sequences of at most `max_len` tokens."""

    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype | None = None,
                 device=None):
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"a cache needs num_slots >= 1 and max_len >= 1, got {num_slots} and {max_len}")
        if max_len > cfg.max_position_embeddings:
            raise ValueError(f"max_len={max_len} exceeds the model's context window "
                             f"max_position_embeddings={cfg.max_position_embeddings}")
        dtype = dtype or cfg.torch_dtype
        self.num_slots, self.max_len = num_slots, max_len
        self.lens = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.layers: list[KDAStateCache | LatentCache] = [
            KDAStateCache(cfg, num_slots, dtype, device) if kind == "kda"
            else LatentCache(cfg, num_slots, max_len, dtype, device)
            for kind in cfg.layer_types
        ]

    def reset(self, slots=None) -> None:
        """Forget the given slots (all by default): their state is zeroed and their length set to 0."""
        slots = torch.arange(self.num_slots) if slots is None else torch.as_tensor(slots, dtype=torch.long)
        slots = slots.to(self.lens.device)
        self.lens[slots] = 0
        for layer in self.layers:
            layer.reset(slots)

    def nbytes(self) -> dict[str, int]:
        """Allocated bytes: per-token latent cache (DSA) and constant per-sequence state (KDA)."""
        latent = sum(t.nbytes for layer in self.layers if isinstance(layer, LatentCache)
                     for t in (layer.latent, layer.index) if t is not None)
        kda = sum(layer.state.nbytes + layer.conv.nbytes for layer in self.layers
                  if isinstance(layer, KDAStateCache))
        return {"dsa": latent, "kda": kda}
