"""The process group Horizon's parallel code runs in, and the few collectives it calls.

Every parallel feature (tensor / expert parallel inference in horizon.parallel.shard, the SPMD engine,
FSDP2 training) goes through `init_group`: it reads torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), picks NCCL on CUDA and gloo on CPU, and always sets a
collective timeout, so a rank that dies or diverges makes the others fail with an error instead of
hanging. A CPU gloo group (`cpu_group`) carries the engine's small host-side messages whatever the
device backend is (vLLM and SGLang do the same).

One process without torchrun is world size 1: `Group.single()` , and every collective here is then
the identity, so single-process code never branches on whether it is distributed.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 120.0
GROUP_FAILED_EXIT = 75  # a rank's exit status when its group broke (another rank failed or vanished)


@dataclass(frozen=True)
class Group:
    """This process's place in the group: rank, world size, and the device it computes on."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: str = "cpu"

    @classmethod
    def single(cls) -> Group:
        return cls()

    @property
    def distributed(self) -> bool:
        return self.world > 1 or (dist.is_available() and dist.is_initialized())

    @property
    def is_driver(self) -> bool:
        """Rank 0: the rank that talks to the outside (HTTP, the terminal, files it writes once)."""
        return self.rank == 0


_CPU_GROUP = None


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_group(device: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Group:
    """Join (or, under plain python, stand in for) the process group torchrun describes.

    device None: CUDA (this rank's LOCAL_RANK GPU) when available, else CPU. A world size of 1 without
    torchrun's variables starts no group at all.
    """
    global _CPU_GROUP
    world = env_world_size()
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    if world == 1 and "MASTER_ADDR" not in os.environ:
        return Group(0, 1, 0, device)
    if not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
        # host-side messages (the engine's step inputs) go over gloo even when the tensors use NCCL
        _CPU_GROUP = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else dist.group.WORLD
    return Group(dist.get_rank(), dist.get_world_size(), local_rank, device)


def cpu_group():
    """The gloo group for host-side objects (None: the default group, or no group at all)."""
    return _CPU_GROUP


def destroy_group() -> None:
    global _CPU_GROUP
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _CPU_GROUP = None


def leave_group() -> None:
    """The end of a run every rank finished: wait for the others, then close the group. Without this a
    rank that exits first closes its connections under a peer's gloo threads, and that peer aborts
    at exit (SIGABRT) instead of exiting 0."""
    if _active():
        dist.barrier(group=_CPU_GROUP)
    destroy_group()


def _active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if _active() else 0


def world_size() -> int:
    return dist.get_world_size() if _active() else 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the ranks (in place; returned); the identity in one process."""
    if _active() and dist.get_world_size() > 1:
        dist.all_reduce(x)
    return x


def broadcast_object(obj, src: int = 0):
    """rank src's Python object on every rank (pickled over the CPU group); the object itself in one process."""
    if not _active() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=_CPU_GROUP)
    return box[0]
