"""The process groups of one era of a drill: the first `size` launched ranks, in CP groups.

An elastic resize (`--sizes 4,2,4`) keeps the launched world and gives each
size an era of its own: `new_group` for the era's world and CP groups,
destroyed when the era ends.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from ..harness.dist import Comm
from .fault_inject import Fault


class EraComm:
    """The launched world seen from one era: its first `size` ranks, in CP groups of `cp`.

    Every launched rank constructs it (group creation is collective over the
    launched world); members then use it where the harness uses a `Comm`.
    """

    def __init__(self, comm: Comm, size: int, cp: int, timeout: float, fault: Fault | None):
        self.comm, self.size, self.fault = comm, size, fault
        self.rank, self.world_size, self.device = comm.rank, size, comm.device
        t = timedelta(seconds=timeout)
        self.ranks = list(range(size))
        self.world = dist.new_group(self.ranks, timeout=t, backend="gloo")
        self._created = [self.world]
        self._cp = None
        for start in range(0, size, cp):
            ranks = list(range(start, start + cp))
            tensors = dist.new_group(ranks, timeout=t)
            objects = (
                tensors
                if comm.backend == "gloo"
                else dist.new_group(ranks, timeout=t, backend="gloo")
            )
            self._created += [tensors] if objects is tensors else [tensors, objects]
            if self.rank in ranks:
                self._cp = (tensors, objects, ranks)

    @property
    def member(self) -> bool:
        return self.rank < self.size

    def cp_group(self, cp: int) -> tuple[object, object, list[int]]:
        return self._cp

    def all_gather_object(self, obj: object, label: str, group=None, ranks=None) -> list:
        if self.fault is not None:
            self.fault.before_collective()
        if group is None:
            group, ranks = self.world, self.ranks
        return self.comm.all_gather_object(obj, label, group, ranks)

    def gather_tensor(self, t, label, dst, group, ranks):
        return self.comm.gather_tensor(t, label, dst, group, ranks)

    def any(self, flag: bool, label: str) -> bool:
        """Whether any rank of the era says so (every member learns it)."""
        return any(self.all_gather_object(bool(flag), label))

    def destroy(self) -> None:
        if not self.comm.teardown_safe:
            return
        for g in self._created:
            if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(g)
