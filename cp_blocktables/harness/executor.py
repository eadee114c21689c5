"""One rank's step: drive the implementation through SPEC.md section 7's surface.

`_Executor` appends, applies, gathers and computes slot mappings for one step,
checks what one rank can see alone (returned views against the persistent
buffers, dummy views' addresses) and flattens the persistent outputs for the
CP group's leader (`split` undoes it there).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from . import presets
from .checks import Violation
from .workload import Step


class _Executor:
    """Drives one implementation instance through steps; checks what one rank can see."""

    def __init__(self, impl: object, preset: presets.Preset, device: torch.device) -> None:
        self.impl = impl
        self.device = device
        cfg = preset.config(0)
        self.num_groups = cfg.num_kv_cache_groups
        self.widths = cfg.max_num_blocks_per_group
        self.max_reqs = cfg.max_num_reqs
        self.max_tokens = cfg.max_num_batched_tokens
        self.num_blocks = np.zeros((self.num_groups, self.max_reqs), dtype=np.int64)
        self.size = self.num_groups * self.max_tokens + self.max_reqs * sum(self.widths)

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
        """Execute `step`; returns (persistent outputs flattened `[size]`, findings, digest)."""
        found = self._dummy(step) if step.kind == "dummy" else self._real(step)
        return self._bulk(), found, self._digest(step)

    def _real(self, step: Step) -> list[Violation]:
        impl, dev = self.impl, self.device
        if step.kind == "warmup":
            impl.redirect_writes_to_null_block = True
        try:
            for a in step.appends:
                impl.append_block_ids(a.row, tuple(list(ids) for ids in a.block_ids), a.overwrite)
                self._count(a.row, a.block_ids, a.overwrite)
        finally:
            if step.kind == "warmup":
                impl.redirect_writes_to_null_block = False
        impl.apply_staged_writes()
        idx = torch.from_numpy(step.idx_mapping).to(dev)
        nct = (
            None
            if step.num_computed_tokens is None
            else torch.from_numpy(step.num_computed_tokens).to(dev)
        )
        tables = impl.gather_block_tables(idx, step.num_reqs_padded, num_computed_tokens=nct)
        qsl = torch.from_numpy(step.query_start_loc).to(dev)
        pos = torch.from_numpy(step.positions).to(dev)
        slots = impl.compute_slot_mappings(idx, qsl, pos, step.num_tokens_padded)
        return self._check_views(
            step.index, tables, step.num_reqs_padded, False
        ) + self._check_slot_view(step.index, slots, step.num_tokens_padded, False)

    def _dummy(self, step: Step) -> list[Violation]:
        tables = self.impl.get_dummy_block_tables(step.dummy_num_reqs)
        slots = self.impl.get_dummy_slot_mappings(step.dummy_num_tokens)
        return self._check_views(
            step.index, tables, step.dummy_num_reqs, True
        ) + self._check_slot_view(step.index, slots, step.dummy_num_tokens, True)

    def _count(self, row: int, ids: tuple, overwrite: bool) -> None:
        for g, x in enumerate(ids):
            self.num_blocks[g, row] = (0 if overwrite else self.num_blocks[g, row]) + len(x)

    def _check_views(self, s: int, tables: object, rows: int, same_ptr: bool) -> list[Violation]:
        persistent = self.impl.input_block_tables
        tables = list(tables)
        if len(tables) != self.num_groups:
            return [Violation(6, f"returned {len(tables)} tables for {self.num_groups} groups", s)]
        found = []
        for g, t in enumerate(tables):
            if tuple(t.shape) != (rows, self.widths[g]):
                found.append(
                    Violation(
                        6,
                        "returned table has the wrong shape",
                        s,
                        g,
                        expected=str((rows, self.widths[g])),
                        actual=str(tuple(t.shape)),
                    )
                )
            elif same_ptr and t.data_ptr() != persistent[g].data_ptr():
                found.append(
                    Violation(
                        6,
                        "get_dummy_block_tables returned a tensor that is not "
                        "a view of input_block_tables",
                        s,
                        g,
                    )
                )
            elif not torch.equal(t.to(torch.int64), persistent[g][:rows].to(torch.int64)):
                found.append(
                    Violation(6, f"returned table differs from input_block_tables[:{rows}]", s, g)
                )
        return found

    def _check_slot_view(
        self, s: int, slots: torch.Tensor, n: int, same_ptr: bool
    ) -> list[Violation]:
        buf = self.impl.slot_mappings
        if tuple(slots.shape) != (self.num_groups, n):
            return [
                Violation(
                    3,
                    "returned slot mapping has the wrong shape",
                    s,
                    expected=str((self.num_groups, n)),
                    actual=str(tuple(slots.shape)),
                )
            ]
        if same_ptr and slots.data_ptr() != buf.data_ptr():
            return [
                Violation(
                    3,
                    "get_dummy_slot_mappings returned a tensor that is not a view of slot_mappings",
                    s,
                )
            ]
        if not torch.equal(slots.to(torch.int64), buf[:, :n].to(torch.int64)):
            return [Violation(3, f"returned slot mapping differs from slot_mappings[:, :{n}]", s)]
        return []

    def _bulk(self) -> torch.Tensor:
        impl = self.impl
        parts = [impl.slot_mappings.reshape(-1).to(torch.int64)]
        parts += [t.reshape(-1).to(torch.int64) for t in impl.input_block_tables]
        return torch.cat(parts)

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
        flat = torch.stack(parts).cpu().numpy()
        n = self.num_groups * self.max_tokens
        slots = flat[:, :n].reshape(len(parts), self.num_groups, self.max_tokens)
        tables, at = [], n
        for w in self.widths:
            tables.append(
                flat[:, at : at + self.max_reqs * w].reshape(len(parts), self.max_reqs, w)
            )
            at += self.max_reqs * w
        return slots, tables
