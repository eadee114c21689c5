"""The legal probes called one at a time: what each builds and where it stays silent.

The token buffer's probes are `tests/harness/test_buffer_probes.py`'s;
`tests/harness/test_probes.py` runs them all through `run_probes` against the
catalogue's wrong implementations."""

from __future__ import annotations

import pytest

from cp_blocktables import BlockTables
from cp_blocktables.harness import legal_probes
from tests.harness.conftest import SlotsOffByOne
from tests.wrong_impls.catalogue import OursOutListByIdentity, OursUnitBlockSpanWithoutCp


@pytest.mark.parametrize("preset", ["mutation", "cp3-no-power-of-two", "kbs-cp4"])
def test_slots_wrong_in_the_first_columns_too_are_left_to_the_workload(probe_inputs, preset):
    """A finding here stops the preset before the workload runs: a defect that shows at
    the far token's offset in the first columns as well is the workload's to name."""
    args, kwargs = probe_inputs(SlotsOffByOne, preset, 0)
    assert legal_probes.probe_far_positions(SlotsOffByOne, args, kwargs, 0) == []


def _unit_probe(factory, inputs, preset_name: str, rank: int = 0) -> list:
    args, kwargs = inputs(factory, preset_name, rank)
    return legal_probes.probe_unit_blocks_past_2_31(factory, args, kwargs, rank)


@pytest.mark.parametrize("rank", [0, 1])
def test_right_implementations_map_one_token_blocks_past_2_31(right_factory, probe_inputs, rank):
    assert _unit_probe(right_factory, probe_inputs, "cp2-unit-blocks", rank) == []


@pytest.mark.parametrize("rank", [0, 1])
def test_a_span_that_leaves_out_the_cp_factor_of_one_token_blocks_is_check_9(probe_inputs, rank):
    """`columns x 1 ** cp` is the columns alone: an int32 path, and the positions past
    2**31 map to PAD while the four controls map right."""
    found = _unit_probe(OursUnitBlockSpanWithoutCp, probe_inputs, "cp2-unit-blocks", rank)
    assert [v.check for v in found] == [9], [v.describe() for v in found]
    assert found[0].actual.endswith("-1, -1, -1, -1]]")
    assert "one-token blocks under CP 8192" in found[0].what


def test_one_token_blocks_wrong_in_the_first_columns_too_are_left_to_the_workload(probe_inputs):
    assert _unit_probe(SlotsOffByOne, probe_inputs, "cp2-unit-blocks") == []


class _NeverBuilt(BlockTables):
    def __init__(self, *args, **kwargs):
        raise AssertionError("the probe built an instance")


@pytest.mark.parametrize("preset", ["mutation", "groups-6", "kbs-cp4"])
def test_presets_without_one_token_blocks_under_cp_build_nothing(probe_inputs, preset):
    """`mutation` and `kbs-cp4` shard no one-token kernel blocks, `groups-6` has them at
    cp 1: the probe, a quarter of a second a rank, runs only where the preset has both."""
    assert _unit_probe(_NeverBuilt, probe_inputs, preset) == []


def test_the_257_group_reads_run_on_the_first_cp_group_alone(probe_inputs):
    """The reads cost seconds in the interpreter: the other CP groups build and apply only."""
    args, kwargs = probe_inputs(OursOutListByIdentity, "groups-6", 0)
    assert legal_probes.probe_many_groups(OursOutListByIdentity, args, kwargs, 0, reads=False) == []
