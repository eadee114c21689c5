"""Wrong implementations, one bug each, and the check of SPEC.md section 6 that catches it.

`CATALOGUE` maps a short name to (`--impl` spec, check number). The classes
live by family: slot mappings (`catalogue_slots`), gathered tables
(`catalogue_tables`), the write path (`catalogue_writes`), all subclasses of
the correct `StandInBlockTables`, calls that must fail and do not
(`catalogue_contract`, caught by the harness's probes), and bugs layered on
the project's own `BlockTables` (`catalogue_ours`), to show that the harness catches a bug on
the real kernels too. Every class is importable from this module, so the
specs read `tests.wrong_impls.catalogue:Name`.
"""

from __future__ import annotations

from .catalogue_contract import (
    InterleaveNotChecked,
    KernelBlocksNotChecked,
    OursIntegrityEntryByParity,
    OursIntegrityNamesCutRows,
    OursIntegrityNamesDummyRows,
    OursIntegrityNamesEveryRowStale,
    OursIntegrityNamesMatchingGroups,
    OursIntegrityNamesSlotsBelowNone,
    OursIntegrityNeverOn,
    OursIntegrityNullBlockOneSlotLong,
    OursIntegrityStaleCancels,
    OursIntegrityTrustsDeviceCounts,
    OursLengthsByIdentity,
    OursOffsetBitsPerBlock,
    OursOutListByIdentity,
    OursPositionsBelow2To61,
    OursPositionsCheckedOnDisabledGroups,
    OursSpanByPower,
    RankWrapped,
)
from .catalogue_ours import (
    OursCutWriteKeepsLength,
    OursDeviceByIndex,
    OursDummyNotDirty,
    OursGatherFirstProgramRows,
    OursInt32PathBelow2To30,
    OursInt32Slots,
    OursKernelIdsByOr,
    OursNoWindowMask,
    OursNullBlockRefused,
    OursPowersOfTwoByAllOnes,
    OursRowsByWidth,
    OursTwoGroupsUnfused,
    OursUnitBlockMaskedUnwindowed,
)
from .catalogue_slots import (
    AllRanksWrite,
    BatchIndexAsRow,
    CpModuloAsMask,
    DisabledGroupWritten,
    DroppedInterleaveRemainder,
    DummyTokensWritten,
    Int32Slots,
    LastRankOffByOne,
    MissingTailPadding,
    PositionsIgnored,
    RareWrongSlot,
    SlotOutIgnored,
    TailClearCapped,
    TokensPastTileDropped,
    UnshardedGroupSharded,
    VirtualBlockFromAllocator,
    VirtualBlockIgnored,
    WrongOwner,
)
from .catalogue_tables import (
    DummyRowsRead,
    DummyRunKeepsTables,
    DummyTablesNotDirty,
    GatherOutIgnored,
    MaskingUnderCp,
    NctRemembered,
    OutGatherMovesDirtyRows,
    StaleDirtyRows,
    WideRowsTruncated,
    WindowOffByOne,
)
from .catalogue_writes import (
    CapacityBeforeExpansion,
    CountsInAllocatorBlocks,
    ExpansionReversed,
    IgnoredOverwrite,
    LaterGroupsNotApplied,
    OverflowClamped,
    OverflowPartlyStaged,
    RedirectAfterExpansion,
    RedirectIgnored,
    StagedWritesCapped,
    StagedWritesReversed,
    StartFromAppliedCount,
)

_MODULE = "tests.wrong_impls.catalogue"


def _entry(cls: type, check: int) -> tuple[str, int]:
    return f"{_MODULE}:{cls.__name__}", check


CATALOGUE: dict[str, tuple[str, int]] = {
    "wrong_owner": _entry(WrongOwner, 1),
    "dropped_interleave_remainder": _entry(DroppedInterleaveRemainder, 1),
    "unsharded_group_sharded": _entry(UnshardedGroupSharded, 2),
    "missing_tail_padding": _entry(MissingTailPadding, 3),
    "dummy_rows_read": _entry(DummyRowsRead, 6),
    "dummy_tokens_written": _entry(DummyTokensWritten, 3),
    "stale_dirty_rows": _entry(StaleDirtyRows, 6),
    "window_off_by_one": _entry(WindowOffByOne, 6),
    "masking_under_cp": _entry(MaskingUnderCp, 6),
    "int32_slots": _entry(Int32Slots, 2),
    "ignored_overwrite": _entry(IgnoredOverwrite, 6),
    "positions_ignored": _entry(PositionsIgnored, 2),
    "batch_index_as_row": _entry(BatchIndexAsRow, 2),
    "all_ranks_write": _entry(AllRanksWrite, 1),
    "redirect_ignored": _entry(RedirectIgnored, 6),
    "dummy_run_keeps_tables": _entry(DummyRunKeepsTables, 6),
    "disabled_group_written": _entry(DisabledGroupWritten, 3),
    "virtual_block_ignored": _entry(VirtualBlockIgnored, 1),
    "later_groups_not_applied": _entry(LaterGroupsNotApplied, 6),
    "ours_int32_slots": _entry(OursInt32Slots, 2),
    "ours_no_window_mask": _entry(OursNoWindowMask, 6),
    "ours_rows_by_width": _entry(OursRowsByWidth, 11),
    "ours_two_groups_unfused": _entry(OursTwoGroupsUnfused, 6),
    "ours_cut_write_keeps_length": _entry(OursCutWriteKeepsLength, 6),
    "ours_null_block_refused": _entry(OursNullBlockRefused, 0),
    "dummy_tables_not_dirty": _entry(DummyTablesNotDirty, 6),
    "ours_dummy_not_dirty": _entry(OursDummyNotDirty, 6),
    "tokens_past_tile_dropped": _entry(TokensPastTileDropped, 1),
    "wide_rows_truncated": _entry(WideRowsTruncated, 6),
    "tail_clear_capped": _entry(TailClearCapped, 3),
    "staged_writes_capped": _entry(StagedWritesCapped, 6),
    "staged_writes_reversed": _entry(StagedWritesReversed, 6),
    "start_from_applied_count": _entry(StartFromAppliedCount, 6),
    "gather_out_ignored": _entry(GatherOutIgnored, 6),
    "slot_out_ignored": _entry(SlotOutIgnored, 3),
    "out_gather_moves_dirty_rows": _entry(OutGatherMovesDirtyRows, 6),
    "nct_remembered": _entry(NctRemembered, 6),
    "overflow_clamped": _entry(OverflowClamped, 8),
    "overflow_partly_staged": _entry(OverflowPartlyStaged, 6),
    "rare_wrong_slot": _entry(RareWrongSlot, 2),
    "last_rank_off_by_one": _entry(LastRankOffByOne, 1),
    "cp_modulo_as_mask": _entry(CpModuloAsMask, 1),
    "virtual_block_from_allocator": _entry(VirtualBlockFromAllocator, 2),
    "expansion_reversed": _entry(ExpansionReversed, 6),
    "counts_in_allocator_blocks": _entry(CountsInAllocatorBlocks, 6),
    "capacity_before_expansion": _entry(CapacityBeforeExpansion, 8),
    "redirect_after_expansion": _entry(RedirectAfterExpansion, 6),
    "interleave_not_checked": _entry(InterleaveNotChecked, 9),
    "rank_wrapped": _entry(RankWrapped, 9),
    "kernel_blocks_not_checked": _entry(KernelBlocksNotChecked, 9),
    "ours_integrity_never_on": _entry(OursIntegrityNeverOn, 10),
    "ours_integrity_trusts_device_counts": _entry(OursIntegrityTrustsDeviceCounts, 10),
    "ours_integrity_names_matching_groups": _entry(OursIntegrityNamesMatchingGroups, 10),
    "ours_integrity_names_cut_rows": _entry(OursIntegrityNamesCutRows, 10),
    "ours_integrity_null_block_one_slot_long": _entry(OursIntegrityNullBlockOneSlotLong, 10),
    "ours_integrity_names_slots_below_none": _entry(OursIntegrityNamesSlotsBelowNone, 10),
    "ours_offset_bits_per_block": _entry(OursOffsetBitsPerBlock, 9),
    "ours_integrity_names_every_row_stale": _entry(OursIntegrityNamesEveryRowStale, 10),
    "ours_positions_checked_on_disabled_groups": _entry(OursPositionsCheckedOnDisabledGroups, 9),
    "ours_integrity_entry_by_parity": _entry(OursIntegrityEntryByParity, 10),
    "ours_lengths_by_identity": _entry(OursLengthsByIdentity, 9),
    "ours_span_by_power": _entry(OursSpanByPower, 0),
    "ours_gather_first_program_rows": _entry(OursGatherFirstProgramRows, 6),
    "ours_device_by_index": _entry(OursDeviceByIndex, 0),
    "ours_positions_below_2_61": _entry(OursPositionsBelow2To61, 9),
    "ours_out_list_by_identity": _entry(OursOutListByIdentity, 9),
    "ours_kernel_ids_by_or": _entry(OursKernelIdsByOr, 6),
    "ours_integrity_names_dummy_rows": _entry(OursIntegrityNamesDummyRows, 10),
    "ours_integrity_stale_cancels": _entry(OursIntegrityStaleCancels, 10),
    "ours_unit_block_masked_unwindowed": _entry(OursUnitBlockMaskedUnwindowed, 6),
    "ours_int32_path_below_2_30": _entry(OursInt32PathBelow2To30, 1),
    "ours_powers_of_two_by_all_ones": _entry(OursPowersOfTwoByAllOnes, 1),
}
"""name -> (`--impl` spec, the check that must report it)."""
