"""`gather_and_compute_slot_mappings` (SPEC.md 8.2): the two reads, bit for bit, in one launch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hopper import flag_divisions, hopper_ttir, needs_cuda_backend
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cp_blocktables import BlockTables
from cp_blocktables._jit import launch_counts
from cp_blocktables.kernels import fused_reads


@st.composite
def configs(draw) -> dict:
    num_groups = draw(st.integers(1, 3))
    cp_size = draw(st.sampled_from([1, 1, 2, 4]))
    interleave = draw(st.sampled_from([1, 2]))
    kernel = [interleave * draw(st.sampled_from([1, 2, 4])) for _ in range(num_groups)]
    block = [k * draw(st.sampled_from([1, 1, 2, 3])) for k in kernel]
    return dict(
        block_sizes=block,
        max_num_reqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.sampled_from([8, 40, 130])),
        max_num_blocks_per_group=[draw(st.integers(2, 6)) for _ in range(num_groups)],
        cp_size=cp_size,
        cp_rank=draw(st.integers(0, cp_size - 1)),
        cp_interleave=interleave,
        slot_mapping_enabled=[draw(st.booleans()) or g == 0 for g in range(num_groups)],
        dcp_sharded=[draw(st.booleans()) for _ in range(num_groups)],
        sliding_window_reach=[draw(st.sampled_from([0, 0, 3, 9])) for _ in range(num_groups)],
        kernel_block_sizes=kernel,
    )


def _tensor(values, dtype=torch.int32) -> torch.Tensor:
    return torch.tensor(np.asarray(values), dtype=dtype)


def _group_cp(bt: BlockTables, g: int) -> int:
    return bt.cp_size if bt.config.dcp_sharded[g] else 1


def _step(draw, bt: BlockTables):
    """A batch: distinct rows (some dummies), padding, positions inside each row's blocks."""
    max_reqs = bt.max_num_reqs
    num_reqs = draw(st.integers(0, max_reqs))
    rows = draw(st.permutations(range(max_reqs)))[:num_reqs]
    idx = [r if draw(st.integers(0, 4)) else -1 for r in rows]
    num_reqs_padded = draw(st.integers(num_reqs, max_reqs))
    lens, positions = [], []
    budget = bt.max_num_batched_tokens
    for r in idx:
        n = draw(st.integers(0, min(4, budget)))
        budget -= n
        lens.append(n)
        if r < 0:
            positions += [draw(st.integers(0, 10**6)) for _ in range(n)]
            continue
        # Positions covered by every enabled group's blocks of this row.
        span = min(
            int(bt.num_blocks.np[g, r]) * bt.kernel_block_sizes[g] * _group_cp(bt, g)
            for g in range(bt.num_kv_cache_groups)
        )
        positions += [draw(st.integers(0, span - 1)) if span else 0 for _ in range(n)]
        if not span:
            lens[-1] = 0
            del positions[len(positions) - n :]
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    num_tokens_padded = draw(st.integers(int(qsl[-1]), bt.max_num_batched_tokens))
    nct = [draw(st.integers(0, 40)) for _ in range(max_reqs)]
    return idx, num_reqs_padded, qsl, positions, num_tokens_padded, nct


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(cfg=configs(), data=st.data())
def test_fused_equals_two_calls_bit_for_bit(cfg, data):
    draw = data.draw
    pair = [BlockTables(device="cpu", **cfg) for _ in range(2)]
    next_id = 1
    for _ in range(draw(st.integers(1, 4))):
        # Appends: new requests in reused rows (overwrite) or growing ones.
        for r in draw(st.lists(st.integers(0, cfg["max_num_reqs"] - 1), max_size=3)):
            overwrite = draw(st.booleans())
            room = [
                cap - (0 if overwrite else int(pair[0].num_blocks.np[g, r]) // (b // k))
                for g, (cap, b, k) in enumerate(
                    zip(
                        cfg["max_num_blocks_per_group"],
                        cfg["block_sizes"],
                        cfg["kernel_block_sizes"],
                    )
                )
            ]
            ids = tuple(list(range(next_id, next_id + draw(st.integers(0, n)))) for n in room)
            next_id += sum(map(len, ids))
            for bt in pair:
                bt.append_block_ids(r, ids, overwrite)
                bt.apply_staged_writes()
        if draw(st.integers(0, 5)) == 0:
            n = draw(st.integers(0, cfg["max_num_reqs"]))
            for bt in pair:
                for v in bt.get_dummy_block_tables(n):
                    v.fill_(3)  # a profiling pass
                bt.get_dummy_slot_mappings(n)
        idx, padded, qsl, pos, tokens_padded, nct = _step(draw, pair[0])
        masked = draw(st.booleans())
        nct_t = _tensor(nct) if masked else None
        a, b = pair
        tables_a = a.gather_block_tables(_tensor(idx), padded, num_computed_tokens=nct_t)
        slots_a = a.compute_slot_mappings(
            _tensor(idx), _tensor(qsl), _tensor(pos, torch.int64), tokens_padded
        )
        before = sum(launch_counts.values())
        tables_b, slots_b = b.gather_and_compute_slot_mappings(
            _tensor(idx), padded, _tensor(qsl), _tensor(pos, torch.int64), tokens_padded, nct_t
        )
        assert sum(launch_counts.values()) - before == 1
        assert len(tables_a) == len(tables_b)
        for ta, tb, full_a, full_b in zip(
            tables_a, tables_b, a.input_block_tables, b.input_block_tables
        ):
            assert ta.shape == tb.shape
            assert tb.numel() == 0 or tb.data_ptr() == full_b.data_ptr()
            assert torch.equal(full_a, full_b)
        assert slots_b.shape == slots_a.shape
        assert slots_b.numel() == 0 or slots_b.data_ptr() == b.slot_mappings.data_ptr()
        assert torch.equal(a.slot_mappings, b.slot_mappings)
        assert a._input_rows_written == b._input_rows_written


def _built(torch_device, **overrides) -> BlockTables:
    kwargs = dict(
        block_sizes=[4, 8],
        max_num_reqs=4,
        max_num_batched_tokens=16,
        max_num_blocks_per_group=[4, 2],
        sliding_window_reach=[4, 0],
    )
    kwargs.update(overrides)
    bt = BlockTables(device=torch_device, **kwargs)
    bt.append_block_ids(1, ([5, 6, 7], [8]), False)
    bt.apply_staged_writes()
    return bt


def test_one_launch_of_the_fused_kernel(torch_device):
    bt = _built(torch_device)
    t = lambda v, dt=torch.int32: torch.tensor(v, dtype=dt, device=torch_device)  # noqa: E731
    before = dict(launch_counts)
    total = sum(launch_counts.values())
    tables, slots = bt.gather_and_compute_slot_mappings(
        t([1, -1]), 3, t([0, 3, 4]), t([0, 1, 2, 0], torch.int64), 6, t([0, 12, 0, 0])
    )
    assert sum(launch_counts.values()) - total == 1
    name = "_gather_and_slot_mappings_kernel"
    assert launch_counts[name] - before.get(name, 0) == 1
    np.testing.assert_array_equal(tables[0].cpu().numpy()[:, :3], [[0, 0, 7], [0] * 3, [0] * 3])
    np.testing.assert_array_equal(tables[1].cpu().numpy()[0, :1], [8])
    np.testing.assert_array_equal(
        slots.cpu().numpy(), [[20, 21, 22, -1, -1, -1], [64, 65, 66, -1, -1, -1]]
    )


def test_refused_call_changes_nothing(torch_device):
    bt = _built(torch_device)
    t = lambda v, dt=torch.int32: torch.tensor(v, dtype=dt, device=torch_device)  # noqa: E731
    bt.gather_block_tables(t([1, 1, 1]), 4)
    before = [x.clone() for x in bt.input_block_tables], bt.slot_mappings.clone()
    total = sum(launch_counts.values())
    with pytest.raises(ValueError, match="num_tokens_padded"):
        bt.gather_and_compute_slot_mappings(t([1]), 1, t([0, 1]), t([0], torch.int64), 99)
    with pytest.raises(ValueError, match="num_reqs_padded"):
        bt.gather_and_compute_slot_mappings(t([1]), 9, t([0, 1]), t([0], torch.int64), 1)
    assert sum(launch_counts.values()) == total and bt._input_rows_written == 4
    assert all(torch.equal(x, y) for x, y in zip(before[0], bt.input_block_tables))
    assert torch.equal(before[1], bt.slot_mappings)


@pytest.mark.parametrize(
    ("idx", "qsl", "positions", "num_tokens_padded", "message"),
    [
        pytest.param([4], [0, 1], [0], 1, r"idx_mapping\[0\] = 4 is neither -1", id="row-past-max"),
        pytest.param([-2], [0, 1], [0], 1, r"idx_mapping\[0\] = -2", id="row-below-dummy"),
        pytest.param([1, -1], [0, 3, 2], [0, 1, 2], 3, "never decrease", id="qsl-decreasing"),
        pytest.param([1], [1, 3], [0, 1, 2], 3, "start at 0", id="qsl-not-from-0"),
        pytest.param([1], [0, 3], [0, 1], 3, "positions has 2", id="positions-short"),
        pytest.param([1], [0, 2], [0, -1], 2, "positions must be >= 0", id="negative-position"),
        pytest.param(
            [1], [0, 1], [16], 1, r"position 16 lies past group 0's table", id="position-past-table"
        ),
        pytest.param(
            [1], [0, 2], [0, 1], 1, "less than the batch's 2 tokens", id="padded-below-tokens"
        ),
    ],
)
def test_forbidden_values_are_refused_before_the_launch(
    torch_device, idx, qsl, positions, num_tokens_padded, message
):
    """The value checks of the two calls (docs/bad-input.md) run for the fused one too,
    wherever inputs are validated: the call raises and changes nothing."""
    bt = _built(torch_device)
    bt.validate_inputs = True
    t = lambda v, dt=torch.int32: torch.tensor(v, dtype=dt, device=torch_device)  # noqa: E731
    bt.gather_block_tables(t([1, 1, 1]), 4)
    before = [x.clone() for x in bt.input_block_tables], bt.slot_mappings.clone()
    total = sum(launch_counts.values())
    with pytest.raises(ValueError, match=message):
        bt.gather_and_compute_slot_mappings(
            t(idx), len(idx), t(qsl), t(positions, torch.int64), num_tokens_padded
        )
    assert sum(launch_counts.values()) == total and bt._input_rows_written == 4
    assert all(torch.equal(x, y) for x, y in zip(before[0], bt.input_block_tables))
    assert torch.equal(before[1], bt.slot_mappings)


def test_zero_groups(torch_device):
    bt = BlockTables([], 4, 8, [], torch_device)
    t = lambda v, dt=torch.int32: torch.tensor(v, dtype=dt, device=torch_device)  # noqa: E731
    total = sum(launch_counts.values())
    tables, slots = bt.gather_and_compute_slot_mappings(
        t([0]), 2, t([0, 1]), t([0], torch.int64), 3
    )
    assert tables == () and slots.shape == (0, 3)
    assert sum(launch_counts.values()) == total


@needs_cuda_backend
@pytest.mark.parametrize(
    ("by_request", "mask_window"),
    [
        pytest.param(False, False, id="by-tile-no-window"),
        pytest.param(True, True, id="by-request-sliding-window"),
    ],
)
def test_the_compiled_fused_kernel_builds_and_divides_no_flags(by_request, mask_window):
    """The fused read as CUDA launches it, built on CPU for a Hopper GPU: the interpreter
    never compiles it. Every device function it calls (`gather_rows` and the slot mapping's)
    must be a `dual_device_fn` for the compiled kernel to call it at all, and none may
    divide a flag (`hopper.flag_divisions`)."""
    kernel = fused_reads._gather_and_slot_mappings_kernel._compiled
    signature = {name: "i32" for name in kernel.arg_names}
    signature.update(
        idx_mapping="*i32", src_ptrs="*u64", src_strides="*i64", dst_ptrs="*u64",
        dst_strides="*i64", widths="*i32", num_blocks="*i32", block_sizes="*i64",
        reaches="*i64", num_computed_tokens="*i32", s_idx_mapping="*i32",
        query_start_loc="*i32", positions="*i64", table_ptrs="*u64", group_params="*i64",
        out="*i64",
    )  # fmt: skip
    constants = dict(
        MAX_WIDTH=100, MASK_WINDOW=mask_window, ROWS=16, COLS=128, NUM_GROUPS=2,
        SEARCH_STEPS=4, POS32=True, POW2=True, PAD_ID=-1, TILE=512, BY_REQUEST=by_request,
        REQ_TILE=1024 if by_request else 1, REQ_TILES=8 if by_request else 1,
    )  # fmt: skip
    ttir = hopper_ttir(kernel, signature, constants)
    assert "tt.store" in ttir
    assert flag_divisions(ttir) == []
