"""Cache memory bookkeeping: the DSA block pool, the KDA slots, and the prefix cache of finished turns.

- `BlockPool`: fixed-size blocks of DSA rows, a free list and reference counts (a full block can be
  shared by several sequences and by prefix-cache entries).
- `SlotPool`: per-sequence KDA state slots.
- `PrefixCache`: what a request leaves behind for the next turn of the same conversation: token
  ids, a copy of the KDA states and conv tails at that position, and references to the DSA blocks.
  A few snapshots per request (not one per block: a full-size snapshot is hundreds of MB), of three
  kinds: "finish", where it finished, serves the next turn when the client sends the reply back
  token-exact; "prompt", where its prompt ended, still serves it when the reply re-renders
  differently (a model's tokens need not be the tokenizer's canonical encoding of its text);
  "boundary", at message boundaries the serving layer named (the end of the system prompt, the
  last turn ends), serves the other branches of a history once one branch has extended it. A new
  entry supersedes the finish and prompt entries it extends (a finish entry keeps the prompt entry
  it grew from); boundary entries are never superseded, only evicted. A new prompt that extends an
  entry's tokens resumes from the longest such entry. Entries are evicted least recently used when
  their snapshot bytes exceed the cap, or when the pool runs dry.
  Lookups cost O(prompt length), not O(entries x length): every entry is indexed by a rolling hash
  of its tokens, and a prompt's prefix hashes are computed once and checked at the entry lengths
  present (a hit is verified token by token, so a hash collision cannot resume a wrong state).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence
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
    kind: str  # "finish" | "prompt" | "boundary" (module docstring)
    digest: int = 0  # _rolling(tokens)'s last value: the entry's key in the index


KINDS = ("finish", "prompt", "boundary")
_MOD, _BASE = (1 << 61) - 1, 1_000_003


def _rolling(tokens: Sequence) -> Iterator[int]:
    """The hash of tokens[:n] for n = 1, 2, ... (polynomial, mod a Mersenne prime); a token may be an
    image key instead of an id (`Sequence.key`), hence hash()."""
    h = 0
    for t in tokens:
        h = (h * _BASE + hash(t)) % _MOD
        yield h


class PrefixCache:
    def __init__(self, pool: BlockPool, max_bytes: int):
        self.pool, self.max_bytes = pool, max_bytes
        self.entries: OrderedDict[int, PrefixEntry] = OrderedDict()  # least recently used first
        self._index: dict[tuple[int, int], set[int]] = {}  # (length, digest) -> entry keys
        self._lengths: Counter[int] = Counter()  # entry lengths present
        self._next = 0
        self.nbytes = 0
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, tokens: list[int], state, blocks: list[int], kind: str = "finish") -> None:
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r}; allowed: {', '.join(KINDS)}")
        nbytes = sum(s.nbytes + c.nbytes for s, c in state)
        if nbytes > self.max_bytes or not tokens:
            return
        for block in blocks:
            self.pool.incref(block)
        tokens = list(tokens)
        for key, entry in self._prefixes_of(tokens, proper=False):
            if len(entry.tokens) == len(tokens):  # the same tokens: the new snapshot replaces it
                kind = "boundary" if entry.kind == "boundary" else kind
                self._drop(key)
            elif entry.kind == "finish" or (entry.kind == "prompt" and kind == "prompt"):
                self._drop(key)  # superseded (module docstring)
        *_, digest = _rolling(tokens)
        self.entries[self._next] = PrefixEntry(list(tokens), state, list(blocks), nbytes, kind, digest)
        self._index.setdefault((len(tokens), digest), set()).add(self._next)
        self._lengths[len(tokens)] += 1
        self._next += 1
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            self.evict_one()

    def lookup(self, prompt: list[int]) -> PrefixEntry | None:
        """The longest entry whose tokens are a proper prefix of `prompt` (one token must remain to compute)."""
        best_key, best = None, None
        found = self._prefixes_of(prompt, proper=True)
        if found:
            longest = len(found[-1][1].tokens)
            best_key, best = next((k, e) for k, e in found if len(e.tokens) == longest)
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        self.entries.move_to_end(best_key)
        return best

    def _prefixes_of(self, tokens: list, proper: bool) -> list[tuple[int, PrefixEntry]]:
        """(key, entry) for every entry whose tokens are a prefix of `tokens` (proper: a shorter one),
        shortest first; among equal ones the oldest first."""
        end = min(len(tokens) - (1 if proper else 0), max(self._lengths, default=0))
        out = []
        for n, h in zip(range(1, end + 1), _rolling(tokens), strict=False):
            if n in self._lengths:
                for key in sorted(self._index.get((n, h), ())):
                    if self.entries[key].tokens == tokens[:n]:
                        out.append((key, self.entries[key]))
        return out

    def evict_one(self) -> bool:
        if not self.entries:
            return False
        self._drop(next(iter(self.entries)))
        return True

    def _drop(self, key: int) -> None:
        entry = self.entries.pop(key)
        n = len(entry.tokens)
        self._index[(n, entry.digest)].discard(key)
        if not self._index[(n, entry.digest)]:
            del self._index[(n, entry.digest)]
        self._lengths[n] -= 1
        if not self._lengths[n]:
            del self._lengths[n]
        self.nbytes -= entry.nbytes
        self.pool.release(entry.blocks)

    def clear(self) -> None:
        while self.evict_one():
            pass
