"""One rank's step: drive the implementation through SPEC.md section 7's surface.

`_Executor` appends, applies, gathers and computes slot mappings for one step,
checks what one rank can see alone (returned views against the persistent
buffers, dummy views' addresses) and flattens the persistent outputs for the
CP group's leader (`split` undoes it there). The optional-argument paths and
a profiling run's writes are in `executor_paths`, the one-rank checks in
`executor_checks`.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from . import presets
from .executor_checks import _RankChecks
from .executor_paths import (  # noqa: F401 - the sentinels and profile_junk are re-exported
    SLOT_SENTINEL,
    TABLE_SENTINEL,
    _ArgumentPaths,
    profile_junk,
)
from .guarded import GuardedPool
from .violations import Violation
from .workload import Step


class _Executor(_ArgumentPaths, _RankChecks):
    """Drives one implementation instance through steps; checks what one rank can see.

    The caller-owned buffers and the fused read come from `_ArgumentPaths`,
    the checks of returned views and refused appends from `_RankChecks`.
    """

    def __init__(self, impl: object, preset: presets.Preset, device: torch.device) -> None:
        self.impl = impl
        self.device = device
        cfg = preset.config(0)
        self.num_groups = cfg.num_kv_cache_groups
        self.m = [preset.kernel_factor(g) for g in range(self.num_groups)]
        self.widths = [cfg.table_width(g) for g in range(self.num_groups)]  # kernel blocks
        self.max_reqs = cfg.max_num_reqs
        self.max_tokens = cfg.max_num_batched_tokens
        self.num_blocks = np.zeros((self.num_groups, self.max_reqs), dtype=np.int64)
        self.part = self.num_groups * self.max_tokens + self.max_reqs * sum(self.widths)
        self.size = 2 * self.part + 1  # persistent outputs, caller-owned outputs, a marker
        self.fused = callable(getattr(impl, "gather_and_compute_slot_mappings", None))
        self._aux_slots: torch.Tensor | None = None
        self._aux_tables: list[torch.Tensor] | None = None
        self.guard = GuardedPool(device)  # inputs and outs end at an unreadable page (CPU)

    def check_buffers(self) -> list[Violation]:
        """The persistent buffers' shapes: everything else relies on them."""
        impl, found = self.impl, []
        shape = tuple(getattr(impl.slot_mappings, "shape", ()))
        if shape != (self.num_groups, self.max_tokens):
            found.append(
                Violation(
                    3,
                    "slot_mappings has the wrong shape",
                    -1,
                    expected=str((self.num_groups, self.max_tokens)),
                    actual=str(shape),
                )
            )
        tables = list(impl.input_block_tables)
        for g in range(self.num_groups):
            shape = tuple(tables[g].shape) if g < len(tables) else None
            if shape != (self.max_reqs, self.widths[g]):
                found.append(
                    Violation(
                        6,
                        "input_block_tables has the wrong shape",
                        -1,
                        g,
                        expected=str((self.max_reqs, self.widths[g])),
                        actual=str(shape),
                    )
                )
        return found

    def run(self, step: Step) -> tuple[torch.Tensor, list[Violation], str]:
        """Execute `step`; returns (outputs flattened `[size]`, findings, digest).

        The flat outputs are the persistent slot mappings and tables, then the
        caller-owned buffers of this step (sentinel-filled when unused).
        The previous step's inputs are released here: its results are checked.
        """
        self.guard.release()
        self._aux_slots = None
        self._aux_tables = None
        found = self._dummy(step) if step.kind == "dummy" else self._real(step)
        return self._bulk(), found, self._digest(step)

    def _real(self, step: Step) -> list[Violation]:
        impl, dev = self.impl, self.device
        found: list[Violation] = []
        if step.kind == "warmup":
            impl.redirect_writes_to_null_block = True
        try:
            for a in step.appends:
                if a.expect_error:
                    found += self._refused_append(step.index, a)
                    continue
                impl.append_block_ids(a.row, tuple(list(ids) for ids in a.block_ids), a.overwrite)
                self._count(a.row, a.block_ids, a.overwrite)
        finally:
            if step.kind == "warmup":
                impl.redirect_writes_to_null_block = False
        impl.apply_staged_writes()
        # Every tensor handed over is a guarded copy: an access past its end faults.
        guard = self.guard.copy
        idx = guard(torch.from_numpy(step.idx_mapping).to(dev))
        nct = (
            None
            if step.num_computed_tokens is None
            else guard(torch.from_numpy(step.num_computed_tokens).to(dev))
        )
        qsl = guard(torch.from_numpy(step.query_start_loc).to(dev))
        pos = guard(torch.from_numpy(step.positions).to(dev))
        nrp, ntp = step.num_reqs_padded, step.num_tokens_padded
        if step.fused_read and self.fused:
            return found + self._fused(step, idx, qsl, pos, nct)
        out = out_ptrs = None
        if step.gather_out:
            out = self._aux_tables = self._caller_tables()
            if step.gather_out == 2:
                ptrs = [t.data_ptr() for t in out]
                out_ptrs = guard(torch.tensor(ptrs, dtype=torch.uint64, device=dev))
        if out is None:
            tables = impl.gather_block_tables(idx, nrp, num_computed_tokens=nct)
        else:
            tables = impl.gather_block_tables(
                idx, nrp, out=out, out_ptrs=out_ptrs, num_computed_tokens=nct
            )
        slot_out = None
        if step.slot_out:
            slot_out = self._aux_slots = self._caller_slots()
            slots = impl.compute_slot_mappings(idx, qsl, pos, ntp, out=slot_out)
        else:
            slots = impl.compute_slot_mappings(idx, qsl, pos, ntp)
        found += self._check_views(step.index, tables, nrp, False, out)
        found += self._check_slot_view(step.index, slots, ntp, False, slot_out)
        return found

    def _dummy(self, step: Step) -> list[Violation]:
        n_reqs, n_tokens = step.dummy_num_reqs, step.dummy_num_tokens
        tables = self.impl.get_dummy_block_tables(n_reqs)
        slots = self.impl.get_dummy_slot_mappings(n_tokens)
        found = self._check_views(step.index, tables, n_reqs, True)
        found += self._check_slot_view(step.index, slots, n_tokens, True)
        if not found:
            found += self._dummy_contents(step.index, tables, slots)
        if step.profile and not found:
            # A profiling run fills what it was handed before the next real step.
            junk_tables, junk_slots = profile_junk(step, self.widths, self.num_groups)
            for g, t in enumerate(tables):
                t.copy_(torch.from_numpy(junk_tables[g]).to(t.dtype))
            slots.copy_(torch.from_numpy(junk_slots).to(slots.dtype))
        return found

    def _count(self, row: int, ids: tuple, overwrite: bool) -> None:
        for g, x in enumerate(ids):
            n = len(x) * self.m[g]  # counts are in kernel blocks (SPEC.md 8.1)
            self.num_blocks[g, row] = (0 if overwrite else self.num_blocks[g, row]) + n

    def _bulk(self) -> torch.Tensor:
        impl = self.impl
        aux_slots = self._aux_slots if self._aux_slots is not None else self._sentinel_slots()
        aux_tables = self._aux_tables if self._aux_tables is not None else self._sentinel_tables()
        parts = [impl.slot_mappings.reshape(-1).to(torch.int64)]
        parts += [t.reshape(-1).to(torch.int64) for t in impl.input_block_tables]
        parts += [aux_slots.reshape(-1)]
        parts += [t.reshape(-1).to(torch.int64) for t in aux_tables]
        parts += [torch.zeros(1, dtype=torch.int64, device=self.device)]
        return torch.cat([p.to(self.device) for p in parts])

    def empty_bulk(self) -> torch.Tensor:
        return torch.full((self.size,), -1, dtype=torch.int64, device=self.device)

    def _digest(self, step: Step) -> str:
        """Hash of the gathered tables' defined part (entries past a row's blocks excluded)."""
        h = hashlib.sha256()
        rows = step.dummy_num_reqs if step.kind == "dummy" else step.num_reqs_padded
        for g, t in enumerate(self.impl.input_block_tables):
            a = t[:rows].cpu().numpy().astype(np.int64)
            if step.kind != "dummy":
                for b, r in enumerate(step.idx_mapping.tolist()):
                    if r >= 0:
                        a[b, self.num_blocks[g, r] :] = 0
            h.update(a.tobytes())
        return h.hexdigest()[:16]

    def split(self, parts: list[torch.Tensor]) -> tuple[np.ndarray, list[np.ndarray]]:
        """Leader side: slots `[cp, groups, max_tokens]`, per group tables `[cp, rows, width]`."""
        return self.split_all(parts)[0]

    def split_all(
        self, parts: list[torch.Tensor]
    ) -> tuple[tuple[np.ndarray, list[np.ndarray]], tuple[np.ndarray, list[np.ndarray]]]:
        """Leader side: the persistent `(slots, tables)` and the caller-owned ones."""
        flat = torch.stack(parts).cpu().numpy()
        return self._unpack(flat, 0), self._unpack(flat, self.part)

    def _unpack(self, flat: np.ndarray, at: int) -> tuple[np.ndarray, list[np.ndarray]]:
        cp = flat.shape[0]
        n = self.num_groups * self.max_tokens
        slots = flat[:, at : at + n].reshape(cp, self.num_groups, self.max_tokens)
        tables, at = [], at + n
        for w in self.widths:
            tables.append(flat[:, at : at + self.max_reqs * w].reshape(cp, self.max_reqs, w))
            at += self.max_reqs * w
        return slots, tables
