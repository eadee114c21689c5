"""Deliberately wrong `BlockTables` implementations: the harness must catch every one.

`stand_in.StandInBlockTables` is a small, correct, pure-torch implementation of
SPEC.md section 3 (written without `cp_blocktables.reference`), split into
hooks; each class of `catalogue` (defined by family in `catalogue_slots`,
`catalogue_tables`, `catalogue_writes` and `catalogue_ours`) overrides one hook
with a bug an engineer could plausibly write, and names the check of SPEC.md
section 6 that must catch it.
"""
