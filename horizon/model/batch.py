"""Batch: the varlen layout of one forward pass.

Hidden states travel through the stack as one flat array of N tokens ([N, d]): B sequences' new
tokens laid end to end, so projections and experts never compute on padding, and one forward can
mix a prefill chunk of one sequence with decode steps of others. The sequence mixers (KDA's
recurrence, DSA's attention) need [B, T, ...] views; `pad` / `unpad` convert, with T the longest
new-token count in the batch.

Per sequence b: `lens[b]` new tokens whose absolute positions start at `start[b]` (tokens already
in the cache), and `slots[b]`, the cache slot that holds its state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Batch:
    lens: torch.Tensor  # [B] int64, new tokens per sequence
    start: torch.Tensor  # [B] int64, position of each sequence's first new token
    slots: torch.Tensor | None  # [B] int64 cache slots, None without a cache
    max_len: int  # T: the longest new-token run
    max_ctx: int  # longest context after this step: max(start + lens)
    seq_ids: torch.Tensor  # [N] which sequence each flat token belongs to
    offsets: torch.Tensor  # [N] index of each flat token within its sequence's new tokens
    positions: torch.Tensor  # [N] absolute position of each flat token
    uniform: bool  # every sequence has exactly max_len new tokens: pad/unpad are reshapes
    _parts: list | None = field(default=None, repr=False, compare=False)  # split_decode()'s answer, once

    @classmethod
    def build(cls, lens, start=None, slots=None, device=None) -> Batch:
        lens = torch.as_tensor(lens, dtype=torch.long, device=device)
        if lens.dim() != 1 or lens.numel() == 0:
            raise ValueError(f"lens must be a non-empty 1-D list of token counts, got shape {tuple(lens.shape)}")
        if bool((lens < 0).any()):
            raise ValueError(f"lens must be >= 0, got {lens.tolist()}")
        device = lens.device
        start = torch.zeros_like(lens) if start is None else torch.as_tensor(start, dtype=torch.long, device=device)
        if start.shape != lens.shape:
            raise ValueError(f"start has shape {tuple(start.shape)}, lens {tuple(lens.shape)}: one entry per sequence")
        if slots is not None:
            slots = torch.as_tensor(slots, dtype=torch.long, device=device)
        lens_host = lens.tolist()
        max_len = max(lens_host)
        max_ctx = int((start + lens).max())
        seq_ids = torch.repeat_interleave(torch.arange(len(lens_host), device=device), lens)
        first = torch.cumsum(lens, 0) - lens  # flat index of each sequence's first token
        offsets = torch.arange(int(sum(lens_host)), device=device) - first[seq_ids]
        positions = start[seq_ids] + offsets
        uniform = all(n == max_len for n in lens_host)
        return cls(lens, start, slots, max_len, max_ctx, seq_ids, offsets, positions, uniform)

    @classmethod
    def decode(cls, start: torch.Tensor, slots: torch.Tensor | None, max_ctx: int) -> Batch:
        """One new token per sequence at positions `start` [B]; `max_ctx` = max(start) + 1, given by the
        caller (it knows it on the host). Built without reading a tensor back, so it can run inside a
        compiled graph (a symbolic max_ctx keeps one graph for every context length)."""
        B = start.shape[0]
        ids = torch.arange(B, device=start.device)
        return cls(torch.ones_like(start), start, slots, 1, max_ctx, ids, torch.zeros_like(start), start, True)

    @property
    def batch_size(self) -> int:
        return self.lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.seq_ids.shape[0]

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[N, ...] -> [B, T, ...], zeros where a sequence has fewer than T new tokens."""
        if self.uniform:
            return x.reshape(self.batch_size, self.max_len, *x.shape[1:])
        out = x.new_zeros(self.batch_size, self.max_len, *x.shape[1:])
        return out.index_put((self.seq_ids, self.offsets), x)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] -> [N, ...]."""
        if self.uniform:
            return x.reshape(self.num_tokens, *x.shape[2:])
        return x[self.seq_ids, self.offsets]

    def valid(self) -> torch.Tensor:
        """[B, T] bool: which padded positions hold real tokens."""
        return torch.arange(self.max_len, device=self.lens.device)[None, :] < self.lens[:, None]

    def split_decode(self) -> list[tuple[Batch, torch.Tensor]]:
        """[(sub-batch, its flat token indices [n])]: decode steps apart from longer runs, when both are here.

        The sequence mixers pad to [B, T]: in a step that admits a prompt chunk of T tokens while 63
        others decode, each decode row would be computed T times over (a sample of `horizon eval
        --batch 64` caught the indexer scoring [64, 25] query rows for one 25-token chunk).
        Run as two groups, decode rows stay [B_d, 1] (bench/mixed_step.py: 2.3x at T = 16, 13x at
        256). Each sequence's numbers are the same either way. A batch without both kinds is one
        part, [(self, None)].
        """
        if self._parts is None:
            one = self.lens == 1
            if self.max_len == 1 or not bool(one.any()):  # nothing longer, or no decode step
                self._parts = [(self, None)]
            else:
                tok = one[self.seq_ids]
                self._parts = [(Batch.build(self.lens[m], self.start[m],
                                            None if self.slots is None else self.slots[m]), t.nonzero().squeeze(1))
                               for m, t in ((one, tok), (~one, ~tok))]
        return self._parts

    def padded_positions(self) -> torch.Tensor:
        """[B, T] absolute positions of the padded layout (positions past a sequence's end included)."""
        return self.start[:, None] + torch.arange(self.max_len, device=self.lens.device)[None, :]
