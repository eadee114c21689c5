"""The legal probes called one at a time: what each builds and where it stays silent.

`tests/harness/test_probes.py` runs them all through `run_probes` against the
catalogue's wrong implementations."""

from __future__ import annotations

import pytest
import torch

from cp_blocktables import BlockTables
from cp_blocktables.harness import legal_probes, presets, probes
from cp_blocktables.harness.features import constructor_kwargs, inspect_factory
from tests.impls.pure_python import BlockTables as PurePython
from tests.wrong_impls.catalogue import (
    OursOutListByIdentity,
    OursShortStepsCutInMidBuffers,
    OursUnitBlockSpanWithoutCp,
)
from tests.wrong_impls.stand_in import StandInBlockTables

LENGTHS = presets.resolve(["groups-1"])[0].probe_buffer_lengths


RIGHT = [
    pytest.param(BlockTables, id="ours"),
    pytest.param(PurePython, id="pure-python"),
    pytest.param(StandInBlockTables, id="stand-in"),
]


def _inputs(factory, preset_name: str, rank: int) -> tuple[list, dict]:
    p = presets.resolve([preset_name])[0]
    args = probes.constructor_args(p.config(rank), torch.device("cpu"))
    return args, constructor_kwargs(p, rank, inspect_factory(factory))


def _probe(factory, preset_name: str, lengths=LENGTHS, rank: int = 0) -> list:
    args, kwargs = _inputs(factory, preset_name, rank)
    return legal_probes.probe_buffer_lengths(factory, args, kwargs, rank, lengths)


def _unit_probe(factory, preset_name: str, rank: int = 0) -> list:
    args, kwargs = _inputs(factory, preset_name, rank)
    return legal_probes.probe_unit_blocks_past_2_31(factory, args, kwargs, rank)


@pytest.mark.parametrize("factory", RIGHT)
@pytest.mark.parametrize("preset", ["groups-1", "mutation", "kbs-cp4", "cp3-no-power-of-two"])
def test_right_implementations_map_the_short_step_in_every_buffer(factory, preset):
    assert _probe(factory, preset) == []


def test_a_step_cut_short_in_a_mid_sized_buffer_is_check_9():
    """The defect shows only where the buffer's 32-token steps have bit 5 set: the
    preset's own 256 tokens map right, 1,000 and 4,001 do not."""
    found = _probe(OursShortStepsCutInMidBuffers, "groups-1")
    assert [v.check for v in found] == [9, 9], [v.describe() for v in found]
    assert "max_num_batched_tokens 1000" in found[0].what
    assert "max_num_batched_tokens 4001" in found[1].what
    assert found[0].expected.startswith("slots [[") and found[0].actual != found[0].expected


class _SlotsOffByOne(BlockTables):
    """Maps every slot it owns one past the right one, in every buffer."""

    def compute_slot_mappings(self, *args, **kwargs):
        slots = super().compute_slot_mappings(*args, **kwargs)
        return torch.where(slots >= 0, slots + 1, slots)


@pytest.mark.parametrize("preset", ["mutation", "cp3-no-power-of-two", "kbs-cp4"])
def test_slots_wrong_in_the_first_columns_too_are_left_to_the_workload(preset):
    """A finding here stops the preset before the workload runs: a defect that shows at
    the far token's offset in the first columns as well is the workload's to name."""
    args, kwargs = _inputs(BlockTables, preset, 0)
    assert legal_probes.probe_far_positions(_SlotsOffByOne, args, kwargs, 0) == []


def test_a_step_wrong_in_the_presets_own_buffer_is_left_to_the_workload():
    """A finding here stops the preset before the workload runs: a defect that shows in
    the preset's own buffer as well is the workload's to name."""
    assert _probe(_SlotsOffByOne, "groups-1") == []


class _RefusesOtherBuffers(BlockTables):
    """Refuses any token buffer longer than 512."""

    def __init__(self, block_sizes, max_num_reqs, max_num_batched_tokens, *args, **kwargs):
        if max_num_batched_tokens > 512:
            raise ValueError(f"max_num_batched_tokens {max_num_batched_tokens} too large")
        super().__init__(block_sizes, max_num_reqs, max_num_batched_tokens, *args, **kwargs)


def test_a_buffer_length_refused_is_the_finding():
    found = _probe(_RefusesOtherBuffers, "groups-1", lengths=(1000,))
    assert [v.check for v in found] == [9]
    assert found[0].actual == "ValueError: max_num_batched_tokens 1000 too large"


def test_only_the_first_cp_group_probes_the_presets_lengths():
    p = presets.resolve(["groups-1"])[0]
    accepts = inspect_factory(_RefusesOtherBuffers)
    kwargs = constructor_kwargs(p, 0, accepts)
    call = (_RefusesOtherBuffers, p.config(0), torch.device("cpu"), kwargs, accepts, 0, True)
    first = probes.run_probes(*call, first_cp_group=True, buffer_lengths=(1000,))
    assert [v.check for v in first] == [9] and "1000" in first[0].what
    assert probes.run_probes(*call, first_cp_group=False, buffer_lengths=(1000,)) == []
    assert probes.run_probes(*call, first_cp_group=True) == []


@pytest.mark.parametrize("factory", RIGHT)
@pytest.mark.parametrize("rank", [0, 1])
def test_right_implementations_map_one_token_blocks_past_2_31(factory, rank):
    assert _unit_probe(factory, "cp2-unit-blocks", rank) == []


@pytest.mark.parametrize("rank", [0, 1])
def test_a_span_that_leaves_out_the_cp_factor_of_one_token_blocks_is_check_9(rank):
    """`columns x 1 ** cp` is the columns alone: an int32 path, and the positions past
    2**31 map to PAD while the four controls map right."""
    found = _unit_probe(OursUnitBlockSpanWithoutCp, "cp2-unit-blocks", rank)
    assert [v.check for v in found] == [9], [v.describe() for v in found]
    assert found[0].actual.endswith("-1, -1, -1, -1]]")
    assert "one-token blocks under CP 8192" in found[0].what


def test_one_token_blocks_wrong_in_the_first_columns_too_are_left_to_the_workload():
    assert _unit_probe(_SlotsOffByOne, "cp2-unit-blocks") == []


class _NeverBuilt(BlockTables):
    def __init__(self, *args, **kwargs):
        raise AssertionError("the probe built an instance")


@pytest.mark.parametrize("preset", ["mutation", "groups-6", "kbs-cp4"])
def test_presets_without_one_token_blocks_under_cp_build_nothing(preset):
    """`mutation` and `kbs-cp4` shard no one-token kernel blocks, `groups-6` has them at
    cp 1: the probe, a quarter of a second a rank, runs only where the preset has both."""
    assert _unit_probe(_NeverBuilt, preset) == []


def test_the_257_group_reads_run_on_the_first_cp_group_alone():
    """The reads cost seconds in the interpreter: the other CP groups build and apply only."""
    args, kwargs = _inputs(OursOutListByIdentity, "groups-6", 0)
    assert legal_probes.probe_many_groups(OursOutListByIdentity, args, kwargs, 0, reads=False) == []
