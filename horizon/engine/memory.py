"""Where a CPU model's weights live: one arena of memory the kernel may back with 2 MB pages.

A decode step streams every weight it uses from memory, and on 4 KB pages their address translations miss
the TLB every step (the `small` preset's weights are 0.5 GB with MXFP4 experts, 2.4 GB in fp32: 130,000 to
600,000 pages; a core's second-level TLB holds ~2,000 entries). On 2 MB pages they fit. Measured on a 2-core
Xeon, cold weights alternated in one process: `rows_matmul` over 16 rows 16% faster, over one row 9%, the
fused MXFP4 expert kernel alone (int8 activations) 15-19%; in compiled `small` steps, fp32 batch 1 7% faster,
16 sequences with MXFP4 experts ~4% (docs/benchmarks.md, "Weights on 2 MB pages").

Why an arena and not `THP_MEM_ALLOC_ENABLE=1` (PyTorch's switch for every large allocation): that also puts
each step's short-lived tensors on huge pages (each then faulted in and zeroed 2 MB at a time), and whole
compiled steps were slower with it. Here only the weights move, once, before the decode graphs are compiled.

Linux with transparent huge pages in `madvise` or `always` mode; elsewhere (or with `HORIZON_HUGE_PAGES=0`)
the weights stay where they are. The values, shapes, strides, names and aliasing of every tensor are kept
(tied weights still share their memory), so checkpoints, state dicts and forwards are unchanged.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 64  # every storage starts on a cache line, as PyTorch's CPU allocator places them


@dataclass
class Placement:
    """Where `place_weights` left the weights: the bytes of their arena and how many of them the kernel backs
    with 2 MB pages (from /proc/self/smaps, at the time of the call; 0 where that cannot be read)."""

    arena_bytes: int = 0
    huge_bytes: int = 0
    reason: str = ""  # why there is no arena, when there is none

    def describe(self) -> str:
        if not self.arena_bytes:
            return f"weights left in place ({self.reason})"
        return (f"weights: {self.arena_bytes / 2**20:.0f} MiB in one arena, {self.huge_bytes / 2**20:.0f} MiB of it "
                f"on 2 MB pages")


def huge_pages_mode() -> str | None:
    """The kernel's transparent-huge-page mode ('always', 'madvise', 'never'); None where there is none."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def unavailable() -> str | None:
    """Why weights cannot go on huge pages here (None: they can)."""
    if os.environ.get("HORIZON_HUGE_PAGES", "1") == "0":
        return "HORIZON_HUGE_PAGES=0"
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return "this platform has no madvise(MADV_HUGEPAGE)"
    mode = huge_pages_mode()
    if mode not in ("always", "madvise"):
        return f"transparent huge pages are {mode or 'absent'} on this machine"
    return None


def arena(nbytes: int) -> torch.Tensor:
    """A zero-filled uint8 CPU tensor of `nbytes`, starting on a 2 MB boundary, in private anonymous memory
    advised for huge pages before its first touch (so the kernel can fault it in 2 MB at a time).

    The mapping's first and last 4 KB pages are made inaccessible: the kernel merges adjacent anonymous
    mappings with the same flags into one, and /proc/self/smaps (huge_bytes) would then count a neighbour's
    huge pages (another model's arena) as this one's."""
    buf = mmap.mmap(-1, nbytes + 2 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    first = torch.frombuffer(buf, dtype=torch.uint8, count=1).data_ptr()
    _guard(first)
    _guard(first + len(buf) - mmap.PAGESIZE)
    start = HUGE_PAGE - first % HUGE_PAGE  # in (0, 2 MB]: the first page stays outside
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=start)  # keeps `buf` alive while in use


def _guard(address: int) -> None:
    """mprotect(PROT_NONE) on the page at `address`; without libc's mprotect, nothing."""
    mprotect = _mprotect()
    if mprotect is not None:
        mprotect(ctypes.c_void_p(address), ctypes.c_size_t(mmap.PAGESIZE), 0)


@functools.cache
def _mprotect():
    """libc's mprotect, looked up once per process (None where there is none)."""
    try:
        return ctypes.CDLL(None, use_errno=True).mprotect
    except (OSError, AttributeError):
        return None


def huge_bytes(storage: torch.UntypedStorage) -> int:
    """Bytes of `storage` the kernel backs with huge pages now: the AnonHugePages of the mappings under it, at
    most its own size (an arena starts on a 2 MB boundary, so a huge page past its end holds only its last bytes)."""
    lo, hi = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):  # a mapping's first line: "start-end perms ..."
                    a, b = (int(v, 16) for v in head.split("-"))
                    inside = a < hi and b > lo
                elif inside and head == "AnonHugePages:":
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return 0
    return min(total, storage.nbytes())


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def place_weights(module: torch.nn.Module) -> Placement:
    """Move every CPU parameter and buffer of `module` into one huge-page arena, in place: each tensor keeps
    its Python object (so whatever holds it, an optimizer or a tied module, still does), its values, shape and
    strides; each old storage is copied whole, so tensors that shared one (tied weights, views) still do."""
    reason = unavailable()
    if reason:
        return Placement(reason=reason)
    tensors = [t for t in (*module.parameters(), *module.buffers())
               if type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu" and t.numel()]
    by_storage: dict[int, list[torch.Tensor]] = {}  # the tensors over each storage
    for t in tensors:
        by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    del tensors
    if len(by_storage) == 1:  # placed already (a second runner over the same model): leave it
        (only,) = by_storage.values()
        storage = only[0].untyped_storage()
        return Placement(arena_bytes=storage.nbytes(), huge_bytes=huge_bytes(storage))
    size = sum(_aligned(ts[0].untyped_storage().nbytes()) for ts in by_storage.values())
    if size < HUGE_PAGE:
        return Placement(reason=f"{size} bytes of weights, less than one 2 MB page")
    space = arena(size)  # address space only: its pages are faulted in as the copies below reach them
    store, offset = space.untyped_storage(), 0
    with torch.no_grad():
        # One storage at a time, its tensors re-pointed at once: its old memory is freed (when nothing else
        # holds it) before the next is copied, so the move needs the weights' memory plus one storage, not twice.
        # In the model's parameter order, which is about the order a step reads them in.
        for key in list(by_storage):
            ts = by_storage.pop(key)
            nbytes = ts[0].untyped_storage().nbytes()
            space[offset:offset + nbytes].copy_(torch.empty(0, dtype=torch.uint8).set_(ts[0].untyped_storage()))
            for t in ts:
                t.data = torch.empty(0, dtype=t.dtype).set_(store, offset // t.element_size() + t.storage_offset(),
                                                            t.shape, t.stride())
            offset += _aligned(nbytes)
    placed = Placement(arena_bytes=size, huge_bytes=huge_bytes(store))
    log.info("%s", placed.describe())
    return placed
