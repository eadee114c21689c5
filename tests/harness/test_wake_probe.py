"""The wake-up probe (check 11): a right wake-up passes, a broken one is named, a missing one
is reported as not supported, and a defect that shows without any sleep is left to the workload."""

from __future__ import annotations

import importlib
import json
import sys

import pytest
import torch
from harness_proc import ROOT, run_cli

from cp_blocktables import BlockTables, StagedWriteTensor
from cp_blocktables.harness import presets, probes, wake_probe
from cp_blocktables.harness.features import constructor_kwargs, inspect_factory, missing_methods

sys.path.insert(0, str(ROOT))
from tests.impls.pure_python import BlockTables as PurePython
from tests.wrong_impls.catalogue_ours import OursRowsByWidth
from tests.wrong_impls.stand_in import StandInBlockTables
from tests.wrong_impls.wake_catalogue import VERIFY_CHECK, WAKE_CATALOGUE

PRESETS = ["mutation", "mutation-cp1", "mutation-odd", "groups-0", "groups-6", "kbs-cp4"]


def _probe(factory, preset_name: str, ranks=None) -> tuple[list, set]:
    """Every rank's findings of `preset_name`, and what each rank reported unsupported."""
    p = presets.resolve([preset_name])[0]
    accepts = inspect_factory(factory)
    found, skipped = [], set()
    for rank in range(p.cp_size) if ranks is None else ranks:
        cfg = p.config(rank)
        kwargs = constructor_kwargs(p, rank, accepts)
        args = probes.constructor_args(cfg, torch.device("cpu"))
        fused = not missing_methods(factory(*args, **kwargs))
        v, s = wake_probe.probe_wake_up(factory, args, kwargs, rank, fused, seed=(3,))
        found += v
        skipped.add(s)
    return found, skipped


class RaisesOnWakeUp(BlockTables):
    """The first build (from the constructor) works; every wake-up after it raises, as with
    the uint64 comparison mutant of `kernels/layout.py`."""

    def init_block_table_layout_tensors(self) -> None:
        if "_built" in self.__dict__:
            raise TypeError("'<' not supported between instances of 'torch.dtype'")
        super().init_block_table_layout_tensors()
        self._built = True


class LeavesWidthsStale(BlockTables):
    """Rebuilds everything, then puts back the row widths as the sleep left them."""

    def init_block_table_layout_tensors(self) -> None:
        old = self.__dict__.get("block_table_widths")
        saved = None if old is None else old.clone()
        super().init_block_table_layout_tensors()
        if saved is not None:
            self.block_table_widths.copy_(saved)


class MarksTheLastSlot(BlockTables):
    """Wakes up right, but every slot mapping's last index is wrong, sleep or no sleep."""

    def compute_slot_mappings(self, idx_mapping, query_start_loc, positions, num_tokens_padded,
                              out=None):  # fmt: skip
        view = super().compute_slot_mappings(
            idx_mapping, query_start_loc, positions, num_tokens_padded, out
        )
        view[:, -1] = 12345  # wrong before any sleep: the workload's check 3 names it
        return view


@pytest.mark.parametrize("preset", PRESETS)
def test_our_block_tables_wake_up_as_if_no_sleep_happened(preset):
    assert _probe(BlockTables, preset) == ([], {None})


@pytest.mark.parametrize(
    "impl",
    [pytest.param(PurePython, id="pure-python"), pytest.param(StandInBlockTables, id="stand-in")],
)
def test_an_implementation_without_the_method_is_not_supported_never_passed(impl):
    found, skipped = _probe(impl, "mutation")
    assert found == []
    assert skipped == {wake_probe.NOT_SUPPORTED}
    assert "not supported by this implementation" in wake_probe.NOT_SUPPORTED


@pytest.mark.parametrize("preset", ["mutation", "groups-0"])
def test_a_wake_up_that_raises_is_check_11_naming_the_error(preset):
    found, _ = _probe(RaisesOnWakeUp, preset, ranks=[0])
    assert [v.check for v in found] == [11]
    assert found[0].what.startswith("init_block_table_layout_tensors() after the sleep raised "
                                    "TypeError: '<' not supported")  # fmt: skip


def test_a_derived_tensor_left_as_the_sleep_left_it_is_named():
    found, _ = _probe(LeavesWidthsStale, "mutation", ranks=[1])
    assert [(v.check, v.rank, v.actual) for v in found] == [(11, 1, "block_table_widths")]
    assert "block_table_widths still holds the garbage the sleep left in it" in found[0].what


@pytest.mark.parametrize(
    ("name", "says"),
    [
        *(
            pytest.param(n, "still hold what the sleep left", id=n)
            for n, (_, check) in WAKE_CATALOGUE.items()
            if check == "rebuilt"
        ),
        pytest.param("reallocates_forward_tables", "moved across the sleep", id="moved"),
        pytest.param("trusts_host_shadow", "after the wake-up: batch row", id="stale-rows"),
        pytest.param("keeps_forward_tables", "past the padded batch", id="forward-tables"),
    ],
)
def test_every_wake_catalogue_defect_is_check_11(name, says):
    module, attr = WAKE_CATALOGUE[name][0].split(":")
    impl = getattr(importlib.import_module(module), attr)
    found, _ = _probe(impl, "mutation", ranks=[0])
    assert [v.check for v in found] == [VERIFY_CHECK] and says in found[0].what, [
        v.describe() for v in found
    ]


@pytest.mark.parametrize("preset", ["mutation", "mutation-odd"])
def test_a_slot_mapping_that_finds_rows_by_width_fails_after_the_reallocation(preset):
    found, _ = _probe(OursRowsByWidth, preset, ranks=[0])
    assert [v.check for v in found] == [VERIFY_CHECK]
    assert found[0].what.startswith("compute_slot_mappings after the tables were reallocated")


class _FixedTable(StagedWriteTensor):
    """A table whose `.gpu` cannot be replaced (a property without a setter)."""

    @property
    def gpu(self) -> torch.Tensor:
        return self.__dict__["gpu"]


class FixedTablesRowsByWidth(OursRowsByWidth):
    """Finds rows by width, but no engine can reallocate its tables: nothing tells."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for t in self.block_tables:
            t.__class__ = _FixedTable


def test_tables_that_cannot_be_replaced_skip_only_the_reallocation():
    assert _probe(FixedTablesRowsByWidth, "mutation", ranks=[0]) == ([], {None})
    found, _ = _probe(type("Raises", (RaisesOnWakeUp, FixedTablesRowsByWidth), {}), "mutation",
                      ranks=[0])  # fmt: skip
    assert [v.check for v in found] == [VERIFY_CHECK]


def test_a_defect_without_any_sleep_is_left_to_the_workloads_checks():
    assert _probe(MarksTheLastSlot, "mutation", ranks=[0]) == ([], {None})


@pytest.mark.multirank
def test_verify_fails_a_wake_up_defect_and_lists_a_missing_wake_up_as_not_supported(tmp_path):
    stand_in = "tests.wrong_impls.stand_in:StandInBlockTables"
    keeps = WAKE_CATALOGUE["keeps_strides"][0]
    report = tmp_path / "report.json"
    args = ["verify", "--world-size", "2", "--device", "cpu", "--preset", "mutation",
            "--quiet", "--no-progress", "--report", str(report),
            "--impl", stand_in, "--impl", keeps]  # fmt: skip
    proc = run_cli(args)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    verdicts = json.loads(report.read_text())["implementations"]
    assert verdicts[keeps]["violated_checks"] == [11] and not verdicts[keeps]["passed"]
    assert verdicts[stand_in]["passed"]
    assert f"mutation: {wake_probe.NOT_SUPPORTED}" in verdicts[stand_in]["unsupported"]
