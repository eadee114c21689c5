"""Wrong implementations of the rules only a probe can see (harness/probes.py).

Each computes every legal step right; what is wrong is a call that must
fail and does not: a constructor that builds from a config SPEC.md refuses
(check 9), or integrity checks (SPEC.md 8.3) that miss a planted fault
(check 10); or one that must succeed and does not: a constructor that
cannot build a legal config of huge blocks, or a slot mapping that refuses a legal
position (check 9).
"""

from __future__ import annotations

import numpy as np
import torch

from cp_blocktables import PAD_SLOT_ID, BlockTables, integrity

from .stand_in import STAND_IN_SIGNATURE, StandInBlockTables


class InterleaveNotChecked(StandInBlockTables):
    """Validates with interleave 1 and keeps the one it was given: a bad interleave builds."""

    __signature__ = STAND_IN_SIGNATURE

    def __init__(self, *args, cp_interleave: int = 1, **kwargs) -> None:
        super().__init__(*args, cp_interleave=1, **kwargs)
        self.cp_interleave = cp_interleave


class RankWrapped(StandInBlockTables):
    """Takes `cp_rank % cp_size`: a rank outside the CP group silently becomes another rank."""

    __signature__ = STAND_IN_SIGNATURE

    def __init__(self, *args, cp_size: int = 1, cp_rank: int = 0, **kwargs) -> None:
        super().__init__(*args, cp_size=cp_size, cp_rank=cp_rank % max(cp_size, 1), **kwargs)


class KernelBlocksNotChecked(StandInBlockTables):
    """A kernel block size that does not divide its block size is replaced, not refused."""

    __signature__ = STAND_IN_SIGNATURE

    def __init__(self, block_sizes, *args, kernel_block_sizes=None, **kwargs) -> None:
        if kernel_block_sizes is not None:
            kernel_block_sizes = [
                k if k >= 1 and b % k == 0 else b
                for b, k in zip(block_sizes, kernel_block_sizes, strict=False)
            ]
        super().__init__(block_sizes, *args, kernel_block_sizes=kernel_block_sizes, **kwargs)


class OursOffsetBitsPerBlock(BlockTables):
    """Keeps a bitset of each kernel block's offsets, one bit an offset, from construction:
    right at every block size an engine uses, a `MemoryError` at legal huge blocks."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._offset_bits = [bytearray(-(-k // 8)) for k in self.kernel_block_sizes]


class _OursPositionsRangeChecked(BlockTables):
    """Range-checks the batch's real positions against `_span(g)` for each group that
    `_checked(g)` names, then maps them as ours does."""

    def _checked(self, g: int) -> bool:
        raise NotImplementedError

    def _span(self, g: int) -> int:
        raise NotImplementedError

    def compute_slot_mappings(self, idx_mapping, query_start_loc, positions, *args, **kwargs):
        qsl = query_start_loc.cpu().numpy()
        rows = np.repeat(idx_mapping.cpu().numpy(), np.diff(qsl))  # [num_tokens]
        pos = positions[: int(qsl[-1])].cpu().numpy()[rows >= 0]
        for g in range(self.num_kv_cache_groups):
            if self._checked(g) and pos.size and pos.max() >= self._span(g):
                raise ValueError(f"position {int(pos.max())} lies past group {g}'s table")
        return super().compute_slot_mappings(
            idx_mapping, query_start_loc, positions, *args, **kwargs
        )


class OursPositionsCheckedOnDisabledGroups(_OursPositionsRangeChecked):
    """Range-checks positions against every group's table, the groups without slot
    mapping included: right wherever all tables cover the model's length, a `ValueError`
    for a legal position past a disabled group's shorter table."""

    def _checked(self, g: int) -> bool:
        return not self.config.slot_mapping_enabled[g]

    def _span(self, g: int) -> int:
        cfg = self.config
        return cfg.block_sizes[g] * cfg.group_cp_size(g) * cfg.max_num_blocks_per_group[g]


class OursSpanByPower(_OursPositionsRangeChecked):
    """Range-checks positions against a span of `block_size ** cp_size` positions a block
    (a power for the virtual block's product): the same at block size 2 and CP 2, wider at
    larger blocks, and at block size 1 a `ValueError` for every legal position past the
    row's width in blocks."""

    def _checked(self, g: int) -> bool:
        return self.config.slot_mapping_enabled[g]

    def _span(self, g: int) -> int:
        cfg = self.config
        return cfg.block_sizes[g] ** cfg.group_cp_size(g) * cfg.max_num_blocks_per_group[g]


class OursLengthsByIdentity(BlockTables):
    """Checks the pointer tensor's length by identity (`is not` for `!=`): CPython shares
    ints only up to 256, so every model up to 256 groups applies and one of 257 is refused."""

    def apply_staged_writes(self) -> None:
        if self.block_table_ptrs.shape[0] is not len(self.block_tables):
            raise ValueError(f"block_table_ptrs must have {len(self.block_tables)} entries")
        super().apply_staged_writes()


class OursPositionsBelow2To61(BlockTables):
    """Bounds positions below 2**61 instead of 2**62: every position an engine reaches maps,
    a legal one past 2**61 is refused with `ValueError`."""

    def compute_slot_mappings(self, idx_mapping, query_start_loc, positions, *args, **kwargs):
        n = int(query_start_loc[-1])
        if n and int(positions[:n].max()) >= 2**61:
            raise ValueError(f"positions must be below 2**61, got {int(positions[:n].max())}")
        return super().compute_slot_mappings(
            idx_mapping, query_start_loc, positions, *args, **kwargs
        )


class OursPositionsPadPast2To61(BlockTables):
    """Takes positions from 2**61 on as outside every table: they map to PAD_SLOT_ID
    without an error, where the contract's bound is 2**62 and the slot is due."""

    def compute_slot_mappings(self, idx_mapping, query_start_loc, positions, *args, **kwargs):
        slots = super().compute_slot_mappings(
            idx_mapping, query_start_loc, positions, *args, **kwargs
        )
        n = int(query_start_loc[-1])
        far = (positions[:n] >= 2**61).nonzero().flatten()
        slots[:, far] = PAD_SLOT_ID
        return slots


class OursOutListByIdentity(BlockTables):
    """Checks the length of the gather's `out` list by identity (`is not` for `!=`): every
    model up to 256 groups gathers into its own tensors, one of 257 is refused."""

    def gather_block_tables(self, idx_mapping, num_reqs_padded, out=None, *args, **kwargs):
        if out is not None and len(out) is not len(self.block_tables):
            raise ValueError(f"out has {len(out)} tables for {len(self.block_tables)} groups")
        return super().gather_block_tables(idx_mapping, num_reqs_padded, out, *args, **kwargs)


def _gather_faults(impl: BlockTables, dst, idx_mapping, num_computed_tokens) -> int:
    """What the right gather check counts: differing entries of real rows plus stale counts."""
    return int(
        integrity.count_gather_faults(
            dst,
            [t.gpu for t in impl.block_tables],
            idx_mapping,
            impl.num_blocks.gpu,
            impl.num_blocks.np,
            impl.kernel_block_sizes,
            impl.sliding_window_reach,
            num_computed_tokens,
        )  # fmt: skip
    )


class OursIntegrityNeverOn(BlockTables):
    """Takes `integrity_checks` and ignores it: the checks of SPEC.md 8.3 never run."""

    def __init__(self, *args, integrity_checks: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.integrity_checks = False


class OursIntegrityTrustsDeviceCounts(BlockTables):
    """The gather check reads the published counts as the truth: a stale count passes."""

    def _check_gathered(self, dst, idx_mapping, num_computed_tokens) -> None:
        integrity.check_gathered_block_tables(
            dst, [t.gpu for t in self.block_tables], idx_mapping, self.num_blocks.gpu,
            self.num_blocks.gpu.cpu().numpy(), self.kernel_block_sizes,
            self.sliding_window_reach, num_computed_tokens,
        )  # fmt: skip


class OursIntegrityNamesMatchingGroups(BlockTables):
    """The gather check sees a gathered row unlike its source, then names the groups whose
    rows match theirs: an engine reading the message looks at the wrong group."""

    def _check_gathered(self, dst, idx_mapping, num_computed_tokens) -> None:
        sources = [t.gpu for t in self.block_tables]
        if not _gather_faults(self, dst, idx_mapping, num_computed_tokens):
            return
        named = []
        for g, (d, s) in enumerate(zip(dst, sources, strict=True)):
            for b, r in enumerate(idx_mapping.cpu().tolist()):
                k = int(self.num_blocks.np[g, r])
                if torch.equal(d[b, :k].cpu(), s[r, :k].cpu()):
                    named.append(f"group {g}: batch row {b} (request row {r}), {k} entries")
        raise integrity.IntegrityError("gather_block_tables: " + "; ".join(named))


class OursIntegrityNamesCutRows(BlockTables):
    """The gather check's explanation compares each row one entry past its count: rows cut
    short by an overwrite, whose stale entry there no gather copies, are named as differing,
    eight a group at most, and behind eight of them the row that differs is never named."""

    def _check_gathered(self, dst, idx_mapping, num_computed_tokens) -> None:
        sources = [t.gpu for t in self.block_tables]
        read = [r for r in idx_mapping.cpu().tolist() if r >= 0]
        stale = (self.num_blocks.gpu.cpu().numpy()[:, read] != self.num_blocks.np[:, read]).any()
        if stale or not _gather_faults(self, dst, idx_mapping, num_computed_tokens):
            return super()._check_gathered(dst, idx_mapping, num_computed_tokens)
        named = []
        for g, (d, s) in enumerate(zip(dst, sources, strict=True)):
            rows = []
            for b, r in enumerate(idx_mapping.cpu().tolist()):
                k = int(self.num_blocks.np[g, r]) + 1  # one entry too many
                if not torch.equal(d[b, :k].cpu(), s[r, :k].cpu()):
                    rows.append(f"group {g}: batch row {b} (request row {r}) differs")
            named += rows[:8]
        raise integrity.IntegrityError("gather_block_tables: " + "; ".join(named))


class OursIntegrityNamesDummyRows(BlockTables):
    """The gather check's explanation takes dummy entries (-1) for rows that differ: they are
    named, eight a group at most, and behind eight of them the row that differs is never
    named."""

    def _check_gathered(self, dst, idx_mapping, num_computed_tokens) -> None:
        sources = [t.gpu for t in self.block_tables]
        read = idx_mapping.cpu().tolist()
        if min(read, default=0) >= 0 or not _gather_faults(
            self, dst, idx_mapping, num_computed_tokens
        ):
            return super()._check_gathered(dst, idx_mapping, num_computed_tokens)
        named = []
        for g, (d, s) in enumerate(zip(dst, sources, strict=True)):
            rows = []
            for b, r in enumerate(read):
                k = int(self.num_blocks.np[g, r]) if r >= 0 else 0
                if r < 0 or not torch.equal(d[b, :k].cpu(), s[r, :k].cpu()):
                    rows.append(f"group {g}: batch row {b} (request row {r}) differs")
            named += rows[:8]
        raise integrity.IntegrityError("gather_block_tables: " + "; ".join(named))


class OursIntegrityStaleCancels(BlockTables):
    """The gather check counts differing entries less stale counts, not plus: a row grown by
    an append after the last apply, gathered into `out` tensors holding other ids, differs in
    the entry its stale count leaves uncopied, and the two findings cancel."""

    def _check_gathered(self, dst, idx_mapping, num_computed_tokens) -> None:
        read = [r for r in idx_mapping.cpu().tolist() if 0 <= r < self.max_num_reqs]
        published = self.num_blocks.gpu.cpu().numpy()[:, read]
        stale = int((published != self.num_blocks.np[:, read]).sum())
        if _gather_faults(self, dst, idx_mapping, num_computed_tokens) == 2 * stale:
            return
        super()._check_gathered(dst, idx_mapping, num_computed_tokens)


class OursIntegrityCountsOnlyLargerEntries(BlockTables):
    """The gather check counts a gathered entry only where it is larger than its source
    (`>` for `!=`): a row gathered into an `out` that another group's smaller ids overwrote
    differs downwards only, and passes."""

    def _check_gathered(self, dst, idx_mapping, num_computed_tokens) -> None:
        rows = idx_mapping.to(torch.int64).clamp(0, self.max_num_reqs - 1)
        n, raised = rows.shape[0], []
        for t, src, k, w in zip(
            dst, self.block_tables, self.kernel_block_sizes, self.sliding_window_reach
        ):
            width = src.gpu.shape[1]
            expected = integrity._expected_rows(src.gpu, rows, k, w, num_computed_tokens)
            up = t.clone()
            up[:n, :width] = torch.maximum(t[:n, :width], expected.to(t.dtype))
            raised.append(up)
        super()._check_gathered(raised, idx_mapping, num_computed_tokens)


class OursIntegrityNullBlockOneSlotLong(BlockTables):
    """The slot check takes the null block to end one slot late: two tokens sharing block 1's
    first slot, the first past the null block's, are never reported."""

    def _check_slots(self, buf, query_start_loc, idx_mapping, positions, num_tokens_padded):
        floors = self._null_slot_floors + 1
        integrity.check_slot_mappings(
            buf, query_start_loc, idx_mapping, positions, floors, num_tokens_padded
        )


class _OursNamesSharedSlots(BlockTables):
    """The slot check counts right, and its explanation names, eight a group, the live slots
    that `_shared` picks from each group's sorted live slots."""

    @staticmethod
    def _shared(live: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _check_slots(self, buf, query_start_loc, idx_mapping, positions, num_tokens_padded):
        floors = self._null_slot_floors
        view = buf[:, :num_tokens_padded]
        if not int(integrity.count_slot_mapping_faults(view, query_start_loc, floors)):
            return
        num_tokens = int(query_start_loc[-1])
        named = []
        for g, row in enumerate(view[:, :num_tokens].cpu()):
            live = row[row >= int(floors[g])].sort().values
            named += [f"group {g}: slot {int(x)} is shared" for x in self._shared(live)[:8]]
        raise integrity.IntegrityError("compute_slot_mappings: " + "; ".join(named))


class OursIntegrityNamesSlotsBelowNone(_OursNamesSharedSlots):
    """The slot check's explanation compares each group's live slots with the smallest one
    only: a slot shared above an unshared one is counted, and the error names no slot."""

    @staticmethod
    def _shared(live: torch.Tensor) -> torch.Tensor:
        return live[1:][live[1:] == live[:1]]


class OursIntegrityNamesSortedNeighbours(_OursNamesSharedSlots):
    """The slot check's explanation takes every live slot no smaller than its neighbour in
    sorted order as shared (`>=` for `==`): it names each group's eight smallest live
    slots, shared or not, so a slot shared above eight unshared ones is counted and never
    named."""

    @staticmethod
    def _shared(live: torch.Tensor) -> torch.Tensor:
        return live[1:][live[1:] >= live[:-1]]


class OursIntegrityEntryByParity(BlockTables):
    """The slot check's explanation finds a token's batch entry as the parity of its
    search: it misnames entries in batches of two or three requests, and raises
    `IndexError`, not the integrity error, when one request alone holds a block twice."""

    def _check_slots(self, *args) -> None:
        right = integrity._token_names

        def by_parity(idx_mapping, qsl, positions):
            def name(t: int) -> str:
                b = int(np.searchsorted(qsl, t, side="right")) & 1
                return f"token {t} (batch entry {b}, row {int(idx_mapping[b])})"

            return name

        integrity._token_names = by_parity
        try:
            super()._check_slots(*args)
        finally:
            integrity._token_names = right


class OursIntegrityNamesEveryRowStale(BlockTables):
    """The gather check's explanation lists every real row as a stale count, eight a group,
    whether or not its published count differs: a stale row behind eight clean ones is
    counted and never named."""

    def _check_gathered(self, dst, idx_mapping, num_computed_tokens) -> None:
        counts = (self.num_blocks.gpu, self.num_blocks.np)
        read = [r for r in idx_mapping.cpu().tolist() if r >= 0]
        published = self.num_blocks.gpu.cpu().numpy()[:, read]
        if not (published != self.num_blocks.np[:, read]).any():
            return super()._check_gathered(dst, idx_mapping, num_computed_tokens)
        named = []
        for g in range(self.num_kv_cache_groups):
            for b, r in enumerate(idx_mapping.cpu().tolist()[:8]):
                if r >= 0:
                    named.append(
                        f"group {g}: batch row {b} (request row {r}) read num_blocks.gpu = "
                        f"{int(counts[0][g, r])} but num_blocks.np = {int(counts[1][g, r])}"
                    )
        raise integrity.IntegrityError("gather_block_tables: " + "; ".join(named))
