"""`row_probe`: gathers of 2**16 + 1 rows and of 257 wide rows, compared with the reference."""

from __future__ import annotations

import pytest
import torch

from cp_blocktables import BlockTables
from cp_blocktables.harness.row_probe import MANY_ROWS, WIDE_SHAPE, probe_many_rows
from tests.wrong_impls.catalogue import OursGatherRowsByBatch

CPU = torch.device("cpu")
MODELS = {
    "two-groups": ([[16, 32], 4, 64, [4, 4], CPU], {}),
    "kernel-blocks-under-cp": (
        [[16, 32], 4, 64, [4, 4], CPU],
        {"cp_size": 2, "cp_interleave": 4, "kernel_block_sizes": [8, 32]},
    ),
}


class LastRowLost(BlockTables):
    """Gathers row `MANY_ROWS - 1` (batch entry 0 of the probe's reversed order) as zeros."""

    def gather_block_tables(self, idx_mapping, num_reqs_padded, *args, **kwargs):
        views = super().gather_block_tables(idx_mapping, num_reqs_padded, *args, **kwargs)
        if num_reqs_padded == MANY_ROWS:
            views[1][0] = 0
        return views


class RowsCapped(BlockTables):
    """Refuses gathers of more than 65,536 rows."""

    def gather_block_tables(self, idx_mapping, num_reqs_padded, *args, **kwargs):
        if num_reqs_padded > 2**16:
            raise ValueError("too many rows for one program")
        return super().gather_block_tables(idx_mapping, num_reqs_padded, *args, **kwargs)


@pytest.mark.parametrize("model", MODELS, ids=list(MODELS))
def test_a_right_implementation_gathers_every_row(model):
    args, kwargs = MODELS[model]
    assert probe_many_rows(BlockTables, args, kwargs, 1) == []


def test_a_wrong_row_is_named_by_group_entry_and_row():
    args, kwargs = MODELS["two-groups"]
    (found,) = probe_many_rows(LastRowLost, args, kwargs, 0)
    assert found.check == 9
    assert f"group 1, batch entry 0 (row {MANY_ROWS - 1}), column 0" in found.what
    assert (found.expected, found.actual) == (str(1 + MANY_ROWS - 1 + 1), "0")


def test_a_refused_gather_is_the_finding():
    args, kwargs = MODELS["two-groups"]
    (found,) = probe_many_rows(RowsCapped, args, kwargs, 0)
    assert found.check == 9 and found.actual.startswith("ValueError: too many rows")


def test_a_model_without_groups_is_not_probed():
    assert probe_many_rows(BlockTables, [[], 4, 64, [], CPU], {}, 0) == []


def test_a_gather_refused_past_2_20_padded_entries_is_the_finding():
    """The rows probe passes (2**16 + 1 rows of one column pad to 2**17 entries); the wide
    one does not: 257 rows of 2,049 columns pad to 2**21."""
    args, kwargs = MODELS["two-groups"]
    (found,) = probe_many_rows(OursGatherRowsByBatch, args, kwargs, 0)
    assert found.check == 9 and found.actual.startswith("RuntimeError: numel (2097152)")
    assert f"all {WIDE_SHAPE[0]} rows of a model with {WIDE_SHAPE[1]} block(s) a row" in found.what


class WideRowLost(BlockTables):
    """Gathers the wide model's last row (batch entry 0) without its last column."""

    def gather_block_tables(self, idx_mapping, num_reqs_padded, *args, **kwargs):
        views = super().gather_block_tables(idx_mapping, num_reqs_padded, *args, **kwargs)
        if num_reqs_padded == WIDE_SHAPE[0]:
            views[0][0, WIDE_SHAPE[1] - 1] = 0
        return views


def test_a_wrong_entry_of_a_wide_row_is_named():
    args, kwargs = MODELS["two-groups"]
    (found,) = probe_many_rows(WideRowLost, args, kwargs, 0)
    row, col = WIDE_SHAPE[0] - 1, WIDE_SHAPE[1] - 1
    assert f"group 0, batch entry 0 (row {row}), column {col}" in found.what
    assert (found.expected, found.actual) == (str(1 + row + col), "0")
