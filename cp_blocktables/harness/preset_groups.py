"""The sweep's presets of zero, one and six KV-cache groups, and of blocks of one slot.

How many groups there are is a regime of its own: with none, every method must
still work and return empty results; with one, the apply takes its single-table
path (no fused writer); with six, the fused launch carries groups of block sizes
4 to 128 and two sliding windows of other reaches side by side. A block of one slot
under CP is a regime too: a sharded group's positions run to twice its width in blocks.
So are sizes one below a power of two (3, 7, 15: all ones in binary), the numbers a
power-of-two test most easily takes for powers of two when every size is one.
"""

from __future__ import annotations

from .preset_spec import GroupSpec, Preset

GROUP_PRESETS: tuple[Preset, ...] = (
    Preset(
        name="cp2-unit-blocks",
        description="cp 2, interleave 1: a sharded group of block size 1 (one slot a block, "
        "so only the virtual block reaches the second half of its positions) beside blocks "
        "of 2 and 4",
        groups=(GroupSpec(1), GroupSpec(2), GroupSpec(4, sharded=False)),
        cp_size=2,
        cp_interleave=1,
        num_steps=10,
        max_num_reqs=4,
        max_num_batched_tokens=64,
        max_model_len=256,
        max_batch_reqs=4,
        max_prefill_chunk=48,
        max_prompt_len=200,
        max_decode_len=16,
        corners=frozenset({"unit_block_past_width", "interleave_1", "several_block_sizes"}),
    ),
    Preset(
        name="cp3-all-ones",
        description="cp 3, interleave 3: block sizes 3 and 15 sharded, 7 unsharded, so every "
        "size a slot mapping divides by is one below a power of two (all ones in binary) and "
        "a power-of-two test that errs on such numbers shifts where it must divide; at world "
        "size 8 two CP groups run it and two ranks sit it out",
        groups=(GroupSpec(3), GroupSpec(15), GroupSpec(7, sharded=False)),
        cp_size=3,
        cp_interleave=3,
        num_steps=8,
        max_num_reqs=4,
        max_num_batched_tokens=64,
        max_model_len=360,
        max_batch_reqs=4,
        max_prefill_chunk=48,
        max_prompt_len=200,
        max_decode_len=16,
        corners=frozenset(
            {"all_ones_sizes", "interleave_eq_block", "interleave_between", "several_block_sizes"}
        ),
    ),
    Preset(
        name="groups-0",
        description="cp 2, no KV-cache group at all: every method still works",
        groups=(),
        cp_size=2,
        cp_interleave=1,
        num_steps=6,
        max_num_reqs=4,
        max_num_batched_tokens=64,
        max_model_len=256,
        max_batch_reqs=4,
        max_prefill_chunk=32,
        max_prompt_len=100,
        max_decode_len=10,
        prefix_prob=0.0,
        corners=frozenset({"zero_groups", "dummy_run"}),
    ),
    Preset(
        name="groups-1",
        description="cp 2, one group: the single-table apply path (no fused writer); a "
        "full batch of short requests filling the token buffer; block size 20, the layout's "
        "one size that is not a power of two (even, no two adjacent bits set)",
        groups=(GroupSpec(20),),
        cp_size=2,
        cp_interleave=2,
        num_steps=18,
        max_num_reqs=4,
        max_num_batched_tokens=256,
        max_model_len=1024,
        max_batch_reqs=4,
        max_prefill_chunk=64,
        max_prompt_len=500,
        max_decode_len=20,
        spec_tokens=1,
        probe_buffer_lengths=(1000, 4001),
        corners=frozenset(
            {
                "one_group",
                "lone_non_power_of_two",
                "writes_past_max_reqs",
                "two_appends_one_row",
                "overflow_refused",
                "full_batch",
                "full_step",
                "full_step_one_token_last",
                "gather_out",
                "slot_out",
                "profiling_writes",
                "request_finished",
            }
        ),
    ),
    Preset(
        name="groups-6",
        description="cp 1, six groups: block sizes 1 to 128, two windows of other reaches",
        groups=(
            GroupSpec(16),
            GroupSpec(32, window=64),
            GroupSpec(1),
            GroupSpec(128),
            GroupSpec(16, enabled=False),
            GroupSpec(4, window=10),
        ),
        cp_size=1,
        cp_interleave=1,
        num_steps=12,
        max_num_reqs=4,
        max_num_batched_tokens=128,
        max_model_len=768,
        max_batch_reqs=4,
        max_prefill_chunk=64,
        max_prompt_len=400,
        max_decode_len=20,
        corners=frozenset(
            {
                "many_groups",
                "unit_block_beside_window",
                "writes_past_max_reqs",
                "append_then_overwrite",
                "overflow_refused",
                "window_boundary",
                "nct_absent",
                "profiling_writes",
            }
        ),
    ),
)
"""In sweep order; `preset_catalog.SWEEP_PRESETS` and `preset_span.SPAN_PRESETS` hold the others."""
