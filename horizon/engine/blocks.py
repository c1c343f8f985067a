"""Cache memory bookkeeping: the DSA block pool, the KDA slots, and the prefix cache of finished turns.

- `BlockPool`: fixed-size blocks of DSA rows, a free list and reference counts (a full block can be
  shared by several sequences and by prefix-cache entries).
- `SlotPool`: per-sequence KDA state slots.
- `PrefixCache`: what a request leaves behind for the next turn of the same conversation: token
  ids, a copy of the KDA states and conv tails at that position, and references to the DSA blocks.
  Two snapshots per request at most (not one per block: a full-size snapshot is hundreds of MB):
  where its prompt ends, and where it finished. The second serves the next turn when the client
  sends the reply back token-exact; the first still serves it when the reply re-renders
  differently (a model's tokens need not be the tokenizer's canonical encoding of its text). A
  new prompt that extends an entry's tokens resumes from the longest such entry. Entries are
  evicted least recently used when their snapshot bytes exceed the cap, or when the pool runs dry.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.refs = [0] * num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self) -> int:
        block = self.free.pop()
        self.refs[block] = 1
        return block

    def incref(self, block: int) -> None:
        self.refs[block] += 1

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free.append(block)


class SlotPool:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.free: list[int] = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self) -> int:
        return self.free.pop()

    def release(self, slot: int) -> None:
        self.free.append(slot)


@dataclass
class PrefixEntry:
    tokens: list[int]  # the tokens whose state is cached (positions 0 .. len-1)
    state: list[tuple[torch.Tensor, torch.Tensor]]  # KDA states and conv tails after the last token
    blocks: list[int]  # DSA blocks holding rows 0 .. len-1 (one reference each)
    nbytes: int
    prompt_end: bool  # taken where a prompt ended (not after generated tokens)


class PrefixCache:
    def __init__(self, pool: BlockPool, max_bytes: int):
        self.pool, self.max_bytes = pool, max_bytes
        self.entries: OrderedDict[int, PrefixEntry] = OrderedDict()  # least recently used first
        self._next = 0
        self.nbytes = 0
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, tokens: list[int], state, blocks: list[int], prompt_end: bool = False) -> None:
        nbytes = sum(s.nbytes + c.nbytes for s, c in state)
        if nbytes > self.max_bytes or not tokens:
            return
        for block in blocks:
            self.pool.incref(block)
        # entries that are prefixes of the new one are superseded, except that an entry ending in
        # generated tokens keeps the prompt-end entry it grew from (the fallback when a reply re-renders
        # differently)
        for key in [k for k, e in self.entries.items()
                    if tokens[: len(e.tokens)] == e.tokens and (prompt_end or not e.prompt_end)]:
            self._drop(key)
        self.entries[self._next] = PrefixEntry(list(tokens), state, list(blocks), nbytes, prompt_end)
        self._next += 1
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            self.evict_one()

    def lookup(self, prompt: list[int]) -> PrefixEntry | None:
        """The longest entry whose tokens are a proper prefix of `prompt` (one token must remain to compute)."""
        best_key, best = None, None
        for key, entry in self.entries.items():
            n = len(entry.tokens)
            if n < len(prompt) and (best is None or n > len(best.tokens)) and prompt[:n] == entry.tokens:
                best_key, best = key, entry
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        self.entries.move_to_end(best_key)
        return best

    def evict_one(self) -> bool:
        if not self.entries:
            return False
        self._drop(next(iter(self.entries)))
        return True

    def _drop(self, key: int) -> None:
        entry = self.entries.pop(key)
        self.nbytes -= entry.nbytes
        self.pool.release(entry.blocks)

    def clear(self) -> None:
        while self.evict_one():
            pass
