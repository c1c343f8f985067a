"""Scheduler: who runs in the next forward, and the cache memory each of them needs.

Each step: running sequences that decode get one token each, then running prefills get chunks
from what is left of the token budget (so a long prompt never stalls the others), then waiting
requests are admitted in arrival order while a KDA slot is free. Admission looks up the prefix
cache: a prompt that extends a finished turn resumes from its KDA snapshot and shares its full
DSA blocks (the partly filled last block is copied, so the two never write the same rows).

When the block pool runs dry the policy is, in order: evict least-recently-used prefix-cache
entries; preempt the most recently admitted running sequence (its slot and blocks are freed and it
goes back to the front of the queue; when re-admitted it recomputes its tokens, and its output so
far is kept); a request that cannot fit even alone finishes with an error. Nothing crashes and
no other request's cache is touched.
"""

from __future__ import annotations

import math
from collections import deque

from horizon.engine.blocks import BlockPool, PrefixCache, SlotPool
from horizon.engine.sequence import Sequence, Status
from horizon.model.cache import HorizonCache


class Scheduler:
    def __init__(self, cache: HorizonCache, max_batch_tokens: int, prefix_cache_bytes: int):
        self.cache = cache
        self.block_size = cache.block_size
        self.max_batch_tokens = max_batch_tokens
        self.blocks = BlockPool(cache.num_blocks)
        self.slots = SlotPool(cache.num_slots)
        self.prefix = PrefixCache(self.blocks, prefix_cache_bytes)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.preemptions = 0

    # --- the step plan -------------------------------------------------------------------------------
    def schedule(self) -> tuple[list[tuple[Sequence, int]], list[Sequence]]:
        """[(sequence, tokens to compute now)] for one forward, and requests that can never fit."""
        plan: dict[Sequence, int] = {}
        failed: list[Sequence] = []
        budget = self.max_batch_tokens
        decoding = [s for s in self.running if s.tokens_to_compute() == 1]
        prefilling = [s for s in self.running if s.tokens_to_compute() > 1]
        for seq in decoding + prefilling:
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            n = seq.chunk(budget)
            if n < 1:
                break
            fits = self._reserve(seq, n)
            while not fits and (victim := self._youngest_other(seq)) is not None:
                budget += plan.pop(victim, 0)
                self.preempt(victim)
                fits = self._reserve(seq, n)
            if fits:
                plan[seq] = n
                budget -= n
            else:  # alone in the pool and still no room (the engine's submit check prevents this)
                failed.append(seq)
                self._free(seq)
        while self.waiting and self.slots.num_free and budget > 0:
            seq = self.waiting[0]
            if not self._admit(seq):
                if not self.running and not plan:
                    failed.append(self.waiting.popleft())  # cannot fit even in an empty pool
                    continue
                break
            self.waiting.popleft()
            self.running.append(seq)
            n = seq.chunk(budget)
            if not self._reserve(seq, n):
                self.preempt(seq)
                break
            plan[seq] = n
            budget -= n
        return list(plan.items()), failed

    # --- memory --------------------------------------------------------------------------------------
    def _ensure_free(self, blocks: int) -> bool:
        while self.blocks.num_free < blocks:
            if not self.prefix.evict_one():
                return False
        return True

    def _reserve(self, seq: Sequence, n: int) -> bool:
        """Blocks for positions up to seq.num_cached + n."""
        need = math.ceil((seq.num_cached + n) / self.block_size) - len(seq.blocks)
        if need > 0:
            if not self._ensure_free(need):
                return False
            seq.blocks += [self.blocks.allocate() for _ in range(need)]
            self._write_table(seq)
        return True

    def _write_table(self, seq: Sequence) -> None:
        row = self.cache.block_table[seq.slot]
        row.fill_(-1)
        row[: len(seq.blocks)] = row.new_tensor(seq.blocks)

    def _admit(self, seq: Sequence) -> bool:
        """Give a waiting sequence a slot, resuming from the prefix cache when its prompt extends an entry."""
        need_first = math.ceil(min(len(seq.tokens), self.max_batch_tokens) / self.block_size)
        if len(seq.tokens) > self.cache.max_len or not self._fits(need_first):
            return False
        seq.slot = self.slots.allocate()
        self.cache.reset([seq.slot])
        entry = self.prefix.lookup(seq.key()) if seq.num_generated == 0 else None
        if entry is not None:
            n = len(entry.tokens)
            full, partial = divmod(n, self.block_size)
            keep = entry.blocks[: full + (1 if partial else 0)]
            for block in keep:  # our own references first: evictions below cannot free them
                self.blocks.incref(block)
            if partial:
                if self._ensure_free(1):
                    copy = self.blocks.allocate()
                    self.cache.copy_blocks([keep[-1]], [copy])
                    self.blocks.release([keep[-1]])
                    keep = keep[:-1] + [copy]
                else:
                    # no block for the copy; the KDA snapshot is at position n, so resuming from the
                    # full blocks alone is impossible: compute from scratch instead
                    self.blocks.release(keep)
                    entry = None
            if entry is not None:
                seq.blocks = keep
                self.cache.restore_state(seq.slot, entry.state)
                seq.num_cached = seq.cached_prompt_tokens = n
        self.cache.lens[seq.slot] = seq.num_cached
        self._write_table(seq)
        seq.status = Status.RUNNING
        return True

    def _fits(self, blocks: int) -> bool:
        return self.blocks.num_free + sum(len(e.blocks) for e in self.prefix.entries.values()) >= blocks

    def _youngest_other(self, seq: Sequence) -> Sequence | None:
        for other in reversed(self.running):
            if other is not seq:
                return other
        return None

    # --- leaving ---------------------------------------------------------------------------------------
    def _free(self, seq: Sequence) -> None:
        if seq.slot is not None:
            self.blocks.release(seq.blocks)
            self.cache.block_table[seq.slot].fill_(-1)
            self.cache.lens[seq.slot] = 0
            self.slots.release(seq.slot)
        seq.slot, seq.blocks = None, []
        if seq in self.running:
            self.running.remove(seq)

    def preempt(self, seq: Sequence) -> None:
        """Free its memory and requeue it first; it recomputes its tokens when re-admitted."""
        self._free(seq)
        seq.num_cached = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def remember(self, seq: Sequence, kind: str) -> None:
        """Snapshot a sequence's state where its computed tokens end now: "prompt" when its prompt has just
        been computed (before its first generated token), "boundary" at a snapshot point inside it."""
        n = seq.num_cached
        self.prefix.add(seq.key(n), self.cache.snapshot_state(seq.slot),
                        seq.blocks[: math.ceil(n / self.block_size)], kind=kind)

    def finish(self, seq: Sequence, keep_prefix: bool) -> None:
        """Release a finished sequence; with keep_prefix its state goes to the prefix cache first."""
        if keep_prefix and seq.slot is not None and seq.num_cached:
            n = seq.num_cached
            self.prefix.add(seq.key(n), self.cache.snapshot_state(seq.slot),
                            seq.blocks[: math.ceil(n / self.block_size)])
        self._free(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)

    @property
    def blocks_in_use(self) -> int:
        return self.blocks.num_blocks - self.blocks.num_free
