"""The Python cost of each method up to its kernel launch, measured on any machine.

`python -m cp_blocktables.bench.host_path` builds `BlockTables` on CPU at
decode size (256 requests x 1 token, 1 and 4 groups), replaces every kernel
launch with a no-op, and times each method per call (median of repeated
batches of calls, in this thread's CPU time). What remains is our own Python:
argument checks, buffer handling, the staging of writes. On a GPU the launch adds Triton's own
launcher on top; on CPU the interpreter would drown everything, hence the stub.
Input value checks are off, as they are by default on CUDA. The upstream-style
rival (`upstream_rival`) is timed beside ours, its launches stubbed the same way.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from .. import _jit
from ..block_tables import BlockTables
from .upstream_rival import UpstreamBlockTables


@contextmanager
def stubbed_launches():
    """Every `DualKernel.launch` counts and returns without running a kernel."""
    original = _jit.DualKernel.launch

    def launch(self, device, grid, *args, **kwargs):
        _jit.launch_counts[self.name] += 1

    _jit.DualKernel.launch = launch
    try:
        yield
    finally:
        _jit.DualKernel.launch = original


def per_call_us(call: Callable[[], object], calls: int = 300, repeats: int = 7) -> float:
    """Median over `repeats` of the mean µs per call over `calls` back-to-back calls.

    Counted in this thread's CPU time (`time.thread_time`), so that other
    processes on a shared machine do not inflate the figure.
    """
    for _ in range(10):
        call()
    figures = []
    for _ in range(repeats):
        t0 = time.thread_time()
        for _ in range(calls):
            call()
        figures.append((time.thread_time() - t0) / calls * 1e6)
    return statistics.median(figures)


def measure(groups: int, reqs: int = 256) -> dict[str, tuple[float, float | None]]:
    """`{method: (ours µs, the upstream-style rival's µs or None)}` per call."""
    rng = np.random.default_rng(0)
    block_sizes = [16, 16, 32, 64][:groups]
    bt = BlockTables(block_sizes, 1024, reqs, [2048] * groups, torch.device("cpu"))
    bt.validate_inputs = False
    idx = torch.tensor(rng.permutation(1024)[:reqs], dtype=torch.int32)
    qsl = torch.arange(reqs + 1, dtype=torch.int32)
    pos = torch.tensor(rng.integers(0, 16384, size=reqs), dtype=torch.int64)
    ids = tuple([int(x) for x in rng.integers(1, 2**31 - 1, size=4)] for _ in range(groups))
    rival = UpstreamBlockTables(bt.config, [t.gpu for t in bt.block_tables], bt.num_blocks.gpu)
    writer = UpstreamBlockTables.owned_state(bt.config, bt.device)
    slots, tables = torch.empty_like(bt.slot_mappings), list(bt.input_block_tables)

    def rival_both() -> None:
        rival.gather_block_tables(idx, reqs, tables)
        rival.compute_slot_mappings(idx, qsl, pos, slots)

    out: dict[str, tuple[float, float | None]] = {}
    with stubbed_launches():
        out["compute_slot_mappings"] = (
            per_call_us(lambda: bt.compute_slot_mappings(idx, qsl, pos, reqs)),
            per_call_us(lambda: rival.compute_slot_mappings(idx, qsl, pos, slots)),
        )
        out["gather_block_tables"] = (
            per_call_us(lambda: bt.gather_block_tables(idx, reqs)),
            per_call_us(lambda: rival.gather_block_tables(idx, reqs, tables)),
        )
        both = getattr(bt, "gather_and_compute_slot_mappings", None)
        if both is not None:
            out["gather_and_compute_slot_mappings"] = (
                per_call_us(lambda: both(idx, reqs, qsl, pos, reqs)),
                per_call_us(rival_both),
            )
        out["append_block_ids (4 ids a group)"] = (
            per_call_us(_appender(bt, ids), calls=1024),
            per_call_us(_appender(writer, ids), calls=1024),
        )
        bt.apply_staged_writes()
        writer.apply_staged_writes()
    return out


def _appender(target, ids) -> Callable[[], None]:
    """Appends to rows 1, 2, ... in turn, applying (untimed in effect) once per 1024 rows."""
    state = {"r": 0}

    def append() -> None:
        r = state["r"] = (state["r"] + 1) % 1024
        target.append_block_ids(r, ids, True)
        if r == 0:
            target.apply_staged_writes()

    return append


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cp_blocktables.bench.host_path")
    parser.add_argument("--groups", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print("µs per call of Python, kernel launches stubbed out (CPU, decode: 256 x 1 token)")
    print(f"  {'':<40} {'ours':>7} {'rival':>7} {'x':>5}")
    for groups in args.groups:
        for name, (ours, theirs) in measure(groups).items():
            ratio = f"{ours / theirs:5.2f}" if theirs else "    -"
            rival = f"{theirs:7.2f}" if theirs is not None else "      -"
            print(f"  G={groups} {name:<36} {ours:7.2f} {rival} {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
