"""ModelRunner: the engine's hands on the model (docs/design.md §4), as in nano-vllm / vLLM.

It owns the model, its device and its paged cache, turns one scheduled step (per sequence: its new
tokens, where they start, its cache slot) into the varlen inputs, runs the forward and returns one
row of logits per sequence. The engine above it never builds tensors for the model.

Decode steps (every sequence adds one token, no images) run as compiled graphs (`torch.compile`,
inductor; on CUDA with CUDA graphs, mode "reduce-overhead"), one per bucketed batch size: the batch
is padded to the next bucket with rows that live in the cache's scratch slot, as vLLM pads to its
captured sizes. Inside a graph nothing is read back to the host: the batch layout is built from
device tensors (Batch.decode), MoE dispatch is a grouped matmul, the indexer's top-k is the exact
integer form. The context length is a symbolic size, so a growing context does not recompile;
crossing the indexer's top-k (dense attention below it, sparse selection above) is a second graph. On
CUDA, where a CUDA graph has fixed shapes, the context is padded to a power of two (one recording per
width), the cache's tensors are static inputs the graphs write in place, and the logits are copied out.
Validation (capacity, window) happens here, on host numbers, before the graph runs. Prefill
chunks and mixed steps run eagerly: they are compute-bound, and their shapes vary step to step.

A compiled runner on the CPU first moves the model's weights into one arena on 2 MB pages
(horizon/engine/memory.py): every step streams them, and on 4 KB pages their address translations miss the TLB.

Eager is the reference: `compile=False` (`horizon serve --enforce-eager`) runs every step through
`model.forward_batch` directly, and the tests check the compiled step against it.

A graph compiles on the first step that needs it, which then waits (tens of seconds on 2 cores), and so
does every request in that step. `compile_in_background()` (what `horizon serve` does) compiles every
graph the runner can need on a thread of its own instead, and a step whose graph is not ready yet runs
eagerly: no request waits on a compile.
"""

from __future__ import annotations

import atexit
import hashlib
import inspect
import logging
import sys
import threading
import time
import types
from dataclasses import dataclass

import torch
from torch._guards import detect_fake_mode
from torch._inductor.custom_graph_pass import CustomGraphPass

from horizon.engine.memory import Placement, place_weights
from horizon.model import Batch, HorizonCache
from horizon.model.options import ForwardOptions
from horizon.quant.kernels import FEW_ROWS, FUSED_ONE_ROW_MAX, few_rows

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SWITCH_INTERVAL_WHILE_COMPILING = 5e-5  # seconds (sys.setswitchinterval; see ModelRunner._compile_pending)

# On CPU, inductor may rewrite a one-row matmul (a batch-1 decode projection) as a multiply-and-sum it
# generates itself: that loop streams a [512 -> 1024] fp32 weight at ~25-35 GB/s on 2 cores where the
# sgemv call reaches ~10 (measured; the batch-1 step of `small` goes from 34 to 18 ms), and it fuses with
# the norms and activations around it. Its size limit is inductor's default (FUSED_ONE_ROW_MAX, 2,048)
# where the CPU kernels run: the LM head stays a matmul and FewRowMatmuls sends it to rows_matmul, faster
# again (horizon.quant.kernels says by how much). Without the kernels it is raised to cover any projection.
MM_AS_REDUCTION = 1 << 17
# The generated wrapper checks every input's size and stride (and alignment) before each step: ~370 checks a
# batch-1 `small` step, 0.35-0.6 ms of Python, 5-9% of an MXFP4 + int8 step (two engines in one process,
# alternating). They can only fail if the model's tensors change under the graph, which the runner rules
# out (its dynamo guards skip the modules for the same reason, below); the step's own inputs are built here.
NO_ASSERTS = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}
# The wrapper itself in C++ (cpp_wrapper): the Python one runs ~2,000 lines a batch-1 `small` step (buffer
# views, allocations, ~60 op calls), ~1 ms of a 4.4 ms MXFP4 + int8 graph (cProfile). Measured with two engines
# in one process, alternating: MXFP4 + int8 4.87 -> 4.44 ms, MXFP4 10.07 -> 9.46 ms. The price is the first
# compile of each graph, 32-36 s -> 55-64 s there (inductor's cache keeps it for the next start) and ~70 s
# more for the test suite's runner tests.


def cpu_options(kernels: bool) -> dict:
    """inductor options for a CPU decode graph; `kernels`: the CPU kernels are built (kernel_available()).
    Also sets inductor's process-wide one-row rewrite limit to match: that pass reads its limit from the
    config only when first imported."""
    limit = FUSED_ONE_ROW_MAX if kernels else MM_AS_REDUCTION
    from torch._inductor.fx_passes import decompose_mem_bound_mm

    decompose_mem_bound_mm.cpu_max_other_dimension_decomposition = limit
    options = {"post_grad_fusion_options": {"decompose_mm_pass": {"cpu_max_other_dimension_decomposition": limit}},
               "cpp_wrapper": True, **NO_ASSERTS}
    return dict(options, post_grad_custom_post_pass=FewRowMatmuls()) if kernels else options


class FewRowMatmuls(CustomGraphPass):
    """Inductor post-grad pass: `x @ W.T` (mm / addmm of a weight's transpose) with a few rows on the CPU
    becomes `rows_matmul(x, W)` (+ bias, in fp32), rounded back to x's dtype as F.linear rounds its output.

    Runs after inductor's own rewrites, so one-row products (batch 1) up to FUSED_ONE_ROW_MAX are already its
    fused multiply-and-sum loops and stay so; a larger one (the LM head) comes here as a matmul."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        aten = torch.ops.aten
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in (aten.mm.default, aten.addmm.default):
                continue
            if node.target is aten.addmm.default:
                if node.kwargs:  # beta / alpha other than 1
                    continue
                bias, x, wt = node.args
            else:
                (x, wt), bias = node.args, None
            if not (isinstance(wt, torch.fx.Node) and wt.target is aten.permute.default
                    and list(wt.args[1]) == [1, 0]):
                continue
            w = wt.args[0]
            xv, wv = x.meta.get("val"), w.meta.get("val")
            if xv is None or wv is None or xv.device.type != "cpu" or wv.dim() != 2 or xv.dtype != wv.dtype:
                continue
            rows = xv.shape[0]
            if not isinstance(rows, int) or not 1 <= rows <= few_rows(xv.dtype) or not wv.is_contiguous():
                continue
            mode = detect_fake_mode([xv, wv])
            with graph.inserting_before(node), mode:
                y = graph.call_function(torch.ops.horizon_kernels.rows_matmul.default, (x, w))
                y.meta["val"] = value = torch.ops.horizon_kernels.rows_matmul.default(xv, wv)
                if bias is not None:
                    y = graph.call_function(aten.add.Tensor, (y, bias))
                    y.meta["val"] = value = value + bias.meta["val"]
                if xv.dtype != torch.float32:
                    y = graph.call_function(torch.ops.prims.convert_element_type.default, (y, xv.dtype))
                    y.meta["val"] = value.to(xv.dtype)
            node.replace_all_uses_with(y)
            graph.erase_node(node)

    def uuid(self) -> str:
        from horizon.quant.kernels import _source_hash

        # the compiled graphs cached by inductor depend on this pass, on the kernel it calls, and on the row limits
        # this CPU gets (few_rows: bf16 up to 64 rows with AMX or on the AVX2 path, 8 otherwise)
        limits = repr([few_rows(dtype) for dtype in FEW_ROWS])
        return hashlib.sha256(inspect.getsource(FewRowMatmuls).encode() + _source_hash().encode()
                              + limits.encode()).hexdigest()


@dataclass
class StepInputs:
    """One scheduled step on the host: per sequence its new tokens, first position and cache slot."""

    tokens: list[list[int]]
    starts: list[int]
    slots: list[int]
    image_mask: torch.Tensor | None = None  # [sum of new tokens] bool, image placeholder positions
    image_embeds: torch.Tensor | None = None  # [image_mask.sum(), hidden]

    @property
    def is_decode(self) -> bool:
        return self.image_mask is None and all(len(t) == 1 for t in self.tokens)


# Background compiles still running (their threads and stop events). At exit each stops after its graph and is
# waited for: a daemon thread still inside torch's C++ code when the interpreter finalises is unwound by
# pthread_exit through frames that may not throw, and the process aborts ("terminate called without an active
# exception") instead of exiting.
_compiles: list[tuple[threading.Thread, threading.Event]] = []


@atexit.register
def _finish_compiles() -> None:
    for _, stop in _compiles:
        stop.set()
    for thread, _ in _compiles:
        thread.join()


def compiling_in_background() -> bool:
    """Whether a runner's background compile is still running in this process."""
    return any(thread.is_alive() for thread, _ in _compiles)


class ModelRunner:
    def __init__(self, model, cache: HorizonCache, compile: bool = True, buckets: tuple[int, ...] | None = None):
        self.model, self.cache = model, cache
        self.device = model.embed.weight.device
        self.compile = compile
        limit = cache.num_slots
        buckets = sorted(set(buckets or DEFAULT_BUCKETS))
        self.buckets = [b for b in buckets if b < limit] + [limit]  # the largest always fits every slot
        self._graph = None
        self.compile_seconds = 0.0  # time spent in steps that compiled a new graph
        self.graphs_seen: set[tuple[int, bool]] = set()  # (bucket, sparse) pairs compiled so far
        self.graphs_failed: dict[tuple[int, bool], str] = {}  # background compiles that failed: their steps stay eager
        self._lock = threading.Lock()  # the graph's creation and the counts above (the compile thread's, the steps')
        self._compiling: threading.Thread | None = None  # compile_in_background's thread
        self._pending: list[tuple[int, bool]] = []  # the graphs it has still to compile
        self._stop = threading.Event()
        if compile:
            # build the CPU kernels / import the Triton one now (or learn that they cannot be): the graphs read
            # that, and a kernel that arrives after the first graph would change what it should call, a recompile
            from horizon.quant.kernels import mxfp4_kernel_runs_on

            mxfp4_kernel_runs_on(self.device)
            model.use_decode_layouts()
        # the weights in one arena on 2 MB pages (engine/memory.py): after the re-layout, before any graph
        # (compiled runners only: the eager one is the reference, and training may hold the model it serves)
        if not compile:
            self.weight_placement = Placement(reason="an eager runner")
        elif self.device.type != "cpu":
            self.weight_placement = Placement(reason=f"on {self.device.type}, not the CPU")
        else:
            self.weight_placement = place_weights(model)

    # --- the step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, step: StepInputs, options: ForwardOptions | None = None) -> torch.Tensor:
        """fp32 logits [B, V]: the next-token distribution after each sequence's last new token.

        `options` (per-call attention modes and probes) other than the defaults run eagerly: a graph is
        compiled for the defaults only."""
        if self.compile and step.is_decode and (options is None or options == ForwardOptions()):
            logits = self._decode(step)
            if logits is not None:
                return logits
        lens = [len(t) for t in step.tokens]  # eager: forward_batch checks the window and the cache itself
        tokens = torch.tensor([t for run in step.tokens for t in run], device=self.device)
        batch = Batch.build(lens, start=step.starts, slots=step.slots, device=self.device)
        return self.model.forward_batch(tokens, batch, self.cache, last_only=True, image_embeds=step.image_embeds,
                                        image_mask=step.image_mask, options=options)

    def bucket(self, batch_size: int) -> int:
        return next(b for b in self.buckets if b >= batch_size)

    def _decode(self, step: StepInputs) -> torch.Tensor | None:
        """One compiled decode step; the checks forward_batch makes eagerly happen here on host numbers.
        None while the step's graph is still to come from the background compile (the step runs eagerly)."""
        B = len(step.tokens)
        max_ctx = max(step.starts) + 1
        key = (self.bucket(B), self._sparse(max_ctx))
        if self._compiling is not None and key not in self.graphs_seen:
            return None  # (forward_batch makes the checks below itself)
        if max_ctx > self.model.config.max_position_embeddings:
            raise ValueError(f"context of {max_ctx} tokens exceeds the model's window "
                             f"max_position_embeddings={self.model.config.max_position_embeddings}")
        if max_ctx > self.cache.max_len:
            raise ValueError(f"the step needs {max_ctx} cached positions but the cache holds "
                             f"max_len={self.cache.max_len}")
        if not self.cache.static:  # a new block must exist for every row's position (host-side block table)
            table = self.cache.block_table
            for slot, pos in zip(step.slots, step.starts, strict=True):
                if int(table[slot, pos // self.cache.block_size]) < 0:
                    raise ValueError(f"no cache block assigned for slot {slot} at position {pos}")
        pad = key[0] - B
        scratch = self.cache.scratch_slot
        # padding rows: position 0 of the scratch slot (their own block; nothing real reads it)
        tokens = torch.tensor([t[0] for t in step.tokens] + [0] * pad, device=self.device)
        start = torch.tensor(step.starts + [0] * pad, device=self.device)
        slots = torch.tensor(step.slots + [scratch] * pad, device=self.device)
        logits = self._call(key, tokens, start, slots, self._context_bucket(max_ctx, key[1]))[:B]
        # on CUDA the rows live in the CUDA graph's output buffer, which the next replay overwrites
        return logits.clone() if self.device.type == "cuda" else logits

    def _context_bucket(self, max_ctx: int, sparse: bool) -> int:
        """The context width the step's graph runs at. On the CPU the step's own: one graph serves every length.
        On CUDA a graph is recorded per distinct size (CUDA graphs have fixed shapes), so the width is rounded up
        to a power of two, within the step's attention (dense up to index_topk, sparse past it) and the cache:
        about log2(max_len) recordings per bucket instead of one per token. Positions past a row's end are masked
        as in any batch of unequal contexts, so the result is the same up to summation order."""
        if self.device.type != "cuda":
            return max_ctx
        limit = self.cache.max_len if sparse else self._dense_limit()
        return min(max(2, 1 << (max_ctx - 1).bit_length()), limit)

    def _call(self, key: tuple[int, bool], tokens: torch.Tensor, start: torch.Tensor, slots: torch.Tensor,
              max_ctx: int) -> torch.Tensor:
        """Run the compiled step for `key` (compiling its graph if this is the first call), counting a compile."""
        # the context length travels as a tensor's size, marked dynamic: one graph for every length
        ctx = torch.empty(max_ctx, 0, device=self.device)
        torch._dynamo.maybe_mark_dynamic(ctx, 0)
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()  # a new step: the last replay's outputs may be overwritten
        logits = self._compiled()(tokens, start, slots, ctx)
        if key not in self.graphs_seen:
            seconds = time.perf_counter() - t0
            with self._lock:
                self.graphs_seen.add(key)
                self.compile_seconds += seconds
            log.info("compiled the decode step for %s in %.1f s", _graph_name(key), seconds)
        return logits

    # --- compiling ahead of the steps ------------------------------------------------------------
    def compile_in_background(self) -> bool:
        """Compile every decode graph this runner can need (each bucket; each also for sparse attention where the
        cache's window passes index_topk) on a daemon thread, smallest bucket first. Until a step's graph is ready
        that step runs eagerly, so no request waits on a compile; a graph that fails to compile is logged
        (`graphs_failed`) and its steps stay eager. Returns whether a thread started: not without `compile`, not
        while one runs or once every graph is made (after `stop_compiling`, a call resumes with the rest), and
        not off the CPU (CUDA graphs are recorded per thread: one recorded here would be recorded again by the
        first step; there the graphs still compile on first use)."""
        if not self.compile or self.cache.max_len < 2:
            return False  # (a 1-token window: its graph compiles on first use, see _warm)
        if self.device.type != "cpu":
            log.info("decode graphs compile on first use on %s (background compiling is CPU-only)", self.device)
            return False
        if self._compiling is not None and (self._compiling.is_alive() or not self._pending):
            return False
        if self._compiling is None:
            sparse_too = self._sparse(self.cache.max_len)
            # per bucket, the attention the window is mostly spent in first: the bundled model's index_topk
            # (64) is passed by almost every chat prompt, `small`'s (2,048) by few
            first_sparse = sparse_too and self.model.config.index_topk < self.cache.max_len / 2
            order = (True, False) if first_sparse else (False, True) if sparse_too else (False,)
            keys = [(b, sparse) for b in self.buckets for sparse in order]
            self._pending = [k for k in keys if k not in self.graphs_seen]
        self._stop.clear()
        self._compiling = threading.Thread(target=self._compile_pending, name="horizon-compile", daemon=True)
        _compiles[:] = [(t, e) for t, e in _compiles if t.is_alive()] + [(self._compiling, self._stop)]
        log.info("compiling %d decode graphs in the background (buckets %s); until its graph is ready a step runs "
                 "eagerly", len(self._pending), ", ".join(map(str, self.buckets)))
        self._compiling.start()
        return True

    @property
    def graphs_pending(self) -> int:
        """Graphs the background compile has still to make (0 without one)."""
        return len(self._pending)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait for the background compile to end; True when it has (or never started)."""
        if self._compiling is not None:
            self._compiling.join(timeout)
        return self._compiling is None or not self._compiling.is_alive()

    def stop_compiling(self) -> None:
        """Stop the background compile after the graph it is on (it cannot be interrupted mid-graph)."""
        self._stop.set()

    def _compile_pending(self) -> None:
        t0 = time.perf_counter()
        # A compile is mostly Python and holds the GIL; an eager step gives it up in every op it calls and, with
        # CPython's default 5 ms switch interval, waits up to that long to get it back each time: a 24-token
        # request of the bundled model took 10-18 s while a graph compiled. At 50 us it took 2-4 s (0.1-0.3 s
        # with no compile running). Process-wide, so only while this thread runs.
        interval = sys.getswitchinterval()
        sys.setswitchinterval(min(interval, SWITCH_INTERVAL_WHILE_COMPILING))
        try:
            while self._pending and not self._stop.is_set():
                key = self._pending[0]
                try:
                    self._warm(key)
                except Exception as e:  # the steps of this graph stay eager; the others may still compile
                    log.exception("compiling the decode step for %s failed; its steps run eagerly", _graph_name(key))
                    self.graphs_failed[key] = f"{type(e).__name__}: {e}"
                self._pending.pop(0)
        finally:
            sys.setswitchinterval(interval)
        if not self._pending:
            log.info("every decode graph is compiled (%d in %.0f s)", len(self.graphs_seen),
                     time.perf_counter() - t0)

    @torch.inference_mode()  # as run(): the graphs are guarded on it
    def _warm(self, key: tuple[int, bool]) -> None:
        """Compile (and run once) the graph for `key` on rows that all live in the cache's scratch slot, as a
        step's padding rows do: nothing a sequence reads is written."""
        bucket, sparse = key
        cfg = self.model.config
        # a context on the right side of index_topk; not 1, which dynamo would specialise the dynamic size to
        max_ctx = cfg.index_topk + 1 if sparse else max(2, self._dense_limit() // 2)
        # three tensors, as a step passes (the same one twice would compile a graph for aliased inputs)
        tokens, start = (torch.zeros(bucket, dtype=torch.long, device=self.device) for _ in range(2))
        slots = torch.full((bucket,), self.cache.scratch_slot, dtype=torch.long, device=self.device)
        self._call(key, tokens, start, slots, max_ctx)

    def _dense_limit(self) -> int:
        """The longest context a step attends to densely (up to index_topk, within the cache)."""
        cfg = self.model.config
        return min(self.cache.max_len, cfg.index_topk) if cfg.index_n_heads else self.cache.max_len

    def _sparse(self, ctx: int) -> bool:
        cfg = self.model.config
        return bool(cfg.index_n_heads) and ctx > cfg.index_topk

    def _compiled(self):
        with self._lock:  # the steps and the background compile may both ask first
            if self._graph is None:
                self._graph = self._make_graph()
        return self._graph

    def _make_graph(self):
        mode = "reduce-overhead" if self.device.type == "cuda" else None
        options = None
        if mode is None:
            from horizon.quant.kernels import kernel_available

            options = cpu_options(kernel_available())
        # dynamo keeps at most `recompile_limit` graphs per code object (this runner's forward, below,
        # holds one per bucket, dense and sparse; past the default 8, a ninth graph is a hard failure
        # under fullgraph: an engine whose buckets run to 256): room for this runner's buckets
        dynamo_config = torch._dynamo.config
        dynamo_config.recompile_limit += 2 * len(self.buckets)
        dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit,
                                                        2 * dynamo_config.recompile_limit)
        # Dynamo's guards on the module state (every parameter's and cache tensor's metadata, each
        # module's identity) cost ~0.8 ms a step, 8% of a batch-1 `small` step, and never fail here:
        # the runner's model and cache keep their tensors for its lifetime (graphs are built for the
        # weights as they are; training keeps the eager engine). They are skipped, and what they also
        # did, keeping apart the graphs of two runners in one process, a forward of this runner's own
        # does: dynamo caches graphs per code object. The guards on the step's inputs (batch bucket,
        # context length, dense or sparse) stay. On CPU only: torch.compile takes no options beside
        # CUDA's mode="reduce-overhead" (untested here: no GPU), so CUDA keeps every guard.
        step = type("DecodeStep", (DecodeStep,), {"forward": _own_code(DecodeStep.forward)})
        if mode is None:
            options = dict(options, guard_filter_fn=torch.compiler.skip_guard_on_all_nn_modules_unsafe)
        else:
            # the cache's tensors keep their storage for the runner's lifetime and the step writes them in place:
            # static inputs of the CUDA graphs (otherwise each replay copies them in, and their mutation makes
            # cudagraph trees fall back to running the graph without CUDA graphs)
            for holder in (self.cache, *self.cache.layers):
                for t in vars(holder).values():
                    if isinstance(t, torch.Tensor):
                        torch._dynamo.mark_static_address(t)
        return torch.compile(step(self.model, self.cache), fullgraph=True, dynamic=False, mode=mode,
                             options=options)


def _graph_name(key: tuple[int, bool]) -> str:
    return f"batch {key[0]} ({'sparse' if key[1] else 'dense'} attention)"


def _own_code(fn):
    """fn with a copy of its code object (equal, not the same: dynamo's graph cache is per code object)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)



class DecodeStep(torch.nn.Module):
    """The compiled region: one decode step from device tensors."""

    def __init__(self, model, cache: HorizonCache):
        super().__init__()
        self.model, self.cache = model, cache

    def forward(self, tokens: torch.Tensor, start: torch.Tensor, slots: torch.Tensor,
                ctx: torch.Tensor) -> torch.Tensor:
        batch = Batch.decode(start, slots, ctx.shape[0])
        return self.model.forward_batch(tokens, batch, self.cache)
