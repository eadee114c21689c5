"""The checker, in one process: a correct implementation passes; each corruption names its check.

Every CP rank is an instance of the plain-torch stand-in driven by the
harness's own per-rank executor; the outputs reach `GroupChecker` exactly as
the leader would receive them, optionally corrupted in between.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from cp_blocktables import reference
from cp_blocktables.contract import PAD_SLOT_ID
from cp_blocktables.harness import presets
from cp_blocktables.harness.checks import GroupChecker, Violation, agreement_violations
from cp_blocktables.harness.runner import _Executor
from cp_blocktables.harness.workload import generate

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.wrong_impls.stand_in import StandInBlockTables  # noqa: E402

Corrupt = Callable[[object, np.ndarray, list[np.ndarray]], None]


def _drive(
    name: str | presets.Preset,
    steps: int,
    corrupt: Corrupt | None = None,
    seed: int = 0,
    digests: Callable[[int], list[str]] | None = None,
) -> GroupChecker:
    preset = presets.PRESETS[name] if isinstance(name, str) else name
    preset = preset.with_overrides(num_steps=steps)
    workload = generate(preset, seed)
    executors = []
    for k in range(preset.cp_size):
        cfg = preset.config(k)
        impl = StandInBlockTables(
            cfg.block_sizes, cfg.max_num_reqs, cfg.max_num_batched_tokens,
            cfg.max_num_blocks_per_group, torch.device("cpu"), cfg.cp_size, k,
            cfg.cp_interleave, cfg.slot_mapping_enabled, cfg.dcp_sharded,
            cfg.sliding_window_reach)  # fmt: skip
        executors.append(_Executor(impl, preset, torch.device("cpu")))
    checker = GroupChecker(preset, workload)
    for step in workload.steps:
        outs = [e.run(step) for e in executors]
        (slots, tables), aux = executors[0].split_all([o[0] for o in outs])
        slots, tables = slots.copy(), [t.copy() for t in tables]
        if corrupt is not None:  # the slots the step produced: the caller's out if it gave one
            corrupt(step, aux[0] if step.slot_out else slots, tables)
        local = [v for o in outs for v in o[1]]
        d = digests(step.index) if digests else [o[2] for o in outs]
        checker.check_step(step, slots, tables, local, d, aux)
    checker.record(checker.read_back(len(workload.steps), workload.unfinished))
    return checker


@pytest.mark.parametrize("name", ["cp1-window", "cp2-i1", "default", "cp4-interleave"])
def test_correct_implementation_passes_with_full_accounting(name):
    checker = _drive(name, 24)
    assert checker.violations == []
    s = checker.stats  # [groups, cp, fields]
    assert (s[..., 0] == s[..., 1]).all(), "owned != expected"
    assert (s[..., 2:5] == 0).all(), "duplicates, misses or wrong slots"
    assert (s[..., 5] == s[..., 6]).all() and s[..., 6].sum() > 0, "KV read back incomplete"
    assert checker.tokens_checked > 0 and checker.steps_checked == 24


def _first_real_token(step) -> int | None:
    _, uids = step.token_rows()
    real = np.flatnonzero(uids >= 0)
    return int(real[0]) if step.kind == "real" and real.size else None


def _checks(checker: GroupChecker) -> set[int]:
    return set(checker.counts)


def test_owner_writing_nothing_is_check_1_and_counted_as_a_miss():
    hit = {}

    def corrupt(step, slots, tables):
        t = _first_real_token(step)
        if t is None or hit:
            return
        owner = int(np.flatnonzero(slots[:, 0, t] != PAD_SLOT_ID)[0])
        slots[owner, 0, t] = PAD_SLOT_ID
        hit["rank"] = owner

    checker = _drive("cp2-i1", 6, corrupt)
    assert 1 in _checks(checker)
    first = checker.violations[0]
    assert first.check == 1 and first.rank == hit["rank"] and "wrote nothing" in first.what
    assert checker.stats[0, hit["rank"], 3] == 1


def test_non_owner_writing_a_token_is_check_1_duplicate():
    hit = {}

    def corrupt(step, slots, tables):
        t = _first_real_token(step)
        if t is not None and not hit:
            other = int(np.flatnonzero(slots[:, 0, t] == PAD_SLOT_ID)[0])
            slots[other, 0, t] = 12345 * 16
            hit["step"] = step.index

    checker = _drive("cp2-i1", 6, corrupt)
    v = next(v for v in checker.violations if v.check == 1)
    assert "owned by rank" in v.what and v.step == hit["step"]
    assert checker.stats[0, :, 2].sum() == 1


def test_unsharded_disagreement_is_check_2():
    hit = {}

    def corrupt(step, slots, tables):
        t = _first_real_token(step)
        if t is not None and not hit:
            slots[1, 1, t] += 1  # group 1 of cp2-i1 is unsharded
            hit["step"] = step.index

    checker = _drive("cp2-i1", 6, corrupt)
    v = checker.violations[0]
    assert (v.check, v.group, v.rank, v.what, v.step) == (2, 1, 1, "wrong slot", hit["step"])


@pytest.mark.parametrize("where", ["tail", "disabled", "dummy_token"])
def test_pad_expected_is_check_3(where):
    def corrupt(step, slots, tables):
        if step.kind != "real":
            return
        _, uids = step.token_rows()
        if where == "tail":
            slots[0, 0, step.num_tokens] = 7
        elif where == "disabled":
            slots[0, 2, 0] = 7  # group 2 of cp2-i1 is disabled
        elif (uids < 0).any():
            slots[0, 0, int(np.flatnonzero(uids < 0)[0])] = 7

    checker = _drive("cp2-i1", 12, corrupt)
    assert _checks(checker) == {3}


def test_shared_slot_is_check_4():
    def corrupt(step, slots, tables):
        _, uids = step.token_rows()
        real = np.flatnonzero(uids >= 0)
        if step.kind == "real" and real.size >= 2 and step.index > 1:
            slots[0, 0, real[1]] = slots[0, 0, real[0]]

    checker = _drive("cp1-window", 4, corrupt)
    assert 4 in _checks(checker)
    assert any("share a slot" in v.what for v in checker.violations)


def test_slot_in_a_foreign_block_is_check_4():
    def corrupt(step, slots, tables):
        _, uids = step.token_rows()
        real = np.flatnonzero(uids >= 0)
        if step.kind == "real" and step.index > 1 and len(set(uids[real].tolist())) > 1:
            other = real[uids[real] != uids[real[0]]][0]
            slots[0, 0, real[0]] = slots[0, 0, other] + 0  # someone else's block

    checker = _drive("cp1-window", 8, corrupt)
    assert any(
        v.check == 4 and "outside the token's own blocks" in v.what for v in checker.violations
    )


def test_foreign_kv_is_check_5():
    checker = _drive("cp2-i1", 10)
    assert checker.violations == []
    uid, blocks = next(iter(checker.req_blocks.items()))
    slot = blocks[0][0] * 16
    for k in range(2):
        checker.kv[k][0][slot] = (999 << 40) | 3
    req = next(f for f in checker.workload.unfinished if f.uid == uid)
    found = checker.read_back(10, [req])
    assert found and {v.check for v in found} == {5}
    assert "request 999 position 3" in found[0].actual


FAR = presets.PRESETS["cp2-past-2-31"]


def _read_requests(checker: GroupChecker) -> list:
    return [f for s in checker.workload.steps for f in s.finished] + checker.workload.unfinished


def test_far_requests_are_read_back_from_their_start_only():
    """Check 5 reads a far request's positions `[read_from, seq_len)`, each once, and
    nothing of its unseeded prefix: reads count exactly those positions."""
    checker = _drive(FAR, 12)
    assert checker.violations == []
    reqs = _read_requests(checker)
    assert any(f.read_from >= 2**31 - FAR.max_prompt_len for f in reqs)
    for g in range(checker.num_groups):
        want = sum(f.seq_len - f.read_from for f in reqs) if checker.enabled[g] else 0
        assert checker.stats[g, :, 6].sum() == checker.stats[g, :, 5].sum() == want


def _far_slot(checker: GroupChecker, req, position: int) -> tuple[int, int]:
    """`(rank, slot)` where `position` of `req` lies in group 0 (SPEC.md section 2)."""
    row = np.asarray(checker.req_blocks[req.uid][0], dtype=np.int64)
    for k in range(checker.cp_size):
        slot = reference.slots_for_positions(
            row, np.array([position]), checker.block_sizes[0], checker.cp_size, k,
            FAR.cp_interleave,
        )[0]  # fmt: skip
        if slot != PAD_SLOT_ID:
            return k, int(slot)
    raise AssertionError("no owner")


def test_foreign_kv_past_2_31_is_check_5_and_the_prefix_is_never_read():
    checker = _drive(FAR, 12)
    req = next(f for f in checker.workload.unfinished if f.read_from)
    k, slot = _far_slot(checker, req, req.seq_len - 1)
    assert req.seq_len - 1 >= 2**31
    below = _far_slot(checker, req, req.read_from - 1)
    checker.kv[below[0]][0][below[1]] = (999 << 40) | 5  # in the prefix: not read
    assert checker.read_back(12, [req]) == []
    checker.kv[k][0][slot] = (999 << 40) | 3
    found = checker.read_back(12, [req])
    assert found and {v.check for v in found} == {5}
    assert found[0].position == req.seq_len - 1 and "request 999 position 3" in found[0].actual


def test_padding_row_not_zero_is_check_6():
    def corrupt(step, slots, tables):
        if step.kind == "real" and step.num_reqs_padded > step.num_reqs:
            tables[0][0, step.num_reqs, 0] = 42

    checker = _drive("cp2-i1", 12, corrupt)
    assert _checks(checker) == {6}
    assert "padding row" in checker.violations[0].what


def test_window_block_left_unmasked_is_check_6():
    def corrupt(step, slots, tables):
        if step.kind != "real" or step.num_computed_tokens is None:
            return
        for b, r in enumerate(step.idx_mapping.tolist()):
            if r >= 0 and step.num_computed_tokens[r] > 200:
                tables[1][0, b, 0] = 77  # group 1 of cp1-window has a window of 48

    checker = _drive("cp1-window", 30, corrupt)
    assert any(
        v.check == 6 and v.what.startswith("sliding-window masking") for v in checker.violations
    )


def test_digest_mismatch_is_check_7_naming_the_odd_rank():
    checker = _drive("cp4-interleave", 3, digests=lambda s: ["a", "a", "b", "a"])
    v = next(v for v in checker.violations if v.check == 7)
    assert v.rank == 2 and "rank 2: 'b'" in v.what


def test_agreement_names_field_and_rank():
    found = agreement_violations(
        [{"seed": 1, "x": 2}, {"seed": 1, "x": 2}, {"seed": 5, "x": 2}], "run options", -1
    )
    assert len(found) == 1
    assert found[0].check == 7 and found[0].rank == 2 and "'seed'" in found[0].what


def test_violation_description_names_every_coordinate():
    v = Violation(
        1,
        "wrong slot",
        4,
        group=1,
        request=9,
        row=3,
        position=77,
        token=5,
        rank=2,
        expected="slot 10",
        actual="slot 11",
    )
    text = v.describe()
    for part in (
        "check 1",
        "step 4",
        "group 1",
        "request 9",
        "row 3",
        "position 77",
        "rank 2",
        "expected slot 10",
        "actual slot 11",
    ):
        assert part in text
