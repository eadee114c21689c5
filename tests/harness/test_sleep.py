"""The simulated sleep: which tensors it finds, what it leaves, and what survives a wake-up."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from cp_blocktables import BlockTables
from cp_blocktables.harness.sleep import moved, simulate_sleep, survivors, walk
from tests.wrong_impls import wake_catalogue as wc

CPU = torch.device("cpu")
KWARGS = dict(
    block_sizes=[16, 32],
    max_num_reqs=4,
    max_num_batched_tokens=64,
    max_num_blocks_per_group=[8, 4],
    device="cpu",
    sliding_window_reach=[0, 32],
)
DERIVED = {
    "block_table_ptrs",
    "block_table_strides",
    "input_block_table_ptrs",
    "input_block_table_strides",
    "block_table_widths",
    "block_sizes_tensor",
    "dcp_sharded",
    "sliding_window_reach_tensor",
    "_layout.params",
    "_null_slot_floors",
}


def built(cls=BlockTables) -> BlockTables:
    bt = cls(**KWARGS)
    bt.append_block_ids(1, ([5, 6], [7]), False)
    bt.apply_staged_writes()
    return bt


def test_the_walk_finds_buffers_and_derived_tensors_and_leaves_host_truth():
    bt = built()
    slept = simulate_sleep(bt, CPU, np.random.default_rng(0))
    garbaged = {path for path, _ in slept.garbage.values()}
    buffers = {"block_tables[0].gpu", "block_tables[1].gpu", "slot_mappings"}
    buffers |= {"input_block_tables[0]", "input_block_tables[1]"}
    new_kernel_tensors = {p for p in garbaged if p.startswith("kernel_block_sizes")}
    assert garbaged - new_kernel_tensors == DERIVED | buffers
    # num_blocks (.cpu, .np and its CPU "device view") and every staging pool are host memory
    assert "num_blocks.cpu" in slept.host_paths
    assert any(p.startswith("fused_writer._buffers") for p in slept.host_paths)
    assert bt.num_blocks.np[:, 1].tolist() == [2, 1]
    assert slept.nbytes == sum(len(g) for _, g in slept.garbage.values()) > 0


def test_garbage_changes_every_byte_in_place():
    bt = built()
    before = {p: (t.data_ptr(), t.clone()) for _, (p, t) in walk(bt, CPU).tensors.items()}
    slept = simulate_sleep(bt, CPU, np.random.default_rng(1))
    for _, (path, t) in walk(bt, CPU).tensors.items():
        ptr, old = before[path]
        assert t.data_ptr() == ptr
        if path in {p for p, _ in slept.garbage.values()}:
            a = old.view(torch.uint8).reshape(-1) if old.dim() else old.view(torch.uint8)
            b = t.view(torch.uint8).reshape(-1)
            assert bool((a != b).all()), path


def test_a_correct_wake_up_leaves_no_survivor_and_keeps_addresses():
    bt = built()
    slept = simulate_sleep(bt, CPU, np.random.default_rng(2))
    assert {s["path"] for s in survivors(bt, CPU, slept)} >= DERIVED - {"_layout.params"}
    bt.init_block_table_layout_tensors()
    assert survivors(bt, CPU, slept) == []
    assert moved(bt, slept) == []


@pytest.mark.parametrize(
    ("cls", "path", "what"),
    [
        (wc.KeepsBlockSizes, "block_sizes_tensor", "still holds"),
        (wc.KeepsStrides, "block_table_strides", "still holds"),
        (wc.KeepsReaches, "sliding_window_reach_tensor", "still holds"),
        (wc.KeepsShardedFlags, "dcp_sharded", "still holds"),
        (wc.KeepsPointerTable, "input_block_table_ptrs", "still holds"),
        (wc.KeepsKernelLayout, "_layout.params", "still holds"),
        (wc.CopiesStaleSizes, "block_sizes_tensor", "a copy of the garbage"),
    ],
)
def test_each_kept_tensor_is_named(cls, path, what):
    bt = built(cls)
    slept = simulate_sleep(bt, CPU, np.random.default_rng(3))
    bt.init_block_table_layout_tensors()
    found = {s["path"]: s["what"] for s in survivors(bt, CPU, slept)}
    assert path in found and what in found[path], found


def test_reallocated_forward_tables_are_named():
    bt = built(wc.ReallocatesForwardTables)
    slept = simulate_sleep(bt, CPU, np.random.default_rng(4))
    bt.init_block_table_layout_tensors()
    assert survivors(bt, CPU, slept) == []
    assert [line.split(":")[0] for line in moved(bt, slept)] == [
        "input_block_tables[0]",
        "input_block_tables[1]",
    ]


@dataclasses.dataclass
class _Layout:
    sizes: torch.Tensor


class _Slotted:
    __slots__ = ("table", "host")

    def __init__(self) -> None:
        self.host = np.zeros(4, dtype=np.int32)
        self.table = torch.from_numpy(self.host)  # shares the numpy array: host truth


class _Toy:
    def __init__(self) -> None:
        self.layout = _Layout(torch.arange(3))
        self.by_name = {"a": torch.ones(2), "b": [torch.zeros(1), (torch.full((2,), 7),)]}
        self.slotted = _Slotted()
        self.alias = self.layout.sizes[1:]  # same storage as layout.sizes: overwritten once
        self.me = self  # cycles are visited once


def test_the_walk_follows_dicts_lists_tuples_dataclasses_and_slots():
    toy = _Toy()
    owned = walk(toy, CPU)
    paths = {p for p, _ in owned.tensors.values()}
    assert paths >= {"by_name['a']", "by_name['b'][0]", "by_name['b'][1][0]"}
    assert len([p for p in paths if p in ("layout.sizes", "alias")]) == 1
    slept = simulate_sleep(toy, CPU, np.random.default_rng(5))
    assert slept.host_paths == ["slotted.table"]
    assert toy.slotted.host.tolist() == [0, 0, 0, 0]
    assert len(slept.garbage) == 4
