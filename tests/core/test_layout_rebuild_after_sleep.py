"""Wake-up after sleep mode (SPEC.md 8.4): nothing derived survives in device memory.

The sleep is simulated as an engine's sleep mode does it: every device tensor
the object owns (found by walking its attributes, private ones included) keeps
its address and loses its contents. The host truth (`num_blocks.cpu`, pinned
host memory on CUDA) survives. After `init_block_table_layout_tensors()` and
the re-append of every live row, the object must behave like a fresh one fed
the same calls.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cp_blocktables import BlockTables, BlockTablesConfig
from cp_blocktables.reference import ReferenceBlockTables

CONFIG = dict(
    block_sizes=[8, 4, 16],
    max_num_reqs=5,
    max_num_batched_tokens=48,
    max_num_blocks_per_group=[6, 8, 3],
    slot_mapping_enabled=[True, True, False],
    dcp_sharded=[True, False, True],
    sliding_window_reach=[0, 8, 0],
    kernel_block_sizes=[2, 4, 16],
)


def device_tensors(root: object, device: torch.device) -> list[torch.Tensor]:
    """Every tensor on `device` reachable from `root`'s attributes (lists, dicts, objects)."""
    found, seen, stack = [], set(), [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type == device.type:
                found.append(obj)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            stack.extend(vars(obj).values())
    return found


def sleep(bt: BlockTables, seed: int) -> int:
    """Overwrite every device tensor `bt` owns with garbage bytes, keeping addresses."""
    host_truth = bt.num_blocks.cpu.untyped_storage().data_ptr()
    gen = torch.Generator().manual_seed(seed)
    n = 0
    for t in device_tensors(bt, bt.device):
        if t.numel() == 0 or t.untyped_storage().data_ptr() == host_truth:
            continue
        assert t.is_contiguous(), "every owned tensor is a contiguous buffer or row slice"
        garbage = torch.randint(
            0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=gen
        )
        t.view(torch.uint8).view(-1).copy_(garbage.to(t.device))
        n += 1
    return n


DERIVED = (
    "block_table_ptrs",
    "block_table_strides",
    "input_block_table_ptrs",
    "input_block_table_strides",
    "block_table_widths",
    "block_sizes_tensor",
    "kernel_block_sizes_tensor",
    "dcp_sharded",
    "sliding_window_reach_tensor",
)


def derived(bt: BlockTables) -> list[torch.Tensor]:
    return [getattr(bt, name) for name in DERIVED] + [bt._layout.params]


def t(values, device, dtype=torch.int32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def step(bt: BlockTables, device, idx, lens, start_pos, padded, nct, fused: bool):
    qsl = np.concatenate([[0], np.cumsum(lens)]).tolist()
    pos = [p for b, n in enumerate(lens) for p in range(start_pos[b], start_pos[b] + n)]
    args = (t(idx, device), padded)
    tail = (t(qsl, device), t(pos, device, torch.int64), qsl[-1] + 3)
    if fused:
        tables, slots = bt.gather_and_compute_slot_mappings(*args, *tail, t(nct, device))
    else:
        tables = bt.gather_block_tables(*args, num_computed_tokens=t(nct, device))
        slots = bt.compute_slot_mappings(t(idx, device), *tail)
    return [x.cpu().clone() for x in tables], slots.cpu().clone()


def state(bt: BlockTables):
    """What a later call can read: the forward-pass buffers and the live rows' blocks.

    Rows that were not live at wake-up (finished requests) are never read
    again before an `overwrite=True` append, so they are left out.
    """
    live = sorted(LIVE)
    rows = [
        [tb.gpu[r, : bt.num_blocks.np[g, r]].cpu() for r in live]
        for g, tb in enumerate(bt.block_tables)
    ]
    return (
        [x.cpu().clone() for x in bt.input_block_tables],
        bt.slot_mappings.cpu().clone(),
        bt.num_blocks.gpu[:, live].cpu().clone(),
        rows,
        bt._input_rows_written,
    )


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


LIVE = {0: ([3, 4, 5], [6, 7, 8, 9], [10]), 2: ([11], [12, 13], [14]), 4: ([15, 16], [17], [])}


def test_wake_up_behaves_as_if_no_sleep_happened(torch_device):
    bt = BlockTables(device=torch_device, **CONFIG)
    for r, ids in LIVE.items():
        bt.append_block_ids(r, ids, False)
    bt.append_block_ids(1, ([20], [21], [22]), False)  # finished before the sleep
    bt.apply_staged_writes()
    step(
        bt,
        torch_device,
        [1, 0, 2, 4, -1],
        [1, 2, 1, 1, 2],
        [0, 5, 2, 3, 0],
        5,
        [0, 9, 0, 0, 0],
        False,
    )
    kept = [x.data_ptr() for x in derived(bt)]
    pinned = [x.data_ptr() for x in (*bt.input_block_tables, bt.slot_mappings)]

    assert sleep(bt, seed=1) >= 15
    bt.init_block_table_layout_tensors()
    fresh = BlockTables(device=torch_device, **CONFIG)
    for obj in (bt, fresh):
        for r, ids in LIVE.items():
            obj.append_block_ids(r, ids, True)
        obj.apply_staged_writes()

    assert [x.data_ptr() for x in (*bt.input_block_tables, bt.slot_mappings)] == pinned
    assert [x.data_ptr() for x in derived(bt)] == kept  # rewritten in place: graphs stay valid
    assert_same(state(bt), state(fresh))
    # Positions stay inside each row's blocks in every enabled group (the contract's rule).
    steps = [
        ([4, 0], [2, 3], [1, 6], 3, [0, 12, 0, 0, 0], True),
        ([2, -1, 0, 4], [1, 1, 4, 2], [6, 0, 8, 2], 5, [0, 20, 0, 0, 0], False),
        ([0], [1], [11], 1, [0, 0, 0, 0, 0], True),
    ]
    for i, (idx, lens, start, padded, nct, fused) in enumerate(steps):
        if i == 1:
            for obj in (bt, fresh):
                obj.append_block_ids(2, ([18], [19], []), False)
                obj.apply_staged_writes()
        if i == 2:
            for obj in (bt, fresh):
                for v in obj.get_dummy_block_tables(2):
                    v.fill_(9)
                obj.get_dummy_slot_mappings(7)
        got = step(bt, torch_device, idx, lens, start, padded, nct, fused)
        want = step(fresh, torch_device, idx, lens, start, padded, nct, fused)
        assert_same(got, want)
        assert_same(state(bt), state(fresh))


@pytest.mark.parametrize("fused", [False, True], ids=["gather", "fused"])
def test_rows_a_larger_batch_left_before_the_sleep_are_zeroed_after_it(torch_device, fused):
    """SPEC.md 3: a gather into the persistent tables zeroes the rows the previous call
    wrote past its own batch; SPEC.md 8.4: after the wake-up every method behaves as if no
    sleep happened. So the rows a batch of 5 wrote before the sleep must be zero after the
    first, smaller, gather that follows the wake-up (as the reference has them), not hold
    what the sleep left there."""
    bt = BlockTables(device=torch_device, **CONFIG)
    ref = ReferenceBlockTables(BlockTablesConfig(**CONFIG))
    for r, ids in LIVE.items():
        bt.append_block_ids(r, ids, True)
        ref.append_block_ids(r, ids, True)
    bt.apply_staged_writes()
    step(bt, torch_device, [4, 0, 2, -1], [1, 1, 1, 1], [0, 0, 0, 0], 5, [0] * 5, fused)
    sleep(bt, seed=3)
    bt.init_block_table_layout_tensors()
    for r, ids in LIVE.items():
        bt.append_block_ids(r, ids, True)
    bt.apply_staged_writes()
    step(bt, torch_device, [2], [1], [0], 2, [0] * 5, fused)
    # the rows this call must leave right: the larger of its 2 and the 5 written before
    expected = ref.gathered_block_tables(np.array([2]), CONFIG["max_num_reqs"])
    for got, (values, defined) in zip(bt.input_block_tables, expected):
        got = got.cpu().numpy().astype(np.int64)
        np.testing.assert_array_equal(got[defined], values[defined])


def test_layout_tensors_are_rebuilt_from_host_config(torch_device):
    bt = BlockTables(device=torch_device, **CONFIG)
    sleep(bt, seed=2)
    bt.init_block_table_layout_tensors()
    fresh = BlockTables(device=torch_device, **CONFIG)
    for name in DERIVED[2:]:
        if name == "input_block_table_ptrs":
            continue
        assert torch.equal(getattr(bt, name), getattr(fresh, name)), name
    assert torch.equal(bt._layout.params, fresh._layout.params)
    assert bt._layout.table_ptrs is bt.block_table_ptrs
    assert bt.block_table_ptrs.tolist() == [x.gpu.data_ptr() for x in bt.block_tables]
    assert bt.input_block_table_ptrs.tolist() == [x.data_ptr() for x in bt.input_block_tables]
    assert all(int(x.abs().sum()) == 0 for x in bt.input_block_tables)
    assert (bt.slot_mappings == -1).all()


@pytest.mark.parametrize(
    ("name", "shape", "dtype"),
    [
        pytest.param("block_table_widths", (3, 1), torch.int32, id="widths-of-another-shape"),
        pytest.param("block_table_widths", (3,), torch.int64, id="widths-of-another-dtype"),
        pytest.param("block_table_ptrs", (2,), torch.uint64, id="ptrs-too-short"),
    ],
)
def test_a_derived_tensor_that_no_longer_fits_is_built_anew(torch_device, name, shape, dtype):
    """docs/contract-notes.md (wake-up): every derived tensor is rewritten in place *where
    it exists and fits*. One replaced by a tensor of another shape (same dtype) or another
    dtype (same shape) does not fit: `init_block_table_layout_tensors()` builds it anew, as
    a fresh instance has it, instead of copying into the replacement."""
    bt = BlockTables(device=torch_device, **CONFIG)
    setattr(bt, name, torch.zeros(shape, dtype=dtype, device=torch_device))
    bt.init_block_table_layout_tensors()
    fresh = BlockTables(device=torch_device, **CONFIG)
    got, want = getattr(bt, name), getattr(fresh, name)
    assert (got.shape, got.dtype) == (want.shape, want.dtype)
    if name == "block_table_ptrs":
        assert got.tolist() == [x.gpu.data_ptr() for x in bt.block_tables]
    else:
        assert torch.equal(got, want)
