"""Checks 1 to 4 of SPEC.md section 6: the slot mappings, token by token."""

from __future__ import annotations

import numpy as np

from ..contract import NULL_BLOCK_ID, PAD_SLOT_ID
from .violations import _PER_STEP_REPORTS, Violation, _slot
from .workload import Step


class _SlotChecks:
    """Checks 1-4 of `GroupChecker` (state lives there)."""

    def _check_slots(self, step: Step, expected: np.ndarray, actual: np.ndarray) -> list[Violation]:
        n = step.num_tokens
        rows, uids = step.token_rows()
        real = np.zeros(actual.shape[2], dtype=bool)
        real[:n] = uids >= 0
        found = []
        for g in range(self.num_groups):
            e, a = expected[:, g, :], actual[:, g, :]  # [cp, max_tokens]
            sharded = self.group_cp[g] > 1
            if self.enabled[g]:
                self._count_slots(g, e[:, real], a[:, real])
                if self.plot_group == g:
                    self._plot_points(step, a)
            bad = a != e
            if not bad.any():
                continue
            for check in (1, 2, 3):
                if check == 3:
                    mask = bad & ~real if self.enabled[g] else bad
                elif self.enabled[g] and (check == 1) == sharded:
                    mask = bad & real
                else:
                    continue
                for k, t in np.argwhere(mask)[:_PER_STEP_REPORTS].tolist():
                    found.append(self._slot_violation(check, step, g, k, t, e, a, rows, uids))
        return found

    def _count_slots(self, g: int, e: np.ndarray, a: np.ndarray) -> None:
        s = self.stats[g]
        epad, apad = e == PAD_SLOT_ID, a == PAD_SLOT_ID
        s[:, 0] += (~apad).sum(axis=1)
        s[:, 1] += (~epad).sum(axis=1)
        s[:, 2] += (~apad & epad).sum(axis=1)
        s[:, 3] += (apad & ~epad).sum(axis=1)
        s[:, 4] += (~apad & ~epad & (a != e)).sum(axis=1)

    def _slot_violation(
        self,
        check: int,
        step: Step,
        g: int,
        k: int,
        t: int,
        e: np.ndarray,
        a: np.ndarray,
        rows: np.ndarray,
        uids: np.ndarray,
    ) -> Violation:
        n = step.num_tokens
        exp, act = int(e[k, t]), int(a[k, t])
        v = Violation(
            check, "", step.index, group=g, token=t, rank=k, expected=_slot(exp), actual=_slot(act)
        )
        if t < n:
            v.row, v.request = int(rows[t]), int(uids[t])
            if uids[t] >= 0:
                v.position = int(step.positions[t])
        if check == 3:
            v.what = (
                "disabled group wrote a slot"
                if not self.enabled[g]
                else "dummy request's token wrote a slot"
                if t < n
                else f"padded tail (token {t} >= num_tokens {n}) is not PAD"
            )
        elif exp == PAD_SLOT_ID:
            owners = np.flatnonzero(e[:, t] != PAD_SLOT_ID).tolist()
            v.what = f"rank {k} wrote a token owned by rank {owners[0] if owners else '?'}"
        elif act == PAD_SLOT_ID:
            v.what = f"rank {k} wrote nothing for a token it must write"
        else:
            v.what = "wrong slot"
        return v

    def _plot_points(self, step: Step, a: np.ndarray) -> None:
        if self.workload.plot_uid is None or step.kind != "real":
            return
        _, uids = step.token_rows()
        toks = np.flatnonzero(uids == self.workload.plot_uid)
        i, k = np.nonzero(a[:, toks].T != PAD_SLOT_ID)  # token by token, ranks ascending
        self.plot_points += zip(step.positions[toks[i]].tolist(), k.tolist(), strict=True)

    def _pick_plot_group(self) -> int | None:
        sharded = [g for g in range(self.num_groups) if self.enabled[g] and self.group_cp[g] > 1]
        enabled = [g for g in range(self.num_groups) if self.enabled[g]]
        return (sharded or enabled or [None])[0]

    # ------------------------------------------------------------ check 4

    def _check_distinct(self, step: Step, actual: np.ndarray) -> list[Violation]:
        n = step.num_tokens
        rows, uids = step.token_rows()
        real = np.flatnonzero(uids >= 0)
        warmup = step.kind == "warmup"
        found = []
        for g in range(self.num_groups):
            if not self.enabled[g]:
                continue
            kbs, m = self.kernel_sizes[g], self.m[g]
            for k in range(self.cp_size):
                slots = actual[k, g, :n][real]
                written = slots != PAD_SLOT_ID
                toks, slots = real[written], slots[written]
                if not warmup:  # warm-up writes all land in the null block, by design
                    found += self._shared_slots(step, g, k, toks, slots, rows, uids)
                blocks = slots // kbs // m  # allocator blocks (SPEC.md 8.1)
                if warmup:
                    wrong = np.flatnonzero(blocks != NULL_BLOCK_ID)
                else:
                    get = self.holders[g].get
                    distinct, back = np.unique(blocks, return_inverse=True)  # a block per bs slots
                    owner = np.array([get(b, -1) for b in distinct.tolist()], dtype=np.int64)
                    wrong = np.flatnonzero(owner[back.reshape(-1)] != uids[toks])
                for i in wrong[:_PER_STEP_REPORTS].tolist():
                    t, b = int(toks[i]), int(blocks[i])
                    held = "the null block (warm-up)" if warmup else "a block of this request"
                    who = self.holders[g].get(b)
                    actual_desc = "a free block" if who is None else f"a block of request {who}"
                    found.append(
                        Violation(
                            4,
                            "slot lies outside the token's own blocks",
                            step.index,
                            g,
                            int(uids[t]),
                            int(rows[t]),
                            int(step.positions[t]),
                            t,
                            k,
                            expected=f"{held}",
                            actual=f"slot {int(slots[i])} in block {b}, {actual_desc}",
                        )
                    )
        return found

    def _shared_slots(
        self,
        step: Step,
        g: int,
        k: int,
        toks: np.ndarray,
        slots: np.ndarray,
        rows: np.ndarray,
        uids: np.ndarray,
    ) -> list[Violation]:
        order = np.argsort(slots, kind="stable")
        s = slots[order]
        dup = np.flatnonzero(s[1:] == s[:-1])
        found = []
        for i in dup[:_PER_STEP_REPORTS].tolist():
            t1, t2 = int(toks[order[i]]), int(toks[order[i + 1]])
            found.append(
                Violation(
                    4,
                    "two tokens of the step share a slot",
                    step.index,
                    g,
                    int(uids[t2]),
                    int(rows[t2]),
                    int(step.positions[t2]),
                    t2,
                    k,
                    expected="distinct slots",
                    actual=f"slot {int(s[i])} also written by token {t1} (request {int(uids[t1])} "
                    f"position {int(step.positions[t1])})",
                )
            )
        return found

    def _check_slot_model(self, step: Step, actual: np.ndarray, call: str) -> list[Violation]:
        """The persistent slot_mappings left as the last call that wrote them left it."""
        if self.slot_model is None:
            return []
        found = []
        bad = np.argwhere(actual != self.slot_model)
        for k, g, t in bad[:_PER_STEP_REPORTS].tolist():
            found.append(
                Violation(
                    3,
                    f"{call} changed the persistent slot_mappings",
                    step.index,
                    g,
                    token=t,
                    rank=k,
                    expected=_slot(int(self.slot_model[k, g, t])),
                    actual=_slot(int(actual[k, g, t])),
                )
            )
        return found
