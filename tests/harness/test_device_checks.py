"""The device checks against the host checks, their oracle: the same violations, step by step.

Every CP rank is an implementation driven by the harness's own executor; each
step's gathered outputs go, optionally corrupted, to two `GroupChecker`s: the
host one (numpy) and the device one (torch tensors, here on the CPU). Both
must report exactly the same violations (check, step, group, request, row,
position, token, rank, expected, actual, wording), the same statistics, plot
points and token counts; and correct outputs must be decided by the device
path alone (no step handed to the host checks).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from harness_proc import run_cli

from cp_blocktables import BlockTables
from cp_blocktables.contract import PAD_SLOT_ID
from cp_blocktables.harness import presets
from cp_blocktables.harness.checks import GroupChecker
from cp_blocktables.harness.device_checks import use_device_checks
from cp_blocktables.harness.executor import _Executor
from cp_blocktables.harness.features import constructor_kwargs, inspect_factory
from cp_blocktables.harness.impl_loader import load_impl
from cp_blocktables.harness.workload import generate
from cp_blocktables.reference import slots_for_positions

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.wrong_impls.catalogue import CATALOGUE  # noqa: E402
from tests.wrong_impls.stand_in import StandInBlockTables  # noqa: E402

Corrupt = Callable[[object, np.ndarray, list[np.ndarray]], None]
CPU = torch.device("cpu")


def _both(
    name: str,
    steps: int,
    corrupt: Corrupt | None = None,
    seed: int = 0,
    impl=StandInBlockTables,
    forget_at: int | None = None,
) -> tuple[GroupChecker, GroupChecker]:
    preset = presets.PRESETS[name].with_overrides(num_steps=steps)
    workload = generate(preset, seed)
    accepts = inspect_factory(impl)
    executors = []
    for k in range(preset.cp_size):
        cfg = preset.config(k)
        kwargs = constructor_kwargs(preset, k, accepts)
        made = impl(
            cfg.block_sizes,
            cfg.max_num_reqs,
            cfg.max_num_batched_tokens,
            cfg.max_num_blocks_per_group,
            CPU,
            **kwargs,
        )
        executors.append(_Executor(made, preset, CPU))
    host, dev = GroupChecker(preset, workload), GroupChecker(preset, workload, device=CPU)
    for step in workload.steps:
        if step.index == forget_at:  # as after a sleep (SPEC.md 8.4): no past to compare with
            host.forget_persistent()
            dev.forget_persistent()
        try:
            outs = [e.run(step) for e in executors]
        except Exception:  # noqa: BLE001 - a wrong implementation raised: the run stops here
            return host, dev
        (slots, tables), aux = executors[0].split_all([o[0] for o in outs])
        slots, tables = slots.copy(), [t.copy() for t in tables]
        aux = (aux[0].copy(), [t.copy() for t in aux[1]])
        if corrupt is not None:  # the slots the step produced: the caller's out if it gave one
            corrupt(step, aux[0] if step.slot_out else slots, tables)
        local = [v for o in outs for v in o[1]]
        digests = [o[2] for o in outs]
        host.check_step(step, slots, tables, list(local), digests, aux)

        def t(x):
            return torch.from_numpy(x.copy())

        dev_aux = (t(aux[0]), [t(x) for x in aux[1]])
        dev.check_step(step, t(slots), [t(x) for x in tables], list(local), digests, dev_aux)
    end = len(workload.steps)
    host.record(host.read_back(end, workload.unfinished))
    dev.record(dev.read_back(end, workload.unfinished))
    return host, dev


def _assert_same(host: GroupChecker, dev: GroupChecker) -> None:
    assert [v.as_dict() for v in dev.violations] == [v.as_dict() for v in host.violations]
    assert dev.counts == host.counts
    assert (dev.stats == host.stats).all()
    assert dev.plot_points == host.plot_points
    assert (dev.tokens_checked, dev.steps_checked) == (host.tokens_checked, host.steps_checked)


PRESETS = ["cp1-window", "cp2-i1", "default", "cp4-interleave", "kbs-cp1", "kbs-cp4", "groups-6"]


@pytest.mark.parametrize("name", [*PRESETS, "cp8-large-ids", "groups-0", "groups-1"])
def test_correct_outputs_pass_on_the_device_alone(name):
    host, dev = _both(name, 14)
    _assert_same(host, dev)
    assert host.violations == [] and dev.dev.fallbacks == 0
    assert dev.tokens_checked > 0 or name == "groups-0"


def test_tables_spanning_2_31_positions_pass_on_the_device_alone():
    """Blocks of 2**18 tokens and more: slots past 2**31, tables spanning 2**31 positions."""
    host, dev = _both("cp8-span-2-31", 6)
    _assert_same(host, dev)
    assert host.violations == [] and dev.dev.fallbacks == 0 and dev.tokens_checked > 0


@pytest.mark.parametrize("impl", [StandInBlockTables, BlockTables], ids=["stand-in", "ours"])
def test_positions_past_2_31_pass_on_the_device_alone_and_fail_alike(impl):
    """Far starts (`cp2-past-2-31`): the device reads back only positions from a
    request's start, as the host does, and a foreign token there is the same check 5 on
    both."""
    host, dev = _both("cp2-past-2-31", 12, impl=impl)
    _assert_same(host, dev)
    assert host.violations == [] and dev.dev.fallbacks == 0 and dev.tokens_checked > 0
    req = next(f for f in host.workload.unfinished if f.read_from)
    row = np.asarray(host.req_blocks[req.uid][0], dtype=np.int64)
    pos = np.array([req.seq_len - 1])
    k = next(k for k in range(2) if slots_for_positions(row, pos, 2**20, 2, k, 8)[0] >= 0)
    slot = int(slots_for_positions(row, pos, 2**20, 2, k, 8)[0])
    for checker in (host, dev):
        checker.kv[k][0][slot] = (999 << 40) | 3
    found = host.read_back(12, [req])
    assert {v.check for v in found} == {5} and found[0].position == req.seq_len - 1 >= 2**31
    assert [v.as_dict() for v in dev.read_back(12, [req])] == [v.as_dict() for v in found]


def test_forgetting_the_persistent_buffers_mid_run_keeps_both_paths_alike():
    host, dev = _both("default", 16, _padding_row, forget_at=7)
    assert host.violations
    _assert_same(host, dev)


# ---------------------------------------------------------------- planted defects


def _real_tokens(step) -> np.ndarray:
    _, uids = step.token_rows()
    return np.flatnonzero(uids >= 0) if step.kind == "real" else np.zeros(0, dtype=np.int64)


def _first_sharded(step, slots, tables, change) -> None:
    real = _real_tokens(step)
    if real.size and step.index % 3 == 1:
        t = int(real[real.size // 2])
        owner = int(np.flatnonzero(slots[:, 0, t] != PAD_SLOT_ID)[0])
        change(slots, owner, t)


def _corrupt_slot(step, slots, tables):
    _first_sharded(step, slots, tables, lambda s, k, t: s.__setitem__((k, 0, t), s[k, 0, t] + 1))


def _swap_owner(step, slots, tables):
    def change(s, k, t):
        other = (k + 1) % s.shape[0]
        s[other, 0, t], s[k, 0, t] = s[k, 0, t], PAD_SLOT_ID

    _first_sharded(step, slots, tables, change)


def _duplicate_slot(step, slots, tables):
    real = _real_tokens(step)
    if real.size >= 2 and step.index > 1:
        slots[0, 0, real[-1]] = slots[0, 0, real[0]]


def _foreign_block(step, slots, tables):
    _, uids = step.token_rows()
    real = _real_tokens(step)
    if real.size and len(set(uids[real].tolist())) > 1 and step.index > 1:
        other = real[uids[real] != uids[real[0]]][0]
        slots[0, 0, real[0]] = slots[0, 0, other]


def _non_pad_tail(step, slots, tables):
    if step.kind == "real" and step.num_tokens < slots.shape[2]:
        slots[-1, 0, step.num_tokens] = 7


def _disabled_group(step, slots, tables):  # group 2 of cp2-i1 is disabled
    if step.kind == "real" and step.index % 2:
        slots[0, 2, 0] = 5


def _dummy_token(step, slots, tables):
    _, uids = step.token_rows()
    if step.kind == "real" and (uids < 0).any():
        slots[-1, 0, int(np.flatnonzero(uids < 0)[0])] = 3


def _wrong_table_entry(step, slots, tables):
    if step.kind == "real" and step.index % 4 == 2 and (step.idx_mapping >= 0).any():
        b = int(np.flatnonzero(step.idx_mapping >= 0)[0])
        tables[0][-1, b, 0] += 1


def _padding_row(step, slots, tables):
    if step.kind == "real" and step.num_reqs_padded > step.num_reqs:
        tables[0][0, step.num_reqs, 0] = 42


def _dummy_run_slots(step, slots, tables):
    if step.kind == "dummy":
        if step.dummy_num_tokens < slots.shape[-1]:  # a dummy run of every token has no tail
            slots[0, 0, step.dummy_num_tokens] = 9
        tables[0][0, 0, 0] += 1


def _unmasked_window(step, slots, tables):  # group 1 of cp1-window has a window of 48
    if step.kind == "real" and step.num_computed_tokens is not None:
        for b, r in enumerate(step.idx_mapping.tolist()):
            if r >= 0 and step.num_computed_tokens[r] > 200:
                tables[1][0, b, 0] = 77


DEFECTS = [
    ("corrupt_slot", "default", _corrupt_slot),
    ("corrupt_slot", "kbs-cp4", _corrupt_slot),
    ("swap_owner", "cp4-interleave", _swap_owner),
    ("swap_owner", "cp2-i1", _swap_owner),
    ("duplicate_slot", "cp1-window", _duplicate_slot),
    ("duplicate_slot", "kbs-cp1", _duplicate_slot),
    ("foreign_block", "cp1-window", _foreign_block),
    ("non_pad_tail", "default", _non_pad_tail),
    ("disabled_group", "cp2-i1", _disabled_group),
    ("dummy_token", "default", _dummy_token),
    ("wrong_table_entry", "kbs-cp4", _wrong_table_entry),
    ("wrong_table_entry", "groups-6", _wrong_table_entry),
    ("padding_row", "cp2-i1", _padding_row),
    ("dummy_run", "default", _dummy_run_slots),
    ("unmasked_window", "cp1-window", _unmasked_window),
]


@pytest.mark.parametrize(
    ("defect", "name", "corrupt"), DEFECTS, ids=[f"{d}-{n}" for d, n, _ in DEFECTS]
)
def test_planted_defects_give_the_same_violations(defect, name, corrupt):
    host, dev = _both(name, 20, corrupt)
    assert host.violations, f"{defect} planted on {name} was not caught"
    _assert_same(host, dev)
    assert dev.dev.fallbacks > 0 or defect == "dummy_run"


def _random_defects(seed: int) -> Corrupt:
    rng = np.random.default_rng(seed)

    def corrupt(step, slots, tables):
        if rng.random() < 0.6 or slots.shape[1] == 0:
            return
        cp, groups, width = slots.shape
        k, g = int(rng.integers(cp)), int(rng.integers(groups))
        if rng.random() < 0.7:
            t = int(rng.integers(min(width, step.num_tokens + 3)))
            others = slots[k, g, : max(step.num_tokens, 1)]
            slots[k, g, t] = rng.choice(
                [PAD_SLOT_ID, slots[k, g, t] + 1, slots[k, g, t] - 1, others[-1], 2**35 + 3]
            )
        else:
            r = int(rng.integers(tables[g].shape[1]))
            j = int(rng.integers(tables[g].shape[2]))
            tables[g][k, r, j] = rng.choice([0, tables[g][k, r, j] + 1, 12345])

    return corrupt


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", PRESETS)
def test_random_defects_give_the_same_violations(name, seed):
    host, dev = _both(name, 12, _random_defects(seed), seed=seed)
    _assert_same(host, dev)


def test_foreign_kv_gives_the_same_check_5():
    host, dev = _both("cp2-i1", 10)
    uid, blocks = next(iter(host.req_blocks.items()))
    slot = blocks[0][0] * 16
    for checker in (host, dev):
        for k in range(2):
            checker.kv[k][0][slot] = (999 << 40) | 3
    req = next(f for f in host.workload.unfinished if f.uid == uid)
    found = host.read_back(10, [req])
    assert found and {v.check for v in found} == {5}
    assert [v.as_dict() for v in dev.read_back(10, [req])] == [v.as_dict() for v in found]
    assert (dev.stats == host.stats).all()


# ---------------------------------------------------------------- wrong implementations

WRONG = [
    ("wrong_owner", "cp2-i1"),
    ("dropped_interleave_remainder", "cp4-interleave"),
    ("unsharded_group_sharded", "cp2-i1"),
    ("missing_tail_padding", "default"),
    ("dummy_tokens_written", "default"),
    ("stale_dirty_rows", "cp2-i1"),
    ("window_off_by_one", "cp1-window"),
    ("int32_slots", "cp1-window"),
    ("positions_ignored", "default"),
    ("all_ranks_write", "cp4-interleave"),
    ("redirect_ignored", "default"),
    ("disabled_group_written", "cp2-i1"),
    ("virtual_block_from_allocator", "kbs-cp4"),
    ("expansion_reversed", "kbs-cp1"),
    ("gather_out_ignored", "cp2-i1"),
    ("slot_out_ignored", "default"),
    ("last_rank_off_by_one", "cp4-interleave"),
]


@pytest.mark.parametrize(("entry", "name"), WRONG, ids=[e for e, _ in WRONG])
def test_wrong_implementations_give_the_same_violations(entry, name):
    spec, check = CATALOGUE[entry]
    host, dev = _both(name, 20, impl=load_impl(spec))
    _assert_same(host, dev)
    assert check in host.counts, f"{entry} not caught by check {check} in 20 steps of {name}"
    assert dev.dev.fallbacks > 0 or set(host.counts) <= {0, 7, 8}


# ---------------------------------------------------------------- the command line


def test_checks_mode_choice():
    assert use_device_checks("auto", torch.device("cuda", 0))
    assert not use_device_checks("auto", CPU)
    assert use_device_checks("device", CPU) and not use_device_checks("host", CPU)
    with pytest.raises(ValueError, match="checks must be one of"):
        use_device_checks("gpu", CPU)


@pytest.mark.multirank
def test_verify_checks_device_on_cpu_passes_ours_and_fails_a_wrong_one():
    args = ["verify", "--world-size", "2", "--preset", "cp2-i1", "--steps", "8", "--checks"]
    ours = run_cli([*args, "device", "--quiet"])
    assert ours.returncode == 0, ours.stdout + ours.stderr
    assert "PASS" in ours.stdout
    wrong = run_cli([*args, "device", "--impl", CATALOGUE["wrong_owner"][0]])
    assert wrong.returncode == 1, wrong.stdout + wrong.stderr
    first = wrong.stdout.split("first violation:\n", 1)[1].splitlines()[0].strip()
    assert first.startswith("check 1 ") and "wrote a token owned by rank" in first
