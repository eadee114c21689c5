"""The contract probes: calls that must fail do, on right implementations; wrong ones are named."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cp_blocktables import BlockTables, integrity
from cp_blocktables.harness import presets, probes
from cp_blocktables.harness.features import constructor_kwargs, inspect_factory
from tests.impls.pure_python import BlockTables as PurePython
from tests.wrong_impls.catalogue_contract import (
    STAND_IN_SIGNATURE,
    InterleaveNotChecked,
    KernelBlocksNotChecked,
    OursIntegrityEntryByParity,
    OursIntegrityNamesCutRows,
    OursIntegrityNamesDummyRows,
    OursIntegrityNamesEveryRowStale,
    OursIntegrityNamesMatchingGroups,
    OursIntegrityNamesSlotsBelowNone,
    OursIntegrityNamesSortedNeighbours,
    OursIntegrityNeverOn,
    OursIntegrityNullBlockOneSlotLong,
    OursIntegrityStaleCancels,
    OursIntegrityTrustsDeviceCounts,
    OursLengthsByIdentity,
    OursOffsetBitsPerBlock,
    OursOutListByIdentity,
    OursPositionsBelow2To61,
    OursPositionsCheckedOnDisabledGroups,
    OursPositionsPadPast2To61,
    RankWrapped,
)
from tests.wrong_impls.stand_in import StandInBlockTables

RIGHT = {"ours": BlockTables, "pure-python": PurePython, "stand-in": StandInBlockTables}
PRESETS = [
    "mutation",
    "cp3-no-power-of-two",  # huge blocks scaled from 12, 6 and 18 with kernel blocks of 6
    "mutation-cp1",
    "mutation-odd",
    "groups-0",
    "kbs-cp4",
    "cp4-interleave",
    "cp2-i1",  # integrity checks on and 16 rows: the fault behind rows cut short
    "groups-6",  # six groups: 257 of them built and applied
]


def _findings(factory, preset_name: str, ranks=None) -> list:
    p = presets.resolve([preset_name])[0]
    accepts = inspect_factory(factory)
    found = []
    for rank in range(p.cp_size) if ranks is None else ranks:
        cfg = p.config(rank)
        kwargs = constructor_kwargs(p, rank, accepts)
        fused = hasattr(factory, "gather_and_compute_slot_mappings")
        found += probes.run_probes(factory, cfg, torch.device("cpu"), kwargs, accepts, rank, fused)
    return found


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("impl", RIGHT.values(), ids=RIGHT.keys())
def test_right_implementations_pass_every_probe(impl, preset):
    assert [v.describe() for v in _findings(impl, preset)] == []


@pytest.mark.parametrize(
    ("impl", "preset", "label"),
    [
        pytest.param(InterleaveNotChecked, "mutation-odd", "cp_interleave=7", id="interleave"),
        pytest.param(RankWrapped, "mutation-cp1", "cp_rank=1 with cp_size=1", id="rank-past"),
        pytest.param(RankWrapped, "mutation-odd", "cp_rank=-1", id="rank-negative"),
        pytest.param(
            KernelBlocksNotChecked, "mutation-odd", "kernel_block_sizes[0]=13", id="kernel-blocks"
        ),  # fmt: skip
    ],
)
def test_a_constructor_that_builds_a_refused_config_is_check_9(impl, preset, label):
    found = _findings(impl, preset, ranks=[0])
    assert {v.check for v in found} == {9}
    hit = [v for v in found if label in v.what]
    assert hit and hit[0].actual == "the constructor accepted it", [v.describe() for v in found]


@pytest.mark.parametrize(
    ("impl", "planted"),
    [
        pytest.param(
            OursIntegrityNeverOn, ("shared slot", "grown", "cut short", "alone"), id="never-on"
        ),
        pytest.param(OursIntegrityTrustsDeviceCounts, ("grown", "cut short"), id="trusts-device"),
    ],
)
@pytest.mark.parametrize("preset", ["mutation-cp1", "mutation-odd"])
def test_integrity_checks_that_miss_a_planted_fault_are_check_10(impl, planted, preset):
    found = _findings(impl, preset, ranks=[0])
    assert {v.check for v in found} == {10}
    for fault in planted:  # both the separate calls and the fused read are probed
        methods = {v.what.split()[0] for v in found if fault in v.what}
        assert methods - {"gather_and_compute_slot_mappings"}, fault
        assert fault == "alone" or "gather_and_compute_slot_mappings" in methods, fault


@pytest.mark.parametrize("preset", ["mutation-cp1", "cp2-i1"])
def test_a_gather_fault_named_by_the_groups_that_match_is_check_10(preset):
    """Only the probe whose aliased `out` leaves groups 0 and 3+ right can tell which group
    a message names; the probe that aliases every group accepts any message naming row 0."""
    found = _findings(OursIntegrityNamesMatchingGroups, preset, ranks=[0])
    assert {v.check for v in found} == {10}, [v.describe() for v in found]
    # A stale count into an `out` of other ids names no stale row there either: its own probe.
    pair = [v for v in found if "groups 1 and 2" in v.what]
    assert len(pair) == 1 and "naming one of" in pair[0].expected, found


def test_a_gather_fault_behind_eight_rows_cut_short_must_be_named():
    """Rows cut short keep a stale entry past their count; an explanation that takes it for a
    difference names them, eight a group, and never the row that differs behind them."""
    found = _findings(OursIntegrityNamesCutRows, "cp2-i1", ranks=[0])
    assert {v.check for v in found} == {10}, [v.describe() for v in found]
    # Dummy rows read one entry past their count (row -1's) differ too: the next probe's.
    cut = [v for v in found if "cut short by an overwrite, then row 15" in v.what]
    assert len(cut) == 1, [v.describe() for v in found]
    assert cut[0].expected == "RuntimeError naming one of 15, 8 (or a ValueError refusing the call)"


def test_a_gather_fault_behind_eight_dummy_entries_must_be_named():
    """A dummy entry gives a zero row whose source is never read; an explanation that takes
    dummies for differing rows names them, eight a group, and never the row behind them.
    `cp2-i1` has the nine rows and two groups of one kernel block factor it needs."""
    found = _findings(OursIntegrityNamesDummyRows, "cp2-i1", ranks=[0])
    assert [v.check for v in found] == [10], [v.describe() for v in found]
    assert "8 dummy entries (-1), then row" in found[0].what
    assert found[0].actual.startswith("RuntimeError: gather_block_tables: group 0: batch row 0")


@pytest.mark.parametrize("preset", ["mutation-cp1", "cp2-i1"])
def test_a_stale_count_gathered_into_an_out_of_other_ids_must_raise(preset):
    """Gathered into zeroed tables, the entry a stale count leaves uncopied equals the unwritten
    source; into an `out` holding other ids it differs too, and a check that lets the two
    findings cancel raises nothing."""
    found = _findings(OursIntegrityStaleCancels, preset, ranks=[0])
    assert [v.check for v in found] == [10], [v.describe() for v in found]
    assert "into out tensors holding other ids" in found[0].what
    assert found[0].actual == "no error"


def test_a_stale_count_behind_eight_clean_rows_must_be_named():
    """An explanation that lists every real row as stale names the eight clean rows gathered
    first, and never the stale one behind them."""
    found = _findings(OursIntegrityNamesEveryRowStale, "cp2-i1", ranks=[0])
    assert [v.check for v in found] == [10], [v.describe() for v in found]
    assert "a stale count behind 8 clean rows" in found[0].what
    assert found[0].expected == "RuntimeError naming one of 15, 8"


@pytest.mark.parametrize("preset", ["mutation-cp1", "cp2-i1"])
def test_a_slot_shared_at_block_1_must_be_reported(preset):
    found = _findings(OursIntegrityNullBlockOneSlotLong, preset, ranks=[0])
    assert [(v.check, v.actual) for v in found] == [(10, "no error")], [v.describe() for v in found]
    assert "a shared slot at block 1" in found[0].what


@pytest.mark.parametrize(
    ("preset", "rank"), [("mutation-cp1", 0), ("cp2-i1", 0), ("cp2-i1", 1)], ids=str
)
@pytest.mark.parametrize(
    "impl",
    [OursIntegrityNamesSlotsBelowNone, OursIntegrityNamesSortedNeighbours],
    ids=["compared-with-the-smallest", "eight-smallest-named"],
)
def test_a_slot_shared_above_unshared_ones_must_be_named(impl, preset, rank):
    """Rows 0 and 1 share slots above row 2's own: an explanation that compares every slot
    with the group's smallest finds no pair, one that takes every sorted neighbour as a
    pair names eight of row 2's; neither names a shared slot."""
    found = _findings(impl, preset, ranks=[rank])
    assert [v.check for v in found] == [10], [v.describe() for v in found]
    assert "of row 2, the smallest" in found[0].what
    assert "RuntimeError: compute_slot_mappings: " in found[0].actual


@pytest.mark.parametrize("preset", ["mutation", "cp3-no-power-of-two"])
def test_a_construction_that_grows_with_the_block_size_is_check_9(preset):
    """Blocks scaled past 2**43 keep every divisibility rule of the preset (interleave 3 and
    kernel block 6 in `cp3-no-power-of-two`): a right implementation builds them, one that
    keeps a bit per offset runs out of memory."""
    found = _findings(OursOffsetBitsPerBlock, preset, ranks=[0])
    # The far-position probe's blocks of 2**58 tokens fail it too.
    assert [(v.check, v.expected[:8]) for v in found] == [(9, "it build"), (9, "slots [[")]
    assert all(v.actual.startswith("MemoryError") and "legal" in v.what for v in found)


READS_257 = "it builds, applies, gathers and maps"


@pytest.mark.parametrize(
    ("impl", "refusal"),
    [
        (OursLengthsByIdentity, "ValueError: block_table_ptrs"),
        (OursOutListByIdentity, "ValueError: out has 257 tables"),
    ],
    ids=["writer-pointers", "gather-out-list"],
)
def test_a_model_of_257_groups_must_build_apply_gather_and_map(impl, refusal):
    """`groups-6` probes 257 groups (its six, repeated): a length compared by identity
    passes every preset and fails there, one past the ints CPython shares."""
    found = _findings(impl, "groups-6", ranks=[0])
    assert [(v.check, v.expected) for v in found] == [(9, READS_257)], found
    assert found[0].actual.startswith(refusal) and "257" in found[0].what


@pytest.mark.parametrize("preset", ["mutation", "cp3-no-power-of-two", "kbs-cp4", "groups-1"])
def test_a_position_past_2_61_must_map(preset):
    """Positions are bounded below 2**62; the sweep's far presets stop near 2**31, so only
    the probe tells a bound of 2**61 from the right one."""
    found = _findings(OursPositionsBelow2To61, preset, ranks=[0])
    assert [v.check for v in found] == [9], found
    assert found[0].expected.startswith("slots [[")
    assert found[0].actual.startswith("ValueError: positions must be below 2**61")
    assert "2**61 + 5" in found[0].what


def test_a_position_past_2_61_mapped_to_pad_is_check_9():
    """A bound of 2**61 inside the kernel raises nothing: the position maps to PAD, and
    only the slot compared with the reference's tells."""
    found = _findings(OursPositionsPadPast2To61, "mutation", ranks=[0])
    assert [v.check for v in found] == [9], found
    assert found[0].expected != found[0].actual and found[0].actual.endswith(", -1]]")


@pytest.mark.parametrize("preset", ["mutation-cp1", "cp2-i1"])
def test_a_block_twice_in_one_lone_request_must_be_named(preset):
    """The other shared-slot probes batch two or three requests, where a batch entry found
    by parity stays in range; one request alone sends it past `idx_mapping`."""
    found = _findings(OursIntegrityEntryByParity, preset, ranks=[0])
    assert [v.check for v in found] == [10], [v.describe() for v in found]
    assert "holding block" in found[0].what and found[0].actual.startswith("IndexError")


@pytest.mark.parametrize("preset", ["mutation", "mutation-cp1", "kbs-cp4", "cp2-i1"])
def test_a_position_past_a_disabled_groups_table_must_map(preset):
    """A group without slot mapping maps every token to PAD: its table bounds no position.
    One that range-checks positions against it refuses a legal call no preset makes."""
    found = _findings(OursPositionsCheckedOnDisabledGroups, preset, ranks=[0])
    assert [(v.check, v.expected) for v in found] == [(9, "it maps")], found
    assert found[0].actual.startswith("ValueError: position") and "legal" in found[0].what


class _WrongType(StandInBlockTables):
    """Refuses with a bare assertion instead of naming the argument."""

    __signature__ = STAND_IN_SIGNATURE

    def __init__(self, *args, **kwargs):
        assert args[1] >= 1
        super().__init__(*args, **kwargs)


class _Unnamed(StandInBlockTables):
    """Refuses with a ValueError that names nothing."""

    __signature__ = STAND_IN_SIGNATURE

    def __init__(self, *args, **kwargs):
        try:
            super().__init__(*args, **kwargs)
        except ValueError:
            raise ValueError("bad config") from None


@pytest.mark.parametrize(
    ("impl", "actual"),
    [
        pytest.param(_WrongType, "AssertionError", id="assertion-instead"),
        pytest.param(_Unnamed, "ValueError: bad config", id="argument-not-named"),
    ],
)
def test_a_refusal_must_be_a_value_error_naming_the_argument(impl, actual):
    found = _findings(impl, "mutation-cp1", ranks=[0])
    assert found and all(v.check == 9 for v in found)
    assert any(v.actual.startswith(actual) for v in found)


def test_every_refusal_changes_exactly_one_argument():
    p = presets.resolve(["mutation-odd"])[0]
    accepts = inspect_factory(BlockTables)
    cfg = p.config(0)
    kwargs = constructor_kwargs(p, 0, accepts)
    args = [cfg.block_sizes, cfg.max_num_reqs, cfg.max_num_batched_tokens,
            cfg.max_num_blocks_per_group, torch.device("cpu")]  # fmt: skip
    refusals = probes._refusals(args, kwargs, accepts)
    assert len(refusals) >= 12
    for r in refusals:
        changed = [i for i, (a, b) in enumerate(zip(args, r.args)) if a != b]
        changed += [k for k in r.kwargs if r.kwargs[k] != kwargs.get(k)]
        assert len(changed) == 1, r.label


class _VagueIntegrity(BlockTables):
    """Raises on a shared slot, but the message names no slot."""

    def _check_slots(self, *args, **kwargs):
        try:
            super()._check_slots(*args, **kwargs)
        except RuntimeError:
            raise RuntimeError("integrity check failed") from None


class _StaleOnlyWhenGrown(BlockTables):
    """Counts a stale count only when the host count grew (the published one is smaller)."""

    def _check_gathered(self, dst, idx_mapping, num_computed_tokens):
        truth = self.num_blocks.np
        seen = np.maximum(truth, self.num_blocks.gpu.cpu().numpy())
        integrity.check_gathered_block_tables(
            dst, [t.gpu for t in self.block_tables], idx_mapping, self.num_blocks.gpu, seen,
            self.kernel_block_sizes, self.sliding_window_reach, num_computed_tokens,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("impl", "what", "actual"),
    [
        pytest.param(
            _VagueIntegrity,
            "shared slot",
            "RuntimeError: integrity check failed",
            id="slot-not-named",
        ),  # fmt: skip
        pytest.param(_StaleOnlyWhenGrown, "cut short", "no error", id="shrunk-count-missed"),
    ],
)
def test_integrity_errors_must_name_the_slot_and_catch_both_stale_directions(impl, what, actual):
    found = _findings(impl, "mutation-odd", ranks=[0])
    hit = [v for v in found if what in v.what]
    assert hit and all(v.check == 10 and v.actual.startswith(actual) for v in hit), [
        v.describe() for v in found
    ]
    assert all(what in v.what for v in found)


class _CountsOnly(BlockTables):
    """Checks a gather's counts but compares each source row with itself, not the output."""

    def _check_gathered(self, dst, idx_mapping, num_computed_tokens):
        sources = [t.gpu for t in self.block_tables]
        integrity.check_gathered_block_tables(
            sources, sources, idx_mapping, self.num_blocks.gpu, self.num_blocks.np,
            self.kernel_block_sizes, self.sliding_window_reach, num_computed_tokens,
        )  # fmt: skip


@pytest.mark.parametrize("preset", ["mutation-cp1", "cp2-i1"])
def test_a_gather_check_that_misses_a_wrong_row_is_check_10(preset):
    """An `out` tensor shared by groups: rows differ from their sources, counts are right.
    The aliased gathers (every group, ids rising and falling; groups 1 and 2 alone) see it."""
    found = _findings(_CountsOnly, preset, ranks=[0])
    assert [(v.check, v.actual) for v in found] == [(10, "no error")] * 3, [
        v.describe() for v in found
    ]
    assert "one out tensor given for every group, their block ids rising" in found[0].what
    assert "one out tensor given for every group, their block ids falling" in found[1].what
    assert "one out tensor given for groups 1 and 2" in found[2].what


class _VagueGatherIntegrity(BlockTables):
    """Raises on every faulty gather, but the message names no row (nor group)."""

    def _check_gathered(self, *args, **kwargs):
        try:
            super()._check_gathered(*args, **kwargs)
        except RuntimeError:
            raise RuntimeError("integrity check failed") from None


def test_gather_integrity_errors_must_name_the_row():
    """SPEC.md 8.3: a violation names the rows. The stale-count probes gather the last row
    into batch row 0, the aliased gather row 0; a message naming no row fails each."""
    found = _findings(_VagueGatherIntegrity, "mutation-cp1", ranks=[0])
    assert found and all(v.check == 10 for v in found), [v.describe() for v in found]
    assert all(v.actual == "RuntimeError: integrity check failed" for v in found)
    kinds = {"stale count" in v.what for v in found}
    assert kinds == {True, False} and any("one out tensor" in v.what for v in found)


class _IgnoresTheEnvironment(BlockTables):
    """Turns integrity checks on by the keyword only, not by CPBT_INTEGRITY_CHECKS=1."""

    def __init__(self, *args, integrity_checks: bool = False, **kwargs) -> None:
        super().__init__(*args, integrity_checks=integrity_checks, **kwargs)
        self.integrity_checks = bool(integrity_checks)


def test_the_environment_variable_alone_must_turn_integrity_checks_on(monkeypatch):
    monkeypatch.delenv("CPBT_INTEGRITY_CHECKS", raising=False)
    found = _findings(_IgnoresTheEnvironment, "mutation-cp1", ranks=[0])
    assert [v.check for v in found] == [10] and "CPBT_INTEGRITY_CHECKS=1 alone" in found[0].what
    assert found[0].actual == "no error"
    assert "CPBT_INTEGRITY_CHECKS" not in __import__("os").environ
