"""The sweep's presets past 2**31: tables that span 2**31 positions, positions past it.

A slot mapping may compute positions in int32 only while every table spans
fewer than 2**31 positions (`kernels.slot_mappings`, `POS32`); past that it
must take int64, and a position past 2**31 must map to its slot, not fall
outside every table. `cp8-span-2-31` makes the tables span 2**31 positions
with short requests; `cp2-past-2-31` puts requests past position 2**31
(`Preset.far_start`, unseeded prefixes) in tables that span 2**31 only with
their CP factor; `cp2-below-2-31` puts them at the top of tables that span
just under 2**31 positions, where the int32 path must still map positions
past 2**30.
"""

from __future__ import annotations

from .preset_catalog import _DUMMY_IN_TABLE, COMMON
from .preset_spec import GroupSpec, Preset

_BELOW_2_31 = 2**31 - 2**21
"""Tables of 1,023 virtual blocks of 2**21 positions (2,046 of 2**20 unsharded)."""

_FAR_TRAFFIC = dict(
    cp_size=2,
    cp_interleave=8,
    num_steps=12,
    max_num_reqs=4,
    max_num_batched_tokens=128,
    max_batch_reqs=4,
    max_prefill_chunk=48,
    max_prompt_len=96,
    max_decode_len=16,
    spec_tokens=2,
    prefix_prob=0.5,  # every prefix-cached request starts far out
)
"""The traffic of the presets whose prefix-cached requests start far out (`far_start`)."""

_FAR_CORNERS = _DUMMY_IN_TABLE | (COMMON - {"prefix_cached_start"})
"""Their common corners: every prefix-cached request starts far out, its prefix unseeded,
so none is seeded."""

SPAN_PRESETS: tuple[Preset, ...] = (
    Preset(
        name="cp8-span-2-31",
        description="cp 8, interleave 16: block sizes of 2**18 to 2**21 tokens, so every "
        "table row spans 2**31 positions (the slot mapping's int64 position path) in 1,024 "
        "columns, and one group whose single block of 2**31 tokens spans them; short requests",
        groups=(
            GroupSpec(2**18),
            GroupSpec(2**19, kernel_block_size=2**18),
            GroupSpec(2**21, sharded=False),
            GroupSpec(2**18, enabled=False),
            # One column of 2**31 positions: its block size itself does not fit int32.
            GroupSpec(2**31, sharded=False),
        ),
        cp_size=8,
        cp_interleave=16,
        num_steps=16,
        max_num_reqs=8,
        max_num_batched_tokens=256,
        max_model_len=2**31,
        max_batch_reqs=8,
        max_prefill_chunk=128,
        max_prompt_len=300,
        max_decode_len=40,
        spec_tokens=2,
        prefix_prob=0.0,  # a prefix-cached start lies a virtual block (2**19+) from 0
        # One block holds a whole request: no append carries two blocks to split.
        corners=(COMMON - {"prefix_cached_start", "two_appends_one_row"})
        | {
            "span_past_2_31",
            "slot_past_2_31",
            "interleave_between",
            "overwrite_cuts_full_append",
            "mixed_groups",
            "several_block_sizes",
            "kernel_blocks",
            "kernel_blocks_mixed",
            "spec_decode",
            "spec_rejected",
        },
    ),
    Preset(
        name="cp2-past-2-31",
        description="cp 2, interleave 8: requests that start just below position 2**31 and "
        "run past it (prefixes not seeded), in tables of blocks of 2**20 and 2**21 tokens "
        "that span 2**31 positions only with the CP factor; short requests from 0 beside them; "
        "exactly two groups, the commonest hybrid model and the fused apply's fewest tables",
        # No kernel blocks (SPEC.md 8.1), so that implementations without them run it too.
        groups=(GroupSpec(2**20), GroupSpec(2**21)),
        max_model_len=2**31 + 256,
        far_start=2**31,
        **_FAR_TRAFFIC,
        corners=_FAR_CORNERS
        | {
            "position_past_2_31",
            "past_2_31_by_cp",
            "two_groups",
            "span_past_2_31",
            "slot_past_2_31",
            "interleave_between",
            "several_block_sizes",
            "spec_decode",
            "spec_rejected",
        },
    ),
    Preset(
        name="cp2-below-2-31",
        description="cp 2, interleave 8: requests that start just below the top of tables "
        "spanning 2**31 - 2**21 positions (prefixes not seeded), so positions past 2**30 on "
        "the slot mapping's int32 path; a sharded and an unsharded group of blocks of 2**20 "
        "tokens; short requests from 0 beside them",
        groups=(GroupSpec(2**20), GroupSpec(2**20, sharded=False)),
        max_model_len=_BELOW_2_31,
        far_start=_BELOW_2_31 - 256,
        **_FAR_TRAFFIC,
        corners=_FAR_CORNERS
        | {
            "past_2_30_int32",
            "two_groups",
            "slot_past_2_31",
            "interleave_between",
            "spec_decode",
            "spec_rejected",
        },
    ),
)
"""In sweep order; `preset_catalog` and `preset_groups` hold the others."""
