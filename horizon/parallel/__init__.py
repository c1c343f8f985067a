"""Running one model across processes: the process group (group), tensor / expert-parallel sharding
of the model and its checkpoints (shard), and FSDP2 training (fsdp)."""

from horizon.parallel.group import Group, all_reduce, broadcast_object, destroy_group, init_group, leave_group

__all__ = ["Group", "all_reduce", "broadcast_object", "destroy_group", "init_group", "leave_group"]
