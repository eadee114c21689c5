"""The sweep's presets (`make verify`): together they cover cp_size 1, 2, 3, 4 and 8,
interleave 1 up to the block size, kernel block sizes, zero to six groups, sliding
windows and every corner of the contract (`preset_spec.CORNERS`). Those whose tables
or positions pass 2**31 live in `preset_span`, those of zero, one and six groups in
`preset_groups`.
"""

from __future__ import annotations

from .preset_spec import GroupSpec, Preset

COMMON = frozenset(
    {
        "prefix_cached_start",
        "chunked_prefill",
        "decode",
        "batch_order_shuffled",
        "dummy_request",
        "padded_tokens",
        "padded_reqs",
        "smaller_step",
        "smaller_batch",
        "row_reused",
        "block_reused",
        "dummy_run",
        "dummy_zero_reqs",
        "dummy_full_tokens",
        "dummy_zero_tokens",
        "positions_tail_garbage",
        "request_finished",
        "two_appends_one_row",
        "append_then_overwrite",
        "gather_out",
        "gather_out_ptrs",
        "slot_out",
        "nct_present",
        "nct_absent",
        "profiling_writes",
        "overflow_refused",
        "fused_read",
    }
)
"""Corners that presets running ordinary mixed traffic promise (the mutation presets too)."""

_DUMMY_IN_TABLE = frozenset({"dummy_token_in_table"})
"""Promised by the sweep's presets whose every CP group (seeds 0 to 7) reaches it."""

_KERNEL = frozenset(
    {"kernel_blocks", "kernel_blocks_mixed", "warmup_redirect", "top_block_id", "null_block_id"}
)
"""Corners of the kernel-block-size presets (SPEC.md 8.1)."""

SWEEP_PRESETS: tuple[Preset, ...] = (
    Preset(
        name="default",
        description="cp 4, interleave 2: sharded, unsharded and disabled groups of three block "
        "sizes, a window configured under CP, speculative decode, warm-up",
        groups=(
            GroupSpec(16),
            GroupSpec(32, window=40),
            GroupSpec(16, sharded=False),
            GroupSpec(64, enabled=False),
        ),
        cp_size=4,
        cp_interleave=2,
        num_steps=19,
        max_num_reqs=24,
        max_num_batched_tokens=384,
        max_model_len=1536,
        max_batch_reqs=12,
        max_prefill_chunk=160,
        max_prompt_len=900,
        max_decode_len=40,
        spec_tokens=3,
        warmup_steps=1,
        corners=_DUMMY_IN_TABLE
        | COMMON
        | {"profiled_rows_reclaimed"}
        | {
            "interleave_between",
            "mixed_groups",
            "several_block_sizes",
            "spec_decode",
            "spec_rejected",
            "window_configured_under_cp",
            "warmup_redirect",
            "top_block_id",
            "null_block_id",
        },
    ),
    Preset(
        name="cp1-window",
        description="cp 1: full-attention and sliding-window groups whose freed blocks go to "
        "other requests; block ids whose slots pass 2**31",
        groups=(
            GroupSpec(16),
            GroupSpec(32, window=48),
            GroupSpec(16, window=21),
            GroupSpec(64, enabled=False),
        ),
        cp_size=1,
        cp_interleave=1,
        num_steps=22,
        max_num_reqs=16,
        max_num_batched_tokens=256,
        max_model_len=1024,
        max_batch_reqs=8,
        max_prefill_chunk=96,
        max_prompt_len=600,
        max_decode_len=60,
        spec_tokens=2,
        block_id_base=2**27 + 3,
        warmup_steps=1,
        corners=_DUMMY_IN_TABLE
        | COMMON
        | {"profiled_rows_reclaimed"}
        | {
            "several_block_sizes",
            "spec_decode",
            "spec_rejected",
            "slot_past_2_31",
            "window_freed_reused",
            "window_boundary",
            "warmup_redirect",
            "top_block_id",
            "null_block_id",
        },
    ),
    Preset(
        name="cp2-i1",
        description="cp 2, interleave 1: sharded, unsharded and disabled groups side by side; "
        "integrity checks on (SPEC.md 8.3: no false alarm, and the probes' faults raise), "
        "with a group of block size 2 whose ids start at 1: slots 1 and 2 beside tokens "
        "without a slot",
        groups=(
            GroupSpec(16),
            GroupSpec(32, sharded=False),
            GroupSpec(16, enabled=False),
            GroupSpec(8),
            # Block 1 holds slots 2 and 3: slot 2 beside a token 0 that a rank does not own.
            GroupSpec(2, first_block_id=1),
        ),
        block_id_base=2**16,  # the other groups' ids lie above group 4's
        cp_size=2,
        cp_interleave=1,
        num_steps=19,
        max_num_reqs=16,
        max_num_batched_tokens=256,
        max_model_len=1024,
        max_batch_reqs=8,
        max_prefill_chunk=96,
        max_prompt_len=600,
        max_decode_len=40,
        spec_tokens=2,
        integrity_checks=True,
        corners=_DUMMY_IN_TABLE
        | COMMON
        | {"profiled_rows_reclaimed"}
        | {"interleave_1", "mixed_groups", "several_block_sizes", "spec_decode", "spec_rejected"}
        | {"small_slot_beside_pad"},
    ),
    Preset(
        name="cp4-interleave",
        description="cp 4, interleave 8: equal to one group's block size and between 1 and "
        "another's",
        groups=(GroupSpec(8), GroupSpec(32), GroupSpec(16, sharded=False)),
        cp_size=4,
        cp_interleave=8,
        num_steps=19,
        max_num_reqs=16,
        max_num_batched_tokens=256,
        max_model_len=1536,
        max_batch_reqs=8,
        max_prefill_chunk=128,
        max_prompt_len=900,
        max_decode_len=40,
        spec_tokens=3,
        corners=_DUMMY_IN_TABLE
        | COMMON
        | {
            "interleave_eq_block",
            "interleave_between",
            "several_block_sizes",
            "spec_decode",
            "spec_rejected",
        },
    ),
    Preset(
        name="cp8-large-ids",
        description="cp 8, interleave 2: block ids near 2**31 so every slot passes 2**31",
        groups=(GroupSpec(16), GroupSpec(64), GroupSpec(16, sharded=False, enabled=False)),
        cp_size=8,
        cp_interleave=2,
        num_steps=25,
        max_num_reqs=16,
        max_num_batched_tokens=256,
        max_model_len=2048,
        max_batch_reqs=8,
        max_prefill_chunk=160,
        max_prompt_len=1200,
        max_decode_len=40,
        spec_tokens=1,
        block_id_base=2**31 - 2**20,
        corners=_DUMMY_IN_TABLE
        | COMMON
        | {
            "interleave_between",
            "several_block_sizes",
            "slot_past_2_31",
            "spec_decode",
            "overwrite_cuts_full_append",
        },
    ),
    Preset(
        name="cp3-no-power-of-two",
        description="cp 3, interleave 3: every group sharded and no block size a power of "
        "two, so a slot mapping must divide; kernel blocks a third of a block; a sliding "
        "window; at world size 8 two CP groups run it and two ranks sit it out",
        groups=(GroupSpec(12), GroupSpec(6), GroupSpec(18, window=50, kernel_block_size=6)),
        cp_size=3,
        cp_interleave=3,
        num_steps=16,
        max_num_reqs=12,
        max_num_batched_tokens=240,
        max_model_len=1080,
        max_batch_reqs=8,
        max_prefill_chunk=96,
        max_prompt_len=600,
        max_decode_len=40,
        spec_tokens=2,
        corners=_DUMMY_IN_TABLE
        | COMMON
        | {
            "no_power_of_two",
            "interleave_between",
            "several_block_sizes",
            "kernel_blocks",
            "kernel_blocks_mixed",
            "kernel_ratio_not_power_of_two",
            "spec_rejected",
            "spec_decode",
            "window_configured_under_cp",
        },
    ),
    Preset(
        name="large-steps",
        description="cp 4: a request of 8,400 tokens in one step, then a step 8,192+ tokens "
        "smaller, of a request or two; rows of 2,100+ blocks; batches of exactly max_num_reqs "
        "requests, gathered 20 rows of 2,560 columns at a time; one apply with more writes "
        "than max_num_reqs",
        groups=(GroupSpec(16), GroupSpec(4, sharded=False), GroupSpec(32, enabled=False)),
        cp_size=4,
        cp_interleave=4,
        num_steps=8,
        max_num_reqs=20,
        max_num_batched_tokens=9216,
        max_model_len=10240,
        max_batch_reqs=20,
        max_prefill_chunk=8400,
        max_prompt_len=400,
        max_decode_len=40,
        spec_tokens=2,
        giant_prefill=8400,
        fill_batches=True,
        corners=frozenset(
            {
                "giant_request_step",
                "giant_shrink",
                "short_step_long_buffer",
                "wide_row",
                "full_batch",
                "wide_gather",
                "writes_past_max_reqs",
                "two_appends_one_row",
                "decode",
                "smaller_step",
                "mixed_groups",
                "interleave_between",
            }
        ),
    ),
    Preset(
        name="kbs-cp1",
        description="cp 1, kernel block sizes (SPEC.md 8.1): ratios 4, 1, 4 and 2 side by side, "
        "a window masked per kernel block, slots past 2**31",
        groups=(
            GroupSpec(64, kernel_block_size=16),
            GroupSpec(32),
            GroupSpec(32, window=40, kernel_block_size=8),
            GroupSpec(16, enabled=False, kernel_block_size=8),
        ),
        cp_size=1,
        cp_interleave=1,
        num_steps=16,
        max_num_reqs=8,
        max_num_batched_tokens=256,
        max_model_len=1024,
        max_batch_reqs=8,
        max_prefill_chunk=128,
        max_prompt_len=600,
        max_decode_len=40,
        spec_tokens=2,
        block_id_base=2**27 + 5,
        warmup_steps=1,
        corners=_DUMMY_IN_TABLE
        | COMMON
        | _KERNEL
        | {"several_block_sizes", "slot_past_2_31", "window_boundary", "window_freed_reused"},
    ),
    Preset(
        name="kbs-cp4",
        description="cp 4, interleave 4 = one group's kernel block: kernel block sizes on "
        "sharded and unsharded groups, ratios 4, 4, 1 and 2",
        groups=(
            GroupSpec(16, kernel_block_size=4),
            GroupSpec(32, kernel_block_size=8),
            GroupSpec(16, sharded=False),
            GroupSpec(64, sharded=False, kernel_block_size=32),
        ),
        cp_size=4,
        cp_interleave=4,
        num_steps=21,
        max_num_reqs=8,
        max_num_batched_tokens=256,
        max_model_len=1536,
        max_batch_reqs=8,
        max_prefill_chunk=128,
        max_prompt_len=900,
        max_decode_len=40,
        spec_tokens=3,
        warmup_steps=1,
        corners=_DUMMY_IN_TABLE
        | COMMON
        | _KERNEL
        | {"interleave_eq_kernel", "interleave_between", "full_step", "full_step_one_token_last"},
    ),
)
