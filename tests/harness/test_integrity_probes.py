"""The integrity probes one at a time: the planted faults that only some orders show.

`tests/harness/test_probes.py` runs every probe through `run_probes`; the probes need an
implementation with SPEC.md 8.3's checks (ours)."""

from __future__ import annotations

import pytest

from cp_blocktables import BlockTables
from cp_blocktables.harness import integrity_probes
from tests.wrong_impls.catalogue import OursIntegrityCountsOnlyLargerEntries


@pytest.mark.parametrize(("preset", "rank"), [("mutation-cp1", 0), ("cp2-i1", 0), ("cp2-i1", 1)])
def test_a_gather_check_blind_to_smaller_entries_fails_where_ids_fall(probe_inputs, preset, rank):
    """Each group's copy into one shared `out` lands in group order: with ids rising with
    the group the last copy is the largest, and a check that counts only entries larger
    than their source still raises; with ids falling every other group reads smaller
    ones, and only a check of every differing entry raises."""
    args, kwargs = probe_inputs(OursIntegrityCountsOnlyLargerEntries, preset, rank)
    found = integrity_probes.probe_integrity(
        OursIntegrityCountsOnlyLargerEntries, args, kwargs, rank, fused=True
    )
    assert [(v.check, v.actual) for v in found] == [(10, "no error")], [v.describe() for v in found]
    assert "block ids falling with the group" in found[0].what
    args, kwargs = probe_inputs(BlockTables, preset, rank)
    assert integrity_probes.probe_integrity(BlockTables, args, kwargs, rank, fused=True) == []
