"""Fixtures shared by the test modules: devices and paired implementation/reference."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import pytest
import torch

from cp_blocktables import BlockTables, BlockTablesConfig
from cp_blocktables.kernels import _common, fused_reads, gather, slot_mappings
from cp_blocktables.reference import ReferenceBlockTables

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
CONTAINER_TESTS_ENV = "CPBT_CONTAINER_TESTS"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put the tests marked `long` first, and leave out the multi-rank tests under the
    paths in `$CPBT_CONTAINER_TESTS`.

    `make test` hands tests to its workers one at a time (`--maxschedchunk 1`), so the
    long ones start first and the short ones fill in around them. CI (`.ci/run`) runs
    the listed multi-rank tests in the container leg, where what they test (spawned
    worlds in shared memory, torchrun, dead and hung ranks) differs most; the host's
    `make test` then deselects them (reported as deselected, never skipped), so each
    runs once. Unset, as on a developer's machine, nothing is left out.
    """
    items.sort(key=lambda item: item.get_closest_marker("long") is None)  # stable
    paths = os.environ.get(CONTAINER_TESTS_ENV, "").split()
    if not paths:
        return
    keep, drop = [], []
    for item in items:
        there = item.get_closest_marker("multirank") and item.nodeid.startswith(tuple(paths))
        (drop if there else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(params=DEVICES)
def torch_device(request) -> torch.device:
    """Every test that takes `torch_device` runs on CPU (interpreter) and, where present, CUDA.

    (Not `device`: that name belongs to the multi-rank plugin's per-rank fixture.)
    """
    return torch.device(request.param)


def _clear_launch_constants() -> None:
    for cache in (gather._GATHER_META, slot_mappings._SLOT_LAUNCHES, fused_reads._FUSED_META):
        cache.clear()


@pytest.fixture(params=["one-program", "small-tiles"])
def host_tiles(request, monkeypatch, torch_device) -> str:
    """Interpreted launches as they run (one program over everything that fits) and in
    2048-element tiles: then the multi-program paths that a GPU always takes (a slot tile
    wholly inside one request, later row blocks, the gather's column loop, several apply
    programs) run on CPU too. Build `BlockTables` after this fixture: plans bind tiles."""
    if request.param == "small-tiles":
        if torch_device.type != "cpu":
            pytest.skip("on CUDA the tiles are the GPU's own")
        monkeypatch.setattr(_common, "HOST_TILE", 2048)
    _clear_launch_constants()
    yield request.param
    _clear_launch_constants()


class Pair:
    """A `BlockTables` under test and the reference model fed the same calls."""

    def __init__(self, torch_device: torch.device, **kwargs) -> None:
        self.device = torch_device
        self.bt = BlockTables(device=torch_device, **kwargs)
        self.ref = ReferenceBlockTables(BlockTablesConfig(**kwargs))

    def tensor(self, values, dtype=torch.int32) -> torch.Tensor:
        return torch.tensor(np.asarray(values), dtype=dtype, device=self.device)

    def append(self, req_index: int, ids: tuple[list[int], ...], overwrite: bool = False) -> None:
        self.bt.append_block_ids(req_index, ids, overwrite)
        self.ref.append_block_ids(req_index, ids, overwrite)

    def slots(self, idx_mapping, qsl, positions, num_tokens_padded) -> np.ndarray:
        """Runs both; asserts the whole persistent buffer matches; returns the returned view."""
        out = self.bt.compute_slot_mappings(
            self.tensor(idx_mapping),
            self.tensor(qsl),
            self.tensor(positions, torch.int64),
            num_tokens_padded,
        )
        expected = self.ref.slot_mappings(
            idx_mapping, qsl, np.asarray(positions), self.bt.max_num_batched_tokens
        )
        np.testing.assert_array_equal(self.bt.slot_mappings.cpu().numpy(), expected)
        assert out.shape == (self.bt.num_kv_cache_groups, num_tokens_padded)
        return out.cpu().numpy()

    def gather(self, idx_mapping, num_reqs_padded, num_rows=None, num_computed_tokens=None):
        """Runs both; asserts every defined entry of rows `[0, num_rows)`; returns the views."""
        nct = None if num_computed_tokens is None else self.tensor(num_computed_tokens)
        out = self.bt.gather_block_tables(
            self.tensor(idx_mapping), num_reqs_padded, num_computed_tokens=nct
        )
        rows = num_rows or num_reqs_padded
        expected = self.ref.gathered_block_tables(
            np.asarray(idx_mapping), rows, num_computed_tokens
        )
        for g, (values, defined) in enumerate(expected):
            got = self.bt.input_block_tables[g][:rows].cpu().numpy()
            np.testing.assert_array_equal(got[defined], values[defined], err_msg=f"group {g}")
        return [t.cpu().numpy() for t in out]


@pytest.fixture
def pair(torch_device) -> Callable[..., Pair]:
    """Factory: `pair(block_sizes=..., ...)` builds a `Pair` on the test's `torch_device`
    (or on the device named by `on=`)."""

    def build(on: str | None = None, **kwargs) -> Pair:
        return Pair(torch.device(on) if on else torch_device, **kwargs)

    return build
