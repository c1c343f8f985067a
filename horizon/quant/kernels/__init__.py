"""Horizon's CPU kernels, JIT-built on first use into one extension: the fused MXFP4 x activation matmul
(`mxfp4.cpp`, its torch op here), the few-rows matmul of batched decode steps (`rows.cpp`: `rows_matmul`
here, which the model runner's graph pass and the dense experts call), the lightning indexer's paged
decode scores (`indexer.cpp`), its exact top-k (`topk.cpp`) and Gated DSA's decode attention over the paged
latent rows (`attention.cpp`), all called from horizon.model.dsa beside their references, KDA's decode step on the
cached states in place and its chunkwise prefill (`kda.cpp`, called from horizon.model.kda beside their
references), the MoE router's group-limited top-k (`router.cpp`, called from horizon.model.moe beside its reference)
the engine's greedy pick (`argmax.cpp`: `argmax_rows` and `argmax_and_finite` here, torch.argmax and
torch.isfinite their references) and its sampled one (`sample.cpp`: `sample_row` and `sample_rows` here,
horizon.engine.sampler's PyTorch route their reference).

    out = mxfp4_expert_matmul(x, blocks, scales, expert)   # torch.ops.horizon.mxfp4_expert_matmul
    # x float [M, K]; blocks uint8 [E, N, nb, 16]; scales uint8 [E, N, nb]; expert int64 [M] in [0, E)
    # out fp32 [M, N]: out[m, n] = sum_k x[m, k] * W_{expert[m]}[n, k], W dequantised exactly (K <= nb*32;
    # the packed padding past column K is never used)

    out = mxfp4_expert_matmul(x, blocks, scales, expert, int8_activations=True)
    # opt-in: each 32-wide block of x rounded to int8 first (`quantize_activations`, the Q8_0 format), then
    # exact integer dot products per block (AVX-512 VNNI or AVX2 where the CPU has them): faster, not exact

The op decodes the packed bytes in registers (AVX-512 or AVX2 as the CPU has them, portable C++ otherwise), so
MXFP4 weights are never expanded to a full-precision matrix. It is one opaque `torch.library.custom_op`
with a fake (meta) implementation: torch.compile traces through it without a graph break, and the
grouping of rows by expert (a host-side pass over CPU memory) stays inside it. The modules call it
through `mxfp4_matmul`, which goes to the C++ op (`torch.ops.horizon_kernels.*`, a CPU kernel with its own
fake) directly whenever it is built, in compiled graphs too: no Python wrapper per call.

Building: `torch.utils.cpp_extension.load` with ninja, lazily on the first call that needs it (never at
install time), once per process, into $HORIZON_KERNEL_CACHE or ~/.cache/horizon/kernels/<torch>-<source
hash>. If that fails (no compiler, no ninja) or HORIZON_KERNELS=0, the op falls back to
`mxfp4_expert_matmul_reference` (pure PyTorch) after one logged warning saying why.

On CUDA the op runs `mxfp4_triton.py`'s Triton kernel (the same decode in registers, over rows grouped by
expert on the device by `expert_tiles`, so CUDA graphs capture it), imported on the first CUDA call only:
triton is not a dependency (`pip install triton` on a GPU machine; torch's CUDA wheels bring it). Without it,
and on other devices, the op takes the reference.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import sys
import threading
from pathlib import Path

import torch

from horizon.quant.mxfp4 import BLOCK, check_packed, dequantize

log = logging.getLogger(__name__)

# one extension: indexer.cpp, topk.cpp and attention.cpp are horizon.model.dsa's, kda.cpp horizon.model.kda's,
# router.cpp horizon.model.moe's, rows.cpp the few-rows matmul (`rows_matmul` below), argmax.cpp the greedy pick
# (`argmax_rows` below), sample.cpp the sampled one (`sample_row` below)
SOURCES = tuple(Path(__file__).with_name(name) for name in ("mxfp4.cpp", "indexer.cpp", "topk.cpp", "attention.cpp",
                                                              "kda.cpp", "rows.cpp", "argmax.cpp", "router.cpp",
                                                              "sample.cpp"))
# hashed with the sources: a change rebuilds
HEADERS = tuple(Path(__file__).with_name(name) for name in ("grouping.h", "amx.h", "simd.h", "kda_chunk.h"))
_lock = threading.Lock()
_built: bool | None = None  # None: not tried yet in this process


def _source_hash() -> str:
    h = hashlib.sha256()
    for source in SOURCES + HEADERS:
        h.update(source.read_bytes())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    """Where the extension is built: $HORIZON_KERNEL_CACHE, else ~/.cache/horizon/kernels/<torch>-<hash>."""
    env = os.environ.get("HORIZON_KERNEL_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "horizon" / "kernels" / f"{torch.__version__}-{_source_hash()}"


def _ensure_ninja_on_path() -> None:
    """torch's load() runs `ninja` from PATH; the pip package's binary is not there when the virtual
    environment is used without being activated, so put its directory first."""
    if shutil.which("ninja"):
        return
    try:
        import ninja  # the pip package (a runtime dependency)
    except ImportError:
        return  # load() then fails with its own message, which the warning repeats
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@contextlib.contextmanager
def _build_lock(directory: Path):
    """Held while this process builds into `directory`: an flock, which the OS releases when its holder dies.
    torch's load() guards a build with a plain `lock` file instead, and a process killed mid-build leaves it
    behind: every later process then waited for it forever, silently (seen here when a benchmark was stopped
    during its first build). Whoever holds the flock is the only Horizon process building there, so a `lock`
    file found then is such a leftover and is removed."""
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own lock file alone
        yield
        return
    with open(directory / "horizon-build.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = directory / "lock"
            if stale.exists():
                log.warning("removing %s, left by a kernel build that was stopped before it finished", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build() -> None:
    from torch.utils import cpp_extension  # imported here: costs nothing until a kernel is wanted

    _ensure_ninja_on_path()
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    cflags, ldflags = ["-O3", "-std=c++17"], []
    if sys.platform.startswith("linux") and torch.backends.openmp.is_available():
        # ATen's parallel_for is OpenMP pragmas in a header: without -fopenmp it would run on one thread
        cflags.append("-fopenmp")
        ldflags.append("-fopenmp")
    with _build_lock(directory):
        cpp_extension.load(name=f"horizon_kernels_{_source_hash()}", sources=[str(s) for s in SOURCES],
                           extra_cflags=cflags, extra_ldflags=ldflags, build_directory=str(directory),
                           is_python_module=False, verbose=False)


def _register_fakes() -> None:
    """Shapes for torch.compile of the C++ ops a graph calls directly (no Python wrapper between the graph
    and the kernel: the indexer's scores, its top-k and the attention, once each per DSA layer per decode step)."""

    @torch.library.register_fake("horizon_kernels::index_scores_paged")
    def _(pool, table, q, w, L, block_size, force_portable=False):
        return pool.new_empty((q.shape[0], L), dtype=torch.float32)

    @torch.library.register_fake("horizon_kernels::topk_recent_first_rows")
    def _(scores, k, force_portable=False):
        return scores.new_empty((scores.shape[0], k), dtype=torch.int64)

    @torch.library.register_fake("horizon_kernels::latent_attention_paged")
    def _(pool, table, q, lens, idx, L, block_size, scale, v_width, force_portable=False):
        return pool.new_empty((q.shape[0], q.shape[1], v_width), dtype=torch.float32)

    @torch.library.register_fake("horizon_kernels::mxfp4_expert_matmul")
    def _(x, blocks, scales, expert, force_portable=False, int8_activations=False):
        return x.new_empty((x.shape[0], blocks.shape[1]), dtype=torch.float32)

    @torch.library.register_fake("horizon_kernels::kda_decode_")
    def _(state, slots, q, k, v, alpha, beta, scale, force_portable=False):
        return v.new_empty(v.shape, dtype=torch.float32)

    @torch.library.register_fake("horizon_kernels::kda_chunk_forward_")
    def _(state, q, k, v, g, beta, scale, chunk):
        return v.new_empty(v.shape, dtype=torch.float32)

    @torch.library.register_fake("horizon_kernels::grouped_topk")
    def _(scores, bias, k, n_group, topk_group):
        return scores.new_empty((scores.shape[0], k), dtype=torch.int64)

    @torch.library.register_fake("horizon_kernels::rows_matmul")
    def _(x, w, expert=None, force_portable=False):
        return x.new_empty((x.shape[0], w.shape[-2]), dtype=torch.float32)


def _disabled() -> bool:
    """HORIZON_KERNELS=0: every kernel off (the CPU extension and the Triton one), the references in their place."""
    return os.environ.get("HORIZON_KERNELS", "1").strip() == "0"


def _last_line(exc: Exception) -> str:
    """The last line of a failure's message (a compiler's or an importer's), for the one warning logged."""
    return (str(exc).strip().splitlines() or [""])[-1]


def kernel_available() -> bool:
    """Whether the compiled kernel is loaded (building it now if this process has not tried yet)."""
    global _built
    if _built is None:
        with _lock:
            if _built is None:
                if _disabled():
                    log.warning("MXFP4 kernel disabled by HORIZON_KERNELS=0: MXFP4 layers use the PyTorch "
                                "reference (dequantise, then matmul)")
                    _built = False
                else:
                    try:
                        _build()
                        _register_fakes()
                        _built = True
                    except Exception as exc:  # any build or load failure: the reference still works
                        why = _last_line(exc)
                        log.warning("CPU kernels unavailable (building %s failed: %s: %s); MXFP4 layers use "
                                    "the PyTorch reference (dequantise, then matmul), and the DSA and KDA "
                                    "layers gather their cached rows and states first",
                                    " and ".join(s.name for s in SOURCES), type(exc).__name__, why)
                        _built = False
    return _built


def kernels_run_on(device: torch.device) -> bool:
    """Whether the CPU kernels serve tensors on `device`: the CPU, with the extension built. Traced into
    compiled graphs, where it only reads whether the extension is built (a guarded global; the model
    runner builds it before compiling) and never builds it."""
    if device.type != "cpu":
        return False
    return _built is True if torch.compiler.is_compiling() else kernel_available()


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> int64 [B]: `logits.argmax(dim=-1)` exactly (each row's first maximum, or its first NaN),
    through the kernel for fp32 CPU rows once this process has built it (the model runner builds it for
    compiled CPU decoding; picking a token never starts a build), else through torch.argmax. PyTorch's CPU
    argmax is a scalar loop: ~0.6 ms for 16 rows of a 32K vocabulary here."""
    if _kernel_takes(logits):
        return torch.ops.horizon_kernels.argmax_rows(logits)[0]
    return logits.argmax(dim=-1)


def argmax_and_finite(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (argmax_rows(logits), bool [B]: whether each row holds only finite values), in one pass of
    the kernel where argmax_rows takes it. Otherwise each row's sum is checked (NaN and +-Inf carry through a sum;
    ~1/30 of isfinite over the rows) and, when one is not finite, every row exactly (a sum of finite logits may
    overflow)."""
    if _kernel_takes(logits):
        return torch.ops.horizon_kernels.argmax_rows(logits)
    finite = torch.isfinite(logits.sum(dim=-1))
    if not bool(finite.all()):
        finite = torch.isfinite(logits).all(dim=-1)
    return logits.argmax(dim=-1), finite


def sample_row(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, u: float) -> int | None:
    """One token from fp32 CPU logits [V] at temperature > 0 (top_k 0: off; top_p 1: off; u uniform in [0, 1)),
    through the kernel once this process has built it; None otherwise, and the caller takes the reference,
    horizon.engine.sampler's `candidates` and `draw` (the same tokens but where u falls within float rounding of
    a boundary between two)."""
    if _kernel_takes(logits, dim=1):
        top_k = top_k if top_k < logits.shape[0] else 0  # (the API takes any size: past int64 a C++ call could not)
        return torch.ops.horizon_kernels.sample_row(logits, temperature, top_k, top_p, u)
    return None


def sample_rows(logits: torch.Tensor, temperatures: list[float], top_ks: list[int], top_ps: list[float],
                us: list[float]) -> list[int] | None:
    """`sample_row` for the rows of fp32 CPU logits [B, V] (each with its own settings and u) in one call, the rows
    in parallel; None where the kernel does not apply."""
    if _kernel_takes(logits, dim=2):
        top_ks = [k if k < logits.shape[1] else 0 for k in top_ks]
        return torch.ops.horizon_kernels.sample_rows(logits, temperatures, top_ks, top_ps, us).tolist()
    return None


def _kernel_takes(logits: torch.Tensor, dim: int = 2) -> bool:
    """Whether the logits kernels (argmax.cpp, sample.cpp) take these: fp32 CPU rows of `dim` dimensions, V > 0,
    once this process has built the extension (picking a token never starts a build)."""
    return (_built is True and logits.device.type == "cpu" and logits.dim() == dim and logits.dtype == torch.float32
            and logits.shape[-1] > 0)


_vector_paths: dict[str, bool] = {}  # has_avx512() and has_avx2(), each once asked outside a compiled graph


def _vector_path(query: str) -> bool:
    """The C++ op `query`'s answer, asked once per process; a graph being compiled reads it as a constant (and, if
    nothing asked yet, gets False: the references, which trace, instead of a query dynamo cannot trace)."""
    if query not in _vector_paths:
        if torch.compiler.is_compiling():
            return False
        _vector_paths[query] = kernel_available() and bool(getattr(torch.ops.horizon_kernels, query)())
    return _vector_paths[query]


def has_avx512() -> bool:
    """Whether the kernel runs its AVX-512 path on this CPU (False when the kernel is unavailable, and under
    HORIZON_AVX512=0, which sends every kernel to its AVX2 or portable path)."""
    return _vector_path("has_avx512")


def vector_path() -> str:
    """Which vector path the kernels take on this CPU: "avx512", "avx2" (AVX2 and FMA without AVX-512, or
    HORIZON_AVX512=0), else "portable" (their C++ loops, or no kernel at all). Compile-safe, as has_avx512()."""
    return "avx512" if has_avx512() else "avx2" if has_avx2() else "portable"


def has_amx() -> bool:
    """Whether the kernels' AMX paths run here (the CPU has AMX-BF16, Linux grants the process its tile state, and
    HORIZON_AMX is not 0): rows_matmul's bf16 x bf16 products, and mxfp4_expert_matmul's for activations that are
    all bf16 (3 or more rows an expert)."""
    return kernel_available() and bool(torch.ops.horizon_kernels.has_amx())


def has_avx2() -> bool:
    """Whether the kernels run their AVX2 paths here: AVX2 and FMA without AVX-512 (or with HORIZON_AVX512=0)."""
    return _vector_path("has_avx2")


def few_rows(dtype: torch.dtype) -> int:
    """FEW_ROWS for weights of `dtype` on this CPU, 0 for a dtype the kernel does not take. bf16 goes up to 64 rows
    - where the AMX path runs (bf16 activations against bf16 weights from 8 rows: 1.49-1.58x oneDNN's bf16
      matmul at 16 rows of `small`'s shapes, cold weights, 2 threads, bench/rows.py);
    - where the AVX2 path runs: oneDNN has no bf16 hardware to use there, and [16 | 64 x 512] against cold bf16
      [512 x 512] took 525 / 2,231 us in F.linear, 90 / 301 in the kernel (a Zen 3 EPYC, 2 threads)."""
    if dtype == torch.bfloat16 and (has_amx() or has_avx2()):
        return 64
    return FEW_ROWS.get(dtype, 0)


def int8_path() -> str | None:
    """Which path the kernel's int8 activations take on this CPU: "vnni" (AVX-512 VNNI), "avx2" (vpmaddubsw, where
    there is AVX2 but no VNNI, or HORIZON_AVX512=0) or "portable" (its C++ loops); None without the kernel."""
    return str(torch.ops.horizon_kernels.int8_path()) if kernel_available() else None


INT8_MAX = 127


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x float [M, K] -> (q int8 [M, K], scale fp32 [M, ceil(K/32)]): the int8 activations of
    `mxfp4_expert_matmul(..., int8_activations=True)`, defined here and matched exactly by the kernel.

    Per 32-wide block of a row (the last one may be shorter): scale = amax(|x|) / 127 and
    q = round(x / scale) (half to even), clamped to +-127; an all-zero block has scale 0 and q 0. A block
    holding NaN or +-Inf gets scale NaN (and q 0), so whatever it feeds is NaN, as with fp32 activations.
    x ~= q * scale, with |error| <= scale / 2 per element: <= 0.4% of the block's largest magnitude.
    """
    M, K = x.shape
    nb = -(-K // BLOCK)
    xb = torch.nn.functional.pad(x.float(), (0, nb * BLOCK - K)).view(M, nb, BLOCK)
    finite = torch.isfinite(xb).all(-1)
    scale = xb.abs().amax(-1) / INT8_MAX
    ok = (finite & (scale > 0))[..., None]
    q = torch.where(ok, torch.round(xb / torch.where(ok, scale[..., None], 1.0)), 0.0).clamp(-INT8_MAX, INT8_MAX)
    scale = torch.where(finite, scale, torch.nan)
    return q.to(torch.int8).view(M, nb * BLOCK)[:, :K], scale


def dequantize_activations(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(q int8 [M, K], scale [M, ceil(K/32)]) -> q * scale per block, fp32 [M, K]."""
    return q.float() * scale.repeat_interleave(BLOCK, dim=1)[:, :q.shape[1]]


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] through the int8 rounding (`quantize_activations`, then back), in x's shape and dtype: what
    the kernel multiplies with int8_activations, for the reference and the dequantising fallbacks."""
    if x.shape[-1] == 0:
        return x
    return dequantize_activations(*quantize_activations(x.reshape(-1, x.shape[-1]))).to(x.dtype).view(x.shape)


def mxfp4_expert_matmul_reference(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                                  expert: torch.Tensor, int8_activations: bool = False) -> torch.Tensor:
    """The op in pure PyTorch: each routed expert dequantised to fp32 (horizon.quant.mxfp4.dequantize),
    then x @ W^T for its rows (x through `quantize_activations` first with int8_activations). Reads
    expert ids on the host (fine for a reference and a fallback)."""
    _check(x, blocks, scales, expert)
    K = x.shape[1]
    x = round_activations(x.float()) if int8_activations else x.float()
    out = torch.zeros(x.shape[0], blocks.shape[1], dtype=torch.float32, device=x.device)
    if K == 0:
        return out
    for e in expert.unique().tolist():
        rows = (expert == e).nonzero().squeeze(1)
        out[rows] = x[rows] @ dequantize(blocks[e], scales[e], torch.float32)[:, :K].T  # K may end blocks early
    return out


def sort_by_expert(key: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """key int64 [M] in [0, E] (E: a row of no expert here) -> (order: a stable sort of the rows by key,
    counts int64 [E + 1]), on the device with no host sync (counts by scatter-add: bincount sizes its output on
    the host). The grouping both `expert_tiles` and horizon.model.moe.grouped_experts start from."""
    counts = torch.zeros(E + 1, dtype=torch.int64, device=key.device).scatter_add_(0, key, torch.ones_like(key))
    return key.argsort(stable=True), counts


def expert_tiles(expert: torch.Tensor, E: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows grouped by expert into tiles of block_m rows, on the device, in shapes fixed by (M, E, block_m),
    so a CUDA graph captures it: grouping.h's counterpart for the Triton kernel (mxfp4_triton.py).

    expert int [M] -> (tile_expert int32 [T]: tile t's expert, E for a tile past those the routing fills;
    slot_row int32 [T * block_m]: the row of x in each slot of each tile, -1 for an empty one), with
    T = ceil(M / block_m) + min(E, M), the most any routing needs (each expert with rows leaves at most one
    tile partly filled). Tiles go in expert order, rows keep their order within an expert, and a row whose id
    is outside [0, E) is in no tile."""
    M, dev = expert.shape[0], expert.device
    T = -(-M // block_m) + min(E, M)
    ids = expert.long()
    key = torch.where((ids >= 0) & (ids < E), ids, E)  # rows of no expert here: bucket E, in no tile
    order, counts = sort_by_expert(key, E)  # a device sort, not grouping.h's host pass
    tiles = (counts[:E] + block_m - 1) // block_m
    tile_end = tiles.cumsum(0)
    tile_expert = torch.searchsorted(tile_end, torch.arange(T, device=dev), right=True).to(torch.int32)
    sorted_key = key[order]
    rank = torch.arange(M, device=dev) - (counts.cumsum(0) - counts)[sorted_key]  # place within its expert
    first_slot = torch.cat([(tile_end - tiles) * block_m, tile_end.new_full((1,), T * block_m)])
    slot = first_slot[sorted_key] + rank  # every row its own slot (bucket E's past the tiles, then cut off)
    slot_row = torch.full((T * block_m + M,), -1, dtype=torch.int64, device=dev).scatter_(0, slot, order)
    return tile_expert, slot_row[:T * block_m].to(torch.int32)


_triton_matmul = None  # the Triton kernel's entry point once imported; False: unavailable


def _triton_kernel():
    """horizon.quant.kernels.mxfp4_triton's matmul, imported on first use (only CUDA calls get here), or None
    when triton is missing or HORIZON_KERNELS=0 (after one logged warning)."""
    global _triton_matmul
    if _triton_matmul is None:
        with _lock:
            if _triton_matmul is None:
                if _disabled():
                    why = "disabled by HORIZON_KERNELS=0"
                else:
                    try:
                        from horizon.quant.kernels.mxfp4_triton import mxfp4_expert_matmul_triton

                        _triton_matmul = mxfp4_expert_matmul_triton
                    except Exception as exc:  # no triton (pip install triton), or it failed to load
                        why = f"{type(exc).__name__}: {_last_line(exc)}"
                if _triton_matmul is None:
                    log.warning("Triton MXFP4 kernel unavailable (%s); MXFP4 layers on CUDA use the PyTorch "
                                "reference (dequantise, then matmul), which a CUDA graph cannot capture", why)
                    _triton_matmul = False
    return _triton_matmul or None


def mxfp4_kernel_runs_on(device: torch.device) -> bool:
    """Whether `mxfp4_matmul` decodes the packed weights in registers for tensors on `device` (the CPU kernel
    built, or on CUDA the Triton kernel imported) rather than dequantising: the MXFP4 modules' choice between
    it and a dequantised matrix. The first call builds / imports the kernel (the model runner calls it
    before compiling); traced into a compiled graph, it only reads whether that happened."""
    if device.type == "cuda":
        return bool(_triton_matmul) if torch.compiler.is_compiling() else _triton_kernel() is not None
    return kernels_run_on(device)


def _mxfp4_off_cpu(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, expert: torch.Tensor,
                   int8_activations: bool) -> torch.Tensor:
    """The op where the CPU kernel does not run: the Triton kernel for CUDA calls when triton imports, else
    the reference."""
    if x.device.type == "cuda" and (kernel := _triton_kernel()) is not None:
        _check(x, blocks, scales, expert)
        return kernel(round_activations(x.float()) if int8_activations else x, blocks, scales, expert)
    return mxfp4_expert_matmul_reference(x, blocks, scales, expert, int8_activations)


def _check(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, expert: torch.Tensor) -> None:
    check_packed(blocks, scales)
    if blocks.dim() != 4:
        raise ValueError(f"mxfp4_expert_matmul: blocks must be [E, N, nb, 16], got {list(blocks.shape)}")
    if x.dim() != 2 or not x.dtype.is_floating_point or x.shape[1] > blocks.shape[2] * BLOCK:
        raise ValueError(f"mxfp4_expert_matmul: x must be float [M, K] with K <= {blocks.shape[2] * BLOCK}, "
                         f"got {x.dtype} {list(x.shape)}")
    if expert.shape != (x.shape[0],) or expert.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"mxfp4_expert_matmul: expert must be int [M={x.shape[0]}], got {expert.dtype} "
                         f"{list(expert.shape)}")


@torch.library.custom_op("horizon::mxfp4_expert_matmul", mutates_args=())
def mxfp4_expert_matmul(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, expert: torch.Tensor,
                        force_portable: bool = False, int8_activations: bool = False) -> torch.Tensor:
    """out fp32 [M, N] = sum_k x[m, k] * W_{expert[m]}[n, k] with W in MXFP4 (the module docstring).

    x is taken as fp32 (the kernel accumulates in fp32), or with int8_activations rounded to int8 per
    32-wide block (`quantize_activations`); force_portable skips the AVX-512 paths.
    """
    if x.device.type == "cpu" and kernel_available():
        return torch.ops.horizon_kernels.mxfp4_expert_matmul(x, blocks, scales, expert, force_portable,
                                                             int8_activations)
    return _mxfp4_off_cpu(x, blocks, scales, expert, int8_activations)


@mxfp4_expert_matmul.register_fake
def _(x, blocks, scales, expert, force_portable=False, int8_activations=False):
    _check(x, blocks, scales, expert)
    return x.new_empty((x.shape[0], blocks.shape[1]), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    x, blocks, scales, expert, _, _ = inputs
    ctx.save_for_backward(blocks, scales, expert)
    ctx.K, ctx.dtype = x.shape[1], x.dtype


def _backward(ctx, grad):
    """d out / d x: grad [M, N] @ W_{expert[m]} per row, W dequantised (the weights are frozen: no grad).
    Training a model with MXFP4 experts (horizon train / rl from the bundled model) backpropagates
    through them to every earlier layer. With int8 activations the rounding is passed straight through
    (its gradient taken as 1), as quantisation-aware training does."""
    blocks, scales, expert = ctx.saved_tensors
    gx = torch.zeros(grad.shape[0], ctx.K, dtype=torch.float32, device=grad.device)
    for e in expert.unique().tolist():
        rows = (expert == e).nonzero().squeeze(1)
        gx[rows] = grad[rows].float() @ dequantize(blocks[e], scales[e], torch.float32)[:, :ctx.K]
    return gx.to(ctx.dtype), None, None, None, None, None


mxfp4_expert_matmul.register_autograd(_backward, setup_context=_setup_context)


def mxfp4_matmul(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, expert: torch.Tensor,
                 int8_activations: bool = False) -> torch.Tensor:
    """`mxfp4_expert_matmul` by the shortest route; what the MXFP4 modules call.

    The compiled kernel straight through the dispatcher whenever it takes the call, in eager mode and inside
    compiled graphs alike (one opaque node there, its fake registered with the build): the custom op's
    Python wrapping costs 15-40 us a call, as much as a batch-1 expert GEMV itself (22 calls a step at
    `small`). Inside a graph without the CPU kernel (off the CPU, or not built): the custom op, which takes
    the Triton kernel on CUDA or the reference; eagerly, the same without the custom op. When x needs a
    gradient (training through frozen MXFP4 experts): the custom op, whose registered backward gives d/dx (the
    C++ op has none).
    """
    q8 = int8_activations
    if x.requires_grad and torch.is_grad_enabled():  # training: the custom op carries the backward
        return mxfp4_expert_matmul(x, blocks, scales, expert, False, q8)
    if torch.compiler.is_compiling():
        if x.device.type == "cpu" and _built is True:  # read, never built, while tracing (the runner builds it)
            return torch.ops.horizon_kernels.mxfp4_expert_matmul.default(x, blocks, scales, expert, False, q8)
        return mxfp4_expert_matmul(x, blocks, scales, expert, False, q8)
    if x.device.type == "cpu" and kernel_available():
        return torch.ops.horizon_kernels.mxfp4_expert_matmul(x, blocks, scales, expert, False, q8)
    return _mxfp4_off_cpu(x, blocks, scales, expert, q8)


def rows_matmul_reference(x: torch.Tensor, w: torch.Tensor, expert: torch.Tensor | None = None) -> torch.Tensor:
    """`rows_matmul` in PyTorch: fp32 x @ W^T with W = w [N, K], or w[expert[m]] of w [E, N, K] for row m
    (int8 weights taken raw). Reads expert ids on the host (fine for a reference and a fallback)."""
    x = x.float()
    if expert is None:
        return x @ w.float().T
    out = x.new_zeros(x.shape[0], w.shape[1])
    for e in expert.unique().tolist():
        rows = (expert == e).nonzero().squeeze(1)
        out[rows] = x[rows] @ w[e].float().T
    return out


# Most rows of x a projection sends to rows_matmul, by weight dtype, where the CPU kernels run (bench/rows.py,
# 2 threads, cold weights): fp32 at 1-64 rows (one row only past FUSED_ONE_ROW_MAX, below; PyTorch's CPU
# sgemm streams a cold fp32 matrix at 4-6 GB/s for 4-16 rows, the kernel at 10-18); bf16 up to 8, past which
# oneDNN's bf16 matmul was faster on a Zen 4 (with AMX, up to 64: `few_rows`); int8 at 1-64, against
# aten._weight_int8pack_mm 1.1-1.6x at 2 rows, 1.3-1.8x at 8, 1.4-1.6x at 64 (a Xeon).
FEW_ROWS = {torch.float32: 64, torch.bfloat16: 8, torch.int8: 64}
# In a compiled graph, a one-row product (a batch-1 decode step) whose weight has at most this many rows and
# columns stays inductor's multiply-and-sum loop, fused with the ops around it; a larger one (the LM head)
# goes to rows_matmul, whose prefetching streams it faster: [32768 x 512] at one row, 2 threads, cold weights,
# 26.8 against 21.6 GB/s in fp32 and 20.3 against 12.7 in int8 (a Xeon). Sending the small ones to the kernel
# too saved less than that alone (a call each, fusions lost): batch-1 `small` steps, engines compiled each way
# in one process, alternating, fp32 15.43 ms with every product to the kernel, 14.49 with those over 1,024
# only, 15.66 with the loops everywhere; MXFP4 experts 9.87 / 9.49 / 10.13 ms. 2,048 (inductor's own default
# for the rewrite) and 4,096 measured as 1,024 did.
FUSED_ONE_ROW_MAX = 2048


def rows_matmul(x: torch.Tensor, w: torch.Tensor, expert: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [M, N] = x [M, K] @ W^T for a few rows (rows.cpp: each weight row read once per call, near memory
    speed where PyTorch's sgemm is not); W = w [N, K] (fp32 / bf16 / int8 raw), or per row m w[expert[m]]
    of stacked w [E, N, K]. The kernel on CPU when it is built (also inside compiled graphs: the C++ op has
    a fake), else the reference."""
    if x.device.type == "cpu" and kernel_available():
        return torch.ops.horizon_kernels.rows_matmul(x, w, expert)
    return rows_matmul_reference(x, w, expert)


__all__ = ["FEW_ROWS", "FUSED_ONE_ROW_MAX", "cache_dir", "dequantize_activations", "expert_tiles", "few_rows",
           "has_amx", "has_avx2", "has_avx512",
           "int8_path", "kernel_available", "kernels_run_on", "mxfp4_expert_matmul", "mxfp4_expert_matmul_reference",
           "mxfp4_kernel_runs_on", "mxfp4_matmul", "quantize_activations", "round_activations", "rows_matmul",
           "rows_matmul_reference", "sort_by_expert", "vector_path"]
