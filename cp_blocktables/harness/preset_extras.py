"""Presets outside the sweep: benchmark workloads and the small, fast mutation-testing ones."""

from __future__ import annotations

import dataclasses

from .preset_catalog import _KERNEL as KERNEL_CORNERS
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

# Mutation testing (`cp-blocktables mutate`): every mutant reruns the harness, so these three
# are small and fast yet reach what the sweep reaches. `mutation` (cp 2) runs the kernels'
# power-of-two fast path, every CP corner, kernel blocks under CP and five groups;
# `mutation-cp1` the general (division) path without kernel blocks (the common append
# path), sliding-window masking at its boundary and slots past 2**31; `mutation-odd` (cp 2,
# interleave 3, one group of kernel blocks that are not powers of two) the general path
# under CP and the single-group apply path. cp1 and odd run with integrity checks on.
# Each promises the argument paths (out buffers, nct present and absent, profiling writes,
# overflow refused, several appends to one row, writes past max_num_reqs). Run all three:
# `--preset mutation --preset mutation-cp1 --preset mutation-odd` (docs/mutation.md).
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
        description="cp 2, interleave 4: sharded (I < bs, I = bs, I = kernel block < bs), "
        "unsharded and disabled groups, a window configured under CP, warm-up; small and fast "
        "(mutation testing)",
        groups=(
            GroupSpec(8),
            GroupSpec(4),
            GroupSpec(4, sharded=False, window=6),
            GroupSpec(16, enabled=False),
            GroupSpec(8, kernel_block_size=4),
        ),
        cp_size=2,
        cp_interleave=4,  # not 2: a shift of `bit_length() >> 1` is right at 2, wrong at 4
        max_model_len=160,
        max_prompt_len=120,
        block_id_base=2**28 + 5,
        corners=COMMON
        | {"writes_past_max_reqs"}
        | KERNEL_CORNERS
        | {
            "interleave_between",
            "interleave_eq_block",
            "interleave_eq_kernel",
            "mixed_groups",
            "many_groups",
            "several_block_sizes",
            "spec_decode",
            "spec_rejected",
            "window_configured_under_cp",
            "slot_past_2_31",
        },
        **{**_MUTATION_COMMON, "max_num_reqs": 6, "max_batch_reqs": 6},
    ),
    Preset(
        name="mutation-cp1",
        description="cp 1: block sizes that are not powers of two (the kernels' general path) "
        "and no kernel blocks (the common append path), windows whose freed blocks are "
        "reused, gathers at a window boundary; small and fast",
        groups=(
            # Sizes of the form 2**k - 1: a power-of-two test that is off by one (`n & (n + 1)`)
            # would send them down the shift-and-mask path, where they give wrong slots.
            GroupSpec(7),
            GroupSpec(3, window=9),
            GroupSpec(15, enabled=False),
            GroupSpec(5, window=1),  # the shortest window: masking must start at reach 1
        ),
        integrity_checks=True,  # SPEC.md 8.3: a false alarm of a check fails the run
        cp_size=1,
        cp_interleave=1,
        max_model_len=160,
        max_prompt_len=120,
        block_id_base=2**29 + 7,
        corners=COMMON
        | {"profiled_rows_reclaimed"}
        | {"warmup_redirect", "top_block_id", "null_block_id"}
        | {
            "several_block_sizes",
            "spec_decode",
            "spec_rejected",
            "slot_past_2_31",
            "window_freed_reused",
            "window_boundary",
        },
        **{**_MUTATION_COMMON, "num_steps": 18},
    ),
    Preset(
        name="mutation-odd",
        description="cp 2, interleave 3, one group of kernel blocks: the general (division) "
        "slot-mapping path under CP and the single-group apply path; small and fast",
        groups=(GroupSpec(12, kernel_block_size=6),),
        integrity_checks=True,  # SPEC.md 8.3: a false alarm of a check fails the run
        cp_size=2,
        cp_interleave=3,
        max_model_len=160,
        max_prompt_len=120,
        block_id_base=2**28 + 3,
        corners=COMMON
        | {
            "one_group",
            "interleave_between",
            "kernel_blocks",
            "spec_decode",
            "spec_rejected",
            "warmup_redirect",
            "top_block_id",
            "null_block_id",
            "slot_past_2_31",
        },
        **{**_MUTATION_COMMON, "num_steps": 17},
    ),
)
