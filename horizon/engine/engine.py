"""Engine: continuous batching over one model, with paged caches, sampling, thinking budgets and prefix reuse.

    engine = Engine(model, tokenizer)
    results = engine.generate([Request(prompt_ids, SamplingParams(max_tokens=64))])   # blocking

    engine.start()                                         # a background thread runs the steps
    async for event in engine.stream(Request(...)):        # TokenEvent ..., then one FinishEvent
        ...
    engine.stop()

One step is: schedule (who runs, how many tokens each), run (the ModelRunner's one forward over
all of them, the varlen batch mixing prefill chunks and decode tokens), post-process (sample,
stream events, finish). Requests and cancellations may arrive from any thread; they are applied between steps.
The engine knows token ids and the chat format's special tokens, never HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch

from horizon.chat.images import image_digest
from horizon.chat.thinking import check_thinking_budgets
from horizon.engine.constraints import Grammars, finishing
from horizon.engine.params import Event, FinishEvent, Request, TokenEvent, Usage
from horizon.engine.runner import ModelRunner, StepInputs
from horizon.engine.sampler import NothingToSample, logprobs, plain_greedy, plain_sampled, sample, sample_rows
from horizon.engine.scheduler import Scheduler
from horizon.engine.sequence import Sequence, Status
from horizon.model import HorizonCache
from horizon.model.options import ForwardOptions
from horizon.model.vision import num_image_tokens
from horizon.parallel.group import GROUP_FAILED_EXIT, broadcast_object, rank, world_size
from horizon.quant.kernels import argmax_and_finite

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    max_num_seqs: int = 16  # sequences decoding at once (KDA state slots)
    max_model_len: int | None = None  # prompt + output per sequence; None: min(model window, 32768); never past it
    block_size: int = 64  # DSA rows per cache block
    num_blocks: int | None = None  # pool size; None: every slot can reach max_model_len
    max_batch_tokens: int = 512  # tokens per forward: decodes first, then prefill chunks
    prefix_cache_bytes: int = 256 * 1024**2  # cap on the KDA snapshots kept for prefix reuse
    coverage_every: int = 0  # every N decode steps, measure how much dense attention mass top-k keeps (0: off)
    selection: str = "indexer"  # "indexer" | "recent": what DSA attends to (horizon eval --selection)
    # decode steps as compiled graphs at bucketed batch sizes (horizon.engine.runner); False is eager, the
    # reference (horizon serve compiles unless --enforce-eager; library users opt in, since a graph
    # takes one to two minutes to compile on 2 cores and freezes the weights it was compiled with)
    compile: bool = False
    # with compile: every decode graph compiles on a background thread from the engine's construction (stop()
    # ends it) and a step whose graph is not ready runs eagerly, so no request waits on a compile (horizon
    # serve; single-process engines on the CPU, see ModelRunner.compile_in_background; elsewhere graphs
    # compile on first use)
    compile_in_background: bool = False
    # under a process group of N > 1 ranks: run in lockstep with the other ranks' engines (tensor parallelism;
    # rank 0 drives). False: this rank's engine alone, over a model it holds whole (data parallelism: each
    # FSDP rank rolls out its own RL groups)
    lockstep: bool = True

    def validate(self) -> None:
        for name in ("max_num_seqs", "block_size", "max_batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name}={getattr(self, name)} must be >= 1")
        if self.selection not in ("indexer", "recent"):
            raise ValueError(f"EngineConfig.selection={self.selection!r}: allowed indexer, recent")
        if self.max_batch_tokens < self.max_num_seqs:
            raise ValueError(f"EngineConfig.max_batch_tokens={self.max_batch_tokens} must be >= max_num_seqs="
                             f"{self.max_num_seqs}, so every running sequence can decode each step")


@dataclass
class Outcome:
    """What one step did to a sequence that sampled: the token (None when it failed before one), and the
    finish (reason, error) when it ended. Under tensor parallelism the driver broadcasts these."""

    token: int | None = None
    forced: bool = False
    logprob: float | None = None
    top: list | None = None
    reason: str | None = None
    error: str | None = None
    error_kind: str | None = None

    def for_followers(self) -> Outcome:
        return Outcome(self.token, self.forced, None, None, self.reason, self.error, self.error_kind)


class QueueFull(Exception):
    def __init__(self, queued: int, limit: int):
        super().__init__(f"{queued} requests are waiting (limit {limit})")
        self.queued, self.limit = queued, limit


class EngineClosed(Exception):
    """The engine takes no new requests (the server is draining)."""


@dataclass
class Result:
    """Everything one request produced (from `Engine.generate`)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    forced: list[int] = field(default_factory=list)  # positions in token_ids the engine forced, not sampled
    events: list[Event] = field(default_factory=list)
    finish: FinishEvent | None = None

    @property
    def usage(self) -> Usage:
        return self.finish.usage


class Stats:
    """Counters the server exports (horizon serve's /metrics)."""

    def __init__(self):
        self.steps = 0
        self.forwards_multi_seq = 0  # forwards that carried more than one sequence
        self.max_seqs_in_forward = 0
        self.tokens_computed = 0  # tokens the model processed (prefill + decode)
        self.tokens_generated = 0
        self.prompt_tokens_cached = 0
        self.images_encoded = 0  # images run through the vision encoder (not those resumed from cache)
        self.thinking_tokens = {"low": 0, "high": 0, "max": 0}
        self.requests_finished = 0
        self.ttft: deque[float] = deque(maxlen=256)  # seconds from arrival to first token
        self.recent: deque[tuple[float, int]] = deque(maxlen=64)  # (time, tokens generated) per step
        self.coverage: deque[float] = deque(maxlen=256)  # sampled top-k share of dense attention mass

    def tokens_per_second(self) -> float:
        if len(self.recent) < 2:
            return 0.0
        (t0, _), (t1, _) = self.recent[0], self.recent[-1]
        return sum(n for _, n in list(self.recent)[1:]) / max(t1 - t0, 1e-9)


class EventStream:
    """One request's events for an asyncio consumer (see Engine.open_stream)."""

    def __init__(self, engine: Engine, request_id: str):
        self.engine, self.request_id = engine, request_id
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.done = False

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> Event:
        if self.done:
            raise StopAsyncIteration
        event = await self.queue.get()
        if isinstance(event, FinishEvent):
            self.done = True
        return event

    def cancel(self) -> None:
        """Cancel the request unless it already finished (frees its slot and blocks before the next step)."""
        if not self.done:
            self.done = True
            self.engine.cancel(self.request_id)


class Engine:
    def __init__(self, model, tokenizer, config: EngineConfig | None = None,
                 generation_config: dict | None = None):
        self.model, self.tokenizer = model.eval(), tokenizer
        self.config = config = config or EngineConfig()
        config.validate()
        window = model.config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > window:
            how = ("its rope_scaling already gives that window" if model.config.rope_scaling else
                   "a longer window needs a checkpoint whose config declares rope_scaling (YaRN) for it")
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context window of {window} "
                             f"tokens (max_position_embeddings; {how})")
        self.max_model_len = config.max_model_len or min(window, 32768)
        p = model.embed.weight
        self.cache = HorizonCache(model.cache_config, config.max_num_seqs, self.max_model_len, dtype=p.dtype,
                                  device=p.device, block_size=config.block_size,
                                  num_blocks=config.num_blocks or
                                  config.max_num_seqs * math.ceil(self.max_model_len / config.block_size))
        self.device = p.device
        self.runner = ModelRunner(model, self.cache, compile=config.compile)
        self.scheduler = Scheduler(self.cache, config.max_batch_tokens, config.prefix_cache_bytes)
        gen = generation_config or {}
        self.budgets = check_thinking_budgets(gen.get("thinking_budgets", {}), "generation_config")
        special = tokenizer.special
        self.stop_ids = {special.assistant_end, special.end_of_text}
        self.image_id = special.image
        self.grammars = Grammars(tokenizer)
        self._thinking_masks: dict[int, torch.Tensor] = {}  # vocab size -> what constrained thinking may sample
        self.stats = Stats()
        self.sequences: dict[str, Sequence] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # ("submit", seq) / ("cancel", id)
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._decode_steps = 0
        self._admission = threading.Lock()
        self._closed: str | None = None  # why new requests are refused (close()), or None
        # tensor parallelism (horizon.parallel): every rank runs this engine; rank 0 drives (takes requests,
        # samples) and broadcasts what the others must do, so their schedulers and caches stay identical
        self.ranks, self.is_driver = (world_size(), rank() == 0) if config.lockstep else (1, True)
        self._followers_stopped = False
        if self.ranks > 1:
            mine = (self.cache.num_blocks, config.max_num_seqs, self.max_model_len, config.block_size)
            if broadcast_object(mine) != mine:
                raise ValueError(f"rank {rank()}'s engine differs from rank 0's (blocks, slots, window, block "
                                 f"size {mine}): every rank must be started with the same settings")
        self._compile_in_background()

    def _compile_in_background(self) -> None:
        # not under tensor parallelism: the compile thread's collectives would interleave with the steps'
        if self.config.compile_in_background and self.ranks == 1:
            self.runner.compile_in_background()

    # --- requests ----------------------------------------------------------------------------------
    def submit(self, request: Request, on_event: Callable[[Event], None], max_queued: int | None = None) -> None:
        """Queue a request (thread-safe); `on_event` receives its events on the engine's thread. With
        `max_queued`, QueueFull when that many accepted requests would wait with no free slot (so at most
        max_num_seqs + max_queued are ever accepted and unfinished); EngineClosed after `close()`."""
        seq = self._make_sequence(request, on_event)
        with self._admission:  # the check and the insert are one step: a burst cannot overshoot the limit
            if self._closed is not None:
                raise EngineClosed(self._closed)
            if request.request_id in self.sequences:
                raise ValueError(f"request_id {request.request_id!r} is already in use")
            # free slots take requests at the next step: they never wait, so they do not count against the queue.
            # Counted from the accepted requests alone (added only under this lock): the scheduler's running list
            # and slot pool change on the engine's thread one after the other, and reading both mid-step refused
            # a request while a slot was still free (a flaky admission test, 1 run in 5).
            waiting = len(self.sequences) - self.config.max_num_seqs
            if max_queued is not None and waiting >= max_queued:
                raise QueueFull(waiting, max_queued)
            self.sequences[seq.id] = seq
            self._inbox.put(("submit", seq))
        self._wake.set()

    def _make_sequence(self, request: Request, on_event: Callable[[Event], None]) -> Sequence:
        """The request checked (ValueError saying what is wrong) and turned into a sequence."""
        params = request.params
        params.validate(self.model.config.vocab_size)
        prompt = request.prompt_ids
        if not prompt:
            raise ValueError("prompt_ids is empty: at least one token is needed")
        if any(not 0 <= t < self.model.config.vocab_size for t in prompt):
            raise ValueError(f"prompt_ids must be token ids in [0, {self.model.config.vocab_size})")
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = "
                             f"{len(prompt) + params.max_tokens} exceeds the context window of "
                             f"{self.max_model_len} tokens")
        capacity = self.cache.num_blocks * self.cache.block_size
        if len(prompt) + params.max_tokens > capacity:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) needs more cache "
                             f"than the whole pool holds ({self.cache.num_blocks} blocks of "
                             f"{self.cache.block_size} tokens = {capacity})")
        budget = params.thinking_budget
        if budget is None and params.tier is not None:
            budget = int(self.budgets[params.tier])
        layout = self._image_layout(request) if request.images or self.image_id in prompt else None
        matcher = self.grammars.matcher(request.constraint) if request.constraint is not None else None
        return Sequence(request, self.tokenizer, budget, self.stop_ids, on_event, matcher, layout)

    @property
    def queued(self) -> int:
        """Accepted requests not running now: those waiting for a slot, preempted, or not yet seen by a step."""
        return max(0, len(self.sequences) - len(self.scheduler.running))

    def _image_layout(self, request: Request) -> list[tuple[int, int, str]]:
        """(first position, tokens, pixel digest) per image: the prompt's image placeholders, in order, are
        the images' token runs (their counts set by each image's size, model/vision.py)."""
        images = request.images or []
        cfg = self.model.config
        if images and self.model.vision is None:
            raise ValueError("this model has no vision encoder: it takes text only")
        positions = [i for i, t in enumerate(request.prompt_ids) if t == self.image_id]
        layout, at = [], 0
        for j, img in enumerate(images):
            if not (isinstance(img, torch.Tensor) and img.dtype == torch.uint8 and img.dim() == 3
                    and img.shape[-1] == 3 and img.shape[0] > 0 and img.shape[1] > 0):
                raise ValueError(f"images[{j}] must be an RGB uint8 tensor [H, W, 3]")
            n = num_image_tokens(cfg, img.shape[0], img.shape[1])
            run = positions[at: at + n]
            if len(run) < n or run[-1] - run[0] != n - 1:
                raise ValueError(f"images[{j}] ({img.shape[1]}x{img.shape[0]} px) needs a run of {n} image "
                                 f"placeholders in the prompt; the prompt has {len(positions) - at} left")
            layout.append((run[0], n, image_digest(img)))
            at += n
        if at != len(positions):
            raise ValueError(f"the prompt has {len(positions)} image placeholders but the images fill {at}")
        return layout

    def close(self, message: str = "the server is shutting down") -> None:
        """Refuse new requests from now on (EngineClosed); running ones go on until `abort_all` or stop()."""
        with self._admission:
            self._closed = message

    def abort_all(self, message: str = "the server is shutting down") -> None:
        """End every request now with an error of kind "unavailable" (a drain's deadline has passed)."""
        self._inbox.put(("abort", message))
        self._wake.set()

    def _abort_all(self, message: str) -> None:
        for seq in list(self.sequences.values()):
            self._finish(seq, "error", f"{message}; the request was stopped before it finished (retry it)",
                         "unavailable")

    def cancel(self, request_id: str) -> None:
        """Stop a request (client gone); its slot and blocks are freed before the next forward."""
        self._inbox.put(("cancel", request_id))
        self._wake.set()

    def _drain_inbox(self) -> None:
        """Apply what arrived since the last step. Under tensor parallelism the driver (rank 0) broadcasts
        it first and the other ranks apply the same items (the requests themselves, rebuilt there)."""
        items = []
        if self.is_driver:
            while True:
                try:
                    items.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
        if self.ranks > 1:
            wire = [(kind, item.request if kind == "submit" else item) for kind, item in items]
            wire = broadcast_object(wire)
            if not self.is_driver:
                items = [(kind, self._follow_submit(item) if kind == "submit" else item) for kind, item in wire]
        for kind, item in items:
            if kind == "submit":
                self.scheduler.waiting.append(item)
            elif kind == "abort":
                self._abort_all(item)
            elif kind == "stop":
                self._stopping = True
            else:
                seq = self.sequences.get(item)
                if seq is not None:
                    self._finish(seq, "cancelled")

    def _follow_submit(self, request: Request) -> Sequence:
        seq = self._make_sequence(request, lambda event: None)  # only the driver talks to clients
        self.sequences[seq.id] = seq
        return seq

    # --- the step ----------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or not self._inbox.empty())

    @torch.inference_mode()
    def step(self) -> bool:
        """One schedule -> forward -> sample round. Returns False when there was nothing to do."""
        self._drain_inbox()
        plan, failed = self.scheduler.schedule()
        for seq in failed:
            self._finish(seq, "error", f"the request needs more cache blocks than the pool holds "
                                       f"({self.cache.num_blocks} blocks of {self.cache.block_size} tokens)")
        if not plan:
            return False
        plan, mask, embeds = self._image_inputs(plan)
        if not plan:
            return True  # every sequence of this step failed on its images
        step = StepInputs([seq.tokens[seq.num_cached: seq.num_cached + n] for seq, n in plan],
                          [seq.num_cached for seq, _ in plan], [seq.slot for seq, _ in plan], mask, embeds)
        options = self._options(step)
        logits = self.runner.run(step, options)
        self._read_probe(options)
        if self.is_driver:
            # one pass over every row for the greedy pick and the finite check (_decide takes the pick for plain
            # greedy rows): row by row, each took ~30 us of overhead, and a sum / isfinite / all check took
            # 0.1-0.15 ms a batch-1 step, the ATen code cold after the forward
            best, finite = (t.tolist() for t in argmax_and_finite(logits))
            drawn = self._draw_plain(plan, logits, finite)
            outcomes = [self._advance(seq, n, row, ok, b, drawn.get(i))
                        for i, ((seq, n), row, ok, b) in enumerate(zip(plan, logits, finite, best, strict=True))]
        if self.ranks > 1:  # the other ranks do what the driver decided (never their own sampling)
            wire = broadcast_object([o.for_followers() if o else None for o in outcomes] if self.is_driver else None)
            if not self.is_driver:
                outcomes = [self._follow(seq, n, o) for (seq, n), o in zip(plan, wire, strict=True)]
        generated = sum(o is not None and o.token is not None for o in outcomes)
        s = self.stats
        s.steps += 1
        s.tokens_computed += sum(n for _, n in plan)
        s.tokens_generated += generated
        s.max_seqs_in_forward = max(s.max_seqs_in_forward, len(plan))
        s.forwards_multi_seq += len(plan) > 1
        s.recent.append((time.perf_counter(), generated))
        return True

    def _draw_plain(self, plan: list, logits: torch.Tensor, finite: list[bool]) -> dict[int, int]:
        """Row -> token for the rows that sample plainly this step (temperature > 0; no grammar, forced token or
        logit adjustment; finite), drawn in one call when there are two or more (as sample() would draw each)."""
        rows = [i for i, ((seq, n), ok) in enumerate(zip(plan, finite, strict=True))
                if ok and seq.num_cached + n >= len(seq.tokens) and seq.matcher is None
                and seq.forced_token() is None and plain_sampled(seq.params)]
        if len(rows) < 2:
            return {}
        seqs = [plan[i][0] for i in rows]
        try:
            tokens = sample_rows(logits[rows], [s.params for s in seqs], [s.generator for s in seqs])
        except Exception:  # each row then samples alone, where a failure ends only its own sequence
            log.exception("drawing %d rows at once failed; drawing them one at a time", len(rows))
            return {}
        return dict(zip(rows, tokens, strict=True))

    def _reached_end(self, seq: Sequence, n: int) -> bool:
        """Count the n tokens the forward computed (with the prefix snapshots they pass); True when the
        sequence now samples its next token."""
        seq.num_cached += n
        if seq.num_cached < len(seq.tokens):
            if seq.num_cached in seq.snapshot_at and seq.num_generated == 0:
                self.scheduler.remember(seq, "boundary")  # a message boundary other branches may share
            return False  # mid-prompt: nothing to sample yet
        if seq.num_generated == 0 and seq.cached_prompt_tokens < seq.prompt_len:
            self.scheduler.remember(seq, "prompt")  # the next turn can resume here at least
        return True

    def _advance(self, seq: Sequence, n: int, row: torch.Tensor, finite: bool, best: int | None,
                 drawn: int | None = None) -> Outcome | None:
        """Post-process one sequence after the forward computed n of its tokens: snapshot, sample, emit,
        finish. Returns what happened (None: mid-prompt). One sequence's failure (its sampling, grammar,
        consumer) ends it alone."""
        try:
            if not self._reached_end(seq, n):
                return None
            outcome = self._decide(seq, row, finite, best, drawn)
            self._apply(seq, outcome)
        except Exception as e:
            log.exception("request %s failed", seq.id)
            outcome = Outcome(reason="error", error=f"{type(e).__name__}: {e}")
            self._finish(seq, outcome.reason, outcome.error)
        return outcome

    def _follow(self, seq: Sequence, n: int, outcome: Outcome | None) -> Outcome | None:
        """A non-driver rank's post-processing: the same cache bookkeeping, the driver's token and finish."""
        if self._reached_end(seq, n) != (outcome is not None):
            raise RuntimeError(f"rank state diverged: request {seq.id} at {seq.num_cached} cached tokens")
        if outcome is not None:
            self._apply(seq, outcome)
        return outcome

    def _decide(self, seq: Sequence, row: torch.Tensor, finite: bool, best: int | None = None,
                drawn: int | None = None) -> Outcome:
        """The next token of a sequence that reached its end (the driver's job: sampling and the grammar).
        `best`: the row's argmax from the step's one pass over its rows, if it has one (taken for plain greedy);
        `drawn`: its token from the step's one draw over the plainly sampled rows (_draw_plain), if it has one."""
        if not finite:  # NaN or infinity: nothing sensible to sample (bad weights, an overflow)
            return Outcome(reason="error",
                           error="the model produced non-finite logits (NaN or infinity) for this request")
        forced = seq.forced_token()
        allowed, problem = (None, None) if forced is not None else self._allowed(seq, row.shape[-1])
        if problem:
            return Outcome(reason="error", error=problem)
        try:
            if forced is not None:
                token = forced
            elif best is not None and allowed is None and plain_greedy(seq.params):
                token = best
            elif drawn is not None and allowed is None:
                token = drawn
            else:
                token = sample(row, seq.params, seq.generated, seq.generator, allowed, finite=True)
        except NothingToSample as e:
            return Outcome(reason="error", error=str(e), error_kind="invalid_request")
        lp, top = logprobs(row, token, seq.params.logprobs) if seq.params.logprobs is not None else (None, None)
        if seq.matcher is not None and not seq.thinking:
            if not seq.matcher.consume_token(token):
                return Outcome(reason="error", error=f"constraint rejected token {token}: {seq.matcher.get_error()}")
            if token < self.grammars.vocab_size and self.grammars.token_bytes[token]:
                seq.json_scan.feed(self.grammars.token_bytes[token])
            else:
                seq.json_scan.reset()
        return Outcome(token, forced is not None, lp, top)

    def _apply(self, seq: Sequence, outcome: Outcome) -> None:
        """Append the outcome's token (events, stop checks, stats) and finish the sequence if it ends. On the
        driver the finish reason comes from the append; the other ranks take the driver's."""
        if outcome.token is not None:
            was_thinking = seq.thinking
            reason = seq.append(outcome.token, outcome.logprob, outcome.top, outcome.forced)
            if self.is_driver:
                outcome.reason = reason
            if was_thinking and seq.params.tier is not None and outcome.token != seq.think_end:
                self.stats.thinking_tokens[seq.params.tier] += 1
            if seq.num_generated == 1:
                self.stats.ttft.append(seq.first_token_time - seq.arrival)
        if outcome.reason:
            self._finish(seq, outcome.reason, outcome.error, outcome.error_kind)

    def _allowed(self, seq: Sequence, vocab: int) -> tuple[torch.Tensor | None, str | None]:
        """The mask of tokens a constrained sequence may sample next (None: any), or a reason it cannot go on.

        After thinking the grammar decides. While thinking, the text is free but the turn's structure is
        not: with a constraint the thinking must close before anything else, so the ends of the turn and
        the call tokens are ruled out there (a turn ending inside thinking would answer nothing)."""
        if seq.matcher is None:
            return None, None
        if seq.thinking:
            return self._thinking_mask(vocab), None
        scan = seq.json_scan
        in_json = scan.depth > 0 or scan.in_string or scan.after_call or not seq.request.constraint.free_text
        closing = in_json and finishing(seq.params.max_tokens - seq.num_generated, seq.params.max_tokens, scan)
        allowed = self.grammars.allowed(seq.matcher, vocab, closing, seq.json_scan.in_string)
        if not bool(allowed.any()):
            return None, f"constraint has no allowed token: {seq.matcher.get_error()}"
        return allowed, None

    def _thinking_mask(self, vocab: int) -> torch.Tensor:
        mask = self._thinking_masks.get(vocab)
        if mask is None:
            sp = self.tokenizer.special
            mask = torch.ones(vocab, dtype=torch.bool)
            mask[[sp.assistant_end, sp.end_of_text, sp.tool_call, sp.tool_call_end]] = False
            self._thinking_masks[vocab] = mask
        return mask

    def _image_inputs(self, plan):
        """(the plan, the image placeholder mask over this step's tokens, the embeddings that fill it); each
        image is encoded once per request, when the first chunk holding its placeholders runs. A sequence
        whose image cannot be encoded ends alone and leaves the plan."""
        if not any(seq.images.layout for seq, _ in plan):
            return plan, None, None
        kept, masks, parts = [], [], []

        def encode(img: torch.Tensor) -> torch.Tensor:
            self.stats.images_encoded += 1
            return self.model.vision.encode(img)

        for seq, n in plan:
            try:
                mask, embeds = seq.images.chunk(seq.num_cached, n, encode)
            except Exception as e:  # one bad image fails its own request, not the step
                log.exception("request %s: encoding its image failed", seq.id)
                self._finish(seq, "error", f"encoding an image failed: {type(e).__name__}: {e}")
                continue
            kept.append((seq, n))
            masks.append(mask if mask is not None else torch.zeros(n, dtype=torch.bool))
            if embeds is not None:
                parts.append(embeds)
        if not parts:
            return kept, None, None
        return kept, torch.cat(masks).to(self.device), torch.cat(parts)

    def _finish(self, seq: Sequence, reason: str, error: str | None = None, error_kind: str | None = None) -> None:
        if seq.status is Status.FINISHED:
            return
        self.scheduler.finish(seq, keep_prefix=reason in ("stop", "length"))
        self.stats.prompt_tokens_cached += seq.cached_prompt_tokens
        self.stats.requests_finished += 1
        self.sequences.pop(seq.id, None)
        seq.images.release()
        try:
            seq.finish(reason, error, error_kind)
        except Exception:  # its consumer is gone or broken: nothing more to tell it, the engine goes on
            log.exception("request %s: delivering its finish failed", seq.id)

    # --- indexer statistics ------------------------------------------------------------------------
    def _options(self, step: StepInputs) -> ForwardOptions | None:
        """This step's attention options: None (the defaults, a compiled graph's) unless the engine selects
        differently (EngineConfig.selection) or this decode step is one of the sampled coverage probes."""
        selection = self.config.selection
        probe = False
        every = self.config.coverage_every
        if every and step.is_decode:
            self._decode_steps += 1
            probe = self._decode_steps % every == 0
        if selection == "indexer" and not probe:
            return None
        return ForwardOptions(selection=selection, measure_coverage=probe)

    def _read_probe(self, options: ForwardOptions | None) -> None:
        if options is not None:
            self.stats.coverage.extend(options.coverage.values())

    # --- driving it ------------------------------------------------------------------------------------
    def run_until_idle(self) -> None:
        while self.has_work:
            self.step()

    def generate(self, requests: list[Request]) -> list[Result]:
        """Run requests to completion on the calling thread (no background thread needed)."""
        if self._thread is not None:
            raise RuntimeError("generate() runs the engine itself; use stream() while the engine thread runs")
        results = {r.request_id: Result(r.request_id) for r in requests}

        def collect(event: Event) -> None:
            res = results[event.request_id]
            res.events.append(event)
            if isinstance(event, TokenEvent):
                if event.forced:
                    res.forced.append(len(res.token_ids))
                res.token_ids.append(event.token_id)
            else:
                res.finish = event

        for r in requests:
            self.submit(r, collect)
        self.run_until_idle()
        return [results[r.request_id] for r in requests]

    def start(self) -> None:
        """Run steps on a background thread until stop()."""
        if self._thread is not None:
            return
        self._stopping = False
        self._compile_in_background()  # resumes what a stop() cut short (a no-op while it runs)
        self._thread = threading.Thread(target=self._loop, name="horizon-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the engine thread; requests still unfinished end with an "unavailable" error (no stream hangs).
        The other ranks of a tensor-parallel group stop with it (their `follow` returns)."""
        self._stopping = True
        self._wake.set()
        self.runner.stop_compiling()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._inbox.put(("abort", "the engine stopped"))
        if self.ranks > 1 and not self._followers_stopped:
            self._inbox.put(("stop", None))
            self._followers_stopped = True
        elif self.ranks > 1:  # the group already ended: nothing to broadcast to
            self._abort_all("the engine stopped")
            return
        self._drain_inbox()

    def follow(self) -> None:
        """A non-driver rank's whole life under tensor parallelism: every step in lockstep with the driver
        (its requests, its tokens) until the driver stops. Any error propagates: the rank must exit."""
        if self.is_driver:
            raise RuntimeError("rank 0 drives the engine (start / generate); follow() is for the other ranks")
        while not self._stopping:
            self.step()

    def _loop(self) -> None:
        while not self._stopping:
            try:
                busy = self.step()
            except Exception as e:  # a failed forward must not hang every client: fail what it ran, go on
                if self.ranks > 1:
                    # the ranks are out of step (one failed or vanished): nothing can be completed, so the
                    # process exits and the launcher ends the others (horizon.parallel.launch)
                    log.critical("tensor-parallel step failed, stopping this rank: %s: %s", type(e).__name__, e)
                    os._exit(GROUP_FAILED_EXIT)
                log.exception("engine step failed")
                for seq in list(self.scheduler.running):
                    self._finish(seq, "error", f"engine error: {type(e).__name__}: {e}")
                continue
            if not busy:
                self._wake.wait(timeout=0.05)
                self._wake.clear()

    def open_stream(self, request: Request, max_queued: int | None = None) -> EventStream:
        """Submit now (a bad request raises ValueError here, before anything is streamed; see submit for
        the queue limit) and return its events as an async iterator; call its `cancel()` if the consumer
        goes away."""
        loop = asyncio.get_running_loop()
        stream = EventStream(self, request.request_id)
        self.submit(request, lambda e: loop.call_soon_threadsafe(stream.queue.put_nowait, e), max_queued)
        return stream

    async def stream(self, request: Request) -> AsyncIterator[Event]:
        """Submit and yield its events; leaving the loop early (client gone) cancels the request."""
        events = self.open_stream(request)
        try:
            async for event in events:
                yield event
        finally:
            events.cancel()

    def clear_prefix_cache(self) -> None:
        """Drop every prefix-cache entry (their blocks return to the pool)."""
        self.scheduler.prefix.clear()

    # --- introspection ---------------------------------------------------------------------------------
    def metrics(self) -> dict:
        s, sch = self.stats, self.scheduler
        return {
            "queue_length": self.queued, "running": len(sch.running),
            "blocks_used": sch.blocks_in_use, "blocks_free": sch.blocks.num_free,
            "blocks_prefix_cache": len({b for e in sch.prefix.entries.values() for b in e.blocks}),
            "slots_free": sch.slots.num_free, "prefix_entries": len(sch.prefix),
            "prefix_cache_bytes": sch.prefix.nbytes, "prefix_hits": sch.prefix.hits,
            "prefix_misses": sch.prefix.misses, "preemptions": sch.preemptions,
            "steps": s.steps, "forwards_multi_seq": s.forwards_multi_seq,
            "max_seqs_in_forward": s.max_seqs_in_forward, "tokens_computed": s.tokens_computed,
            "tokens_generated": s.tokens_generated, "prompt_tokens_cached": s.prompt_tokens_cached,
            "images_encoded": s.images_encoded,
            "tokens_per_second": s.tokens_per_second(),
            "ttft_mean_s": sum(s.ttft) / len(s.ttft) if s.ttft else None,
            "thinking_tokens": dict(s.thinking_tokens),
            "indexer_topk_coverage_mean": sum(s.coverage) / len(s.coverage) if s.coverage else None,
            "decode_graphs_compiled": len(self.runner.graphs_seen),
            "decode_graphs_pending": self.runner.graphs_pending,
            "compile_seconds": self.runner.compile_seconds,
        }
