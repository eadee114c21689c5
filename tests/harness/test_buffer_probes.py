"""The token buffer's probes called one at a time: what each maps and where it stays silent."""

from __future__ import annotations

import pytest
import torch

from cp_blocktables import BlockTables
from cp_blocktables.harness import buffer_probes, presets, probes
from cp_blocktables.harness.features import constructor_kwargs, inspect_factory
from tests.harness.conftest import SlotsOffByOne
from tests.wrong_impls.catalogue import (
    OursFullBufferLosesItsLastToken,
    OursShortStepsCutInMidBuffers,
)

LENGTHS = presets.resolve(["groups-1"])[0].probe_buffer_lengths
FULL = ["cp2-unit-blocks", "cp3-all-ones", "mutation", "groups-1", "large-steps"]


@pytest.fixture
def lengths_probe(probe_inputs):
    def probe(factory, preset_name: str, lengths=LENGTHS, rank: int = 0) -> list:
        args, kwargs = probe_inputs(factory, preset_name, rank)
        return buffer_probes.probe_buffer_lengths(factory, args, kwargs, rank, lengths)

    return probe


@pytest.fixture
def full_probe(probe_inputs):
    def probe(factory, preset_name: str, rank: int = 0, fused: bool | None = None) -> list:
        args, kwargs = probe_inputs(factory, preset_name, rank)
        if fused is None:  # as the harness decides: the implementation has the fused read
            fused = hasattr(factory, "gather_and_compute_slot_mappings")
        return buffer_probes.probe_full_buffer(factory, args, kwargs, rank, fused)

    return probe


@pytest.mark.parametrize("preset", ["groups-1", "mutation", "kbs-cp4", "cp3-no-power-of-two"])
def test_right_implementations_map_the_short_step_in_every_buffer(
    right_factory, lengths_probe, preset
):
    assert lengths_probe(right_factory, preset) == []


def test_a_step_cut_short_in_a_mid_sized_buffer_is_check_9(lengths_probe):
    """The defect shows only where the buffer's 32-token steps have bit 5 set: the
    preset's own 256 tokens map right, 1,000 and 4,001 do not."""
    found = lengths_probe(OursShortStepsCutInMidBuffers, "groups-1")
    assert [v.check for v in found] == [9, 9], [v.describe() for v in found]
    assert "max_num_batched_tokens 1000" in found[0].what
    assert "max_num_batched_tokens 4001" in found[1].what
    assert found[0].expected.startswith("slots [[") and found[0].actual != found[0].expected


def test_a_step_wrong_in_the_presets_own_buffer_is_left_to_the_workload(lengths_probe):
    """A finding here stops the preset before the workload runs: a defect that shows in
    the preset's own buffer as well is the workload's to name."""
    assert lengths_probe(SlotsOffByOne, "groups-1") == []


class _RefusesOtherBuffers(BlockTables):
    """Refuses any token buffer longer than 512."""

    def __init__(self, block_sizes, max_num_reqs, max_num_batched_tokens, *args, **kwargs):
        if max_num_batched_tokens > 512:
            raise ValueError(f"max_num_batched_tokens {max_num_batched_tokens} too large")
        super().__init__(block_sizes, max_num_reqs, max_num_batched_tokens, *args, **kwargs)


def test_a_buffer_length_refused_is_the_finding(lengths_probe):
    found = lengths_probe(_RefusesOtherBuffers, "groups-1", lengths=(1000,))
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


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("preset", FULL)
def test_right_implementations_map_a_step_that_fills_the_buffer(
    right_factory, full_probe, preset, rank
):
    assert full_probe(right_factory, preset, rank) == []


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("preset", ["cp2-unit-blocks", "cp3-all-ones"])
def test_a_first_request_that_fills_the_buffer_and_loses_its_last_token_is_check_9(
    full_probe, preset, fused
):
    """Both full steps lose the token, alone and followed by empty entries; the control,
    one token short, maps right. The fused call shares the slot programs."""
    found = full_probe(OursFullBufferLosesItsLastToken, preset, fused=fused)
    assert [v.check for v in found] == [9] * (2 + fused), [v.describe() for v in found]
    steps = {v.what.split(" (")[0].split("compute_slot_mappings of ")[1] for v in found}
    assert steps == {
        "one request of 64 tokens filling the buffer",
        "one request of 64 tokens filling the buffer, then an empty entry",
    }
    assert fused == any(v.what.startswith("gather_and_") for v in found)


def test_a_full_step_wrong_one_token_short_too_is_left_to_the_workload(full_probe):
    assert full_probe(SlotsOffByOne, "cp2-unit-blocks") == []


class _RefusesFullSteps(BlockTables):
    """Refuses a step whose real tokens fill the whole buffer."""

    def compute_slot_mappings(self, idx_mapping, query_start_loc, *args, **kwargs):
        if int(query_start_loc[-1]) == self.max_num_batched_tokens:
            raise RuntimeError("no room for padding")
        return super().compute_slot_mappings(idx_mapping, query_start_loc, *args, **kwargs)


def test_a_full_step_refused_is_the_finding(full_probe):
    found = full_probe(_RefusesFullSteps, "mutation", fused=False)
    assert [v.check for v in found] == [9, 9]
    assert found[0].actual == "RuntimeError: no room for padding"


class _NeverBuilt(BlockTables):
    def __init__(self, *args, **kwargs):
        raise AssertionError("the probe built an instance")


def test_buffers_past_the_full_probes_bound_build_nothing(probe_inputs):
    args, kwargs = probe_inputs(BlockTables, "mutation")
    args[2] = 2**14 + 1
    assert buffer_probes.probe_full_buffer(_NeverBuilt, args, kwargs, 0, True) == []
