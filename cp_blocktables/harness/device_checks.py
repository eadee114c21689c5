"""SPEC.md section 6's checks 1-6 as torch reductions on the device the outputs were gathered to.

The host checks (`checks_slots`, `checks_tables`, `checks_kv`) copy every
rank's outputs to the host and compare them in numpy. On a GPU rank that copy
and the numpy work dominate a step, so `DeviceChecker` does the bulk of the
same comparisons where the gathered tensors already are:

* the expected slot mapping of every token, rank and group, from the
  reference's rules re-expressed in torch (owner, local offset, virtual block,
  kernel block size of SPEC.md 8.1, unsharded and disabled groups, dummy
  tokens, the padded tail) over a device mirror of the reference's own tables
  (the workload's appends, never the implementation's tables): checks 1-3 are
  one comparison of the whole `[cp, groups, max_tokens]` buffer;
* check 4: shared slots by a sort per rank and group; each written slot's
  block looked up in the holder ledger (from the workload) with `searchsorted`;
* check 6: the model of the persistent `input_block_tables` (section 3's rule
  for the rows a gather defines) kept on the device and compared entirely;
* check 5: the simulated KV caches as sorted device tensors (`device_kv`).

A step costs one small read-back: the number of mismatches, the per-rank
statistics and the few slots the ownership plot needs. Only when that number
is non-zero does the step run again through the host checks, which word the
violations exactly as always. Dummy steps (`get_dummy_*`) run on the host.
"""

from __future__ import annotations

import numpy as np
import torch

from ..contract import NULL_BLOCK_ID, PAD_SLOT_ID
from .device_kv import DeviceKv, read_request_counts
from .executor import TABLE_SENTINEL
from .violations import _TAG_SHIFT, Violation
from .workload import Finished, Step

CHECK_MODES = ("auto", "device", "host")


def use_device_checks(mode: str, device: torch.device) -> bool:
    """`--checks auto`: on the device when the rank's outputs live on a GPU."""
    if mode not in CHECK_MODES:
        raise ValueError(f"checks must be one of {', '.join(CHECK_MODES)}, got {mode!r}")
    return mode == "device" or (mode == "auto" and torch.device(device).type == "cuda")


def split_on_device(executor, parts: list[torch.Tensor]):
    """`executor.split_all` without leaving the device: `((slots, tables), (slots, tables))`."""
    flat = torch.stack(parts)
    cp, n, at = flat.shape[0], executor.num_groups * executor.max_tokens, 0
    out = []
    for start in (0, executor.part):
        at = start + n
        slots = flat[:, start:at].reshape(cp, executor.num_groups, executor.max_tokens)
        tables = []
        for w in executor.widths:
            size = executor.max_reqs * w
            tables.append(flat[:, at : at + size].reshape(cp, executor.max_reqs, w))
            at += size
        out.append((slots, tables))
    return tuple(out)


def _host(x):
    return x.cpu().numpy() if isinstance(x, torch.Tensor) else x


class DeviceChecker:
    """The device half of a `GroupChecker` (which keeps the workload's ledger and the host path)."""

    def __init__(self, checker, device: torch.device) -> None:
        self.c = checker
        self.device = dev = torch.device(device)
        refs = checker.refs[0]
        self.tables = [torch.as_tensor(t).to(dev) for t in refs.tables]  # kernel ids
        self.num_blocks = torch.as_tensor(refs.num_blocks).to(dev)
        self.table_values = [torch.zeros_like(t) for t in self.tables]  # check 6's model
        self.table_defined = [torch.zeros_like(t, dtype=torch.bool) for t in self.tables]
        self.slot_model: torch.Tensor | None = None
        checker.table_values = checker.table_defined = None  # host copies only while needed
        self.host_fresh = False  # the host models are the truth (after a host-checked step)
        self.fallbacks = 0  # steps the device path handed to the host checks
        checker.kv = [[DeviceKv(dev) for _ in range(checker.num_groups)] for _ in checker.kv]

    # ------------------------------------------------------------ model residency

    def pull(self) -> None:
        """Make the host checks' models current (before they run)."""
        c = self.c
        if self.host_fresh:
            return
        c.slot_model = None if self.slot_model is None else _host(self.slot_model).copy()
        c.table_values = [_host(t).copy() for t in self.table_values]
        c.table_defined = [_host(t).copy() for t in self.table_defined]
        self.host_fresh = True

    def _push(self) -> None:
        c, dev = self.c, self.device
        if not self.host_fresh:
            return
        self.slot_model = None if c.slot_model is None else torch.from_numpy(c.slot_model).to(dev)
        for g in range(c.num_groups):
            self.table_values[g].copy_(torch.from_numpy(c.table_values[g]))
            self.table_defined[g].copy_(torch.from_numpy(c.table_defined[g]))
        c.slot_model = c.table_values = c.table_defined = None
        self.host_fresh = False

    def mirror(self, step: Step) -> None:
        """The rows this step's appends changed in the reference's tables, onto the device."""
        rows = sorted({a.row for a in step.appends})
        if not rows:
            return
        ref, idx = self.c.refs[0], torch.as_tensor(rows, device=self.device)
        for g, t in enumerate(self.tables):
            t[idx] = torch.from_numpy(ref.tables[g][rows]).to(self.device)
        self.num_blocks[:, idx] = torch.from_numpy(ref.num_blocks[:, rows]).to(self.device)

    # ------------------------------------------------------------ one step

    def check(self, step: Step, slots, tables, aux) -> list[Violation]:
        c = self.c
        if step.kind == "dummy":
            return self._on_host(step, slots, tables, aux, fallback=False)
        self._push()
        dev, n = self.device, step.num_tokens
        rows_np, uids_np = step.token_rows()
        rows = torch.from_numpy(rows_np).to(dev)
        uids = torch.from_numpy(uids_np).to(dev)
        pos = torch.from_numpy(np.ascontiguousarray(step.positions[:n])).to(dev)
        expected, bad = self._expected(step, rows, pos, slots.shape[2])
        produced = slots
        if step.slot_out and aux is not None:
            produced = aux[0]
            if self.slot_model is not None:
                bad = bad + (slots != self.slot_model).sum()
        bad = bad + (produced != expected).sum()
        real = uids >= 0
        stats = self._stats(expected[:, :, :n], produced[:, :, :n], real)
        bad = bad + self._distinct(step, produced[:, :, :n], real, uids)
        out_tables = aux[1] if step.gather_out and aux is not None else None
        new_rows, table_bad = self._tables(step, tables, out_tables)
        bad = bad + table_bad
        plot_t, plot_vals = self._plot(step, uids_np, produced)
        reads: list[tuple[Finished, int]] = []
        if step.kind == "real":
            self._write_kv(step, produced[:, :, :n], real, uids, pos)
            reads = [(r, g) for r in step.finished for g in range(c.num_groups) if c.enabled[g]]
        read_counts = [read_request_counts(c, r, g, dev) for r, g in reads]
        for x in read_counts:
            bad = bad + x[0]
        head = [bad.reshape(1), stats.reshape(-1), plot_vals.reshape(-1)]
        back = torch.cat(head + [x[1:] for x in read_counts]).cpu().numpy()  # the one read-back
        if back[0] != 0:
            return self._on_host(step, slots, tables, aux, fallback=True)
        # Nothing found: commit the models and figures exactly as the host checks would.
        at = 1 + stats.numel()
        c.stats[:, :, :5] += back[1:at].reshape(stats.shape)
        vals = back[at : at + plot_vals.numel()].reshape(plot_vals.shape)
        i, k = np.nonzero(vals.T != PAD_SLOT_ID)  # token by token, ranks ascending
        c.plot_points += zip(step.positions[plot_t[i]].tolist(), k.tolist(), strict=True)
        at += plot_vals.numel()
        self._commit_reads(reads, back[at:])
        if not (step.slot_out and aux is not None):
            self.slot_model = expected
        self._commit_tables(step, new_rows)
        if step.kind == "real":
            c.tokens_checked += int(np.diff(step.query_start_loc)[step.uids >= 0].sum())
        return []

    def read_back(self, step_index: int, finished: list[Finished]) -> list[Violation]:
        """Check 5 for `finished` outside a step (the requests still running at the end)."""
        c = self.c
        reads = [(r, g) for r in finished for g in range(c.num_groups) if c.enabled[g]]
        if not reads:
            return []
        counts = torch.stack([read_request_counts(c, r, g, self.device) for r, g in reads])
        back = counts.cpu().numpy()
        if back[:, 0].any():
            return c._read_back_host(step_index, finished)
        self._commit_reads(reads, back[:, 1:].reshape(-1))
        return []

    def _commit_reads(self, reads, flat: np.ndarray) -> None:
        per = 2 * self.c.cp_size
        for i, (_, g) in enumerate(reads):
            counts = flat[i * per : (i + 1) * per].reshape(-1, 2)
            self.c.stats[g, :, 5] += counts[:, 0]
            self.c.stats[g, :, 6] += counts[:, 1]

    def _on_host(self, step: Step, slots, tables, aux, fallback: bool) -> list[Violation]:
        self.pull()
        self.fallbacks += fallback
        host_aux = None if aux is None else (_host(aux[0]), [_host(t) for t in aux[1]])
        return self.c._host_body(step, _host(slots), [_host(t) for t in tables], host_aux)

    # ------------------------------------------------------------ checks 1-3

    def _expected(self, step: Step, rows, pos, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Section 2's slot of every token for every rank and group, `[cp, groups, width]`;
        and a count of tokens whose column lies outside their row (the host raises on them)."""
        c, dev, n = self.c, self.device, step.num_tokens
        cp, inter = c.cp_size, c.preset.cp_interleave
        out = torch.full((cp, c.num_groups, width), PAD_SLOT_ID, dtype=torch.int64, device=dev)
        bad = torch.zeros((), dtype=torch.int64, device=dev)
        valid = rows >= 0
        r = rows.clamp(min=0)
        ranks = torch.arange(cp, device=dev)[:, None]
        for g in range(c.num_groups):
            if not c.enabled[g]:
                continue
            kbs, gcp, table = c.kernel_sizes[g], c.group_cp[g], self.tables[g]
            col = pos // (kbs * gcp)
            bad = bad + (valid & ((col >= table.shape[1]) | (pos < 0))).sum()
            block = table[r, col.clamp(0, table.shape[1] - 1)]
            if gcp == 1:
                slot = torch.where(valid, block * kbs + pos % kbs, PAD_SLOT_ID)
                out[:, g, :n] = slot[None, :]
                continue
            o = pos % (kbs * gcp)
            owner = (o // inter) % gcp
            local = (o // (inter * gcp)) * inter + o % inter
            mine = valid[None, :] & (owner[None, :] == ranks)
            out[:, g, :n] = torch.where(mine, (block * kbs + local)[None, :], PAD_SLOT_ID)
        return out, bad

    def _stats(self, e: torch.Tensor, a: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """`_SlotChecks._count_slots` of every enabled group, `[groups, cp, 5]`."""
        epad, apad = e == PAD_SLOT_ID, a == PAD_SLOT_ID  # [cp, groups, n]
        fields = [~apad, ~epad, ~apad & epad, apad & ~epad, ~apad & ~epad & (a != e)]
        s = torch.stack([(f & real).sum(dim=2) for f in fields], dim=2)  # [cp, groups, 5]
        enabled = torch.tensor(self.c.enabled, dtype=torch.bool, device=self.device)
        return (s * enabled[None, :, None]).transpose(0, 1)

    # ------------------------------------------------------------ check 4

    def _distinct(self, step: Step, a: torch.Tensor, real, uids) -> torch.Tensor:
        """Shared slots and slots outside the token's own blocks (warm-up: the null block)."""
        c, dev, n = self.c, self.device, step.num_tokens
        warmup = step.kind == "warmup"
        bad = torch.zeros((), dtype=torch.int64, device=dev)
        distinct = -2 - torch.arange(n, dtype=torch.int64, device=dev)  # never a real duplicate
        for g in range(c.num_groups):
            if not c.enabled[g]:
                continue
            s = a[:, g, :]  # [cp, n]
            written = real[None, :] & (s != PAD_SLOT_ID)
            blocks = torch.div(s, c.kernel_sizes[g] * c.m[g], rounding_mode="floor")
            if warmup:
                bad = bad + (written & (blocks != NULL_BLOCK_ID)).sum()
                continue
            if n > 1:
                ordered = torch.sort(torch.where(written, s, distinct[None, :]), dim=1).values
                bad = bad + (ordered[:, 1:] == ordered[:, :-1]).sum()
            keys, holder = self._holders(g)
            if keys.numel() == 0:
                bad = bad + written.sum()
                continue
            i = torch.searchsorted(keys, blocks.contiguous()).clamp(max=keys.numel() - 1)
            who = torch.where(keys[i] == blocks, holder[i], -1)
            bad = bad + (written & (who != uids[None, :])).sum()
        return bad

    def _holders(self, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.c.holders[g]
        keys = np.fromiter(d.keys(), dtype=np.int64, count=len(d))
        vals = np.fromiter(d.values(), dtype=np.int64, count=len(d))
        order = np.argsort(keys)
        return (
            torch.from_numpy(keys[order]).to(self.device),
            torch.from_numpy(vals[order]).to(self.device),
        )

    # ------------------------------------------------------------ check 5 (writes)

    def _write_kv(self, step: Step, a: torch.Tensor, real, uids, pos) -> None:
        c = self.c
        tags = (uids << _TAG_SHIFT) | pos
        for g in range(c.num_groups):
            if not c.enabled[g]:
                continue
            for k in range(c.cp_size):
                w = real & (a[k, g] != PAD_SLOT_ID)
                c.kv[k][g].put(a[k, g][w], tags[w])

    # ------------------------------------------------------------ check 6

    def _rule(self, step: Step, num_rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`ReferenceBlockTables.gathered_block_tables` in torch, on the device mirror."""
        c, dev = self.c, self.device
        idx = np.full(num_rows, -1, dtype=np.int64)
        m = min(num_rows, step.num_reqs)
        idx[:m] = step.idx_mapping[:m]
        idx_t = torch.from_numpy(idx).to(dev)
        valid = (idx_t >= 0)[:, None]
        r = idx_t.clamp(min=0)
        nct = step.num_computed_tokens
        out = []
        for g, table in enumerate(self.tables):
            j = torch.arange(table.shape[1], device=dev)[None, :]
            count = self.num_blocks[g][r][:, None]
            inside = valid & (j < count)
            values = torch.where(inside, table[r], 0)
            if nct is not None and c.reach[g] > 0:
                live_from = torch.from_numpy(nct.astype(np.int64)).to(dev)[r][:, None] - c.reach[g]
                values = torch.where((j + 1) * c.kernel_sizes[g] <= live_from, 0, values)
            out.append((values, ~(valid & (j >= count))))
        return out

    def _tables(self, step: Step, tables, out) -> tuple[list | None, torch.Tensor]:
        c, nrp = self.c, step.num_reqs_padded
        bad = torch.zeros((), dtype=torch.int64, device=self.device)
        if out is not None:
            for g, (values, defined) in enumerate(self._rule(step, nrp)):
                bad = bad + ((out[g][:, :nrp] != values) & defined).sum()
                bad = bad + (out[g][:, nrp:] != TABLE_SENTINEL).sum()
            return None, bad + self._against_model(tables, 0, None)
        num_rows = max(nrp, c.rows_written)
        new_rows = self._rule(step, num_rows)
        return new_rows, bad + self._against_model(tables, num_rows, new_rows)

    def _against_model(self, tables, num_rows: int, new_rows) -> torch.Tensor:
        bad = torch.zeros((), dtype=torch.int64, device=self.device)
        for g, t in enumerate(tables):
            if new_rows is not None:
                values, defined = new_rows[g]
                bad = bad + ((t[:, :num_rows] != values) & defined).sum()
            rest_v, rest_d = self.table_values[g][num_rows:], self.table_defined[g][num_rows:]
            bad = bad + ((t[:, num_rows:] != rest_v) & rest_d).sum()
        return bad

    def _commit_tables(self, step: Step, new_rows) -> None:
        if new_rows is None:
            return
        num_rows = new_rows[0][0].shape[0] if new_rows else 0
        for g, (values, defined) in enumerate(new_rows):
            self.table_values[g][:num_rows] = values
            self.table_defined[g][:num_rows] = defined
        self.c.rows_written = step.num_reqs_padded

    # ------------------------------------------------------------ the ownership plot

    def _plot(self, step: Step, uids_np: np.ndarray, a: torch.Tensor):
        c, g = self.c, self.c.plot_group
        if g is None or not c.enabled[g] or c.workload.plot_uid is None or step.kind != "real":
            empty = np.zeros(0, dtype=np.int64)
            return empty, torch.zeros((c.cp_size, 0), dtype=torch.int64, device=self.device)
        toks = np.flatnonzero(uids_np == c.workload.plot_uid)
        return toks, a[:, g, torch.from_numpy(toks).to(self.device)]
