"""Kernel benchmark: `BlockTables`' three Triton kernels beside their yardsticks, in one run.

Rows: `compute_slot_mappings` over token counts, groups and CP sizes;
`gather_block_tables` over batch sizes and row widths, with and without
sliding-window masking; `append_block_ids` + `apply_staged_writes` for 256
requests x 4 groups, fused against one apply per group; the cost of SPEC 8.3's
slot-mapping integrity check as a ratio to that kernel at 8K and 64K tokens
(`integrity_checks`, see `_integrity_rows`). Yardsticks, measured
in the same run: an empty Triton kernel (the launch floor), a large
device-to-device copy (the bandwidth ceiling, bytes read plus written), and
`torch_rival` (plain PyTorch, same semantics) timed on the same inputs.

On CUDA, device time is the median of CUDA events around one call launched
while a queued GPU sleep keeps the stream busy, so the events bracket the
kernel and not the host's launch cost; inputs are rotated among copies whose
total exceeds twice the L2 where memory allows (large cases read cold data,
small ones stay L2-resident, as an engine's freshly prepared inputs do).
Host time is `time.perf_counter` around the Python call, without a
synchronisation. Every row also checks that the kernel and the rival agree.

On CPU the kernels run in Triton's interpreter: sizes are capped, figures are
marked as CPU figures, and device and host time are the same wall time. They
smoke-test the command; they say nothing about GPU speed.

Bytes are the fewest a kernel must read and write; docs/performance.md says
how each row counts them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial

import numpy as np
import torch
import triton

from .. import integrity
from .._jit import dual_jit
from ..block_tables import BlockTables
from ..contract import BlockTablesConfig
from .torch_rival import TorchBlockTables

_MAX_REQS = 1024
_BLOCK_SIZES = (16, 16, 32, 64)  # group g of a 4-group model; 1 group uses the first
_MAX_CONTEXT = 32768  # decode requests sit at a random position below this
_MAX_PREFIX = 16384  # prefill chunks start at a random (prefix-cached) position below this
_DECODE_ONLY_UP_TO = 256  # batches of at most this many tokens are pure decode
_MIXED_DECODES = 128  # larger batches: this many decodes ...
_MIXED_PREFILLS = 128  # ... and this many prefill chunks sharing the remaining tokens
_GATHER_BLOCK_SIZE = 16
_APPLY_GROUPS = 4
_APPLY_BLOCKS = 4  # block ids appended per request and group in one step
_MAX_SETS = 8  # rotated input copies, at most
_BUSY_CYCLES = 200_000  # ~100 us of GPU sleep queued ahead of a timed apply
_GOAL_FLOOR_RATIO = 1.5
_GOAL_COPY_FRACTION = 0.5
_GOAL_SPEEDUP = 10.0

CPU_BANNER = "CPU figures (Triton interpreter): a smoke test of the command, not of GPU speed"


@dataclass(frozen=True)
class _Plan:
    tokens: tuple[int, ...]
    groups: tuple[int, ...]
    cp_sizes: tuple[int, ...]
    gather_reqs: tuple[int, ...]
    gather_blocks: tuple[int, ...]
    apply_reqs: int
    apply_steps: int
    copy_bytes: int
    host_calls: int  # timed calls per row (device and host)


_FULL_TOKENS = (1, 256, 8192, 65536, 1 << 20, 1 << 22)
_SHAPES = dict(groups=(1, 4), cp_sizes=(1, 4))
_PLANS = {
    ("cuda", False): _Plan(
        tokens=_FULL_TOKENS, gather_reqs=(1, 256, 1024), gather_blocks=(32, 2048),
        apply_reqs=256, apply_steps=50, copy_bytes=1 << 30,
        host_calls=50, **_SHAPES,
    ),
    ("cuda", True): _Plan(
        tokens=_FULL_TOKENS[:4], gather_reqs=(1, 256), gather_blocks=(32, 2048),
        apply_reqs=256, apply_steps=20, copy_bytes=1 << 28,
        host_calls=20, **_SHAPES,
    ),
    # CPU: the interpreter costs milliseconds per program instance; cap at 64K tokens.
    ("cpu", False): _Plan(
        tokens=_FULL_TOKENS[:4], gather_reqs=(1, 256, 1024), gather_blocks=(32, 2048),
        apply_reqs=256, apply_steps=3, copy_bytes=1 << 26,
        host_calls=3, **_SHAPES,
    ),
    ("cpu", True): _Plan(
        tokens=_FULL_TOKENS[:2], gather_reqs=(1, 64), gather_blocks=(32,),
        apply_reqs=32, apply_steps=2, copy_bytes=1 << 23,
        host_calls=3, **_SHAPES,
    ),
}  # fmt: skip


# ---------------------------------------------------------------- timing


def _median_us(seconds: Sequence[float]) -> float:
    return statistics.median(seconds) * 1e6


class _Timer:
    """Times callables on one device: device medians, host medians, and input rotation."""

    def __init__(self, device: torch.device, plan: _Plan) -> None:
        self.device = device
        self.plan = plan
        self.cuda = device.type == "cuda"
        self.l2_bytes = 0
        if self.cuda:
            props = torch.cuda.get_device_properties(device)
            self.l2_bytes = int(getattr(props, "L2_cache_size", 50 << 20))
            self._evict = torch.empty(2 * self.l2_bytes // 4, dtype=torch.int32, device=device)

    def num_sets(self, set_bytes: int) -> int:
        """Input copies to rotate: enough to pass twice the L2 on CUDA, within `_MAX_SETS`."""
        if not self.cuda:
            return 2
        return max(2, min(_MAX_SETS, math.ceil(2 * self.l2_bytes / max(set_bytes, 1))))

    def time(self, calls: Sequence[Callable[[], object]]) -> tuple[float, float]:
        """`(device µs, host µs)` medians of `calls`, taken round robin."""
        for call in calls:  # every copy written at least once; compilers and caches warm
            call()
        rotation = itertools.cycle(calls)
        step = lambda: next(rotation)()  # noqa: E731
        if self.cuda:
            device_us = self._device_us(step)
        host = []
        for _ in range(self.plan.host_calls):
            t0 = time.perf_counter()
            step()
            host.append(time.perf_counter() - t0)
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return device_us, _median_us(host)
        return _median_us(host), _median_us(host)

    def _device_us(self, step: Callable[[], object]) -> float:
        """Median device time of one call, launched while the GPU is still busy.

        A queued sleep keeps the stream occupied while the host launches the
        call, so the events bracket the kernel's own execution, not the
        host's launch cost (reported separately). Large inputs are cold
        (rotated sets exceed the L2); small ones stay L2-resident, as the
        freshly prepared inputs of an engine step are.
        """
        sleep = getattr(torch.cuda, "_sleep", None)
        times = []
        for _ in range(self.plan.host_calls):
            if sleep is not None:
                sleep(_BUSY_CYCLES)
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        return _median_us(times)

    def _keep_busy(self) -> None:
        """Queue device work so that a following launch is timed on the device, not the host."""
        self._evict.zero_()
        sleep = getattr(torch.cuda, "_sleep", None)
        if sleep is not None:
            sleep(_BUSY_CYCLES)

    def time_steps(
        self, stage: Callable[[int], None], apply: Callable[[], None], steps: int
    ) -> dict[str, float]:
        """Medians per step: host µs of `stage(i)`, host µs and device µs of `apply()`."""
        warm = 2
        staging, applying, events = [], [], []
        for i in range(warm + steps):
            t0 = time.perf_counter()
            stage(i)
            t1 = time.perf_counter()
            if self.cuda:
                self._keep_busy()
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
            t2 = time.perf_counter()
            apply()
            t3 = time.perf_counter()
            if self.cuda:
                end.record()
                torch.cuda.synchronize(self.device)
            if i >= warm:
                staging.append(t1 - t0)
                applying.append(t3 - t2)
                if self.cuda:
                    events.append(start.elapsed_time(end) * 1e-3)
        host_apply = _median_us(applying)
        return {
            "device_us": _median_us(events) if self.cuda else host_apply,
            "host_us": host_apply,
            "host_step_us": _median_us([a + b for a, b in zip(staging, applying)]),
        }


# ---------------------------------------------------------------- rows


@dataclass
class _Row:
    kind: str
    case: str
    params: dict
    median_us: float
    host_us: float
    bytes: int
    torch_us: float | None = None
    torch_host_us: float | None = None
    agrees: bool | None = None
    gbps: float | None = None
    copy_fraction: float | None = None
    floor_ratio: float | None = None
    speedup: float | None = None
    extra: dict | None = None

    def derive(self, floor_us: float, copy_gbps: float) -> None:
        if self.bytes and self.median_us > 0:
            self.gbps = self.bytes / self.median_us / 1e3
            self.copy_fraction = self.gbps / copy_gbps if copy_gbps else None
        self.floor_ratio = self.median_us / floor_us if floor_us else None
        if self.torch_us is not None and self.median_us > 0:
            self.speedup = self.torch_us / self.median_us


def _tokens_label(n: int) -> str:
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def _random_table_ids(shape: tuple[int, ...], gen: torch.Generator, device) -> torch.Tensor:
    """Block ids in [1, 2**31 - 1): never the null block, slots pass 2**31."""
    return torch.randint(1, 2**31 - 1, shape, generator=gen, dtype=torch.int32, device=device)


def _fill(bt: BlockTables, gen: torch.Generator) -> None:
    """Every row of every table full of random ids, and the counts published."""
    for g, t in enumerate(bt.block_tables):
        t.gpu.copy_(_random_table_ids(tuple(t.gpu.shape), gen, bt.device))
        bt.num_blocks.np[g, :] = t.gpu.shape[1]
    bt.num_blocks.copy_to_uva()
    bt.validate_inputs = False  # the rival does not validate either


def _rival_of(bt: BlockTables) -> TorchBlockTables:
    return TorchBlockTables(bt.config, [t.gpu for t in bt.block_tables], bt.num_blocks.gpu)


# ---------------------------------------------------------------- slot mappings


def _batch(tokens: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(rows [R] int32, lens [R] int64, positions [tokens] int64)` of a realistic batch.

    Up to `_DECODE_ONLY_UP_TO` tokens: one decode token per request. Larger:
    decodes and prefill chunks (starting at prefix-cached positions), shuffled.
    """
    if tokens <= _DECODE_ONLY_UP_TO:
        lens = np.ones(tokens, dtype=np.int64)
        first = rng.integers(0, _MAX_CONTEXT, size=tokens)
    else:
        prefill = tokens - _MIXED_DECODES
        chunks = np.full(_MIXED_PREFILLS, prefill // _MIXED_PREFILLS, dtype=np.int64)
        chunks[: prefill % _MIXED_PREFILLS] += 1
        lens = np.concatenate([np.ones(_MIXED_DECODES, dtype=np.int64), chunks])
        first = np.concatenate(
            [
                rng.integers(0, _MAX_CONTEXT, size=_MIXED_DECODES),
                rng.integers(0, _MAX_PREFIX, size=_MIXED_PREFILLS),
            ]
        )
        order = rng.permutation(lens.size)
        lens, first = lens[order], first[order]
    begin = np.cumsum(lens) - lens
    positions = np.repeat(first - begin, lens) + np.arange(tokens)
    rows = rng.permutation(_MAX_REQS)[: lens.size].astype(np.int32)
    return rows, lens, positions.astype(np.int64)


def _slot_bytes(
    cfg: BlockTablesConfig, idx: torch.Tensor, lens: torch.Tensor, pos: torch.Tensor
) -> int:
    """Positions, qsl and idx read; the whole buffer written; each distinct table entry read."""
    num_reqs, num_tokens = idx.shape[0], pos.shape[0]
    total = 8 * num_tokens + 4 * (num_reqs + 1) + 4 * num_reqs
    total += 8 * cfg.num_kv_cache_groups * cfg.max_num_batched_tokens
    row = torch.repeat_interleave(idx.to(torch.int64), lens)  # [num_tokens]
    for g, width in enumerate(cfg.max_num_blocks_per_group):
        cp, bs = cfg.group_cp_size(g), cfg.block_sizes[g]
        key = row * width + pos // (bs * cp)
        if cp > 1:
            key = key[((pos % (bs * cp)) // cfg.cp_interleave) % cp == cfg.cp_rank]
        total += 4 * int(torch.unique(key).numel())
    return total


@dataclass
class _SlotInputs:
    """One rotated copy of a slot-mapping row's inputs and of both outputs."""

    idx: torch.Tensor  # int32 [num_reqs]
    qsl: torch.Tensor  # int32 [num_reqs + 1]
    pos: torch.Tensor  # int64 [num_tokens]
    out: torch.Tensor  # int64 [groups, num_tokens]
    rival_out: torch.Tensor


def _slot_rows(timer: _Timer, rng: np.random.Generator, gen: torch.Generator) -> list[_Row]:
    device, plan, rows = timer.device, timer.plan, []
    for tokens in plan.tokens:
        req_rows, lens, positions = _batch(tokens, rng)
        qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        top = int(positions.max())
        for groups in plan.groups:
            block_sizes = list(_BLOCK_SIZES[:groups])
            widths = [top // bs + 1 for bs in block_sizes]
            for cp in plan.cp_sizes:
                bt = BlockTables(
                    block_sizes, _MAX_REQS, tokens, widths, device, cp_size=cp, cp_rank=cp // 2
                )
                _fill(bt, gen)
                rival = _rival_of(bt)
                sets = [
                    _SlotInputs(
                        torch.tensor(req_rows, device=device),
                        torch.tensor(qsl, device=device),
                        torch.tensor(positions, device=device),
                        torch.empty((groups, tokens), dtype=torch.int64, device=device),
                        torch.empty((groups, tokens), dtype=torch.int64, device=device),
                    )
                    for _ in range(timer.num_sets(8 * tokens * (1 + 2 * groups)))
                ]
                dev, host = timer.time(
                    [
                        partial(bt.compute_slot_mappings, s.idx, s.qsl, s.pos, tokens, out=s.out)
                        for s in sets
                    ]
                )
                rival_dev, rival_host = timer.time(
                    [
                        partial(rival.compute_slot_mappings, s.idx, s.qsl, s.pos, s.rival_out)
                        for s in sets
                    ]
                )
                agrees = all(torch.equal(s.out, s.rival_out) for s in sets)
                lens_dev = torch.tensor(lens, device=device)
                nbytes = _slot_bytes(bt.config, sets[0].idx, lens_dev, sets[0].pos)
                rows.append(
                    _Row(
                        "compute_slot_mappings",
                        f"T={_tokens_label(tokens)} G={groups} cp={cp}",
                        dict(tokens=tokens, groups=groups, cp_size=cp, requests=len(req_rows)),
                        dev, host, nbytes, rival_dev, rival_host, agrees,
                    )
                )  # fmt: skip
                del bt, rival, sets
    return rows


# ---------------------------------------------------------------- gather


class _GatherInputs:
    """One rotated copy of a gather row's state: its own tables, rival and outputs."""

    def __init__(self, blocks: int, reach: int, req_rows, nct, device, gen) -> None:
        self.bt = BlockTables(
            [_GATHER_BLOCK_SIZE], _MAX_REQS, 1, [blocks], device, sliding_window_reach=[reach]
        )
        _fill(self.bt, gen)
        self.rival = _rival_of(self.bt)
        self.rival_out = [torch.zeros_like(self.bt.input_block_tables[0])]
        self.idx = torch.tensor(req_rows, device=device)  # int32 [reqs]
        self.nct = torch.tensor(nct, device=device)  # int32 [max_reqs]

    def agrees(self, reqs: int) -> bool:
        return torch.equal(self.bt.input_block_tables[0][:reqs], self.rival_out[0][:reqs])


def _gather_rows(timer: _Timer, rng: np.random.Generator, gen: torch.Generator) -> list[_Row]:
    device, plan, rows = timer.device, timer.plan, []
    bs = _GATHER_BLOCK_SIZE
    for blocks in plan.gather_blocks:
        reach = blocks * bs // 4
        # Computed tokens between half and all of a full row: a quarter to three
        # quarters of each row lies wholly below the window.
        nct = rng.integers(blocks * bs // 2, blocks * bs + 1, size=_MAX_REQS).astype(np.int32)
        dead = np.clip((nct.astype(np.int64) - reach) // bs, 0, blocks)  # [max_reqs]
        for reqs in plan.gather_reqs:
            req_rows = rng.permutation(_MAX_REQS)[:reqs].astype(np.int32)
            sets = [
                _GatherInputs(blocks, reach, req_rows, nct, device, gen)
                for _ in range(timer.num_sets(3 * 4 * _MAX_REQS * blocks))
            ]
            for masked in (False, True):
                dev, host = timer.time(
                    [
                        partial(s.bt.gather_block_tables, s.idx, reqs,
                                num_computed_tokens=s.nct if masked else None)
                        for s in sets
                    ]
                )  # fmt: skip
                rival_dev, rival_host = timer.time(
                    [
                        partial(s.rival.gather_block_tables, s.idx, reqs, s.rival_out,
                                s.nct if masked else None)
                        for s in sets
                    ]
                )  # fmt: skip
                agrees = all(s.agrees(reqs) for s in sets)
                live = reqs * blocks - (int(dead[req_rows].sum()) if masked else 0)
                nbytes = 4 * reqs * (2 + masked) + 4 * live + 4 * reqs * blocks
                rows.append(
                    _Row(
                        "gather_block_tables",
                        f"R={reqs} W={blocks}" + (" swa" if masked else ""),
                        dict(requests=reqs, blocks_per_row=blocks, sliding_window=masked),
                        dev, host, nbytes, rival_dev, rival_host, agrees,
                    )
                )  # fmt: skip
            del sets
    return rows


# ---------------------------------------------------------------- staged writes


def _apply_rows(timer: _Timer, rng: np.random.Generator) -> list[_Row]:
    device, plan = timer.device, timer.plan
    reqs, groups, k = plan.apply_reqs, _APPLY_GROUPS, _APPLY_BLOCKS
    kwargs = dict(
        block_sizes=[16] * groups,
        max_num_reqs=reqs,
        max_num_batched_tokens=1,
        max_num_blocks_per_group=[k] * groups,
    )
    # Four steps of ids, reused round robin: [step][request] -> one list per group.
    steps = [
        [tuple(rng.integers(1, 2**31 - 1, size=(groups, k)).tolist()) for _ in range(reqs)]
        for _ in range(4)
    ]

    def stage_into(target) -> Callable[[int], None]:
        def stage(i: int) -> None:
            for r, ids in enumerate(steps[i % len(steps)]):
                target.append_block_ids(r, ids, True)

        return stage

    fused = BlockTables(device=device, **kwargs)
    per_group = BlockTables(device=device, **kwargs)

    def apply_per_group() -> None:
        for t in per_group.block_tables:
            t.apply_write()
        per_group.num_blocks.copy_to_uva()

    cfg = BlockTablesConfig(**kwargs)
    rival = TorchBlockTables(
        cfg,
        [torch.zeros_like(t.gpu) for t in fused.block_tables],
        torch.zeros((groups, reqs), dtype=torch.int32, device=device),
    )
    n = plan.apply_steps
    f = timer.time_steps(stage_into(fused), fused.apply_staged_writes, n)
    p = timer.time_steps(stage_into(per_group), apply_per_group, n)
    r = timer.time_steps(stage_into(rival), rival.apply_staged_writes, n)
    agrees = all(
        torch.equal(a.gpu, b.gpu) and torch.equal(a.gpu, c)
        for a, b, c in zip(fused.block_tables, per_group.block_tables, rival.tables)
    )
    elems, writes = reqs * groups * k, reqs * groups
    params = dict(requests=reqs, groups=groups, blocks_per_write=k)
    return [
        _Row(
            "apply_staged_writes", f"{reqs}x{groups} {name}", dict(params, variant=name),
            t["device_us"], t["host_us"], 8 * elems + (16 if name == "fused" else 12) * writes,
            r["device_us"], r["host_us"], agrees,
            extra=dict(host_step_us=t["host_step_us"], torch_host_step_us=r["host_step_us"]),
        )
        for name, t in (("fused", f), ("per-group", p))
    ]  # fmt: skip


# ---------------------------------------------------------------- integrity checks

_INTEGRITY_TOKENS = (8192, 65536)
_INTEGRITY_GROUPS = 4


def _integrity_rows(timer: _Timer, rng: np.random.Generator) -> list[_Row]:
    """Cost of SPEC 8.3's slot-mapping check beside the slot-mapping kernel it follows.

    At 8K and 64K tokens (else the plan's largest), 4 groups, CP 1; tables hold
    distinct ids, so a correct mapping has no shared slot and the check must
    report none (`agrees`). Device time: the detection kernels alone (no
    read-back); host time: the whole check, read-back included. `extra`
    holds the kernel's figures and both ratios.
    """
    device, rows = timer.device, []
    tokens_list = [t for t in timer.plan.tokens if t in _INTEGRITY_TOKENS]
    block_sizes = list(_BLOCK_SIZES[:_INTEGRITY_GROUPS])
    for tokens in tokens_list or [max(timer.plan.tokens)]:
        req_rows, lens, positions = _batch(tokens, rng)
        qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        widths = [int(positions.max()) // bs + 1 for bs in block_sizes]
        bt = BlockTables(block_sizes, _MAX_REQS, tokens, widths, device)
        bt.validate_inputs = False
        for g, t in enumerate(bt.block_tables):
            unique = (torch.randperm(t.gpu.numel(), device=device) * 7919 + 1) % (2**31 - 1)
            t.gpu.copy_(unique.reshape(t.gpu.shape))  # distinct ids: no slot is shared
            bt.num_blocks.np[g, :] = t.gpu.shape[1]
        bt.num_blocks.copy_to_uva()
        idx, qsl_t, pos = (torch.tensor(a, device=device) for a in (req_rows, qsl, positions))
        out = torch.empty((_INTEGRITY_GROUPS, tokens), dtype=torch.int64, device=device)
        kernel_dev, kernel_host = timer.time(
            [partial(bt.compute_slot_mappings, idx, qsl_t, pos, tokens, out=out)]
        )
        count = partial(integrity.count_slot_mapping_faults, out, qsl_t, block_sizes, tokens)
        dev, _ = timer.time([count])
        _, host = timer.time(
            [partial(integrity.check_slot_mappings, out, qsl_t, idx, pos, block_sizes, tokens)]
        )
        ratio = dev / kernel_dev
        rows.append(
            _Row(
                "integrity_checks", f"T={_tokens_label(tokens)} G=4 {ratio:.1f}x slots",
                dict(tokens=tokens, groups=_INTEGRITY_GROUPS, check="slot_mappings"),
                dev, host, 8 * _INTEGRITY_GROUPS * tokens, agrees=int(count()) == 0,
                extra=dict(kernel_us=kernel_dev, kernel_host_us=kernel_host,
                           ratio=ratio, host_ratio=host / kernel_host),
            )
        )  # fmt: skip
        del bt, out
    return rows


# ---------------------------------------------------------------- yardsticks


@dual_jit
def _empty_kernel(x):
    pass


def _yardstick_rows(timer: _Timer, gen: torch.Generator) -> list[_Row]:
    device = timer.device
    x = torch.empty(1, dtype=torch.int32, device=device)
    dev, host = timer.time([lambda: _empty_kernel.launch(device, (1,), x)])
    floor = _Row("launch_floor", "empty Triton kernel", {}, dev, host, 0)
    n = timer.plan.copy_bytes
    src = _random_table_ids((n // 4,), gen, device)
    dst = torch.empty_like(src)
    dev, host = timer.time([lambda: dst.copy_(src)])
    copy = _Row("copy", f"{n >> 20} MiB device-to-device", dict(bytes=n), dev, host, 2 * n)
    return [floor, copy]


# ---------------------------------------------------------------- report


def _goals(rows: list[_Row], floor: _Row) -> list[dict]:
    def slot(pred):
        return [r for r in rows if r.kind == "compute_slot_mappings" and pred(r.params["tokens"])]

    def verdict(goal: str, met: bool | None, figure: str) -> dict:
        status = "not measured" if met is None else ("met" if met else "missed")
        return dict(goal=goal, status=status, figure=figure)

    goals = []
    small = slot(lambda t: t <= 8192)
    worst = max(small, key=lambda r: r.floor_ratio, default=None)
    host_ratio = max((r.host_us / floor.host_us for r in small), default=0.0)
    goals.append(
        verdict(
            f"slot mappings up to 8K tokens within {_GOAL_FLOOR_RATIO}x of the launch floor",
            None if worst is None else worst.floor_ratio <= _GOAL_FLOOR_RATIO,
            ""
            if worst is None
            else f"worst {worst.floor_ratio:.2f}x device ({worst.case}); "
            f"host: worst {host_ratio:.2f}x the empty kernel's launch",
        )
    )
    big = slot(lambda t: t >= 1 << 22)
    worst = min(big, key=lambda r: r.copy_fraction or 0.0, default=None)
    goals.append(
        verdict(
            f"slot mappings at 4M tokens >= {_GOAL_COPY_FRACTION:.0%} of copy bandwidth",
            None if worst is None else (worst.copy_fraction or 0.0) >= _GOAL_COPY_FRACTION,
            "no 4M-token row in this run"
            if worst is None
            else f"worst {worst.copy_fraction:.0%} ({worst.case}, {worst.gbps:.0f} GB/s)",
        )
    )
    large = slot(lambda t: t >= 65536)
    worst = min(large, key=lambda r: r.speedup or 0.0, default=None)
    goals.append(
        verdict(
            f"slot mappings at 64K+ tokens >= {_GOAL_SPEEDUP:.0f}x faster than PyTorch",
            None if worst is None else (worst.speedup or 0.0) >= _GOAL_SPEEDUP,
            "no 64K-token row in this run"
            if worst is None
            else f"worst {worst.speedup:.1f}x ({worst.case})",
        )
    )
    apply = {r.params["variant"]: r for r in rows if r.kind == "apply_staged_writes"}
    f, p = apply.get("fused"), apply.get("per-group")
    goals.append(
        verdict(
            f"fused apply faster than per-group apply ({_APPLY_GROUPS} groups), device and host",
            None if f is None else f.median_us < p.median_us and f.host_us < p.host_us,
            ""
            if f is None
            else f"device {f.median_us:.1f} vs {p.median_us:.1f} µs, "
            f"host {f.host_us:.1f} vs {p.host_us:.1f} µs",
        )
    )
    return goals


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _human_bytes(n: int) -> str:
    if not n:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n}B"


_HEADER = (
    f"{'kind':<21} {'case':<22} {'dev µs':>9} {'host µs':>9} {'bytes':>8} {'GB/s':>7} "
    f"{'%copy':>6} {'x floor':>8} {'torch µs':>9} {'speedup':>8} {'check':>5}"
)


def _table_line(r: _Row) -> str:
    check = {None: "", True: "ok", False: "FAIL"}[r.agrees]
    return (
        f"{r.kind:<21} {r.case:<22} {r.median_us:>9.1f} {r.host_us:>9.1f} "
        f"{_human_bytes(r.bytes):>8} {_fmt(r.gbps, '7.1f'):>7} "
        f"{_fmt(None if r.copy_fraction is None else 100 * r.copy_fraction, '6.1f'):>6} "
        f"{_fmt(r.floor_ratio, '8.2f'):>8} {_fmt(r.torch_us, '9.1f'):>9} "
        f"{_fmt(r.speedup, '8.2f'):>8} {check:>5}"
    ).rstrip()


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU"


def _resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be cuda or cpu, got {device}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda asked for, but torch sees no CUDA device")
    return device


def run_kernel_bench(device: str | torch.device, quick: bool, json_path: str | None) -> list[dict]:
    """Time every row on `device` ("auto", "cuda" or "cpu"), print the table and the goals,
    write `{"meta", "rows", "goals"}` to `json_path` when given; returns the rows as dicts."""
    device = _resolve_device(device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    cpu = device.type == "cpu"
    plan = _PLANS[(device.type, quick)]
    timer = _Timer(device, plan)
    rng = np.random.default_rng(0)
    gen = torch.Generator(device=device).manual_seed(0)
    threads = torch.get_num_threads()
    if cpu:
        # The interpreter runs on one thread; so does the rival, or its figures
        # swing with thread wake-ups on a busy machine.
        torch.set_num_threads(1)
    try:
        yardsticks = _yardstick_rows(timer, gen)
        rows = yardsticks + _slot_rows(timer, rng, gen) + _gather_rows(timer, rng, gen)
        rows += _apply_rows(timer, rng) + _integrity_rows(timer, rng)
    finally:
        torch.set_num_threads(threads)
    floor, copy = yardsticks
    copy_gbps = copy.bytes / copy.median_us / 1e3
    for r in rows:
        r.derive(floor.median_us, copy_gbps)
    goals = _goals(rows, floor)
    meta = dict(
        device=device.type,
        device_name=_device_name(device),
        torch=torch.__version__,
        triton=triton.__version__,
        python=platform.python_version(),
        cpu_figures=cpu,
        quick=quick,
        l2_bytes=timer.l2_bytes,
        launch_floor_us=floor.median_us,
        copy_gbps=copy_gbps,
        timing="events around one call launched behind queued GPU work; inputs rotated"
        if not cpu
        else "wall-clock median, one thread",
    )
    _print_report(meta, rows, goals)
    out = [asdict(r) | dict(device=device.type, cpu_figures=cpu) for r in rows]
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(meta=meta, rows=out, goals=goals), f, indent=1)
    return out


def _print_report(meta: dict, rows: list[_Row], goals: list[dict]) -> None:
    print(
        f"cp-blocktables kernel benchmark on {meta['device_name']} ({meta['device']}); "
        f"torch {meta['torch']}, triton {meta['triton']}, python {meta['python']}"
    )
    if meta["cpu_figures"]:
        print(f"*** {CPU_BANNER} ***")
    print(
        f"launch floor {meta['launch_floor_us']:.1f} µs, copy {meta['copy_gbps']:.1f} GB/s; "
        f"timing: {meta['timing']}; dev µs = median device time, host µs = Python call"
    )
    print(_HEADER)
    print("-" * len(_HEADER))
    for r in rows:
        print(_table_line(r))
    print("goals" + (" (CPU figures: the goals are for CUDA)" if meta["cpu_figures"] else ""))
    for g in goals:
        print(f"  [{g['status']:>12}] {g['goal']}" + (f": {g['figure']}" if g["figure"] else ""))


# ---------------------------------------------------------------- command line


def add_bench_kernels_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `cp-blocktables bench kernels`."""
    parser.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="cuda (compiled kernels), cpu (Triton interpreter, reduced sizes); auto: cuda if seen",
    )
    parser.add_argument("--json", dest="json_path", metavar="PATH", help="also write rows here")
    parser.add_argument(
        "--quick", action="store_true", help="fewer sizes and repeats (a smoke test)"
    )


def bench_kernels_command(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 when every kernel agreed with the rival, 1 if not, 2 on bad usage."""
    try:
        rows = run_kernel_bench(args.device, args.quick, args.json_path)
    except ValueError as e:
        print(f"cp-blocktables bench kernels: {e}", file=sys.stderr)
        return 2
    bad = [f"{r['kind']} {r['case']}" for r in rows if r["agrees"] is False]
    if bad:
        print(f"kernel and PyTorch rival disagree on: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cp_blocktables.bench.kernels",
        description="Time the Triton kernels against the launch floor, copy bandwidth "
        "and a plain-PyTorch rival.",
    )
    add_bench_kernels_arguments(parser)
    return bench_kernels_command(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
