"""SPEC 8.3 integrity checks: each planted violation is named; correct runs are unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cp_blocktables import PAD_SLOT_ID, BlockTables, integrity, kernels
from cp_blocktables.integrity import IntegrityError

GOOD = dict(block_sizes=[16, 32], max_num_reqs=4, max_num_batched_tokens=64,
            max_num_blocks_per_group=[8, 4])  # fmt: skip


def make(device, checks=True, **kwargs) -> BlockTables:
    return BlockTables(device=device, **(GOOD | kwargs), integrity_checks=checks)


def ints(values, device, dtype=torch.int32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def slots(bt, idx, qsl, pos, padded=None):
    d = bt.device
    padded = qsl[-1] if padded is None else padded
    return bt.compute_slot_mappings(ints(idx, d), ints(qsl, d), ints(pos, d, torch.int64), padded)


# ---------------------------------------------------------------- planted violations


def test_aliased_slots_name_group_slot_and_both_tokens(torch_device):
    bt = make(torch_device)
    bt.append_block_ids(0, ([5], [7]), False)
    bt.append_block_ids(1, ([5], [8]), False)  # both rows hold block 5 of group 0
    bt.apply_staged_writes()
    with pytest.raises(IntegrityError) as e:
        slots(bt, [0, 1], [0, 1, 2], [3, 3])
    msg = str(e.value)
    assert isinstance(e.value, RuntimeError)
    assert (
        "group 0: slot 83 is shared by token 0 (batch entry 0, row 0, position 3) and "
        "token 1 (batch entry 1, row 1, position 3)"
    ) in msg
    assert "group 1" not in msg
    off = make(torch_device, checks=False)
    off.append_block_ids(0, ([5], [7]), False)
    off.append_block_ids(1, ([5], [8]), False)
    off.apply_staged_writes()
    slots(off, [0, 1], [0, 1, 2], [3, 3])  # no check, no error


@pytest.mark.parametrize(
    "third",
    [pytest.param(6, id="third-slot-above"), pytest.param(4, id="third-slot-below")],
)
def test_a_shared_slot_names_its_two_tokens_beside_a_third_live_one(torch_device, third):
    """Rows 0 and 1 share block 5 of group 0 (slot 83); row 2's token holds a slot of its
    own above or below it. The error names the two tokens that share the slot (SPEC.md
    8.3), never the third, whichever way the slots sort."""
    bt = make(torch_device)
    for r, row_ids in enumerate((([5], [7]), ([5], [8]), ([third], [9]))):
        bt.append_block_ids(r, row_ids, False)
    bt.apply_staged_writes()
    with pytest.raises(IntegrityError) as e:
        slots(bt, [0, 1, 2], [0, 1, 2, 3], [3, 3, 3])
    assert (
        "group 0: slot 83 is shared by token 0 (batch entry 0, row 0, position 3) and "
        "token 1 (batch entry 1, row 1, position 3)"
    ) in str(e.value)
    assert "token 2" not in str(e.value)


@pytest.mark.parametrize(
    ("ids", "named"),
    [
        pytest.param(
            (([1], [7]), ([1], [8])), "group 0: slot 16 is shared", id="group-0-block-1-slot-16"
        ),
        pytest.param(
            (([5], [1]), ([6], [1])), "group 1: slot 32 is shared", id="group-1-block-1-slot-32"
        ),
    ],
)
def test_a_shared_slot_at_the_null_bound_is_named(torch_device, ids, named):
    """Block 1, the first past the null block, starts at slot `block_size` (SPEC.md 2):
    the lowest slot outside the null block, so two rows holding it share a slot the
    checks must name with both tokens (SPEC.md 8.3), like any other."""
    bt = make(torch_device)
    for r, row_ids in enumerate(ids):
        bt.append_block_ids(r, row_ids, False)
    bt.apply_staged_writes()
    with pytest.raises(IntegrityError) as e:
        slots(bt, [0, 1], [0, 1, 2], [0, 0])
    assert (
        f"{named} by token 0 (batch entry 0, row 0, position 0) and "
        "token 1 (batch entry 1, row 1, position 0)"
    ) in str(e.value)


@pytest.mark.parametrize(
    ("rows", "positions", "named"),
    [
        ([-1, 2], [0, 5], "token 1 (batch entry 1, row 2, position 5)"),
        ([2], [5], "token 0 (batch entry 0, row 2, position 5)"),
    ],
    ids=["behind-a-dummy", "one-token-step"],
)
def test_negative_slot_is_named(torch_device, rows, positions, named):
    """A corrupted table entry gives a negative slot, named with its token; a step of one
    token (a slot mapping of one column) can share no slot, yet the check must see it."""
    bt = make(torch_device)
    bt.append_block_ids(2, ([1], [2]), False)
    bt.apply_staged_writes()
    bt.block_tables[1].gpu[2, 0] = -3  # a corrupted table entry
    with pytest.raises(IntegrityError) as e:
        slots(bt, rows, list(range(len(rows) + 1)), positions)
    assert f"group 1: {named} has negative slot -91" in str(e.value)


def test_a_one_token_step_counts_its_negative_slot(torch_device):
    d = torch_device
    assert int(integrity.count_slot_mapping_faults(ints([[-5]], d, torch.int64), ints([0, 1], d),
                                                   [16])) == 1  # fmt: skip


def test_a_token_at_slot_0_is_not_named_as_negative(torch_device):
    """Slot 0 (the null block's first) is no fault: beside a real fault, only that is named."""
    d = torch_device
    s = ints([[0, 40, 40, -5, 0]], d, torch.int64)
    text = integrity.explain_slot_mapping_faults(s, ints([0, 5], d), ints([1], d), None, [16])
    assert text.count("negative slot") == 1
    assert "group 0: token 3 (batch entry 0, row 1) has negative slot -5" in text
    assert "group 0: slot 40 is shared by token 1 (batch entry 0, row 1) and token 2" in text


def test_the_explanation_names_a_slot_between_pad_and_0_as_negative(torch_device):
    """The explanation's rule is the module's: a slot other than `PAD_SLOT_ID` that is below
    0 is named. Slot mappings are int64, where that is every slot below -1; the helper takes
    any tensor, and in a float one a slot between -1 and 0 is negative too (the count, which
    compares with `PAD_SLOT_ID`, does not count it: only a direct call reaches this)."""
    d = torch_device
    s = torch.tensor([[-0.5, PAD_SLOT_ID, -2.0, 40.0]], dtype=torch.float64, device=d)
    text = integrity.explain_slot_mapping_faults(s, ints([0, 4], d), ints([1], d), None, [16])
    assert "group 0: token 0 (batch entry 0, row 1) has negative slot" in text
    assert "group 0: token 2 (batch entry 0, row 1) has negative slot -2" in text
    assert text.count("negative slot") == 2  # token 1's PAD is no fault


@pytest.mark.parametrize(
    ("token", "entry"),
    [(0, 0), (1, 0), (2, 2), (3, 3), (4, 3)],
    ids=["first-token", "last-of-entry-0", "after-an-empty-entry", "first-of-last", "last"],
)
def test_a_faulty_token_is_named_with_its_batch_entry_and_row(torch_device, token, entry):
    """SPEC.md 1: batch entry `b` holds tokens `[qsl[b], qsl[b+1])` (entry 1 here is empty);
    a token with a negative slot is named with that entry and its row `idx_mapping[b]`."""
    d = torch_device
    idx = [3, 0, 2, 1]
    row = [40 + t for t in range(5)]
    row[token] = -5
    s = ints([row], d, torch.int64)
    text = integrity.explain_slot_mapping_faults(
        s, ints([0, 2, 2, 3, 5], d), ints(idx, d), None, [16]
    )
    named = f"group 0: token {token} (batch entry {entry}, row {idx[entry]}) has negative slot -5"
    assert named in text


def test_slot_faults_are_named_up_to_8_of_each_kind(torch_device):
    """docs/contract-notes.md: up to 8 of each kind are named; the count says how many.
    Group 0: ten negative slots (tokens 0..9) and ten slots each shared by two tokens."""
    d = torch_device
    negative = [-2 - t for t in range(10)]
    shared = [100 + k for k in range(10) for _ in range(2)]
    s = ints([negative + shared], d, torch.int64)
    text = integrity.explain_slot_mapping_faults(s, ints([0, 30], d), ints([0], d), None, [16])
    assert text.count("has negative slot") == 8
    assert "group 0: 10 token(s) share a slot with an earlier one" in text
    assert text.count("is shared by") == 8


def test_gather_faults_are_named_up_to_8_of_each_kind(torch_device):
    """docs/contract-notes.md: up to 8 of each kind are named. Ten batch rows, each with a
    stale count and an entry that differs from its source."""
    d = torch_device
    src = [ints([[r + 1] for r in range(10)], d)]
    out = [ints([[99]] * 10, d)]
    idx = ints(list(range(10)), d)
    truth = np.ones((1, 10), dtype=np.int32)
    published = ints([[2] * 10], d)
    text = integrity.explain_gather_faults(out, src, idx, published, truth, [16], [0])
    assert text.count("(stale count)") == 8
    assert text.count("differs from its source") == 8


def test_null_block_slots_may_be_shared(torch_device):
    bt = make(torch_device)
    bt.redirect_writes_to_null_block = True  # a warm-up: every id becomes block 0
    for r in range(3):
        bt.append_block_ids(r, ([9], [9]), False)
    bt.apply_staged_writes()
    out = slots(bt, [0, 1, 2], [0, 2, 4, 6], [0, 1, 0, 1, 0, 1])
    assert out[0].tolist() == [0, 1, 0, 1, 0, 1]


SMALL_BLOCKS = {
    # block size, the row's block ids, idx_mapping, query_start_loc, positions, cp, slots
    "bs1-dummy-token-0-slot-2": (1, [2], [-1, 0], [0, 1, 2], [0, 0], {}, [PAD_SLOT_ID, 2]),
    "bs1-dummy-token-1-slot-1": (1, [1], [0, -1], [0, 1, 2], [0, 0], {}, [1, PAD_SLOT_ID]),
    "bs2-dummy-token-0-slot-2": (2, [1], [-1, 0], [0, 1, 2], [0, 0], {}, [PAD_SLOT_ID, 2]),
    "bs1-cp2-rank1-token-0-on-rank-0": (
        1, [2], [0], [0, 2], [0, 1], dict(cp_size=2, cp_rank=1), [PAD_SLOT_ID, 2],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", SMALL_BLOCKS.values(), ids=SMALL_BLOCKS.keys())
def test_tokens_without_a_slot_share_none_with_a_live_one(torch_device, case):
    """Block sizes 1 and 2: live slots start at 1 and 2 (block 0 is the null block), beside
    the indices of the first tokens; a PAD token there (a dummy, or a token another rank
    owns) repeats no live token's slot, so the checks raise nothing (SPEC.md 8.3)."""
    block_size, ids, idx, qsl, pos, cp, expected = case
    bt = make(torch_device, block_sizes=[block_size], max_num_blocks_per_group=[8], **cp)
    bt.append_block_ids(0, (ids,), False)
    bt.apply_staged_writes()
    assert slots(bt, idx, qsl, pos)[0].tolist() == expected


def test_tokens_past_num_tokens_are_not_checked(torch_device):
    bt = make(torch_device)
    bt.append_block_ids(0, ([5], [7]), False)
    bt.apply_staged_writes()
    out = bt.slot_mappings
    slots(bt, [0], [0, 1], [3], padded=4)
    out[:, 1:4] = 5 * 16 + 3  # junk in the padded tail repeats token 0's slot
    count = integrity.count_slot_mapping_faults(out, ints([0, 1], torch_device), [16, 32], 4)
    assert int(count) == 0


@pytest.mark.parametrize(
    "row",
    [
        pytest.param([80, 81, 80, PAD_SLOT_ID], id="shared-slot-past-the-view"),
        pytest.param([80, 81, -5, PAD_SLOT_ID], id="negative-slot-past-the-view"),
    ],
)
def test_only_the_returned_view_is_checked(torch_device, row):
    """`limit` is the returned view's width (`num_tokens_padded`): a batch said to be shorter
    than it is (refused when inputs are validated) has its tokens past the view unchecked,
    though they are in the batch; with no limit the whole buffer is the view."""
    s = ints([row], torch_device, torch.int64)
    qsl = ints([0, 3], torch_device)  # token 2 is in the batch, past a view of 2 columns
    idx = ints([0], torch_device)
    assert int(integrity.count_slot_mapping_faults(s, qsl, [16], 2)) == 0
    assert integrity.explain_slot_mapping_faults(s, qsl, idx, None, [16], 2) == ""
    assert int(integrity.count_slot_mapping_faults(s, qsl, [16])) == 1


@pytest.mark.parametrize(
    "ids, overwrite, published, truth",
    [
        pytest.param(([6], []), False, 2, 3, id="grown-by-an-append"),
        pytest.param(([7], [8]), True, 2, 1, id="cut-short-by-an-overwrite"),
    ],
)
def test_stale_count_is_named(torch_device, ids, overwrite, published, truth):
    """Counts changed on the host after the last apply, larger or smaller: the message names
    the group and rows (SPEC.md 8.3), also when every entry compared is still equal."""
    bt = make(torch_device)
    bt.append_block_ids(1, ([4, 5], [6]), False)
    bt.apply_staged_writes()
    bt.append_block_ids(1, ids, overwrite)  # staged and counted on the host, never applied
    with pytest.raises(IntegrityError) as e:
        bt.gather_block_tables(ints([1], torch_device), 1)
    assert (
        f"group 0: batch row 0 (request row 1) read num_blocks.gpu = {published} "
        f"but num_blocks.np = {truth}"
    ) in str(e.value)
    assert "stale count" in str(e.value)
    assert "group 1: batch row" not in str(e.value)


def test_corrupted_gather_output_is_named(torch_device, monkeypatch):
    bt = make(torch_device)
    bt.append_block_ids(3, ([11, 12, 13], [21]), False)
    bt.append_block_ids(0, ([14], [22, 23]), False)
    bt.apply_staged_writes()
    real = kernels.gather_block_tables

    def corrupting(*args, **kwargs):  # a kernel that gets one entry wrong
        real(*args, **kwargs)
        bt.input_block_tables[0][1, 0] = 999

    monkeypatch.setattr(kernels, "gather_block_tables", corrupting)
    with pytest.raises(IntegrityError) as e:
        bt.gather_block_tables(ints([3, 0], torch_device), 2)
    assert (
        "group 0: batch row 1 differs from its source, request row 0, in 1 of 1 entries; "
        "first at column 0: gathered 999, expected 14"
    ) in str(e.value)
    assert "group 1" not in str(e.value)


def test_tables_reallocated_without_new_pointers_are_caught(torch_device):
    bt = make(torch_device)
    bt.append_block_ids(2, ([3, 4], [5]), False)
    bt.apply_staged_writes()
    old = bt.block_tables[1].gpu  # still alive, still what the kernels' pointers name
    bt.block_tables[1].gpu = old.clone()
    bt.block_tables[1].gpu[2, 0] = 6  # the new table says 6; the pointers still read 5
    with pytest.raises(IntegrityError, match="group 1: batch row 0 differs .* gathered 5, "
                       "expected 6"):  # fmt: skip
        bt.gather_block_tables(ints([2], torch_device), 1)
    del old


def test_the_differing_row_is_named_behind_eight_rows_cut_short(torch_device):
    """Eight reused rows cut short by an overwrite hold stale entries just past their
    counts, batched before the row whose table was reallocated without new pointers:
    the message names that row and group alone (SPEC.md 8.3), not the clean rows."""
    bt = make(torch_device, max_num_reqs=9)
    for r in range(8):
        bt.append_block_ids(r, ([40 + r, 50 + r], [60 + r, 70 + r]), False)
    bt.apply_staged_writes()
    for r in range(8):
        bt.append_block_ids(r, ([80 + r], [90 + r]), True)  # entry 1 stays, past the count
    bt.append_block_ids(8, ([30], [31]), False)
    bt.apply_staged_writes()
    old = bt.block_tables[1].gpu  # still alive, still what the kernels' pointers name
    bt.block_tables[1].gpu = old.clone()
    bt.block_tables[1].gpu[8, 0] = 33  # the new table says 33; the pointers still read 31
    with pytest.raises(IntegrityError) as e:
        bt.gather_block_tables(ints(list(range(9)), torch_device), 9)
    assert str(e.value) == (
        "integrity check failed: gather_block_tables: group 1: batch row 8 differs from its "
        "source, request row 8, in 1 of 1 entries; first at column 0: gathered 31, expected 33"
    )
    del old


def test_gather_explanation_names_only_the_differing_entries(torch_device, monkeypatch):
    """A dummy entry, and a reused row's stale entries past its count, are not compared:
    the explanation names the corrupted entry alone."""
    bt = make(torch_device)
    bt.append_block_ids(0, ([14, 15], [22]), False)
    bt.append_block_ids(1, ([1, 2, 3], [4, 5]), False)
    bt.append_block_ids(1, ([16], [23]), True)  # a reused row: source entries 1, 2 stale
    bt.apply_staged_writes()
    real = kernels.gather_block_tables

    def corrupting(*args, **kwargs):
        real(*args, **kwargs)
        bt.input_block_tables[0][0, 0] = 999

    monkeypatch.setattr(kernels, "gather_block_tables", corrupting)
    with pytest.raises(IntegrityError) as e:
        bt.gather_block_tables(ints([0, -1, 1], torch_device), 3)
    assert str(e.value) == (
        "integrity check failed: gather_block_tables: group 0: batch row 0 differs from its "
        "source, request row 0, in 1 of 2 entries; first at column 0: gathered 999, expected 14"
    )


@pytest.mark.parametrize(
    ("got", "named"),
    [
        pytest.param(
            [90, 12, 93, 0],
            "in 2 of 3 entries; first at column 0: gathered 90, expected 11",
            id="columns-0-and-2",
        ),
        pytest.param(
            [11, 91, 92, 0],
            "in 2 of 3 entries; first at column 1: gathered 91, expected 12",
            id="columns-1-and-2",
        ),
    ],
)
def test_a_row_differing_in_several_entries_names_the_first(torch_device, got, named):
    """docs/contract-notes.md: the explanation quotes the first entry that differs, with
    the count of those that do, not any other of them."""
    d = torch_device
    src = [ints([[11, 12, 13, 0]], d)]
    text = integrity.explain_gather_faults(
        [ints([got], d)], src, ints([0], d), ints([[3]], d), np.array([[3]], np.int32), [16], [0]
    )
    assert (
        text == "gather_block_tables: group 0: batch row 0 differs from its source, "
        f"request row 0, {named}"
    )


def test_sliding_window_masking_is_what_is_expected(torch_device):
    bt = make(torch_device, sliding_window_reach=[20, 0])
    bt.append_block_ids(0, ([1, 2, 3, 4], [5, 6]), False)
    bt.apply_staged_writes()
    nct = ints([60, 0, 0, 0], torch_device)
    (t0, t1) = bt.gather_block_tables(ints([0], torch_device), 1, num_computed_tokens=nct)
    assert t0[0, :4].tolist() == [0, 0, 3, 4] and t1[0, :2].tolist() == [5, 6]


def test_count_functions_on_crafted_tensors(torch_device):
    d = torch_device
    s = ints([[PAD_SLOT_ID, 40, 40, -5, 40, 40], [3, 3, 50, 51, 52, 50]], d, torch.int64)
    qsl = ints([0, 3, 4], d)  # 4 tokens: only columns 0..3 count
    # group 0: 40 twice, -5 once; group 1: 3 twice but below the null bound 16
    assert int(integrity.count_slot_mapping_faults(s, qsl, [16, 16])) == 2
    assert int(integrity.count_slot_mapping_faults(s, qsl, [16, 2])) == 3
    text = integrity.explain_slot_mapping_faults(s, qsl, ints([2, -1], d), None, [16, 16])
    assert "group 0: token 3 (batch entry 1, row -1) has negative slot -5" in text
    assert text.count("negative slot") == 1  # token 0's PAD is no fault
    assert "group 0: slot 40 is shared by token 1 (batch entry 0, row 2) and token 2" in text
    assert "group 1" not in text

    src = [ints([[0, 0, 0], [7, 8, 9]], d)]
    out = [ints([[7, 8, 1], [0, 0, 0]], d)]  # entry 2 of row 0 past the count: not read
    args = (out, src, ints([1, -1], d), ints([[0, 2]], d), np.array([[0, 2]], dtype=np.int32))
    assert int(integrity.count_gather_faults(*args, [16], [0])) == 0
    out[0][0, 1] = 5
    assert int(integrity.count_gather_faults(*args, [16], [0])) == 1
    stale = args[:3] + (ints([[0, 1]], d),) + args[4:]
    assert int(integrity.count_gather_faults(*stale, [16], [0])) == 2  # count and entry 1


@pytest.mark.parametrize(
    "reach", [0, -4, -16], ids=["reach-0", "reach-minus-4", "reach-minus-a-block"]
)
def test_a_reach_not_above_0_masks_nothing_in_the_checks(torch_device, reach):
    """Only a positive reach masks (docs/contract-notes.md; the gather kernel's `reach > 0`).
    The config refuses a negative reach, so only a direct call passes one: the checks then
    expect the source row whole, as for reach 0. Were -4 taken as a window, 28 computed
    tokens would start it at token 32 and zero entries 0 and 1 (tokens 0 to 31)."""
    d = torch_device
    src = [ints([[0, 0, 0], [7, 8, 9]], d)]
    out = [ints([[7, 8, 9]], d)]  # row 1, whole
    nct = ints([0, 28], d)
    args = (out, src, ints([1], d), ints([[0, 3]], d), np.array([[0, 3]], dtype=np.int32))
    assert int(integrity.count_gather_faults(*args, [16], [reach], nct)) == 0
    integrity.check_gathered_block_tables(*args, [16], [reach], nct)  # raises nothing
    assert integrity.explain_gather_faults(*args, [16], [reach], nct) == ""


# ---------------------------------------------------------------- correct runs


def _random_step(rng, pairs, next_id, lengths):
    """Append fresh (never shared) ids to random rows of both instances; returns a batch."""
    num_reqs = int(rng.integers(1, 5))
    idx, qsl, pos = [], [0], []
    for r in rng.permutation(4)[:num_reqs].tolist():
        n = int(rng.integers(1, 6))
        if rng.random() < 0.15:  # a dummy request, junk positions
            idx.append(-1)
            pos += rng.integers(-5, 99, size=n).tolist()
            qsl.append(qsl[-1] + n)
            continue
        overwrite = lengths[r] + n > 60  # a finished request's row reused
        start = 0 if overwrite else lengths[r]
        lengths[r] = start + n
        blocks = []
        for bs in GOOD["block_sizes"]:
            have = -(-start // bs)
            blocks.append(list(range(next_id[0], next_id[0] + -(-lengths[r] // bs) - have)))
            next_id[0] += 8
        for bt in pairs:
            bt.append_block_ids(r, tuple(blocks), overwrite)
        idx.append(r)
        pos += list(range(start, lengths[r]))
        qsl.append(qsl[-1] + n)
    return idx, qsl, pos


@pytest.mark.parametrize("reach", [0, 24])
def test_checks_on_change_no_output(torch_device, reach):
    rng = np.random.default_rng(reach)
    kw = dict(sliding_window_reach=[reach, 0])
    on, off = make(torch_device, True, **kw), make(torch_device, False, **kw)
    next_id, lengths = [1], [0] * 4
    for _ in range(8):
        idx, qsl, pos = _random_step(rng, (on, off), next_id, lengths)
        for bt in (on, off):
            bt.apply_staged_writes()
        padded = min(qsl[-1] + int(rng.integers(0, 3)), 64)
        nct = ints(lengths, torch_device)
        results = []
        for bt in (on, off):
            tables = bt.gather_block_tables(
                ints(idx, torch_device), len(idx), num_computed_tokens=nct
            )
            s = slots(bt, idx, qsl, pos, padded)
            results.append(([t.cpu() for t in tables], s.cpu(), bt.slot_mappings.cpu()))
        (ta, sa, ba), (tb, sb, bb) = results
        assert all(torch.equal(a, b) for a, b in zip(ta, tb))
        assert torch.equal(sa, sb) and torch.equal(ba, bb)


def test_checks_under_cp_run_clean(torch_device):
    bt = make(torch_device, cp_size=2, cp_rank=1, cp_interleave=4)
    bt.append_block_ids(0, ([1, 2], [3]), False)
    bt.append_block_ids(1, ([4], [5]), False)
    bt.apply_staged_writes()
    idx = [1, 0]
    bt.gather_block_tables(ints(idx, torch_device), 2)
    slots(bt, idx, [0, 20, 60], list(range(20)) + list(range(40)))


def test_unchecked_rows_past_the_table_are_dummies_under_the_checks(torch_device):
    """With validation off a row outside [0, max_num_reqs) is treated as a dummy request
    (docs/contract-notes.md, input checks): with the checks on too, a zero row, no error."""
    bt = make(torch_device)
    bt.validate_inputs = False
    bt.append_block_ids(3, ([11, 12], [21]), False)
    bt.apply_staged_writes()
    t0, t1 = bt.gather_block_tables(ints([3, 4], torch_device), 2)
    assert t0[0, :2].tolist() == [11, 12] and t1[0, :1].tolist() == [21]
    assert t0[1].tolist() == [0] * 8 and t1[1].tolist() == [0] * 4


@pytest.mark.parametrize("row", [5, 2**31 - 1], ids=["two-past-the-last-row", "int32-max"])
def test_unchecked_rows_further_past_the_table_are_dummies_under_the_checks(torch_device, row):
    """As the test before, for rows beyond `max_num_reqs` itself (here 4): the checks take
    every row at or past it for a dummy, so a correct gather raises nothing."""
    bt = make(torch_device)
    bt.validate_inputs = False
    bt.append_block_ids(3, ([11, 12], [21]), False)
    bt.apply_staged_writes()
    t0, t1 = bt.gather_block_tables(ints([3, row], torch_device), 2)
    assert t0[0, :2].tolist() == [11, 12] and t1[0, :1].tolist() == [21]
    assert t0[1].tolist() == [0] * 8 and t1[1].tolist() == [0] * 4


# ---------------------------------------------------------------- switch and cost


def test_env_var_switches_checks_on_at_construction(monkeypatch, torch_device):
    monkeypatch.delenv(integrity.ENV_VAR, raising=False)
    assert make(torch_device, checks=False).integrity_checks is False
    assert make(torch_device, checks=True).integrity_checks is True
    monkeypatch.setenv(integrity.ENV_VAR, "1")
    bt = make(torch_device, checks=False)
    assert bt.integrity_checks is True
    monkeypatch.setenv(integrity.ENV_VAR, "0")
    assert make(torch_device, checks=False).integrity_checks is False
    assert bt.integrity_checks is True  # read at construction only
    bt.append_block_ids(0, ([5], [7]), False)
    bt.append_block_ids(1, ([5], [8]), False)
    bt.apply_staged_writes()
    with pytest.raises(IntegrityError, match="slot 83 is shared"):
        slots(bt, [0, 1], [0, 1, 2], [3, 3])


def test_keyword_is_last_in_the_signature():
    import inspect

    params = list(inspect.signature(BlockTables).parameters)
    assert params[-1] == "integrity_checks"
    assert inspect.signature(BlockTables).parameters["integrity_checks"].default is False


def test_checks_off_run_no_check_code(torch_device, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("an integrity check ran while checks are off")

    for name in ("check_slot_mappings", "check_gathered_block_tables", "raise_on_faults"):
        monkeypatch.setattr(integrity, name, boom)
    bt = make(torch_device, checks=False)
    bt.append_block_ids(0, ([5], [7]), False)
    bt.apply_staged_writes()
    bt.gather_block_tables(ints([0], torch_device), 1)
    slots(bt, [0], [0, 1], [3])


def test_counts_reach_a_cuda_device_through_pinned_memory(monkeypatch):
    """The module's cost model: the host counts reach a CUDA device by a non-blocking copy
    from pinned memory, so the check adds no synchronisation before its one read-back. Run
    on the host: a stand-in for `pin_memory` records the copy a CUDA device would get."""
    copies = []

    class Pinned:
        def to(self, device, non_blocking=False):
            copies.append((device, non_blocking))
            return "on the device"

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: Pinned())
    cuda = torch.device("cuda", 0)
    assert integrity._to_device(np.array([[1, 2]]), cuda) == "on the device"
    assert copies == [(cuda, True)]
    on_host = integrity._to_device([3, 4], torch.device("cpu"))  # no pinning on the host
    assert on_host.dtype == torch.int64 and on_host.tolist() == [3, 4] and copies == [(cuda, True)]
