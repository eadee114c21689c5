"""Contract probes: the calls SPEC.md says must fail, made on instances of their own.

The workload makes legal calls and checks what they compute. Two rules of the
contract are about calls that must raise, and no legal workload makes them:

- construction validates everything it is given and raises `ValueError`
  naming the offending argument (SPEC.md sections 2, 3 and 8.1), so a bad
  config cannot silently build tables that overflow a block;
- with integrity checks on (section 8.3), a slot shared by two tokens, a
  gather that reads a count never published, and a gathered row that differs
  from its source raise `RuntimeError`.

An implementation that skips a rule computes every legal step right, so only
a probe can tell. Each probe starts from the preset's own valid constructor
arguments and changes exactly one thing (a correct implementation has one
reason to refuse), and builds its own instance, so the workload's instance
never sees a refused or faulty call. Every rank probes with its own
`cp_rank`: a defect on one rank fails the run. Findings are check 9
(construction) and check 10 (integrity checks).
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from ..reference import ReferenceBlockTables
from .features import Accepts
from .guarded import guard
from .violations import Violation

CONSTRUCTION = 9
INTEGRITY = 10
ENV_VAR = "CPBT_INTEGRITY_CHECKS"  # SPEC.md 8.3: also turns the checks on
_SHARED_ID = 4099  # allocator block id both probe rows hold: far from the null block 0
_FRESH_ID = 4111


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
    defaults = {
        "slot_mapping_enabled": True,
        "dcp_sharded": True,
        "sliding_window_reach": 0,
        "kernel_block_sizes": None,
    }
    for key, pad in defaults.items():
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
) -> list[Violation]:
    """Every probe for one rank; `cfg` and `kwargs` built its workload instance."""
    args = constructor_args(cfg, device)
    found = probe_construction(factory, args, kwargs, accepts, cp_rank)
    if kwargs.get("integrity_checks"):
        found += probe_integrity(factory, args, kwargs, cp_rank, fused)
    return found


def constructor_args(cfg, device: torch.device) -> list:
    """The positional arguments of SPEC.md section 3's constructor for config `cfg`."""
    return [cfg.block_sizes, cfg.max_num_reqs, cfg.max_num_batched_tokens,
            cfg.max_num_blocks_per_group, device]  # fmt: skip


def _names_group(message: str, group: int) -> bool:
    return _names_number(message, str(group))


def _names_number(message: str, number: str) -> bool:
    """Whether `message` holds `number` as a whole number (slot 12 is not in "123")."""
    return re.search(rf"(?<![0-9]){re.escape(number)}(?![0-9])", message) is not None


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


# ---------------------------------------------------------------- integrity checks


def _reference(args: list, kwargs: dict, cp_rank: int) -> ReferenceBlockTables:
    block_sizes, max_num_reqs, max_tokens, max_blocks, _ = args
    cfg = SimpleNamespace(
        block_sizes=block_sizes,
        max_num_reqs=max_num_reqs,
        max_num_batched_tokens=max_tokens,
        max_num_blocks_per_group=max_blocks,
        cp_size=kwargs.get("cp_size", 1),
        cp_rank=cp_rank,
        cp_interleave=kwargs.get("cp_interleave", 1),
        slot_mapping_enabled=kwargs.get("slot_mapping_enabled"),
        dcp_sharded=kwargs.get("dcp_sharded"),
        sliding_window_reach=kwargs.get("sliding_window_reach"),
        kernel_block_sizes=kwargs.get("kernel_block_sizes"),
    )
    return ReferenceBlockTables(cfg)


def _shared_rows(ref: ReferenceBlockTables, max_tokens: int) -> tuple[list, int] | None:
    """Block ids that make rows 0 and 1 hold the same blocks over positions `[0, P)`.

    `P` is one interleave round `cp_size * I` (every rank owns a position in
    it), capped so that both rows' tokens fit one step; `None` if the rows
    cannot hold it.
    """
    rules = ref.rules
    cp = max(rules.group_cp)  # cp_size, or 1 when no group is sharded
    span = min(cp * rules.interleave, max_tokens // 2)
    if rules.max_num_reqs < 2 or span < 1:
        return None
    ids = []
    for g in range(rules.num_groups):
        covers = rules.block_sizes[g] * rules.group_cp[g]  # positions one allocator block spans
        count = -(-span // covers)
        if count * rules.m[g] > rules.width[g]:
            return None
        ids.append([_SHARED_ID + j for j in range(count)])
    return ids, span


def _expect_error(
    what: str,
    setup: Callable[[], Callable[[], object]],
    cp_rank: int,
    names: tuple[str, ...] = (),
    refusal_ok: bool = False,
) -> list[Violation]:
    """`setup()` builds the state and returns the faulty call, which must raise `RuntimeError`
    whose message contains one of `names` (when given: SPEC.md 8.3 says what it names);
    `refusal_ok`: a `ValueError` (the call refused before it ran) passes too."""
    expected = "RuntimeError" + (f" naming one of {', '.join(names)}" if names else "")
    expected += " (or a ValueError refusing the call)" if refusal_ok else ""
    try:
        call = setup()
    except Exception as e:  # noqa: BLE001 - legal calls that raise are a finding too
        actual = f"setting up the probe raised {type(e).__name__}: {e}"
    else:
        try:
            call()
        except RuntimeError as e:
            if not names or any(_names_number(str(e), n) for n in names):
                return []
            actual = f"RuntimeError: {e}"
        except ValueError as e:
            if refusal_ok:
                return []
            actual = f"ValueError: {e}"
        except Exception as e:  # noqa: BLE001
            actual = f"{type(e).__name__}: {e}"
        else:
            actual = "no error"
    return [Violation(INTEGRITY, what, -1, rank=cp_rank, expected=expected, actual=actual[:300])]


def _i32(values, device: torch.device) -> torch.Tensor:
    """An input for the implementation: on the CPU it ends at an unreadable page (`guarded`)."""
    return guard(torch.tensor(values, dtype=torch.int32, device=device))


def _i64(values, device: torch.device) -> torch.Tensor:
    return guard(torch.tensor(values, dtype=torch.int64, device=device))


def probe_integrity(
    factory: Callable, args: list, kwargs: dict, cp_rank: int, fused: bool
) -> list[Violation]:
    """Plant the faults of SPEC.md 8.3 on fresh instances.

    A shared slot: rows 0 and 1 hold the same block ids and both map positions
    `[0, P)` (an allocator that hands one block to two requests); the message
    must name one of the shared slots, and the environment variable alone must
    turn the checks on too. A stale count, both ways: a row grown by
    an append, and a row cut short by an overwrite with fewer blocks, after the
    last apply, then a gather of that row. `fused`:
    the implementation has `gather_and_compute_slot_mappings` (section 8.2),
    whose effects are those of both calls, checks included. A gathered row
    unlike its source, counts published: see `_aliased_gather`.
    """
    device = args[4]
    ref = _reference(args, kwargs, cp_rank)
    n = ref.rules.num_groups
    methods = ("gather_block_tables", "gather_and_compute_slot_mappings")[: 1 + fused]
    found: list[Violation] = []
    shared = _shared_rows(ref, args[2]) if n else None
    if shared is not None:
        ids, span = shared
        for r in (0, 1):
            ref.append_block_ids(r, ids, True)
        positions = list(range(span)) * 2
        qsl = [0, span, 2 * span]
        expected = ref.slot_mappings(np.array([0, 1]), np.array(qsl), np.array(positions), 2 * span)
        shared_slots = tuple(str(x) for row in expected for x in _repeats(row))
        if shared_slots:
            plain = {k: v for k, v in kwargs.items() if k != "integrity_checks"}
            ways = [("compute_slot_mappings", kwargs, ""), *((m, kwargs, "") for m in methods[1:])]
            ways.append(("compute_slot_mappings", plain, f" (checks on by {ENV_VAR}=1 alone)"))
            for how, kw, note in ways:

                def setup(how=how, kw=kw, env=bool(note)):
                    impl = _filled(factory, args, kw, ids, rows=(0, 1), env=env)
                    idx, q, pos = _i32([0, 1], device), _i32(qsl, device), _i64(positions, device)
                    if how == "compute_slot_mappings":
                        return lambda: impl.compute_slot_mappings(idx, q, pos, 2 * span)
                    return lambda: impl.gather_and_compute_slot_mappings(idx, 2, q, pos, 2 * span)

                what = f"{how} with rows 0 and 1 holding the same blocks (a shared slot){note}"
                found += _expect_error(what, setup, cp_rank, shared_slots)
    stale = {"grown by an append": False, "cut short by an overwrite": True}
    two_fit = all(w >= 2 * m for w, m in zip(ref.rules.width, ref.rules.m))
    row = ref.rules.max_num_reqs - 1  # gathered into batch row 0: the message names one of them
    rows = (str(row), "0")
    for (change, overwrite), how in itertools.product(stale.items(), methods if two_fit else ()):

        def setup(how=how, overwrite=overwrite):
            first = [_SHARED_ID, _FRESH_ID] if overwrite else [_SHARED_ID]
            impl = _filled(factory, args, kwargs, [first] * n, rows=(row,))
            impl.append_block_ids(row, tuple([_FRESH_ID] for _ in range(n)), overwrite)  # no apply
            idx = _i32([row], device)
            if how == "gather_block_tables":
                return lambda: impl.gather_block_tables(idx, 1)
            q, pos = _i32([0, 1], device), _i64([0], device)
            return lambda: impl.gather_and_compute_slot_mappings(idx, 1, q, pos, 1)

        what = f"{how} of row {row} {change} after the last apply_staged_writes (a stale count)"
        found += _expect_error(what, setup, cp_rank, rows)
    if n >= 2:
        found += _expect_error(  # row 0: a check comparing the sources with themselves is blind
            "gather_block_tables of row 0 into one out tensor given for every group (a gathered "
            "row that differs from its source, counts all published)",
            lambda: _aliased_gather(factory, args, kwargs, ref, 0),
            cp_rank,
            ("0",),
            refusal_ok=True,
        )
    return found


def _aliased_gather(
    factory: Callable, args: list, kwargs: dict, ref: ReferenceBlockTables, row: int
) -> Callable[[], object]:
    """`row` holds a different block in every group, applied; the gather's `out` names one
    tensor for all groups, so one group's copy overwrites another's: a gathered row differs
    from its source while every count is published. Only the entry comparison of SPEC.md 8.3
    sees it (a refusal of the aliased `out` up front is fine too)."""
    rules, device = ref.rules, args[4]
    first, ids = set(), []
    for m in rules.m:  # the groups' first kernel ids must differ pairwise
        b = _SHARED_ID + len(ids)
        while b * m in first:
            b += 1
        first.add(b * m)
        ids.append([b])
    impl = _filled(factory, args, kwargs, ids, rows=(row,))
    shared = torch.zeros((1, max(rules.width)), dtype=torch.int32, device=device)
    idx = _i32([row], device)
    return lambda: impl.gather_block_tables(idx, 1, out=[shared] * rules.num_groups)


def _repeats(row: np.ndarray) -> list[int]:
    """Slots (>= 0) that two or more tokens of `row` share."""
    values, counts = np.unique(row[row >= 0], return_counts=True)
    return values[counts > 1].tolist()


def _filled(
    factory: Callable, args: list, kwargs: dict, ids: list, rows: tuple, env: bool = False
) -> object:
    """An instance whose `rows` hold `ids`, applied; `env`: built under `CPBT_INTEGRITY_CHECKS=1`
    (SPEC.md 8.3 reads it at construction), restored afterwards."""
    old = os.environ.get(ENV_VAR)
    if env:
        os.environ[ENV_VAR] = "1"
    try:
        impl = factory(*args, **kwargs)
    finally:
        if env and old is None:
            del os.environ[ENV_VAR]
        elif env:
            os.environ[ENV_VAR] = old
    for r in rows:
        impl.append_block_ids(r, tuple(ids), True)
    impl.apply_staged_writes()
    return impl
