"""Rows, goals and the printed table of the kernel benchmark."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GOAL_RIVAL_RATIO = 1.0
GOAL_DECODE_HOST_US = 10.0
GOAL_KBS_NOISE = 0.05
GOAL_FLOOR_RATIO = 1.5
GOAL_COPY_FRACTION = 0.5

CPU_BANNER = "CPU figures (Triton interpreter): a smoke test of the command, not of GPU speed"


@dataclass
class Row:
    """One measured case: ours beside the upstream-style rival (and, for some, PyTorch)."""

    kind: str
    case: str
    params: dict
    device_us: float = math.nan
    host_us: float = math.nan
    rival_device_us: float | None = None
    rival_host_us: float | None = None
    bytes: int = 0
    torch_device_us: float | None = None
    agrees: bool | None = None
    timing: str = ""
    error: str | None = None
    extra: dict = field(default_factory=dict)
    # derived
    device_ratio: float | None = None
    host_ratio: float | None = None
    gbps: float | None = None
    copy_fraction: float | None = None
    floor_ratio: float | None = None
    torch_speedup: float | None = None

    def derive(self, floor_us: float, copy_gbps: float) -> None:
        if self.error:
            return
        if self.rival_host_us and self.host_us > 0:
            self.host_ratio = self.host_us / self.rival_host_us
        if not self.device_us > 0:
            return
        if self.rival_device_us:
            self.device_ratio = self.device_us / self.rival_device_us
        if self.bytes:
            self.gbps = self.bytes / self.device_us / 1e3
            self.copy_fraction = self.gbps / copy_gbps if copy_gbps else None
        self.floor_ratio = self.device_us / floor_us if floor_us else None
        if self.torch_device_us:
            self.torch_speedup = self.torch_device_us / self.device_us


def tokens_label(n: int) -> str:
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


# ---------------------------------------------------------------- goals


def _verdict(goal: str, met: bool | None, figure: str) -> dict:
    status = "not measured" if met is None else ("PASS" if met else "MISS")
    return dict(goal=goal, status=status, figure=figure)


def _worst(rows: list[Row], key: str) -> tuple[list[Row], Row | None]:
    measured = [r for r in rows if getattr(r, key) is not None]
    return measured, max(measured, key=lambda r: getattr(r, key), default=None)


def goals(rows: list[Row]) -> list[dict]:
    """The issue's goals, each PASS, MISS or not measured, with the figure that decides it."""
    ok = [r for r in rows if not r.error]
    out = []
    for column, what in (("device_ratio", "device"), ("host_ratio", "host")):
        measured, worst = _worst(ok, column)
        misses = [r for r in measured if getattr(r, column) > GOAL_RIVAL_RATIO]
        out.append(
            _verdict(
                f"every row <= {GOAL_RIVAL_RATIO:.1f}x the upstream-style rival in {what} time",
                None if worst is None else not misses,
                ""
                if worst is None
                else f"worst {getattr(worst, column):.2f}x ({worst.kind} {worst.case}); "
                f"{len(misses)} of {len(measured)} rows above",
            )
        )
    decode = [r for r in ok if r.params.get("decode") and r.host_us == r.host_us]
    worst = max(decode, key=lambda r: r.host_us, default=None)
    out.append(
        _verdict(
            f"host <= {GOAL_DECODE_HOST_US:.0f} µs a call for each method at decode sizes",
            None if worst is None else worst.host_us <= GOAL_DECODE_HOST_US,
            "" if worst is None else f"worst {worst.host_us:.1f} µs ({worst.kind} {worst.case})",
        )
    )
    small = [
        r
        for r in ok
        if r.kind == "compute_slot_mappings"
        and r.params["tokens"] <= 8192
        and r.floor_ratio is not None
    ]
    worst = max(small, key=lambda r: r.floor_ratio, default=None)
    out.append(
        _verdict(
            f"slot mappings up to 8K tokens within {GOAL_FLOOR_RATIO}x of the empty-kernel floor",
            None if worst is None else worst.floor_ratio <= GOAL_FLOOR_RATIO,
            "" if worst is None else f"worst {worst.floor_ratio:.2f}x ({worst.case})",
        )
    )
    big = [
        r
        for r in ok
        if r.kind == "compute_slot_mappings"
        and r.params["tokens"] >= 1 << 22
        and r.copy_fraction is not None
    ]
    worst = min(big, key=lambda r: r.copy_fraction, default=None)
    out.append(
        _verdict(
            f"slot mappings at 4M tokens >= {GOAL_COPY_FRACTION:.0%} of copy bandwidth",
            None if worst is None else worst.copy_fraction >= GOAL_COPY_FRACTION,
            "no 4M-token row in this run"
            if worst is None
            else f"worst {worst.copy_fraction:.0%} ({worst.case}, {worst.gbps:.0f} GB/s)",
        )
    )
    kbs = [  # device figures only: the interpreter's wall time says nothing of a GPU's
        r
        for r in ok
        if r.kind == "kernel_blocks" and r.extra.get("ratio") is not None and r.timing != "wall"
    ]
    worst = max(kbs, key=lambda r: r.extra["ratio"], default=None)
    out.append(
        _verdict(
            f"slot mappings with K < B cost no more than with K == B "
            f"(within {GOAL_KBS_NOISE:.0%} timing noise)",
            None if worst is None else worst.extra["ratio"] <= 1 + GOAL_KBS_NOISE,
            "" if worst is None else f"worst {worst.extra['ratio']:.2f}x ({worst.case})",
        )
    )
    failed = [r for r in rows if r.error or r.agrees is False]
    out.append(
        _verdict(
            "every row measured, and ours agrees with the rival bit for bit",
            not failed,
            ", ".join(f"{r.kind} {r.case}: {r.error or 'outputs differ'}" for r in failed[:4]),
        )
    )
    return out


# ---------------------------------------------------------------- table


def _fmt(value: float | None, spec: str) -> str:
    if value is None or value != value:
        width = spec.split(".")[0]
        return format("-", f">{width}") if width else "-"
    return format(value, spec)


HEADER = (
    f"{'kind':<33} {'case':<24} {'dev µs':>8} {'rival':>8} {'x':>5} "
    f"{'host µs':>8} {'rival':>8} {'x':>5} {'GB/s':>7} {'x floor':>7} {'check':>5}"
)


def table_line(r: Row) -> str:
    head = f"{r.kind:<33} {r.case:<24}"
    if r.error:
        return f"{head} ERROR {r.error}"[:200]
    check = {None: "", True: "ok", False: "FAIL"}[r.agrees]
    return (
        f"{head} {_fmt(r.device_us, '8.1f')} {_fmt(r.rival_device_us, '8.1f')} "
        f"{_fmt(r.device_ratio, '5.2f')} {_fmt(r.host_us, '8.1f')} "
        f"{_fmt(r.rival_host_us, '8.1f')} {_fmt(r.host_ratio, '5.2f')} "
        f"{_fmt(r.gbps, '7.1f')} {_fmt(r.floor_ratio, '7.2f')} {check:>5}"
    ).rstrip()


def _slot_layouts(rows: list[Row]) -> str:
    """Which token counts the slot-mapping rows ran by request and which by tile."""
    cases: dict[str, list[str]] = {}
    for r in rows:
        layout = r.params.get("slot_layout")
        label = f"T={tokens_label(r.params['tokens'])}" if "tokens" in r.params else ""
        if layout and label not in cases.setdefault(layout, []):
            cases[layout].append(label)
    return "; ".join(f"by {k}: {', '.join(v)}" for k, v in sorted(cases.items()))


def print_report(meta: dict, rows: list[Row], verdicts: list[dict]) -> None:
    print(
        f"cp-blocktables kernel benchmark on {meta['device_name']} ({meta['device']}); "
        f"torch {meta['torch']}, triton {meta['triton']}, python {meta['python']}"
    )
    if meta["cpu_figures"]:
        print(f"*** {CPU_BANNER} ***")
    print(
        f"launch floor {_fmt(meta['launch_floor_us'], '.1f')} µs, copy "
        f"{_fmt(meta['copy_gbps'], '.1f')} GB/s; timing: {meta['timing']}"
    )
    print("x = ours / upstream-style rival (below 1: ours faster)")
    print(HEADER)
    print("-" * len(HEADER))
    for r in rows:
        print(table_line(r))
    layouts = _slot_layouts(rows)
    if layouts:
        print(f"slot mappings (and the fused read) by layout: {layouts}")
    print("goals" + (" (CPU figures: the goals are for CUDA)" if meta["cpu_figures"] else ""))
    for g in verdicts:
        print(f"  [{g['status']:>12}] {g['goal']}" + (f": {g['figure']}" if g["figure"] else ""))
