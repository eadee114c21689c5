"""Presets outside the sweep: benchmark workloads and the small, fast mutation-testing ones."""

from __future__ import annotations

import dataclasses

from .preset_catalog import COMMON
from .preset_spec import GroupSpec, Preset

_BENCH_64K = Preset(
    name="bench-64k",
    description="cp 4: steps of about 64K tokens (benchmark, not in the sweep)",
    groups=(GroupSpec(16), GroupSpec(64, sharded=False)),
    cp_size=4,
    cp_interleave=4,
    num_steps=4,
    max_num_reqs=48,
    max_num_batched_tokens=65536,
    max_model_len=262144,
    max_batch_reqs=40,
    max_prefill_chunk=16384,
    max_prompt_len=65536,
    max_decode_len=8,
    prefix_prob=0.0,
    dummy_req_prob=0.0,
    dummy_run_prob=0.0,
    fill_batches=True,
)

BENCH_PRESETS: tuple[Preset, ...] = (
    _BENCH_64K,
    dataclasses.replace(
        _BENCH_64K,
        name="bench-1m",
        description="cp 4: steps of about 1M tokens (benchmark, not in the sweep; for GPUs)",
        num_steps=3,
        max_num_batched_tokens=1 << 20,
        max_model_len=1 << 21,
        max_prefill_chunk=1 << 17,
        max_prompt_len=1 << 20,
    ),
)

# Mutation testing (`cp-blocktables mutate`): every mutant reruns the harness, so these two
# are small and fast yet reach what the sweep reaches. `mutation` (cp 2) runs the kernels'
# power-of-two fast path and every CP corner; `mutation-cp1` the general (division) path,
# sliding-window masking at its boundary and slots past 2**31, which need cp_size 1 or odd
# sizes. Run both: `--preset mutation --preset mutation-cp1` (docs/mutation.md).
_MUTATION_COMMON = dict(
    num_steps=16,
    max_num_reqs=8,
    max_num_batched_tokens=64,
    max_batch_reqs=6,
    max_prefill_chunk=24,
    max_decode_len=10,
    spec_tokens=2,
    warmup_steps=1,
    dummy_run_prob=0.15,
)
MUTATION_PRESETS: tuple[Preset, ...] = (
    Preset(
        name="mutation",
        description="cp 2, interleave 2: sharded (I < bs and I = bs), unsharded and disabled "
        "groups, a window configured under CP, warm-up; small and fast (mutation testing)",
        groups=(
            GroupSpec(8),
            GroupSpec(2),
            GroupSpec(4, sharded=False, window=6),
            GroupSpec(16, enabled=False),
        ),
        cp_size=2,
        cp_interleave=2,
        max_model_len=160,
        max_prompt_len=120,
        block_id_base=2**30 + 5,
        corners=COMMON
        | {
            "interleave_between",
            "interleave_eq_block",
            "mixed_groups",
            "several_block_sizes",
            "spec_decode",
            "spec_rejected",
            "window_configured_under_cp",
            "warmup_redirect",
            "slot_past_2_31",
        },
        **_MUTATION_COMMON,
    ),
    Preset(
        name="mutation-cp1",
        description="cp 1: block sizes that are not powers of two (the kernels' general path), "
        "windows whose freed blocks are reused, gathers at a window boundary; small and fast",
        groups=(GroupSpec(6), GroupSpec(4, window=9), GroupSpec(12, enabled=False)),
        cp_size=1,
        cp_interleave=1,
        max_model_len=160,
        max_prompt_len=120,
        block_id_base=2**30 + 7,
        corners=COMMON
        | {
            "several_block_sizes",
            "spec_decode",
            "spec_rejected",
            "slot_past_2_31",
            "window_freed_reused",
            "window_boundary",
            "warmup_redirect",
        },
        **_MUTATION_COMMON,
    ),
)
