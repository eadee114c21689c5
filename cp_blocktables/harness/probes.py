"""Contract probes: calls SPEC.md says must fail, and one that must not, on instances of their own.

The workload makes legal calls and checks what they compute. Two rules of the
contract are about calls that must raise, and no legal workload makes them:

- construction validates everything it is given and raises `ValueError`
  naming the offending argument (SPEC.md sections 2, 3 and 8.1), so a bad
  config cannot silently build tables that overflow a block;
- with integrity checks on (section 8.3), a slot shared by two tokens, a
  gather that reads a count never published, and a gathered row that differs
  from its source raise `RuntimeError`.

Four legal calls at the contract's edges must succeed (`legal_probes`):
huge blocks, a position past a disabled group's table, a position past
2**61 and a model of 257 groups.

An implementation that skips a rule computes every legal step right, so only
a probe can tell. Each probe starts from the preset's own valid constructor
arguments and changes exactly one thing (a correct implementation has one
reason to refuse), and builds its own instance, so the workload's instance
never sees a refused or faulty call. Every rank probes with its own
`cp_rank`: a defect on one rank fails the run. Findings are check 9
(construction) and check 10 (integrity checks, `integrity_probes`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .buffer_probes import probe_buffer_lengths, probe_full_buffer
from .features import Accepts
from .integrity_probes import names_number, probe_integrity
from .legal_probes import (
    PER_GROUP_DEFAULTS,
    probe_disabled_group_positions,
    probe_far_positions,
    probe_huge_blocks,
    probe_many_groups,
    probe_unit_blocks_past_2_31,
)
from .row_probe import probe_many_rows
from .violations import Violation

CONSTRUCTION = 9
_MANY_GROUPS_FROM = 6  # presets of this many groups or more probe 257 groups (`groups-6`)


@dataclass
class _Refusal:
    """One invalid configuration: the preset's arguments with one entry made wrong."""

    label: str
    args: list
    kwargs: dict
    names: tuple[str, ...]  # the message must contain one of these
    group: int | None = None  # ... and name this group (SPEC.md 8.1: "naming the group")


def _refusals(args: list, kwargs: dict, accepts: Accepts) -> list[_Refusal]:
    """Every single-fault variant of the valid `(args, kwargs)` worth refusing."""
    block_sizes, _, _, max_blocks, _ = args
    n = len(block_sizes)
    out: list[_Refusal] = []

    def arg(label: str, i: int, value, name: str, group: int | None = None) -> None:
        a = list(args)
        a[i] = value
        out.append(_Refusal(label, a, dict(kwargs), (name,), group))

    def kw(label: str, key: str, value, name: str, group: int | None = None) -> None:
        if accepts.accepts(key):
            out.append(_Refusal(label, list(args), {**kwargs, key: value}, (name,), group))

    arg("max_num_reqs=0", 1, 0, "max_num_reqs")
    arg("max_num_batched_tokens=0", 2, 0, "max_num_batched_tokens")
    blocks = "max_num_blocks_per_group"
    arg(f"{blocks} one entry too many", 3, [*max_blocks, 1], blocks)
    if n:
        g = n - 1
        arg(f"block_sizes[{g}]=0", 0, [*block_sizes[:g], 0], "block_sizes")
        arg(f"{blocks}[{g}]=0", 3, [*max_blocks[:g], 0], blocks)
    for key, pad in PER_GROUP_DEFAULTS.items():
        current = kwargs.get(key)
        if current is None:
            current = list(block_sizes) if key == "kernel_block_sizes" else [pad] * n
        extra = current[-1] if current else (1 if key == "kernel_block_sizes" else pad)
        kw(f"{key} one entry too many", key, [*current, extra], key)
    cp_size = int(kwargs.get("cp_size", 1))
    kw(f"cp_rank={cp_size} with cp_size={cp_size}", "cp_rank", cp_size, "cp_rank")
    kw("cp_rank=-1", "cp_rank", -1, "cp_rank")
    kernel = kwargs.get("kernel_block_sizes") or list(block_sizes)
    sharded = kwargs.get("dcp_sharded") or [True] * n
    if cp_size > 1 and "cp_interleave" in kwargs:
        for g in range(n):
            if sharded[g]:
                bad = kernel[g] + 1  # never divides kernel[g]
                kw(f"cp_interleave={bad} for group {g}", "cp_interleave", bad, "cp_interleave")
                kw("cp_interleave=0", "cp_interleave", 0, "cp_interleave")
                break
    if n and accepts.accepts("kernel_block_sizes"):
        g = n - 1
        bad = block_sizes[g] + 1  # never divides block_sizes[g]
        kw(f"kernel_block_sizes[{g}]={bad}", "kernel_block_sizes", [*kernel[:g], bad],
           "kernel_block_sizes", g)  # fmt: skip
        kw(f"kernel_block_sizes[{g}]=0", "kernel_block_sizes", [*kernel[:g], 0],
           "kernel_block_sizes", g)  # fmt: skip
    return out


def run_probes(
    factory: Callable,
    cfg,
    device: torch.device,
    kwargs: dict,
    accepts: Accepts,
    cp_rank: int,
    fused: bool,
    first_cp_group: bool = True,
    buffer_lengths: tuple[int, ...] = (),
) -> list[Violation]:
    """Every probe for one rank; `cfg` and `kwargs` built its workload instance.

    `first_cp_group`: this rank belongs to the first CP group running the
    preset; the probes that cost seconds run there alone (the other groups
    build the same config). `buffer_lengths`: the preset's
    `probe_buffer_lengths`."""
    args = constructor_args(cfg, device)
    found = probe_construction(factory, args, kwargs, accepts, cp_rank)
    found += probe_huge_blocks(factory, args, kwargs, cp_rank)
    found += probe_far_positions(factory, args, kwargs, cp_rank)
    if accepts.accepts("slot_mapping_enabled"):
        found += probe_disabled_group_positions(factory, args, kwargs, cp_rank)
    if len(cfg.block_sizes) >= _MANY_GROUPS_FROM:
        found += probe_many_groups(factory, args, kwargs, cp_rank, reads=first_cp_group)
        if first_cp_group:
            found += probe_many_rows(factory, args, kwargs, cp_rank)
    if first_cp_group:
        found += probe_unit_blocks_past_2_31(factory, args, kwargs, cp_rank)
        found += probe_full_buffer(factory, args, kwargs, cp_rank, fused)
        if buffer_lengths:
            found += probe_buffer_lengths(factory, args, kwargs, cp_rank, buffer_lengths)
    if kwargs.get("integrity_checks"):
        found += probe_integrity(factory, args, kwargs, cp_rank, fused)
    return found


def constructor_args(cfg, device: torch.device) -> list:
    """The positional arguments of SPEC.md section 3's constructor for config `cfg`."""
    return [cfg.block_sizes, cfg.max_num_reqs, cfg.max_num_batched_tokens,
            cfg.max_num_blocks_per_group, device]  # fmt: skip


def _names_group(message: str, group: int) -> bool:
    return names_number(message, str(group))


def probe_construction(
    factory: Callable, args: list, kwargs: dict, accepts: Accepts, cp_rank: int
) -> list[Violation]:
    """Each invalid configuration must raise `ValueError` naming what is wrong."""
    found = []
    for r in _refusals(args, kwargs, accepts):
        expected = f"ValueError naming {' or '.join(r.names)}"
        if r.group is not None:
            expected += f" and group {r.group}"
        try:
            factory(*r.args, **r.kwargs)
        except ValueError as e:
            text = str(e)
            if any(name in text for name in r.names) and (
                r.group is None or _names_group(text, r.group)
            ):
                continue
            actual = f"ValueError: {text}"
        except Exception as e:  # noqa: BLE001 - any other type is the finding
            actual = f"{type(e).__name__}: {e}"
        else:
            actual = "the constructor accepted it"
        found.append(
            Violation(
                CONSTRUCTION,
                f"construction with {r.label} (the rest of the preset's arguments valid)",
                -1,
                rank=cp_rank,
                expected=expected,
                actual=actual[:300],
            )
        )
    return found
