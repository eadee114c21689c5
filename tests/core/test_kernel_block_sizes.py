"""Kernel block sizes (SPEC.md 8.1): validation, expansion, counts, slots and masking.

A slot is a token address: whichever `K` divides `B`, every position of every
request gets the same slot, and the KV round trip of section 2 holds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cp_blocktables import PAD_SLOT_ID, BlockTables
from cp_blocktables.reference import ReferenceBlockTables, local_len, owned_positions, read_slots

P = PAD_SLOT_ID


def cfg(**overrides) -> dict:
    """One group of 8-token allocator blocks in 2-token kernel blocks (m = 4)."""
    kwargs = dict(
        block_sizes=[8],
        max_num_reqs=4,
        max_num_batched_tokens=32,
        max_num_blocks_per_group=[3],
        kernel_block_sizes=[2],
    )
    kwargs.update(overrides)
    return kwargs


# ------------------------------------------------------------------ construction


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(kernel_block_sizes=[0]), r"kernel_block_sizes\[0\] must be >= 1"),
        (dict(kernel_block_sizes=[3]), r"kernel_block_sizes\[0\]=3 does not divide .*group 0"),
        (dict(kernel_block_sizes=[2, 2]), r"kernel_block_sizes has 2 entries"),
        (dict(kernel_block_sizes=[2.0]), r"kernel_block_sizes\[0\] must be an int"),
        (dict(kernel_block_sizes=[16]), r"kernel_block_sizes\[0\]=16 does not divide"),
        (
            dict(cp_size=2, cp_interleave=4),
            r"cp_interleave=4 does not divide kernel_block_sizes\[0\]=2 of DCP-sharded group 0",
        ),
    ],
)
def test_bad_kernel_block_sizes_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        BlockTables(device=torch.device("cpu"), **cfg(**overrides))


def test_interleave_rule_uses_k_only_for_sharded_groups_under_cp():
    BlockTables(device="cpu", **cfg(cp_size=2, cp_interleave=2))
    BlockTables(device="cpu", **cfg(cp_size=2, cp_interleave=4, dcp_sharded=[False]))
    BlockTables(device="cpu", **cfg(cp_interleave=8))


def test_public_state_and_shapes(torch_device):
    bt = BlockTables(
        device=torch_device,
        **cfg(block_sizes=[8, 16], max_num_blocks_per_group=[3, 2], kernel_block_sizes=[2, 16]),
    )
    assert bt.block_sizes == [8, 16] and bt.kernel_block_sizes == [2, 16]
    assert [t.gpu.shape for t in bt.block_tables] == [(4, 12), (4, 2)]
    assert [t.shape for t in bt.input_block_tables] == [(4, 12), (4, 2)]
    assert bt.kernel_block_sizes_tensor.tolist() == [2, 16]
    assert bt.block_sizes_tensor.tolist() == [8, 16]
    default = BlockTables(device=torch_device, **cfg(kernel_block_sizes=None))
    assert default.kernel_block_sizes == [8] and default.block_tables[0].gpu.shape == (4, 3)


# ------------------------------------------------------------------ appends


def test_append_expands_ids_and_counts_kernel_blocks(pair):
    p = pair(**cfg(block_sizes=[8, 4], max_num_blocks_per_group=[3, 3], kernel_block_sizes=[2, 4]))
    p.append(1, ([3, 5], [7]))
    assert p.bt.block_tables[0]._staged_write_contents == [12, 13, 14, 15, 20, 21, 22, 23]
    assert p.bt.block_tables[1]._staged_write_contents == [7]
    np.testing.assert_array_equal(p.bt.num_blocks.np[:, 1], [8, 1])
    p.bt.apply_staged_writes()
    p.append(1, ([6], [9]))
    p.bt.apply_staged_writes()
    np.testing.assert_array_equal(p.bt.num_blocks.np[:, 1], [12, 2])
    for g in range(2):
        np.testing.assert_array_equal(p.bt.block_tables[g].gpu.cpu().numpy(), p.ref.tables[g])
    p.append(1, ([2], []), overwrite=True)
    p.bt.apply_staged_writes()
    assert p.bt.num_blocks.gpu[0, 1].item() == 4
    p.gather([1], 1)


def test_capacity_check_uses_expanded_length_and_stages_nothing(pair):
    p = pair(**cfg(block_sizes=[4, 8], max_num_blocks_per_group=[4, 2], kernel_block_sizes=[4, 2]))
    p.append(0, ([1], [2]))
    with pytest.raises(RuntimeError, match=r"request 0, group 1: .*end at 12.*capacity 8"):
        p.bt.append_block_ids(0, ([3], [4, 5]), False)
    assert p.bt.block_tables[0]._staged_write_contents == [1]
    assert p.bt.block_tables[1]._staged_write_contents == [8, 9, 10, 11]
    np.testing.assert_array_equal(p.bt.num_blocks.np[:, 0], [1, 4])


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        pytest.param(
            ([1, 2, 3, 4, 5], [], []),
            r"group 0: blocks would end at 5, past the row capacity 4",
            id="allocator-blocks",
        ),
        pytest.param(
            ([], [1, 2], []),
            r"group 1: kernel blocks would end at 8, past the row capacity 4",
            id="kernel-blocks",
        ),
        pytest.param(
            ([], [], [1, 2]),
            r"group 2: kernel blocks would end at 4, past the row capacity 2",
            id="two-kernel-blocks-a-block",
        ),
    ],
)
def test_capacity_error_names_the_groups_unit(ids, message):
    """End and capacity are in kernel blocks (docs/contract-notes.md), and the message says
    so where a block is several kernel blocks (group 1, m = 4; group 2, m = 2, the
    smallest such factor); where it is one (group 0), it says blocks, as on the lean path."""
    bt = BlockTables(
        device="cpu",
        **cfg(
            block_sizes=[4, 8, 8],
            max_num_blocks_per_group=[4, 1, 1],
            kernel_block_sizes=[4, 2, 4],
        ),
    )
    with pytest.raises(RuntimeError, match=message):
        bt.append_block_ids(0, ids, False)


@pytest.mark.parametrize(
    "container",
    [list, tuple, lambda x: np.array(x, dtype=np.int64), lambda x: np.array(x, dtype=np.int32)],
    ids=["list", "tuple", "numpy-int64", "numpy-int32"],
)
def test_a_groups_ids_in_any_container_expand_and_are_range_checked(pair, container):
    """A group's ids as a numpy array (several of them) expand like a list on the
    kernel-block path, and an id out of range gets the documented refusal."""
    p = pair(**cfg(block_sizes=[8, 4], max_num_blocks_per_group=[3, 3], kernel_block_sizes=[2, 4]))
    p.bt.append_block_ids(1, (container([3, 5]), container([7, 8])), False)
    p.ref.append_block_ids(1, ([3, 5], [7, 8]), False)
    p.bt.apply_staged_writes()
    for g in range(2):
        np.testing.assert_array_equal(p.bt.block_tables[g].gpu.cpu().numpy(), p.ref.tables[g])
    with pytest.raises(ValueError, match=r"request 2, group 1: block ids must lie in"):
        p.bt.append_block_ids(2, (container([1]), container([4, -1])), False)
    assert p.bt.num_blocks.np[:, 2].tolist() == [0, 0]


def test_block_ids_whose_kernel_ids_pass_int32_are_refused(torch_device):
    bt = BlockTables(device=torch_device, **cfg())
    bt.append_block_ids(0, ([2**29 - 1],), False)  # last kernel id 2**31 - 1
    with pytest.raises(ValueError, match=r"block ids must lie in \[0, 536870911\]"):
        bt.append_block_ids(1, ([2**29],), False)
    assert bt.num_blocks.np[0, 1] == 0


def test_redirect_stages_the_null_blocks_kernel_blocks(pair):
    p = pair(**cfg())
    p.bt.redirect_writes_to_null_block = True
    p.ref.redirect_writes_to_null_block = True
    p.append(2, ([5, 6],))
    assert p.bt.block_tables[0]._staged_write_contents == [0, 1, 2, 3, 0, 1, 2, 3]
    p.bt.apply_staged_writes()
    assert p.bt.num_blocks.np[0, 2] == 8
    out = p.slots([2], [0, 3], [0, 7, 9], 3)
    np.testing.assert_array_equal(out[0], [0, 7, 1])


# ------------------------------------------------------------------ slots and gathers


@pytest.mark.parametrize(("cp_size", "cp_rank", "interleave"), [(1, 0, 1), (2, 1, 1), (4, 2, 2)])
def test_slots_match_reference(pair, cp_size, cp_rank, interleave):
    p = pair(
        **cfg(
            block_sizes=[8, 12],
            max_num_blocks_per_group=[6, 4],
            kernel_block_sizes=[2, 4],
            max_num_batched_tokens=64,
            cp_size=cp_size,
            cp_rank=cp_rank,
            cp_interleave=interleave,
            dcp_sharded=[True, False],
        )
    )
    p.append(0, ([4, 9, 2, 7, 1, 3], [5, 6, 8, 10]))
    p.append(3, ([11], [12]))
    p.bt.apply_staged_writes()
    p.slots([3, -1, 0], [0, 3, 5, 45], [0, 5, 7, 1, 2, *range(7, 47)], 50)


@pytest.mark.parametrize(("computed", "first_live"), [(20, 4), (21, 4), (19, 3), (12, 0)])
def test_masking_per_kernel_column(pair, computed, first_live):
    """reach 12, K 2: kernel column j is dead iff (j + 1) * 2 <= computed - 12."""
    p = pair(**cfg(block_sizes=[4], kernel_block_sizes=[2], sliding_window_reach=[12]))
    p.append(1, ([5, 6, 7],))
    p.bt.apply_staged_writes()
    out = p.gather([1], 1, num_computed_tokens=[0, computed, 0, 0])
    row = out[0][0, :6]
    np.testing.assert_array_equal(row[:first_live], 0)
    np.testing.assert_array_equal(row[first_live:], [10, 11, 12, 13, 14, 15][first_live:])


# ------------------------------------------------------------------ a slot is a token address


@st.composite
def layouts(draw):
    cp_size = draw(st.sampled_from([1, 2, 3, 4]))
    interleave = draw(st.sampled_from([1, 2, 4]))
    num_groups = draw(st.integers(1, 2))
    groups = []
    for _ in range(num_groups):
        sharded = draw(st.booleans())
        base = interleave if sharded and cp_size > 1 else 1
        k = base * draw(st.sampled_from([1, 2, 3]))
        m = draw(st.sampled_from([2, 3, 4]))
        groups.append((k * m, k, sharded))
    lens = draw(st.lists(st.integers(0, 60), min_size=1, max_size=3))
    order = draw(st.permutations(range(len(lens))))
    seed = draw(st.integers(0, 2**16))
    return cp_size, interleave, groups, lens, order, seed


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(layout=layouts())
def test_same_slot_whichever_k_divides_b_and_kv_round_trip(layout):
    cp_size, interleave, groups, lens, order, seed = layout
    rng = np.random.default_rng(seed)
    num_reqs = len(lens)
    caps = [-(-max(lens) // (b * (cp_size if s else 1))) + 1 for b, _, s in groups]
    kwargs = dict(
        block_sizes=[b for b, _, _ in groups],
        max_num_reqs=num_reqs + 1,
        max_num_batched_tokens=sum(lens) + 4,
        max_num_blocks_per_group=caps,
        cp_size=cp_size,
        cp_interleave=interleave,
        dcp_sharded=[s for _, _, s in groups],
    )
    # Distinct allocator ids per group, one row per request (the last row is never used).
    ids = []
    for cap in caps:
        pool = rng.permutation(np.arange(1, 1 + cap * num_reqs)).tolist()
        ids.append([pool[r * cap : (r + 1) * cap] for r in range(num_reqs)])
    idx = [order[b] for b in range(num_reqs)] + [-1]
    batch_lens = [lens[r] for r in idx[:-1]] + [2]
    qsl = np.concatenate([[0], np.cumsum(batch_lens)])
    positions = np.concatenate([np.arange(n) for n in batch_lens])
    num_tokens = int(qsl[-1])
    t = lambda v, dt=torch.int32: torch.tensor(np.asarray(v), dtype=dt)  # noqa: E731
    kv = [[{} for _ in groups] for _ in range(cp_size)]  # rank -> group -> slot -> token
    fine_rows = []
    for k in range(cp_size):
        by_k = []
        for kernel in (None, [kk for _, kk, _ in groups]):
            bt = BlockTables(device="cpu", cp_rank=k, kernel_block_sizes=kernel, **kwargs)
            for r in range(num_reqs):
                bt.append_block_ids(r, tuple(ids[g][r] for g in range(len(groups))), False)
            bt.apply_staged_writes()
            slots = bt.compute_slot_mappings(t(idx), t(qsl), t(positions, torch.int64), num_tokens)
            by_k.append(slots.numpy().copy())
        coarse, fine = by_k
        np.testing.assert_array_equal(fine, coarse, err_msg=f"rank {k}")
        ref = ReferenceBlockTables(bt.config)
        for r in range(num_reqs):
            ref.append_block_ids(r, [ids[g][r] for g in range(len(groups))], False)
        np.testing.assert_array_equal(fine, ref.slot_mappings(idx, qsl, positions, num_tokens))
        assert (fine[:, num_tokens - 2 :] == P).all()  # the dummy request
        tables = bt.gather_block_tables(t(idx[:-1]), num_reqs)
        fine_rows.append([tb.numpy().copy() for tb in tables])
        for g in range(len(groups)):
            for b, r in enumerate(idx[:-1]):
                for tok in range(qsl[b], qsl[b + 1]):
                    if fine[g, tok] != P:
                        assert fine[g, tok] not in kv[k][g], "two tokens share a slot"
                        kv[k][g][int(fine[g, tok])] = (r, int(positions[tok]))
    for g, (_, kernel, sharded) in enumerate(groups):
        c = cp_size if sharded else 1
        for b, r in enumerate(idx[:-1]):
            for k in range(cp_size):
                kk = k if c > 1 else 0
                n = local_len(lens[r], kk, c, interleave)
                row = fine_rows[k][g][b]
                got = [kv[k][g][s] for s in read_slots(row, n, kernel).tolist()]
                want = [(r, int(p)) for p in owned_positions(lens[r], kk, c, interleave, kernel)]
                assert got == want, f"group {g} request {r} rank {k}"
