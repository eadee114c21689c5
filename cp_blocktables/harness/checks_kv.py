"""Check 5 of SPEC.md section 6: the KV round trip through a simulated cache per rank."""

from __future__ import annotations

from itertools import repeat

import numpy as np
import torch

from .. import reference
from ..contract import PAD_SLOT_ID
from .violations import _PER_STEP_REPORTS, _TAG_SHIFT, Violation, _untag
from .workload import Finished, Step


class _KvChecks:
    """Check 5 of `GroupChecker` (state lives there)."""

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
                cache = self.kv[k][g]
                if self.dev is not None:  # a DeviceKv (the host checks after a device finding)
                    cache.put(torch.from_numpy(slots[w]), torch.from_numpy(tags[w]))
                else:
                    cache.update(zip(slots[w].tolist(), tags[w].tolist(), strict=True))

    def _read_request(self, step_index: int, req: Finished, g: int) -> list[Violation]:
        """Read positions `[start, seq_len)` of `req` back on every rank, `start` being
        `req.read_from`: rank `k` reads its local tokens `[local_len(start), local_len(
        seq_len))`, which hold exactly its positions there, so no array is as long as a
        request that starts far out."""
        bs, c, inter = self.block_sizes[g], self.group_cp[g], self.preset.cp_interleave
        kbs = self.kernel_sizes[g]
        row = np.asarray(self.req_blocks[req.uid][g], dtype=np.int64)
        dead = np.fromiter(self.req_dead[req.uid][g], dtype=np.int64)  # dead table columns
        start = req.read_from
        found, seen = [], np.zeros(req.seq_len - start, dtype=np.int64)  # [positions read]
        for k in range(self.cp_size):
            kk = k if c > 1 else 0
            owned = reference.owned_positions(req.seq_len, kk, c, inter, kbs, start=start)
            first = reference.local_len(start, kk, c, inter)
            n_local = reference.local_len(req.seq_len, kk, c, inter)
            slots = reference.read_slots(row, n_local, bs, kernel_block_size=kbs, first=first)
            q = np.arange(first, n_local)
            live = ~np.isin(q // bs, dead)
            keys = slots[live].tolist()  # looked up in one C-level pass over the cache
            got = np.fromiter(map(self.kv[k][g].get, keys, repeat(-1)), np.int64, len(keys))
            want = (req.uid << _TAG_SHIFT) | owned[live]
            ok = got == want
            self.stats[g, k, 5] += int(ok.sum())
            self.stats[g, k, 6] += int(live.sum())
            if c > 1:
                seen[owned[live][ok] - start] += 1
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
            for i in np.flatnonzero(seen != 1)[:_PER_STEP_REPORTS].tolist():
                found.append(
                    Violation(
                        5,
                        "position read back on the wrong number of ranks",
                        step_index,
                        g,
                        req.uid,
                        req.row,
                        start + i,
                        expected="exactly one rank",
                        actual=f"{seen[i]} ranks",
                    )
                )
        return found
