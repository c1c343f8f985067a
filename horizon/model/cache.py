"""Decode caches: what each layer keeps per sequence between forward passes.

- KDA layer: the delta-rule state S [H, d_k, d_v] (fp32) and the last (kernel - 1) inputs of the
  short convolution, in per-sequence slots. Constant size, whatever the context length.
- Gated DSA layer: per token, only the latent c_kv with the decoupled key slice [kv_lora_rank +
  qk_rope_head_dim] and the indexer key [index_head_dim]. Keys and values per head are never
  cached: decode attends to the latent directly (absorbed form).

The DSA rows live in a paged pool: fixed-size blocks of `block_size` token rows, and a block
table per slot mapping its positions to blocks (position p is row
`block_table[slot, p // block_size] * block_size + p % block_size` of the pool). With
`num_blocks=None` every slot owns a fixed run of blocks (a plain cache for `max_len` tokens per
sequence); the engine instead allocates blocks from a free list as sequences grow and shares full
blocks between sequences with a common prefix.

Layers reach their part through small interfaces: `read` / `write` for KDA slots, `write` / `rows`
/ `gather` / `index_keys` for the latent pool.

Past the `num_slots` real slots there is one scratch slot (`scratch_slot`) with its own pool block:
a compiled decode step runs at a fixed batch size (horizon.engine.runner pads to a bucket), and its
padding rows read and write there, never in a real sequence's state or rows.
"""

from __future__ import annotations

import math

import torch

from horizon.config import ModelConfig
from horizon.model.batch import Batch


def gather_rows(table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """table [R, w], rows [...] (row indices) -> [..., w]: one index_select, a plain row copy."""
    w = table.shape[-1]
    flat = rows.reshape(-1)
    if table.dtype.itemsize < 4 and (w * table.dtype.itemsize) % 4 == 0 and not table.requires_grad:
        # copy rows as 4-byte words: index_select's 16-bit path is ~7x slower per byte on CPU
        # (not under autograd: a dtype view has no gradient)
        return table.view(torch.int32).index_select(0, flat).view(table.dtype).view(*rows.shape, w)
    return table.index_select(0, flat).view(*rows.shape, w)


class KDAStateCache:
    def __init__(self, cfg: ModelConfig, num_slots: int, dtype: torch.dtype, device):
        H, dk = cfg.kda_num_heads, cfg.kda_head_dim
        self.state = torch.zeros(num_slots, H, dk, dk, dtype=torch.float32, device=device)
        self.conv = torch.zeros(num_slots, cfg.kda_conv_size - 1, 3 * H * dk, dtype=dtype, device=device)

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.state[slots], self.read_conv(slots)

    def read_conv(self, slots: torch.Tensor) -> torch.Tensor:
        """The short convolution's tails alone (a decode step reads the states in place: kda_decode)."""
        return self.conv[slots]

    def write(self, slots: torch.Tensor, state: torch.Tensor, conv: torch.Tensor) -> None:
        self.state[slots] = state.to(self.state.dtype)
        self.write_conv(slots, conv)

    def write_conv(self, slots: torch.Tensor, conv: torch.Tensor) -> None:
        """The short convolution's tails alone (a decode step updates the states in place: kda_decode)."""
        self.conv[slots] = conv.to(self.conv.dtype)

    def reset(self, slots: torch.Tensor) -> None:
        self.state[slots] = 0
        self.conv[slots] = 0


class LatentCache:
    """One DSA layer's pool of per-token latent rows ([kv_lora_rank + qk_rope_head_dim]) and indexer keys."""

    def __init__(self, cfg: ModelConfig, block_table: torch.Tensor, block_size: int, num_blocks: int,
                 dtype: torch.dtype, device):
        rows = num_blocks * block_size
        self.block_table, self.block_size = block_table, block_size  # shared with HorizonCache
        rows += block_size  # the scratch slot's block (see the module docstring)
        self.latent = torch.zeros(rows, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype=dtype, device=device)
        self.index = torch.zeros(rows, cfg.index_head_dim, dtype=dtype, device=device) if cfg.index_n_heads else None

    def physical(self, slots: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Pool rows of positions pos [B, ...] of the sequences in slots [B]; unassigned -> row 0.

        Only positions a query cannot see (past a sequence's end) can be unassigned, so row 0 is a
        harmless stand-in that keeps the gather in bounds.
        """
        view = (-1,) + (1,) * (pos.dim() - 1)
        block = self.block_table[slots.view(view), pos // self.block_size]
        return torch.where(block >= 0, block * self.block_size + pos % self.block_size, 0)

    def write(self, batch: Batch, latent: torch.Tensor, index_keys: torch.Tensor | None) -> None:
        """Store the new tokens' rows ([N, ...]) at their positions."""
        where = self.physical(batch.slots[batch.seq_ids], batch.positions)
        self.latent[where] = latent.to(self.latent.dtype)
        if self.index is not None:
            self.index[where] = index_keys.to(self.index.dtype)

    def _all_positions(self, batch: Batch) -> torch.Tensor:
        pos = torch.arange(batch.max_ctx, device=batch.lens.device)
        return self.physical(batch.slots, pos.expand(batch.batch_size, -1))

    def rows(self, batch: Batch) -> torch.Tensor:
        """[B, L, width]: every latent row up to the batch's longest context."""
        return gather_rows(self.latent, self._all_positions(batch))

    def gather(self, batch: Batch, idx: torch.Tensor) -> torch.Tensor:
        """[B, T, k, width]: the latent rows at positions idx [B, T, k] (the sparse selection)."""
        return gather_rows(self.latent, self.physical(batch.slots, idx))

    def index_keys(self, batch: Batch) -> torch.Tensor:
        """[B, L, index_head_dim]: every indexer key up to the batch's longest context."""
        return gather_rows(self.index, self._all_positions(batch))

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks (copy-on-write of a shared, partly filled block)."""
        bs = self.block_size
        offsets = torch.arange(bs, device=src.device)
        s_rows, d_rows = (src[:, None] * bs + offsets).flatten(), (dst[:, None] * bs + offsets).flatten()
        self.latent[d_rows] = self.latent[s_rows]
        if self.index is not None:
            self.index[d_rows] = self.index[s_rows]


class StepContext:
    """The same read interface as LatentCache over this step's own tokens, for a forward without a cache."""

    def __init__(self, batch: Batch, latent: torch.Tensor, index_keys: torch.Tensor | None):
        self.T = batch.max_len
        self.latent = batch.pad(latent).flatten(0, 1)  # [B * T, width]; zeros past each sequence's end
        self.index = batch.pad(index_keys).flatten(0, 1) if index_keys is not None else None

    def _rows(self, idx: torch.Tensor) -> torch.Tensor:
        view = (-1,) + (1,) * (idx.dim() - 1)
        return torch.arange(idx.shape[0], device=idx.device).view(view) * self.T + idx

    def rows(self, batch: Batch) -> torch.Tensor:
        return self.latent.view(batch.batch_size, self.T, -1)

    def gather(self, batch: Batch, idx: torch.Tensor) -> torch.Tensor:
        return gather_rows(self.latent, self._rows(idx))

    def index_keys(self, batch: Batch) -> torch.Tensor:
        return self.index.view(batch.batch_size, self.T, -1)


class HorizonCache:
    """Every layer's decode state: `num_slots` sequences, DSA rows in a pool of `num_blocks` blocks.

    num_blocks=None: each slot owns ceil(max_len / block_size) blocks (block tables fixed); otherwise
    the block tables start empty (-1) and the owner (the engine) assigns blocks.
    """

    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype | None = None,
                 device=None, block_size: int = 64, num_blocks: int | None = None):
        if num_slots < 1 or max_len < 1 or block_size < 1:
            raise ValueError(f"a cache needs num_slots, max_len and block_size >= 1, got {num_slots}, {max_len}, "
                             f"{block_size}")
        if max_len > cfg.max_position_embeddings:
            raise ValueError(f"max_len={max_len} exceeds the model's context window "
                             f"max_position_embeddings={cfg.max_position_embeddings}")
        dtype = dtype or cfg.torch_dtype
        self.num_slots, self.max_len, self.block_size = num_slots, max_len, block_size
        self.max_blocks = math.ceil(max_len / block_size)  # blocks one sequence can hold
        self.static = num_blocks is None
        self.num_blocks = num_slots * self.max_blocks if self.static else num_blocks
        if self.static:
            table = torch.arange(self.num_blocks, device=device).view(num_slots, self.max_blocks)
        else:
            table = torch.full((num_slots, self.max_blocks), -1, dtype=torch.long, device=device)
        # the scratch slot: every position maps to block num_blocks, the one past the pool's real blocks
        scratch = torch.full((1, self.max_blocks), self.num_blocks, dtype=torch.long, device=device)
        self.full_table = torch.cat((table, scratch))  # what the layers index (the scratch slot included)
        self.block_table = self.full_table[:num_slots]  # a view: the engine's slots
        self.scratch_slot = num_slots
        self.full_lens = torch.zeros(num_slots + 1, dtype=torch.long, device=device)  # the scratch slot's too
        self.lens = self.full_lens[:num_slots]  # a view: tokens cached per engine slot
        self.layers: list[KDAStateCache | LatentCache] = [
            KDAStateCache(cfg, num_slots + 1, dtype, device) if kind == "kda"
            else LatentCache(cfg, self.full_table, block_size, self.num_blocks, dtype, device)
            for kind in cfg.layer_types
        ]

    def check_capacity(self, batch: Batch) -> None:
        """Every new token must have a pool block: a clear error instead of a silent overwrite."""
        end = batch.start + batch.lens
        if batch.max_ctx > self.max_len:
            raise ValueError(f"the batch needs {batch.max_ctx} cached positions but the cache holds "
                             f"max_len={self.max_len}")
        if not self.static:
            last = (end - 1).clamp(min=0) // self.block_size
            missing = (self.block_table[batch.slots, last] < 0) & (batch.lens > 0)
            if bool(missing.any()):
                raise ValueError(f"no cache block assigned for slot(s) {batch.slots[missing].tolist()} at "
                                 f"position(s) {(end - 1)[missing].tolist()}")

    def reset(self, slots=None) -> None:
        """Forget the given slots (all by default): state zeroed, length 0 (blocks stay assigned)."""
        slots = torch.arange(self.num_slots) if slots is None else torch.as_tensor(slots, dtype=torch.long)
        slots = slots.to(self.lens.device)
        self.lens[slots] = 0
        for layer in self.layers:
            if isinstance(layer, KDAStateCache):
                layer.reset(slots)

    # --- engine helpers ----------------------------------------------------------------------------
    def latent_layers(self) -> list[LatentCache]:
        return [layer for layer in self.layers if isinstance(layer, LatentCache)]

    def kda_layers(self) -> list[KDAStateCache]:
        return [layer for layer in self.layers if isinstance(layer, KDAStateCache)]

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        s, d = (torch.as_tensor(x, dtype=torch.long, device=self.block_table.device) for x in (src, dst))
        for layer in self.latent_layers():
            layer.copy_blocks(s, d)

    def snapshot_state(self, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of one slot's KDA states and convolution tails (for prefix reuse)."""
        return [(layer.state[slot].clone(), layer.conv[slot].clone()) for layer in self.kda_layers()]

    def restore_state(self, slot: int, snapshot: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for layer, (state, conv) in zip(self.kda_layers(), snapshot, strict=True):
            layer.state[slot] = state
            layer.conv[slot] = conv

    # --- sizes ---------------------------------------------------------------------------------------
    def bytes_per_token(self) -> int:
        """DSA cache bytes one token occupies, summed over the DSA layers (from the allocated pools)."""
        return sum(t.nbytes // t.shape[0] for layer in self.latent_layers() for t in (layer.latent, layer.index)
                   if t is not None)

    def state_bytes_per_slot(self) -> int:
        """KDA bytes one sequence occupies (states + convolution tails), constant in the context."""
        return sum((layer.state.nbytes + layer.conv.nbytes) // layer.state.shape[0] for layer in self.kda_layers())
