"""One Triton kernel, two back ends: compiled for CUDA tensors, interpreted for CPU tensors.

`triton.jit` decides at decoration time whether it builds a compiled
`JITFunction` or an `InterpretedFunction` (it reads `TRITON_INTERPRET`).
`dual_jit` decorates the same Python function once each way, so a CPU-only
machine runs the very kernels a GPU runs, with no environment variable set by
hand, and a GPU machine can use both in one process.

Every launch goes through `DualKernel.launch`, which also counts launches per
kernel (`launch_counts`): tests use it to prove that a fused path is one launch.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import contextmanager

import torch
import triton

launch_counts: Counter[str] = Counter()
"""Launches per kernel name since import (both back ends)."""


@contextmanager
def _triton_interpret(value: str):
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


class DualKernel:
    """A kernel usable from CUDA and CPU tensors; pick the back end by device."""

    def __init__(self, fn: Callable) -> None:
        self.name = fn.__name__
        with _triton_interpret("0"):
            self._compiled = triton.jit(fn)
        with _triton_interpret("1"):
            self._interpreted = triton.jit(fn)

    def launch(self, device: torch.device, grid: Sequence[int], *args, **kwargs) -> None:
        """Run `grid` program instances on `device` (empty grids launch nothing)."""
        if any(n == 0 for n in grid):
            return
        launch_counts[self.name] += 1
        if device.type == "cpu":
            self._interpreted[tuple(grid)](*args, **kwargs)
        elif device.index is None or device.index == torch.cuda.current_device():
            self._compiled[tuple(grid)](*args, **kwargs)
        else:  # Triton launches on the current device
            with torch.cuda.device(device.index):
                self._compiled[tuple(grid)](*args, **kwargs)


def dual_jit(fn: Callable) -> DualKernel:
    return DualKernel(fn)
