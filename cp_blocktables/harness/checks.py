"""The seven checks of SPEC.md section 6, applied to one CP group's outputs step by step.

`GroupChecker` runs on the CP group's leader. Each step it receives every
rank's persistent outputs (slot mappings `[groups, max_num_batched_tokens]`
and forward-pass tables `[max_num_reqs, width]` per group) and compares them
with `cp_blocktables.reference`, the only source of expected values. It also
keeps, per rank and group, a sparse model of the KV cache (slot -> tag of
request and position) written through the slot mappings the implementation
produced, and reads every request back through section 2's read rule when the
request finishes (check 5).

The checker never looks at the implementation's internals, and it learns
which request holds which block from the workload, not from the tables.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from .. import reference
from ..contract import PAD_SLOT_ID
from .checks_kv import _KvChecks
from .checks_slots import _SlotChecks
from .checks_tables import _TableChecks
from .device_checks import DeviceChecker
from .presets import Preset
from .violations import (  # noqa: F401 - re-exported: checks is where callers look
    _PER_STEP_REPORTS,
    _TAG_SHIFT,
    CHECKS,
    STAT_FIELDS,
    Violation,
    _slot,
    _tag,
    _untag,
    agreement_violations,
)
from .workload import Finished, Step, Workload


class GroupChecker(_SlotChecks, _KvChecks, _TableChecks):
    """Checks one CP group's run of one workload; lives on the group's leader.

    Stats are per group and CP rank (`STAT_FIELDS`); `violations` keeps the
    first few per check, group and step (all are counted in `counts`).
    """

    def __init__(
        self,
        preset: Preset,
        workload: Workload,
        max_kept: int = 200,
        device: torch.device | str | None = None,
    ) -> None:
        self.preset = preset
        self.workload = workload
        self.cp_size = preset.cp_size
        self.cfgs = [preset.config(k) for k in range(self.cp_size)]
        self.refs = [reference.ReferenceBlockTables(c) for c in self.cfgs]
        cfg = self.cfgs[0]
        self.num_groups = cfg.num_kv_cache_groups
        self.block_sizes = cfg.block_sizes
        self.kernel_sizes = cfg.kernel_block_sizes
        self.m = [preset.kernel_factor(g) for g in range(self.num_groups)]
        rules = self.refs[0].rules  # read from the raw arguments, never the contract's helpers
        self.group_cp = rules.group_cp
        self.enabled = cfg.slot_mapping_enabled
        self.reach = rules.reach
        self.kv = [[{} for _ in range(self.num_groups)] for _ in range(self.cp_size)]
        self.holders: list[dict[int, int]] = [{} for _ in range(self.num_groups)]
        self.req_blocks: dict[int, list[list[int]]] = {}
        self.req_dead: dict[int, list[set[int]]] = {}
        self._init_table_model(cfg)
        self.slot_model: np.ndarray | None = None  # persistent slot_mappings, [cp, groups, n]
        self.stats = np.zeros((self.num_groups, self.cp_size, len(STAT_FIELDS)), dtype=np.int64)
        self.violations: list[Violation] = []
        self.counts: Counter[int] = Counter()
        self.max_kept = max_kept
        self.steps_checked = 0
        self.tokens_checked = 0
        self.first_failed_step: int | None = None
        self.plot_group = self._pick_plot_group()
        self.plot_points: list[tuple[int, int]] = []
        # With a device, checks run as torch reductions there (`device_checks`); the host
        # checks below then only word what the device found, and run dummy steps.
        self.dev = None if device is None else DeviceChecker(self, torch.device(device))

    # ------------------------------------------------------------ entry points

    def forget_persistent(self) -> None:
        """The implementation's device memory was discarded (sleep mode, SPEC.md 8.4):
        the persistent forward-pass tables and slot mappings hold nothing defined
        until a call writes them again, so no check compares against their past."""
        if self.dev is not None:
            self.dev.pull()
        self.slot_model = None
        for defined in self.table_defined:
            defined[:] = False

    def check_step(
        self,
        step: Step,
        slots: np.ndarray,
        tables: list[np.ndarray],
        local: list[Violation],
        digests: list[str],
        aux: tuple[np.ndarray, list[np.ndarray]] | None = None,
    ) -> list[Violation]:
        """Every check of one step.

        `slots` `[cp, groups, max_tokens]`, `tables[g]` `[cp, rows, w]`: the
        persistent buffers after the step; `aux`: the caller-owned buffers the
        step passed as `out` (same shapes), when it did. numpy arrays, or with
        a device checker torch tensors (`device_checks.split_on_device`).
        """
        found = list(local)
        found += agreement_violations(
            [{"block_table_digest": d} for d in digests], "gathered block tables", step.index
        )
        self._apply_events(step)
        if self.dev is not None:
            self.dev.mirror(step)
            found += self.dev.check(step, slots, tables, aux)
        else:
            found += self._host_body(step, slots, tables, aux)
        self.steps_checked += 1
        self.record(found)
        return found

    def _host_body(
        self,
        step: Step,
        slots: np.ndarray,
        tables: list[np.ndarray],
        aux: tuple[np.ndarray, list[np.ndarray]] | None,
    ) -> list[Violation]:
        """Checks 1-6 of one step in numpy, after the step's events are applied."""
        found = []
        if step.kind == "dummy":
            found += self._check_dummy(step, slots, tables)
        else:
            expected = np.stack(
                [
                    ref.slot_mappings(
                        step.idx_mapping, step.query_start_loc, step.positions, slots.shape[2]
                    )
                    for ref in self.refs
                ]
            )
            produced = slots
            if step.slot_out and aux is not None:
                produced = aux[0]
                found += self._check_slot_model(step, slots, "compute_slot_mappings(out=...)")
            else:
                self.slot_model = expected
            found += self._check_slots(step, expected, produced)
            found += self._check_distinct(step, produced)
            out_tables = aux[1] if step.gather_out and aux is not None else None
            found += self._check_tables(step, tables, out_tables)
            if step.kind == "real":
                self._write_kv(step, produced)
                found += self._read_back_host(step.index, step.finished)
                self.tokens_checked += int(
                    (step.uids >= 0).astype(np.int64) @ np.diff(step.query_start_loc)
                )
        return found

    def read_back(self, step_index: int, finished: list[Finished]) -> list[Violation]:
        """Check 5 for requests whose last token is written: read every rank back."""
        if self.dev is not None:
            return self.dev.read_back(step_index, finished)
        return self._read_back_host(step_index, finished)

    def _read_back_host(self, step_index: int, finished: list[Finished]) -> list[Violation]:
        found = []
        for req in finished:
            for g in range(self.num_groups):
                if self.enabled[g]:
                    found += self._read_request(step_index, req, g)
        return found

    def record(self, found: list[Violation]) -> None:
        for v in found:
            self.counts[v.check] += 1
            if len(self.violations) < self.max_kept:
                self.violations.append(v)
        if found and self.first_failed_step is None:
            self.first_failed_step = found[0].step

    # ------------------------------------------------------------ ledger

    def _apply_events(self, step: Step) -> None:
        """Releases, then appends, then prefix seeding: the workload's view of this step."""
        gone = set()
        for rel in step.releases:
            for b in rel.block_ids:
                if self.holders[rel.group].get(b) == rel.uid:
                    del self.holders[rel.group][b]
            if rel.reason == "window":
                self.req_dead[rel.uid][rel.group].update(rel.columns)
            else:
                gone.add(rel.uid)
        for uid in gone:
            self.req_blocks.pop(uid, None)
            self.req_dead.pop(uid, None)
        warmup = step.kind == "warmup"
        for ref in self.refs:
            ref.redirect_writes_to_null_block = warmup
            for a in step.appends:
                try:
                    ref.append_block_ids(a.row, [list(ids) for ids in a.block_ids], a.overwrite)
                except RuntimeError:
                    if not a.expect_error:
                        raise
                else:
                    if a.expect_error:
                        raise AssertionError(f"the reference accepted a refused append {a}")
            ref.redirect_writes_to_null_block = False
        if warmup:
            return
        for a in step.appends:
            if not a.ledger:
                continue
            if a.overwrite:
                self.req_blocks[a.uid] = [[] for _ in range(self.num_groups)]
                self.req_dead[a.uid] = [set() for _ in range(self.num_groups)]
            for g, ids in enumerate(a.block_ids):
                self.req_blocks[a.uid][g].extend(ids)
                for b in ids:
                    self.holders[g][b] = a.uid
        for req in step.admitted:
            if req.prefix_len and not req.read_from:
                self._seed_prefix(req)

    def _seed_prefix(self, req: Finished) -> None:
        """Prefix-cached positions were written by an earlier request: put them in the caches.

        Not for a far start (`Finished.read_from`): its prefix may pass 2**31 positions,
        and check 5 reads none of it.
        """
        pos = np.arange(req.prefix_len, dtype=np.int64)
        for g in range(self.num_groups):
            if not self.enabled[g]:
                continue
            row = np.asarray(self.req_blocks[req.uid][g], dtype=np.int64)
            for k in range(self.cp_size):
                kk = k if self.group_cp[g] > 1 else 0
                slots = reference.slots_for_positions(
                    row,
                    pos,
                    self.block_sizes[g],
                    self.group_cp[g],
                    kk,
                    self.preset.cp_interleave,
                    kernel_block_size=self.kernel_sizes[g],
                )
                mine = slots != PAD_SLOT_ID
                tags = (req.uid << _TAG_SHIFT) | pos[mine]
                cache = self.kv[k][g]
                if self.dev is not None:  # a DeviceKv: the arrays in one write
                    cache.put(torch.from_numpy(slots[mine]), torch.from_numpy(tags))
                else:
                    cache.update(zip(slots[mine].tolist(), tags.tolist(), strict=True))

    # ------------------------------------------------------------ results

    def stat_rows(self, ranks: list[int]) -> list[dict]:
        out = []
        for g in range(self.num_groups):
            for k in range(self.cp_size):
                row = {"group": g, "cp_rank": k, "rank": ranks[k]}
                row.update({f: int(self.stats[g, k, i]) for i, f in enumerate(STAT_FIELDS)})
                out.append(row)
        return out
