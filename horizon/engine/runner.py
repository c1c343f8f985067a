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
crossing the indexer's top-k (dense attention below it, sparse selection above) is a second graph.
Validation (capacity, window) happens here, on host numbers, before the graph runs. Prefill
chunks and mixed steps run eagerly: they are compute-bound, and their shapes vary step to step.

Eager is the reference: `compile=False` (`horizon serve --enforce-eager`) runs every step through
`model.forward_batch` directly, and the tests check the compiled step against it.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import time
import types
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._guards import detect_fake_mode
from torch._inductor.custom_graph_pass import CustomGraphPass

from horizon.model import Batch, HorizonCache
from horizon.model.options import ForwardOptions
from horizon.quant.kernels import FEW_ROWS, FUSED_ONE_ROW_MAX

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
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
            if not isinstance(rows, int) or not 1 <= rows <= FEW_ROWS.get(xv.dtype, 0) or not wv.is_contiguous():
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

        # the compiled graphs cached by inductor depend on this pass and on the kernel it calls
        return hashlib.sha256(inspect.getsource(FewRowMatmuls).encode() + _source_hash().encode()).hexdigest()


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
        if compile:
            # build the CPU kernels / import the Triton one now (or learn that they cannot be): the graphs read
            # that, and a kernel that arrives after the first graph would change what it should call, a recompile
            from horizon.quant.kernels import mxfp4_kernel_runs_on

            mxfp4_kernel_runs_on(self.device)

    # --- the step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, step: StepInputs, options: ForwardOptions | None = None) -> torch.Tensor:
        """fp32 logits [B, V]: the next-token distribution after each sequence's last new token.

        `options` (per-call attention modes and probes) other than the defaults run eagerly: a graph is
        compiled for the defaults only."""
        if self.compile and step.is_decode and (options is None or options == ForwardOptions()):
            return self._decode(step)
        lens = [len(t) for t in step.tokens]  # eager: forward_batch checks the window and the cache itself
        tokens = torch.tensor([t for run in step.tokens for t in run], device=self.device)
        batch = Batch.build(lens, start=step.starts, slots=step.slots, device=self.device)
        return self.model.forward_batch(tokens, batch, self.cache, last_only=True, image_embeds=step.image_embeds,
                                        image_mask=step.image_mask, options=options)

    def bucket(self, batch_size: int) -> int:
        return next(b for b in self.buckets if b >= batch_size)

    def _decode(self, step: StepInputs) -> torch.Tensor:
        """One compiled decode step; the checks forward_batch makes eagerly happen here on host numbers."""
        B = len(step.tokens)
        max_ctx = max(step.starts) + 1
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
        pad = self.bucket(B) - B
        scratch = self.cache.scratch_slot
        # padding rows: position 0 of the scratch slot (their own block; nothing real reads it)
        tokens = torch.tensor([t[0] for t in step.tokens] + [0] * pad, device=self.device)
        start = torch.tensor(step.starts + [0] * pad, device=self.device)
        slots = torch.tensor(step.slots + [scratch] * pad, device=self.device)
        # the context length travels as a tensor's size, marked dynamic: one graph for every length
        ctx = torch.empty(max_ctx, 0, device=self.device)
        torch._dynamo.maybe_mark_dynamic(ctx, 0)
        key = (B + pad, self._sparse(max_ctx))
        t0 = time.perf_counter()
        logits = self._compiled()(tokens, start, slots, ctx)
        if key not in self.graphs_seen:
            self.graphs_seen.add(key)
            self.compile_seconds += time.perf_counter() - t0
            log.info("compiled the decode step for batch %d (%s attention) in %.1f s", key[0],
                     "sparse" if key[1] else "dense", time.perf_counter() - t0)
        return logits[:B]

    def _sparse(self, ctx: int) -> bool:
        cfg = self.model.config
        return bool(cfg.index_n_heads) and ctx > cfg.index_topk

    def _compiled(self):
        if self._graph is None:
            # inductor's caches (generated kernels, autotuning, FX graphs) outlive the process: a restart
            # recompiles in a fraction of the first compile's time
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache" / "horizon" / "inductor"))
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
            self._graph = torch.compile(step(self.model, self.cache), fullgraph=True, dynamic=False, mode=mode,
                                        options=options)
        return self._graph


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
