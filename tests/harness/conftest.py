"""Fixtures the probe tests share: the right implementations and a preset's inputs."""

from __future__ import annotations

import pytest
import torch

from cp_blocktables import BlockTables
from cp_blocktables.harness import presets, probes
from cp_blocktables.harness.features import constructor_kwargs, inspect_factory
from tests.impls.pure_python import BlockTables as PurePython
from tests.wrong_impls.stand_in import StandInBlockTables


class SlotsOffByOne(BlockTables):
    """Maps every slot it owns one past the right one, in every step: a defect the
    workload names, so a probe's control must leave it alone."""

    def compute_slot_mappings(self, *args, **kwargs):
        slots = super().compute_slot_mappings(*args, **kwargs)
        return torch.where(slots >= 0, slots + 1, slots)


@pytest.fixture(
    params=[BlockTables, PurePython, StandInBlockTables], ids=["ours", "pure-python", "stand-in"]
)
def right_factory(request):
    """Each correct implementation: a probe must find nothing in it."""
    return request.param


@pytest.fixture
def probe_inputs():
    """`inputs(factory, preset_name, rank)`: the probes' `(args, kwargs)` for that preset's
    config on `rank`, the keywords as the harness passes them to `factory`."""

    def inputs(factory, preset_name: str, rank: int = 0) -> tuple[list, dict]:
        p = presets.resolve([preset_name])[0]
        args = probes.constructor_args(p.config(rank), torch.device("cpu"))
        return args, constructor_kwargs(p, rank, inspect_factory(factory))

    return inputs
