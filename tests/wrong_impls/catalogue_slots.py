"""Wrong implementations whose slot mappings are wrong (SPEC.md section 6, checks 1 to 3).

Ownership and local offsets under CP (check 1), slot values (check 2) and
padding: PAD where no token is, nor a disabled group's (check 3). Each class
overrides one hook of the correct `StandInBlockTables`; `catalogue` names the
check that must catch it.
"""

from __future__ import annotations

import numpy as np
import torch

from cp_blocktables.contract import PAD_SLOT_ID

from .stand_in import StandInBlockTables


class WrongOwner(StandInBlockTables):
    """Ownership rotated by one rank: every token lands on its neighbour."""

    def _owner(self, o, c, i):
        return (o // i + 1) % c


class DroppedInterleaveRemainder(StandInBlockTables):
    """Local offset forgets `o mod I`: the I tokens of a run share one slot."""

    def _local(self, o, c, i):
        return (o // (i * c)) * i


class UnshardedGroupSharded(StandInBlockTables):
    """Treats every group as DCP-sharded, the replicated ones too."""

    def _group_cp(self, g):
        return self.cp_size


class VirtualBlockIgnored(StandInBlockTables):
    """Sharded groups index the table by `p // bs`, not by the virtual block `p // (bs*C)`."""

    def _column(self, pos, bs, c):
        return pos // bs


class AllRanksWrite(StandInBlockTables):
    """Every rank writes every token of a sharded group (no PAD for non-owners)."""

    def _non_owner_value(self, slot):
        return slot


class CpModuloAsMask(StandInBlockTables):
    """The owner as `(o // I) & (C - 1)`: a mask for the modulo, right only when the CP
    size is a power of two (cp 3 gives ranks 0 and 2 every token, rank 1 none)."""

    def _owner(self, o, c, i):
        return (o // i) & (c - 1)


class LastRankOffByOne(StandInBlockTables):
    """Only the last CP rank gets the local offset wrong (one past it, wrapping in the block)."""

    def _local(self, o, c, i):
        local = super()._local(o, c, i)
        return (local + 1) % (self.block_sizes[0]) if self.cp_rank == c - 1 else local


class VirtualBlockFromAllocator(StandInBlockTables):
    """Sharded groups find the table column with the allocator block B: p // (B*C)."""

    def _column(self, pos, bs, c):
        g = self.block_sizes.index(bs)
        return pos // (self.alloc_block_sizes[g] * c)


class PositionsIgnored(StandInBlockTables):
    """Uses a token's index within its request's chunk instead of its position."""

    def _token_positions(self, positions, qsl, batch):
        return torch.arange(batch.shape[0]) - qsl[batch]


class BatchIndexAsRow(StandInBlockTables):
    """Reads table row `b` (the batch index) instead of `idx_mapping[b]`."""

    def _token_rows(self, idx, batch):
        return torch.where(idx[batch] >= 0, batch, -1)


class Int32Slots(StandInBlockTables):
    """Computes slots in int32: values past 2**31 wrap."""

    def _store_slots(self, slots):
        return slots.to(torch.int32).to(torch.int64)


class RareWrongSlot(StandInBlockTables):
    """One compute_slot_mappings call in fifty (at random) moves one token's slot by one, in
    a group every rank writes (unsharded, or cp_size 1: check 2)."""

    def compute_slot_mappings(self, idx_mapping, query_start_loc, positions, n, out=None):
        res = super().compute_slot_mappings(idx_mapping, query_start_loc, positions, n, out)
        rng = getattr(self, "_rng", None) or np.random.default_rng(1000 + self.cp_rank)
        self._rng = rng
        buf = self.slot_mappings if out is None else out
        real = (buf[:, : int(query_start_loc[-1])] != PAD_SLOT_ID).nonzero()
        everyone = [g for g in range(buf.shape[0]) if self.cfg.group_cp_size(g) == 1]
        real = real[torch.isin(real[:, 0], torch.tensor(everyone, dtype=real.dtype))]
        if rng.random() < 1 / 50 and len(real):
            g, t = real[int(rng.integers(len(real)))].tolist()
            buf[g, t] += 1
        return res


class TokensPastTileDropped(StandInBlockTables):
    """One program per request handles at most 8192 of its tokens: the rest stay PAD."""

    def compute_slot_mappings(self, idx_mapping, query_start_loc, positions, n, out=None):
        res = super().compute_slot_mappings(idx_mapping, query_start_loc, positions, n, out)
        buf = self.slot_mappings if out is None else out
        qsl = query_start_loc.cpu().tolist()
        for lo, hi in zip(qsl[:-1], qsl[1:], strict=True):
            if hi - lo > 8192:
                buf[:, lo + 8192 : hi] = PAD_SLOT_ID
        return res


class MissingTailPadding(StandInBlockTables):
    """Clears only the batch's own tokens: a smaller step leaves the old tail."""

    def _clear_slot_buffer(self, buf, num_tokens):
        buf[:, :num_tokens].fill_(PAD_SLOT_ID)


class TailClearCapped(StandInBlockTables):
    """Clears the stale tail one 8192-token tile past num_tokens only."""

    def _clear_slot_buffer(self, buf, num_tokens):
        buf[:, : num_tokens + 8192].fill_(PAD_SLOT_ID)


class DummyTokensWritten(StandInBlockTables):
    """Tokens of dummy requests get slots (from row 0) instead of PAD."""

    def _writes(self, rows):
        return torch.ones_like(rows, dtype=torch.bool)


class DisabledGroupWritten(StandInBlockTables):
    """Writes slots for groups whose slot mapping is disabled."""

    def _enabled(self, g):
        return True


class SlotOutIgnored(StandInBlockTables):
    """compute_slot_mappings writes the persistent buffer even when given the caller's out."""

    def compute_slot_mappings(self, idx_mapping, query_start_loc, positions, n, out=None):
        return super().compute_slot_mappings(idx_mapping, query_start_loc, positions, n)
