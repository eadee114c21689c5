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
from dataclasses import asdict, dataclass

import numpy as np

from .. import reference
from ..contract import NULL_BLOCK_ID, PAD_SLOT_ID
from .presets import Preset
from .workload import Finished, Step, Workload

CHECKS = {
    0: "implementation raised an error",
    1: "sharded group: exactly one rank, the owner, writes each token at section 2's slot",
    2: "unsharded group or cp_size 1: every rank writes section 2's slot",
    3: "PAD_SLOT_ID for disabled groups, dummy tokens and the padded tail",
    4: "no two tokens share a slot; each slot lies in a block of the token's own request",
    5: "KV round trip: every position read back once, on its owner, no foreign token",
    6: "gathered block tables: copied rows, zero dummy/padding/stale rows, window masking",
    7: "configs, workload and block tables agree across ranks",
}

_TAG_SHIFT = 40
_PER_STEP_REPORTS = 4
"""Violations recorded per check, group and step: enough to see the pattern, not a flood."""

STAT_FIELDS = (
    "owned",
    "expected",
    "duplicates",
    "misses",
    "wrong_slots",
    "read_back",
    "read_expected",
)


@dataclass
class Violation:
    """One broken expectation, with everything needed to find it again."""

    check: int
    what: str
    step: int
    group: int | None = None
    request: int | None = None
    row: int | None = None
    position: int | None = None
    token: int | None = None
    rank: int | None = None
    expected: str = ""
    actual: str = ""

    def describe(self) -> str:
        where = [f"step {self.step}"]
        for name in ("group", "request", "row", "position", "token", "rank"):
            value = getattr(self, name)
            if value is not None:
                where.append(f"{name} {value}")
        text = f"check {self.check} ({CHECKS[self.check]}): {self.what} [{', '.join(where)}]"
        if self.expected or self.actual:
            text += f"; expected {self.expected}, actual {self.actual}"
        return text

    def as_dict(self) -> dict:
        return asdict(self)


def _tag(uid: int, position: int) -> int:
    return (uid << _TAG_SHIFT) | position


def _untag(tag: int | None) -> str:
    if tag is None:
        return "nothing written"
    return f"request {tag >> _TAG_SHIFT} position {tag & ((1 << _TAG_SHIFT) - 1)}"


def _slot(value: int) -> str:
    return "PAD_SLOT_ID" if value == PAD_SLOT_ID else f"slot {value}"


def agreement_violations(
    entries: list[dict], what: str, step: int, ranks: list[int] | None = None
) -> list[Violation]:
    """Check 7: every field of `entries` (one dict per rank) must agree with the majority."""
    ranks = ranks if ranks is not None else list(range(len(entries)))
    out = []
    fields = sorted({k for e in entries for k in e})
    for name in fields:
        values = [repr(e.get(name, "<missing>")) for e in entries]
        if len(set(values)) == 1:
            continue
        majority, _ = Counter(values).most_common(1)[0]
        for rank, v in zip(ranks, values, strict=True):
            if v != majority:
                out.append(
                    Violation(
                        7,
                        f"{what}: field {name!r} differs between ranks ("
                        + ", ".join(f"rank {r}: {x}" for r, x in zip(ranks, values, strict=True))
                        + ")",
                        step,
                        rank=rank,
                        expected=majority,
                        actual=v,
                    )
                )
    return out


class GroupChecker:
    """Checks one CP group's run of one workload; lives on the group's leader.

    Stats are per group and CP rank (`STAT_FIELDS`); `violations` keeps the
    first few per check, group and step (all are counted in `counts`).
    """

    def __init__(self, preset: Preset, workload: Workload, max_kept: int = 200) -> None:
        self.preset = preset
        self.workload = workload
        self.cp_size = preset.cp_size
        self.cfgs = [preset.config(k) for k in range(self.cp_size)]
        self.refs = [reference.ReferenceBlockTables(c) for c in self.cfgs]
        cfg = self.cfgs[0]
        self.num_groups = cfg.num_kv_cache_groups
        self.block_sizes = cfg.block_sizes
        self.group_cp = [cfg.group_cp_size(g) for g in range(self.num_groups)]
        self.enabled = cfg.slot_mapping_enabled
        self.reach = cfg.effective_sliding_window_reach()
        self.kv = [[{} for _ in range(self.num_groups)] for _ in range(self.cp_size)]
        self.holders: list[dict[int, int]] = [{} for _ in range(self.num_groups)]
        self.req_blocks: dict[int, list[list[int]]] = {}
        self.req_dead: dict[int, list[set[int]]] = {}
        self.rows_high = 0
        self.stats = np.zeros((self.num_groups, self.cp_size, len(STAT_FIELDS)), dtype=np.int64)
        self.violations: list[Violation] = []
        self.counts: Counter[int] = Counter()
        self.max_kept = max_kept
        self.steps_checked = 0
        self.tokens_checked = 0
        self.first_failed_step: int | None = None
        self.plot_group = self._pick_plot_group()
        self.plot_points: list[tuple[int, int]] = []

    # ------------------------------------------------------------ entry points

    def check_step(
        self,
        step: Step,
        slots: np.ndarray,
        tables: list[np.ndarray],
        local: list[Violation],
        digests: list[str],
    ) -> list[Violation]:
        """Every check of one step.

        `slots` `[cp, groups, max_tokens]`, `tables[g]` `[cp, rows, w]`.
        """
        found = list(local)
        found += agreement_violations(
            [{"block_table_digest": d} for d in digests], "gathered block tables", step.index
        )
        self._apply_events(step)
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
            found += self._check_slots(step, expected, slots)
            found += self._check_distinct(step, slots)
            found += self._check_tables(step, tables)
            if step.kind == "real":
                self._write_kv(step, slots)
                found += self.read_back(step.index, step.finished)
                self.tokens_checked += int(
                    (step.uids >= 0).astype(np.int64) @ np.diff(step.query_start_loc)
                )
        self.steps_checked += 1
        self.record(found)
        return found

    def read_back(self, step_index: int, finished: list[Finished]) -> list[Violation]:
        """Check 5 for requests whose last token is written: read every rank back."""
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
                ref.append_block_ids(a.row, [list(ids) for ids in a.block_ids], a.overwrite)
            ref.redirect_writes_to_null_block = False
        if warmup:
            return
        for a in step.appends:
            if a.overwrite:
                self.req_blocks[a.uid] = [[] for _ in range(self.num_groups)]
                self.req_dead[a.uid] = [set() for _ in range(self.num_groups)]
            for g, ids in enumerate(a.block_ids):
                self.req_blocks[a.uid][g].extend(ids)
                for b in ids:
                    self.holders[g][b] = a.uid
        for req in step.admitted:
            if req.prefix_len:
                self._seed_prefix(req)

    def _seed_prefix(self, req: Finished) -> None:
        """Prefix-cached positions were written by an earlier request: put them in the caches."""
        pos = np.arange(req.prefix_len, dtype=np.int64)
        for g in range(self.num_groups):
            if not self.enabled[g]:
                continue
            row = np.asarray(self.req_blocks[req.uid][g], dtype=np.int64)
            for k in range(self.cp_size):
                kk = k if self.group_cp[g] > 1 else 0
                slots = reference.slots_for_positions(
                    row, pos, self.block_sizes[g], self.group_cp[g], kk, self.preset.cp_interleave
                )
                mine = slots != PAD_SLOT_ID
                tags = (req.uid << _TAG_SHIFT) | pos[mine]
                self.kv[k][g].update(zip(slots[mine].tolist(), tags.tolist(), strict=True))

    # ------------------------------------------------------------ checks 1, 2, 3

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
        for t in np.flatnonzero(uids == self.workload.plot_uid).tolist():
            for k in np.flatnonzero(a[:, t] != PAD_SLOT_ID).tolist():
                self.plot_points.append((int(step.positions[t]), k))

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
            bs = self.block_sizes[g]
            for k in range(self.cp_size):
                slots = actual[k, g, :n][real]
                written = slots != PAD_SLOT_ID
                toks, slots = real[written], slots[written]
                if not warmup:  # warm-up writes all land in the null block, by design
                    found += self._shared_slots(step, g, k, toks, slots, rows, uids)
                blocks = slots // bs
                if warmup:
                    wrong = np.flatnonzero(blocks != NULL_BLOCK_ID)
                else:
                    holders = self.holders[g]
                    owner = np.array([holders.get(b, -1) for b in blocks.tolist()], dtype=np.int64)
                    wrong = np.flatnonzero(owner != uids[toks])
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

    # ------------------------------------------------------------ check 5

    def _write_kv(self, step: Step, actual: np.ndarray) -> None:
        n = step.num_tokens
        _, uids = step.token_rows()
        real = uids >= 0
        tags = (uids[real] << _TAG_SHIFT) | step.positions[:n][real]
        for g in range(self.num_groups):
            if not self.enabled[g]:
                continue
            for k in range(self.cp_size):
                slots = actual[k, g, :n][real]
                w = slots != PAD_SLOT_ID
                self.kv[k][g].update(zip(slots[w].tolist(), tags[w].tolist(), strict=True))

    def _read_request(self, step_index: int, req: Finished, g: int) -> list[Violation]:
        bs, c, inter = self.block_sizes[g], self.group_cp[g], self.preset.cp_interleave
        row = np.asarray(self.req_blocks[req.uid][g], dtype=np.int64)
        dead = self.req_dead[req.uid][g]
        found, seen = [], np.zeros(req.seq_len, dtype=np.int64)
        for k in range(self.cp_size):
            kk = k if c > 1 else 0
            owned = reference.owned_positions(req.seq_len, kk, c, inter, bs)
            n_local = reference.local_len(req.seq_len, kk, c, inter)
            slots = reference.read_slots(row, n_local, bs)
            q = np.arange(n_local)
            live = np.array([(j not in dead) for j in (q // bs).tolist()], dtype=bool)
            cache = self.kv[k][g]
            got = np.array([cache.get(s, -1) for s in slots[live].tolist()], dtype=np.int64)
            want = (req.uid << _TAG_SHIFT) | owned[live]
            ok = got == want
            self.stats[g, k, 5] += int(ok.sum())
            self.stats[g, k, 6] += int(live.sum())
            if c > 1:
                seen[owned[live][ok]] += 1
            for i in np.flatnonzero(~ok)[:_PER_STEP_REPORTS].tolist():
                found.append(
                    Violation(
                        5,
                        f"rank {k}'s local token {int(q[live][i])} reads back the wrong KV",
                        step_index,
                        g,
                        req.uid,
                        req.row,
                        int(owned[live][i]),
                        rank=k,
                        expected=_untag(int(want[i])),
                        actual=_untag(None if got[i] < 0 else int(got[i])),
                    )
                )
        if c > 1 and not found:
            for p in np.flatnonzero(seen != 1)[:_PER_STEP_REPORTS].tolist():
                found.append(
                    Violation(
                        5,
                        "position read back on the wrong number of ranks",
                        step_index,
                        g,
                        req.uid,
                        req.row,
                        p,
                        expected="exactly one rank",
                        actual=f"{seen[p]} ranks",
                    )
                )
        return found

    # ------------------------------------------------------------ check 6

    def _check_tables(self, step: Step, tables: list[np.ndarray]) -> list[Violation]:
        num_rows = tables[0].shape[1] if tables else 0
        expected = self.refs[0].gathered_block_tables(
            step.idx_mapping, num_rows, step.num_computed_tokens
        )
        limit = max(step.num_reqs_padded, self.rows_high)
        self.rows_high = step.num_reqs_padded
        found = []
        for g in range(self.num_groups):
            values, defined = expected[g]
            defined = defined.copy()
            defined[limit:] = False
            bad = (tables[g] != values[None]) & defined[None]  # [cp, rows, width]
            if not bad.any():
                continue
            raw = self.refs[0].gathered_block_tables(step.idx_mapping, num_rows, None)[g][0]
            for k, b, j in np.argwhere(bad)[:_PER_STEP_REPORTS].tolist():
                found.append(self._table_violation(step, g, k, b, j, values, raw, tables[g][k]))
        return found

    def _table_violation(
        self,
        step: Step,
        g: int,
        k: int,
        b: int,
        j: int,
        values: np.ndarray,
        unmasked: np.ndarray,
        actual: np.ndarray,
    ) -> Violation:
        v = Violation(
            6,
            "",
            step.index,
            g,
            rank=k,
            expected=f"entry {j} = {int(values[b, j])}",
            actual=f"entry {j} = {int(actual[b, j])}",
        )
        if b >= step.num_reqs_padded:
            v.what = f"row {b} left by a larger batch is not zero"
        elif b >= step.num_reqs:
            v.what = f"padding row {b} is not zero"
        elif step.idx_mapping[b] < 0:
            v.what = f"dummy row {b} is not zero"
        else:
            v.row, v.request = int(step.idx_mapping[b]), int(step.uids[b])
            if values[b, j] == NULL_BLOCK_ID and unmasked[b, j] != NULL_BLOCK_ID:
                w, bs = self.reach[g], self.block_sizes[g]
                nct = int(step.num_computed_tokens[v.row])
                v.what = (
                    f"sliding-window masking: block {int(unmasked[b, j])} lies wholly below "
                    f"the window ((j+1)*bs = {(j + 1) * bs} <= num_computed_tokens {nct} - "
                    f"reach {w}) and may be freed"
                )
            else:
                v.what = f"batch row {b} is not a copy of table row {v.row}"
        return v

    def _check_dummy(
        self, step: Step, slots: np.ndarray, tables: list[np.ndarray]
    ) -> list[Violation]:
        found = []
        for k, g, t in np.argwhere(slots != PAD_SLOT_ID)[:_PER_STEP_REPORTS].tolist():
            found.append(
                Violation(
                    3,
                    "get_dummy_slot_mappings left a non-PAD entry",
                    step.index,
                    g,
                    token=t,
                    rank=k,
                    expected="PAD_SLOT_ID",
                    actual=_slot(int(slots[k, g, t])),
                )
            )
        limit = max(step.dummy_num_reqs, self.rows_high)
        self.rows_high = 0
        for g in range(self.num_groups):
            bad = tables[g][:, :limit] != 0
            for k, b, j in np.argwhere(bad)[:_PER_STEP_REPORTS].tolist():
                found.append(
                    Violation(
                        6,
                        f"get_dummy_block_tables left row {b} non-zero (it may hold stale ids)",
                        step.index,
                        g,
                        rank=k,
                        expected=f"entry {j} = 0",
                        actual=f"entry {j} = {int(tables[g][k, b, j])}",
                    )
                )
        return found

    # ------------------------------------------------------------ results

    def stat_rows(self, ranks: list[int]) -> list[dict]:
        out = []
        for g in range(self.num_groups):
            for k in range(self.cp_size):
                row = {"group": g, "cp_rank": k, "rank": ranks[k]}
                row.update({f: int(self.stats[g, k, i]) for i, f in enumerate(STAT_FIELDS)})
                out.append(row)
        return out
