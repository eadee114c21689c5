"""A stateful property test: any sequence of `BlockTables` calls agrees with the reference.

Hypothesis drives one `BlockTables` (CPU, Triton's interpreter) through random
sequences of SPEC.md section 3's methods and, after every call, compares every
output the contract defines with `cp_blocktables.reference` and a small host
model of the persistent buffers. Nothing expected is read from the code
under test.

The host model (`Model`) tracks what the contract says the persistent
buffers hold:

* `tables[g]` / `known[g]`: the forward-pass tables' expected values and the
  entries the contract defines (a real row's entries past its block count are
  open);
* `dirty`: rows of the persistent tables that may hold ids: the last
  persistent gather's `num_reqs_padded`, or, after `get_dummy_block_tables(n)`
  (whose rows a profiling run fills with block ids), `n`. The next persistent
  gather must zero rows `[num_reqs, max(num_reqs_padded, dirty))`;
* `slots` / `slots_known`: the persistent slot-mapping buffer.

Calls that write into caller-owned `out` tensors must leave the model alone.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cp_blocktables import PAD_SLOT_ID, BlockTables, BlockTablesConfig
from cp_blocktables.reference import ReferenceBlockTables

CPU = torch.device("cpu")
MAX_ID = 2**31 - 1


@st.composite
def configs(draw) -> dict:
    """Small configurations: 1-3 groups, CP 1/2/4, interleave up to 2, windows, odd sizes."""
    num_groups = draw(st.integers(1, 3))
    cp_size = draw(st.sampled_from([1, 2, 4]))
    interleave = draw(st.sampled_from([1, 2])) if cp_size > 1 else 1
    sharded = [draw(st.booleans()) for _ in range(num_groups)]
    sizes = [
        draw(st.sampled_from([2, 4, 6, 8] if s or cp_size == 1 else [2, 3, 4, 6])) for s in sharded
    ]
    return dict(
        block_sizes=sizes,
        max_num_reqs=draw(st.integers(3, 5)),
        max_num_batched_tokens=draw(st.integers(12, 24)),
        max_num_blocks_per_group=[draw(st.integers(2, 4)) for _ in range(num_groups)],
        cp_size=cp_size,
        cp_rank=draw(st.integers(0, cp_size - 1)),
        cp_interleave=interleave,
        slot_mapping_enabled=[draw(st.booleans()) for _ in range(num_groups)],
        dcp_sharded=sharded,
        sliding_window_reach=[draw(st.sampled_from([0, 0, 3, 5, 8])) for _ in range(num_groups)],
    )


def same_buffer(view: torch.Tensor, base: torch.Tensor) -> bool:
    """`view` starts at `base`'s first element (also when it is empty, where data_ptr is 0)."""
    return (
        view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        and view.storage_offset() == base.storage_offset()
    )


def i32(values) -> torch.Tensor:
    return torch.tensor(np.asarray(values, dtype=np.int64), dtype=torch.int32)


class BlockTablesMachine(RuleBasedStateMachine):
    """One `BlockTables` and its host model; every rule checks what it can see."""

    @initialize(kwargs=configs())
    def build(self, kwargs: dict) -> None:
        self.bt = BlockTables(device=CPU, **kwargs)
        self.cfg = BlockTablesConfig(**kwargs)
        self.ref = ReferenceBlockTables(self.cfg)
        self.groups = self.cfg.num_kv_cache_groups
        shapes = [(self.cfg.max_num_reqs, m) for m in self.cfg.max_num_blocks_per_group]
        self.tables = [np.zeros(s, dtype=np.int64) for s in shapes]
        self.known = [np.zeros(s, dtype=bool) for s in shapes]
        self.dirty = 0
        self.slots = np.full((self.groups, self.cfg.max_num_batched_tokens), PAD_SLOT_ID)
        self.slots_known = False
        self.staged = False

    # ------------------------------------------------------------ writes

    def _append(self, row: int, ids: tuple[list[int], ...], overwrite: bool) -> None:
        try:
            self.ref.append_block_ids(row, ids, overwrite)
        except RuntimeError:
            before = self.bt.num_blocks.np.copy()
            with pytest.raises(RuntimeError):
                self.bt.append_block_ids(row, ids, overwrite)
            np.testing.assert_array_equal(self.bt.num_blocks.np, before)
            return
        self.bt.append_block_ids(row, ids, overwrite)
        self.staged = True

    def _ids(self, data, max_len: int = 3) -> tuple[list[int], ...]:
        return tuple(
            data.draw(st.lists(st.integers(1, MAX_ID), max_size=max_len))
            for _ in range(self.groups)
        )

    @rule(data=st.data(), overwrite=st.booleans())
    def append(self, data, overwrite: bool) -> None:
        """One append; over capacity it must raise and change nothing (checked after apply)."""
        row = data.draw(st.integers(0, self.cfg.max_num_reqs - 1))
        self._append(row, self._ids(data, max_len=5), overwrite)

    @rule(data=st.data())
    def append_same_row_several_times(self, data) -> None:
        """Several appends to one row before one apply: the latest write of an entry wins."""
        row = data.draw(st.integers(0, self.cfg.max_num_reqs - 1))
        for _ in range(data.draw(st.integers(2, 3))):
            self._append(row, self._ids(data), data.draw(st.booleans()))

    @rule(flag=st.booleans())
    def redirect(self, flag: bool) -> None:
        self.bt.redirect_writes_to_null_block = flag
        self.ref.redirect_writes_to_null_block = flag

    @rule()
    def apply(self) -> None:
        self.bt.apply_staged_writes()
        self.staged = False
        counts = self.ref.num_blocks
        np.testing.assert_array_equal(self.bt.num_blocks.gpu.numpy(), counts)
        for g in range(self.groups):
            table = self.bt.block_tables[g].gpu.numpy()
            for r in range(self.cfg.max_num_reqs):
                n = counts[g, r]
                np.testing.assert_array_equal(table[r, :n], self.ref.tables[g][r, :n])

    @invariant()
    def host_counts_advance_at_once(self) -> None:
        if hasattr(self, "bt"):
            np.testing.assert_array_equal(self.bt.num_blocks.np, self.ref.num_blocks)

    # ------------------------------------------------------------ batches

    def _idx_mapping(self, data) -> list[int]:
        rows = data.draw(
            st.lists(st.integers(0, self.cfg.max_num_reqs - 1), unique=True, max_size=4)
        )
        dummies = data.draw(st.integers(0, 2))
        for _ in range(dummies):
            if len(rows) < self.cfg.max_num_reqs:
                rows.insert(data.draw(st.integers(0, len(rows))), -1)
        return rows

    def _nct(self, data) -> np.ndarray:
        span = max(self.cfg.max_num_blocks_per_group) * max(self.cfg.block_sizes) + 4
        return np.asarray(
            data.draw(
                st.lists(
                    st.integers(0, span),
                    min_size=self.cfg.max_num_reqs,
                    max_size=self.cfg.max_num_reqs,
                )
            )
        )

    @precondition(lambda self: not self.staged)
    @rule(data=st.data(), into_out=st.booleans(), with_ptrs=st.booleans(), mask=st.booleans())
    def gather(self, data, into_out: bool, with_ptrs: bool, mask: bool) -> None:
        idx = self._idx_mapping(data)
        nrp = data.draw(st.integers(len(idx), self.cfg.max_num_reqs))
        nct = self._nct(data) if mask else None
        nct_t = None if nct is None else i32(nct)
        if into_out:
            rows = data.draw(st.integers(nrp, self.cfg.max_num_reqs + 2))
            out = [
                torch.full((rows, m + 1), -7, dtype=torch.int32)
                for m in self.cfg.max_num_blocks_per_group
            ]
            ptrs = torch.tensor([t.data_ptr() for t in out], dtype=torch.uint64)
            got = self.bt.gather_block_tables(
                i32(idx),
                nrp,
                out=out,
                out_ptrs=ptrs if with_ptrs else None,
                num_computed_tokens=nct_t,
            )
            expected = self.ref.gathered_block_tables(np.asarray(idx), nrp, nct)
            for g, (values, defined) in enumerate(expected):
                actual = out[g][:nrp, : values.shape[1]].numpy()
                np.testing.assert_array_equal(actual[defined], values[defined])
                assert same_buffer(got[g], out[g]) and got[g].shape[0] == nrp
            self._check_persistent_tables()
            return
        num_rows = max(nrp, self.dirty)
        got = self.bt.gather_block_tables(i32(idx), nrp, num_computed_tokens=nct_t)
        expected = self.ref.gathered_block_tables(np.asarray(idx), num_rows, nct)
        for g, (values, defined) in enumerate(expected):
            self.tables[g][:num_rows] = values
            self.known[g][:num_rows] = defined
            persistent = self.bt.input_block_tables[g]
            assert same_buffer(got[g], persistent) and got[g].shape[0] == nrp
        self.dirty = nrp
        self._check_persistent_tables()

    def _check_persistent_tables(self) -> None:
        for g in range(self.groups):
            actual = self.bt.input_block_tables[g].numpy()
            np.testing.assert_array_equal(
                actual[self.known[g]], self.tables[g][self.known[g]], err_msg=f"group {g}"
            )

    @rule(data=st.data())
    def dummy_tables_then_profiling_run(self, data) -> None:
        """`get_dummy_block_tables(n)`, then a profiling pass writes ids into the views."""
        n = data.draw(st.integers(0, self.cfg.max_num_reqs))
        views = self.bt.get_dummy_block_tables(n)
        zeroed = max(n, self.dirty)
        for g in range(self.groups):
            self.tables[g][:zeroed] = 0
            self.known[g][:zeroed] = True
            assert same_buffer(views[g], self.bt.input_block_tables[g])
            assert views[g].shape[0] == n
        self._check_persistent_tables()
        for g in range(self.groups):
            first = data.draw(st.integers(1, MAX_ID - 64))
            width = views[g].shape[1]
            ids = (first + np.arange(n * width) % 64).reshape(n, width)
            views[g].copy_(torch.from_numpy(ids).to(torch.int32))
            self.tables[g][:n] = ids
        self.dirty = n

    # ------------------------------------------------------------ slot mappings

    def _covered(self, r: int) -> int:
        """Positions of row `r` whose blocks every enabled group holds."""
        cfg = self.cfg
        spans = [
            int(self.ref.num_blocks[g, r]) * cfg.block_sizes[g] * cfg.group_cp_size(g)
            for g in range(self.groups)
            if cfg.slot_mapping_enabled[g]
        ]
        return min(spans, default=16)

    @precondition(lambda self: not self.staged)
    @rule(data=st.data(), into_out=st.booleans())
    def compute_slot_mappings(self, data, into_out: bool) -> None:
        idx = self._idx_mapping(data)
        counts, positions = [], []
        budget = self.cfg.max_num_batched_tokens
        for r in idx:
            cover = self._covered(r) if r >= 0 else 2**40
            n = min(data.draw(st.integers(0, 4)), budget) if cover else 0
            budget -= n
            counts.append(n)
            positions += data.draw(
                st.lists(st.integers(0, cover - 1), min_size=n, max_size=n) if n else st.just([])
            )
        qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        num_tokens = int(qsl[-1])
        length = self.cfg.max_num_batched_tokens
        ntp = data.draw(st.integers(num_tokens, length))
        tail = data.draw(
            st.lists(st.integers(0, 2**40), min_size=ntp - num_tokens, max_size=ntp - num_tokens)
        )
        pos = torch.tensor(positions + tail, dtype=torch.int64)
        out_len = data.draw(st.integers(ntp, length + 3)) if into_out else length
        expected = self.ref.slot_mappings(np.asarray(idx), qsl, np.asarray(positions), out_len)
        if into_out:
            out = torch.full((self.groups, out_len), -5, dtype=torch.int64)
            got = self.bt.compute_slot_mappings(i32(idx), i32(qsl), pos, ntp, out=out)
            np.testing.assert_array_equal(out.numpy(), expected)
            assert same_buffer(got, out)
        else:
            got = self.bt.compute_slot_mappings(i32(idx), i32(qsl), pos, ntp)
            np.testing.assert_array_equal(self.bt.slot_mappings.numpy(), expected)
            self.slots, self.slots_known = expected, True
            assert same_buffer(got, self.bt.slot_mappings)
        assert tuple(got.shape) == (self.groups, ntp)
        self._check_persistent_slots()

    @rule(data=st.data())
    def dummy_slot_mappings(self, data) -> None:
        n = data.draw(st.integers(0, self.cfg.max_num_batched_tokens))
        got = self.bt.get_dummy_slot_mappings(n)
        self.slots = np.full_like(self.slots, PAD_SLOT_ID)
        self.slots_known = True
        assert same_buffer(got, self.bt.slot_mappings)
        assert tuple(got.shape) == (self.groups, n)
        self._check_persistent_slots()

    def _check_persistent_slots(self) -> None:
        if self.slots_known:
            np.testing.assert_array_equal(self.bt.slot_mappings.numpy(), self.slots)


BlockTablesMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=12,
    deadline=None,
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestBlockTablesStateful = BlockTablesMachine.TestCase
