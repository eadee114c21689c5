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

from ..contract import PAD_SLOT_ID
from . import presets
from .violations import Violation
from .workload import Step


class _Executor:
    """Drives one implementation instance through steps; checks what one rank can see."""

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
        """
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
        idx = torch.from_numpy(step.idx_mapping).to(dev)
        nct = (
            None
            if step.num_computed_tokens is None
            else torch.from_numpy(step.num_computed_tokens).to(dev)
        )
        qsl = torch.from_numpy(step.query_start_loc).to(dev)
        pos = torch.from_numpy(step.positions).to(dev)
        nrp, ntp = step.num_reqs_padded, step.num_tokens_padded
        if step.fused_read and self.fused:
            return found + self._fused(step, idx, qsl, pos, nct)
        out = out_ptrs = None
        if step.gather_out:
            out = self._aux_tables = self._sentinel_tables()
            if step.gather_out == 2:
                out_ptrs = torch.tensor([t.data_ptr() for t in out], dtype=torch.uint64, device=dev)
        if out is None:
            tables = impl.gather_block_tables(idx, nrp, num_computed_tokens=nct)
        else:
            tables = impl.gather_block_tables(
                idx, nrp, out=out, out_ptrs=out_ptrs, num_computed_tokens=nct
            )
        slot_out = None
        if step.slot_out:
            slot_out = self._aux_slots = self._sentinel_slots()
            slots = impl.compute_slot_mappings(idx, qsl, pos, ntp, out=slot_out)
        else:
            slots = impl.compute_slot_mappings(idx, qsl, pos, ntp)
        found += self._check_views(step.index, tables, nrp, False, out)
        found += self._check_slot_view(step.index, slots, ntp, False, slot_out)
        return found

    def _fused(self, step: Step, idx, qsl, pos, nct) -> list[Violation]:
        """SPEC.md 8.2 on the persistent buffers, then the two calls into caller-owned buffers:
        the leader checks the first against the reference, and here both must agree."""
        impl, nrp, ntp = self.impl, step.num_reqs_padded, step.num_tokens_padded
        tables, slots = impl.gather_and_compute_slot_mappings(
            idx, nrp, qsl, pos, ntp, num_computed_tokens=nct
        )
        found = self._check_views(step.index, tables, nrp, False)
        found += self._check_slot_view(step.index, slots, ntp, False)
        if found:
            return found
        out, slot_out = self._sentinel_tables(), self._sentinel_slots()
        two = impl.gather_block_tables(idx, nrp, out=out, num_computed_tokens=nct)
        impl.compute_slot_mappings(idx, qsl, pos, ntp, out=slot_out)
        for g, (a, b) in enumerate(zip(tables, two, strict=True)):
            if not torch.equal(self._defined(step, g, a), self._defined(step, g, b)):
                found.append(
                    Violation(
                        6,
                        "gather_and_compute_slot_mappings returned other tables than "
                        "gather_block_tables",
                        step.index,
                        g,
                    )
                )
        if not torch.equal(slots.to(torch.int64), slot_out[:, :ntp].to(torch.int64)):
            found.append(
                Violation(
                    3,
                    "gather_and_compute_slot_mappings returned other slots than "
                    "compute_slot_mappings",
                    step.index,
                )
            )
        return found

    def _defined(self, step: Step, g: int, t: torch.Tensor) -> torch.Tensor:
        """Table rows with entries past each real row's count zeroed (those are never read)."""
        a = t.to(torch.int64).cpu().clone()
        for b, r in enumerate(step.idx_mapping.tolist()):
            if r >= 0:
                a[b, int(self.num_blocks[g, r]) :] = 0
        return a

    def _refused_append(self, s: int, a) -> list[Violation]:
        """An append past some group's capacity: `RuntimeError`, nothing staged (SPEC.md 3)."""
        what = "append_block_ids past a row's capacity"
        try:
            self.impl.append_block_ids(a.row, tuple(list(ids) for ids in a.block_ids), a.overwrite)
        except RuntimeError:
            return []
        except Exception as e:  # noqa: BLE001 - the wrong exception is a finding
            return [
                Violation(
                    8,
                    f"{what} raised {type(e).__name__} instead of RuntimeError: {e}",
                    s,
                    row=a.row,
                    request=a.uid,
                    expected="RuntimeError",
                    actual=type(e).__name__,
                )
            ]
        return [
            Violation(
                8,
                f"{what} did not raise",
                s,
                row=a.row,
                request=a.uid,
                expected="RuntimeError",
                actual="returned normally",
            )
        ]

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

    def _dummy_contents(self, s: int, tables, slots: torch.Tensor) -> list[Violation]:
        """What a dummy run hands out holds no block id and no slot (before anyone writes)."""
        found = []
        for g, t in enumerate(tables):
            if bool((t != 0).any()):
                found.append(
                    Violation(6, "get_dummy_block_tables handed out rows that are not zero", s, g)
                )
        if bool((self.impl.slot_mappings != PAD_SLOT_ID).any()):
            found.append(
                Violation(3, "get_dummy_slot_mappings left a non-PAD entry in slot_mappings", s)
            )
        return found

    def _count(self, row: int, ids: tuple, overwrite: bool) -> None:
        for g, x in enumerate(ids):
            n = len(x) * self.m[g]  # counts are in kernel blocks (SPEC.md 8.1)
            self.num_blocks[g, row] = (0 if overwrite else self.num_blocks[g, row]) + n

    def _check_views(
        self, s: int, tables: object, rows: int, same_ptr: bool, out: list | None = None
    ) -> list[Violation]:
        persistent = self.impl.input_block_tables if out is None else out
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
                what = "input_block_tables" if out is None else "the caller's out"
                found.append(Violation(6, f"returned table differs from {what}[:{rows}]", s, g))
        return found

    def _check_slot_view(
        self, s: int, slots: torch.Tensor, n: int, same_ptr: bool, out: torch.Tensor | None = None
    ) -> list[Violation]:
        buf = self.impl.slot_mappings if out is None else out
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
            what = "slot_mappings" if out is None else "the caller's out"
            return [Violation(3, f"returned slot mapping differs from {what}[:, :{n}]", s)]
        return []

    def _sentinel_tables(self) -> list[torch.Tensor]:
        return [
            torch.full((self.max_reqs, w), TABLE_SENTINEL, dtype=torch.int32, device=self.device)
            for w in self.widths
        ]

    def _sentinel_slots(self) -> torch.Tensor:
        shape = (self.num_groups, self.max_tokens)
        return torch.full(shape, SLOT_SENTINEL, dtype=torch.int64, device=self.device)

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


TABLE_SENTINEL = 0x3C3C3C3C
"""What the harness fills caller-owned tables with: rows a gather must not touch keep it."""

SLOT_SENTINEL = -0x3C3C3C3C
"""What the harness fills a caller-owned slot buffer with: every entry must be overwritten."""


def profile_junk(step: Step, widths: list[int], num_groups: int):
    """Block ids and slots a profiling run writes into the views a dummy run handed out.

    `(tables, slots)`: per group `[dummy_num_reqs, width]` (a random prefix of each row
    filled with ids, the rest zero) and `[groups, dummy_num_tokens]`. Deterministic in
    the step, so the leader knows what every rank wrote.
    """
    rng = np.random.default_rng(step.profile_seed)
    n = step.dummy_num_reqs
    tables = []
    for w in widths:
        t = np.zeros((n, w), dtype=np.int64)
        cols = rng.integers(1, w + 1, n)
        ids = rng.integers(1, 2**31 - 1, (n, w))
        t[np.arange(w)[None, :] < cols[:, None]] = ids[np.arange(w)[None, :] < cols[:, None]]
        tables.append(t)
    slots = rng.integers(0, 2**40, (num_groups, step.dummy_num_tokens))
    return tables, slots
