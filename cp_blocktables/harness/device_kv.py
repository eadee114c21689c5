"""Check 5 of SPEC.md section 6 on the rank's device: the simulated KV caches as sorted tensors.

`DeviceKv` stands in for the host checker's dict (slot -> tag of request and
position) of one rank and group: the slots written so far, sorted, and their
tags, on the device of the gathered outputs. A step's writes merge in with one
stable sort (the last write of a slot wins, as a dict update's does), and a
read-back looks its slots up with `searchsorted`. It keeps the dict's
interface (`update`, `get`, item assignment), so the host checks of
`checks_kv` and `GroupChecker._seed_prefix` work on it unchanged; `get` reads
from a host snapshot built when first needed after a write (only the host
fallback, after a device check found something, asks for it).

`read_request_counts` is `_KvChecks._read_request` as device reductions: per
rank, how many live local tokens read back their own position (and how many
were read), and how many reads or positions broke the rule. The expected side
follows the reference's rules (owner, local length, read slot of the `q`-th
local token) from the workload's own table row, never from the implementation.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .. import reference
from .violations import _TAG_SHIFT


class DeviceKv:
    """One rank's KV cache of one group: sorted slots and their tags, on a device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.keys = torch.empty(0, dtype=torch.int64, device=device)
        self.tags = torch.empty(0, dtype=torch.int64, device=device)
        self._snapshot: dict[int, int] | None = None

    def put(self, slots: torch.Tensor, tags: torch.Tensor) -> None:
        """Write `tags` at `slots`, in order (a later write of the same slot wins)."""
        if slots.numel() == 0:
            return
        keys = torch.cat([self.keys, slots.to(self.device, torch.int64)])
        vals = torch.cat([self.tags, tags.to(self.device, torch.int64)])
        keys, order = torch.sort(keys, stable=True)
        vals = vals[order]
        last = torch.ones_like(keys, dtype=torch.bool)
        last[:-1] = keys[1:] != keys[:-1]
        self.keys, self.tags = keys[last], vals[last]
        self._snapshot = None

    def lookup(self, slots: torch.Tensor) -> torch.Tensor:
        """The tag at each slot, or -1 where nothing was written."""
        if self.keys.numel() == 0:
            return torch.full_like(slots, -1)
        i = torch.searchsorted(self.keys, slots).clamp(max=self.keys.numel() - 1)
        return torch.where(self.keys[i] == slots, self.tags[i], torch.full_like(slots, -1))

    # dict interface, for the host checks (fallback) and the prefix seeding
    def update(self, pairs: Iterable[tuple[int, int]]) -> None:
        pairs = list(pairs)
        if pairs:
            t = torch.tensor(pairs, dtype=torch.int64)
            self.put(t[:, 0], t[:, 1])

    def __setitem__(self, slot: int, tag: int) -> None:
        self.update([(slot, tag)])

    def get(self, slot: int, default: int | None = None) -> int | None:
        if self._snapshot is None:
            self._snapshot = dict(zip(self.keys.tolist(), self.tags.tolist(), strict=True))
        return self._snapshot.get(slot, default)

    def __len__(self) -> int:
        return self.keys.numel()


def read_request_counts(checker, req, g: int, device: torch.device) -> torch.Tensor:
    """`[bad, ok_0, read_0, ok_1, read_1, ...]` of one finished request in group `g`.

    `bad` counts the reads that did not find their own position and, under a
    sharded group, positions read back on other than one rank: non-zero exactly
    when `_KvChecks._read_request` reports something. Like it, it reads only
    positions `[req.read_from, seq_len)`.
    """
    bs, c, inter = checker.block_sizes[g], checker.group_cp[g], checker.preset.cp_interleave
    kbs = checker.kernel_sizes[g]
    row = torch.as_tensor(checker.req_blocks[req.uid][g], dtype=torch.int64).to(device)
    row = (row[:, None] * (bs // kbs) + torch.arange(bs // kbs, device=device)).reshape(-1)
    dead_cols = sorted(checker.req_dead[req.uid][g])
    dead = torch.as_tensor(dead_cols, dtype=torch.int64).to(device)
    length, start = req.seq_len, req.read_from
    # [positions read], position start + i at i
    seen = torch.zeros(length - start if c > 1 else 0, dtype=torch.int64, device=device)
    out = []
    bad = torch.zeros((), dtype=torch.int64, device=device)
    for k in range(checker.cp_size):
        kk = k if c > 1 else 0
        first = reference.local_len(start, kk, c, inter)
        n_local = reference.local_len(length, kk, c, inter)
        q = torch.arange(first, n_local, dtype=torch.int64, device=device)
        if c > 1:  # the q-th position rank kk owns; reference.owner must agree, below
            owned = (q // inter) * (inter * c) + kk * inter + q % inter
            o = owned % (kbs * c)
            bad = bad + (((o // inter) % c != kk) | (owned >= length) | (owned < start)).sum()
        else:
            owned = q
        slots = row[(q // kbs).clamp(max=max(row.numel() - 1, 0))] * kbs + q % kbs
        if row.numel() * kbs < n_local:  # the row is shorter than the request: host raises
            bad = bad + 1
        live = ~torch.isin(q // bs, dead) if dead_cols else torch.ones_like(q, dtype=torch.bool)
        got = checker.kv[k][g].lookup(slots)
        want = (req.uid << _TAG_SHIFT) | owned
        ok = (got == want) & live
        bad = bad + (live & ~ok).sum()
        out += [ok.sum(), live.sum()]
        if c > 1:
            at = (owned - start).clamp(0, max(length - start - 1, 0))
            seen.index_add_(0, at, ok.to(torch.int64))
    if c > 1:
        bad = bad + (seen != 1).sum()
    return torch.stack([bad, *out])
