"""What a harness preset is: its KV-cache groups, its traffic knobs and the corners it promises.

A preset is what a person names on the command line (`--preset cp4-interleave`).
It fixes the KV-cache groups, the CP size and interleave, the table sizes, the
number of steps and how often each kind of traffic occurs, and it promises a
set of corners (SPEC.md section 6) that its workload must reach. The workload
generator counts every corner; a preset whose run misses a promised corner
fails (`missing_corners`).

The presets themselves live in `preset_catalog`, `preset_groups` and
`preset_span` (the sweep) and `preset_extras` (benchmarks, mutation testing);
`presets` registers them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..contract import INT32_MAX, BlockTablesConfig

CORNERS = (
    "interleave_1",
    "interleave_between",
    "interleave_eq_block",
    "mixed_groups",
    "several_block_sizes",
    "prefix_cached_start",
    "chunked_prefill",
    "decode",
    "spec_decode",
    "spec_rejected",
    "batch_order_shuffled",
    "dummy_request",
    "dummy_token_in_table",
    "padded_tokens",
    "padded_reqs",
    "smaller_step",
    "smaller_batch",
    "row_reused",
    "block_reused",
    "slot_past_2_31",
    "window_freed_reused",
    "window_boundary",
    "window_configured_under_cp",
    "dummy_run",
    "dummy_zero_reqs",
    "dummy_full_tokens",
    "dummy_zero_tokens",
    "warmup_redirect",
    "top_block_id",
    "null_block_id",
    "positions_tail_garbage",
    "request_finished",
    # Size regimes and argument paths an implementation may branch on (docs/harness.md).
    "giant_request_step",
    "giant_shrink",
    "short_step_long_buffer",
    "wide_row",
    "span_past_2_31",
    "position_past_2_31",
    "past_2_31_by_cp",
    "past_2_30_int32",
    "no_power_of_two",
    "lone_non_power_of_two",
    "all_ones_sizes",
    "full_batch",
    "wide_gather",
    "full_step",
    "full_step_one_token_last",
    "writes_past_max_reqs",
    "two_appends_one_row",
    "append_then_overwrite",
    "overwrite_cuts_full_append",
    "gather_out",
    "gather_out_ptrs",
    "slot_out",
    "nct_present",
    "nct_absent",
    "profiling_writes",
    "profiled_rows_reclaimed",
    "overflow_refused",
    "fused_read",
    "zero_groups",
    "one_group",
    "two_groups",
    "many_groups",
    "kernel_blocks",
    "kernel_blocks_mixed",
    "kernel_ratio_not_power_of_two",
    "interleave_eq_kernel",
    "small_slot_beside_pad",
    "unit_block_past_width",
    "unit_block_beside_window",
)
"""Every corner the workload generator counts (SPEC.md section 6's list, spelled out)."""


@dataclass(frozen=True)
class GroupSpec:
    """One KV-cache group: block size, DCP sharding, slot mapping on/off, sliding window.

    `kernel_block_size` (SPEC.md 8.1): the attention kernel's block, dividing
    `block_size`; 0 means equal to it (the constructor keyword is then omitted).
    `first_block_id`: the first id the workload gives this group; 0 means the
    preset's layout (`Preset.block_id_range`). A group of block size 1 or 2
    whose ids start at 1 writes slots 1 and 2, the smallest outside the null
    block, in a preset whose other ids lie far above.
    """

    block_size: int
    sharded: bool = True
    enabled: bool = True
    window: int = 0
    kernel_block_size: int = 0
    first_block_id: int = 0

    @property
    def kernel(self) -> int:
        return self.kernel_block_size or self.block_size


@dataclass(frozen=True)
class Preset:
    """A configuration and the traffic to drive through it.

    `max_model_len` bounds every position any request reaches (speculative
    tokens included); each group's table width is derived from it, so a
    request never passes its row capacity.

    `far_start` (0: off): every prefix-cached request starts at or just below
    this position (its prefix ends there) and its new tokens, up to
    `max_prompt_len` of prompt and then the decode, run past it. Its prefix is
    not seeded into the simulated KV caches and check 5 reads back only the
    positions from its start on, so a request past position 2**31 costs its
    new tokens, not 2**31 cache entries.

    `probe_buffer_lengths`: values of `max_num_batched_tokens` at which the
    first CP group's ranks map one short step beside the workload
    (`buffer_probes.probe_buffer_lengths`, check 9): lengths no preset's buffer
    has, each probed in under a second.
    """

    name: str
    description: str
    groups: tuple[GroupSpec, ...]
    cp_size: int
    cp_interleave: int
    num_steps: int
    max_num_reqs: int
    max_num_batched_tokens: int
    max_model_len: int
    max_batch_reqs: int
    max_prefill_chunk: int
    max_prompt_len: int
    max_decode_len: int
    spec_tokens: int = 0
    prefix_prob: float = 0.3
    block_id_base: int = 1
    dummy_req_prob: float = 0.3
    pad_prob: float = 0.5
    shuffle_prob: float = 0.7
    dummy_run_prob: float = 0.08
    warmup_steps: int = 0
    fill_batches: bool = False
    giant_prefill: int = 0
    multi_write_prob: float = 0.25
    overflow_prob: float = 0.04
    out_prob: float = 0.2
    nct_prob: float = 0.75
    profile_prob: float = 0.7
    fused_read_prob: float = 0.25
    integrity_checks: bool = False
    far_start: int = 0
    probe_buffer_lengths: tuple[int, ...] = ()
    corners: frozenset[str] = frozenset()

    def with_overrides(self, cp_size: int | None = None, num_steps: int | None = None) -> Preset:
        """The same traffic under another CP size or step count."""
        changes = {}
        if cp_size is not None:
            changes["cp_size"] = cp_size
        if num_steps is not None:
            changes["num_steps"] = num_steps
        return dataclasses.replace(self, **changes)

    @property
    def block_sizes(self) -> list[int]:
        return [g.block_size for g in self.groups]

    @property
    def kernel_block_sizes(self) -> list[int]:
        return [g.kernel for g in self.groups]

    def kernel_factor(self, g: int) -> int:
        """`m`: kernel blocks per allocator block of group `g`."""
        return self.groups[g].block_size // self.groups[g].kernel

    def constructor_needs(self) -> dict[str, str]:
        """Constructor keywords this preset sets to something other than their default.

        An implementation that does not accept one of them cannot run the preset
        (SPEC.md section 8: reported as not supported, never as a pass).
        """
        needs = {}
        if self.cp_size > 1:
            needs["cp_size"] = needs["cp_rank"] = f"cp_size {self.cp_size}"
        if self.cp_interleave != 1:
            needs["cp_interleave"] = f"cp_interleave {self.cp_interleave}"
        if not all(g.enabled for g in self.groups):
            needs["slot_mapping_enabled"] = "a group with slot mapping disabled"
        if self.cp_size > 1 and not all(g.sharded for g in self.groups):
            needs["dcp_sharded"] = "an unsharded group under CP"
        if any(g.window for g in self.groups):
            needs["sliding_window_reach"] = "a sliding window"
        if any(g.kernel != g.block_size for g in self.groups):
            needs["kernel_block_sizes"] = "kernel block sizes (SPEC.md 8.1)"
        return needs

    def group_cp_size(self, g: int) -> int:
        return self.cp_size if self.groups[g].sharded else 1

    def max_num_blocks_per_group(self) -> list[int]:
        return [
            math.ceil(self.max_model_len / (g.block_size * self.group_cp_size(i)))
            for i, g in enumerate(self.groups)
        ]

    def block_pool_size(self) -> int:
        """Block ids per group: enough that allocation never runs dry."""
        return self.max_num_reqs * max(self.max_num_blocks_per_group(), default=0) + 64

    def block_id_range(self, g: int) -> tuple[int, int]:
        """`(first, count)`: the block ids the workload hands group `g` (the null block aside).

        Group `g` takes `[block_id_base + g * pool, ... + pool)`, or the pool from
        its own `first_block_id` when it names one.
        """
        pool = self.block_pool_size()
        return self.groups[g].first_block_id or self.block_id_base + g * pool, pool

    def config(self, cp_rank: int = 0) -> BlockTablesConfig:
        """The validated constructor arguments of rank `cp_rank` (raises `ValueError`)."""
        return BlockTablesConfig(
            block_sizes=self.block_sizes,
            max_num_reqs=self.max_num_reqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_blocks_per_group=self.max_num_blocks_per_group(),
            cp_size=self.cp_size,
            cp_rank=cp_rank,
            cp_interleave=self.cp_interleave,
            slot_mapping_enabled=[g.enabled for g in self.groups],
            dcp_sharded=[g.sharded for g in self.groups],
            sliding_window_reach=[g.window for g in self.groups],
            kernel_block_sizes=self.kernel_block_sizes,
        )

    def validate(self) -> None:
        """Raise `ValueError` naming what makes this preset unusable."""
        self.config(0)
        if self.max_batch_reqs > self.max_num_reqs:
            raise ValueError(f"preset {self.name}: max_batch_reqs > max_num_reqs")
        longest = self.max_prompt_len + self.max_decode_len + self.spec_tokens + 1
        if longest > self.max_model_len:
            raise ValueError(
                f"preset {self.name}: prompt + decode + speculative tokens "
                f"({longest}) exceed max_model_len={self.max_model_len}"
            )
        if self.giant_prefill and (
            self.giant_prefill > min(self.max_prefill_chunk, self.max_num_batched_tokens - 16)
            or self.giant_prefill + self.max_decode_len + self.spec_tokens + 1 > self.max_model_len
        ):
            raise ValueError(
                f"preset {self.name}: giant_prefill {self.giant_prefill} must fit one chunk, "
                f"one step and max_model_len"
            )
        self._validate_block_ids()
        self._validate_far_start(longest)
        unknown = self.corners - set(CORNERS)
        if unknown:
            raise ValueError(f"preset {self.name}: unknown corners {sorted(unknown)}")

    def _validate_far_start(self, longest: int) -> None:
        """A far start's request must fit `max_model_len`; and no window may be configured:
        `num_computed_tokens` is int32, so a count past 2**31 is passed clamped, which only
        a window would read (`workload._Generator._real_step`)."""
        if not self.far_start:
            return
        if self.far_start < 0 or self.far_start + longest > self.max_model_len:
            raise ValueError(
                f"preset {self.name}: far_start {self.far_start} plus the longest request "
                f"({longest}) exceed max_model_len={self.max_model_len}"
            )
        if any(g.window for g in self.groups):
            raise ValueError(f"preset {self.name}: far_start with a sliding window")

    def _validate_block_ids(self) -> None:
        """Every group's ids, in kernel blocks, lie in `[1, INT32_MAX]`, and no id is given
        to two groups: a table mixed up with another group's must not name the same blocks."""
        if self.block_id_base < 1:
            raise ValueError(f"preset {self.name}: block ids must start at 1 or above")
        taken: list[tuple[int, int, int]] = []
        for g in range(len(self.groups)):
            first, count = self.block_id_range(g)
            m = self.kernel_factor(g)
            if first < 1 or (first + count) * m > INT32_MAX:
                raise ValueError(
                    f"preset {self.name}: block ids of group {g} [{first * m}, "
                    f"{(first + count) * m}) (in kernel blocks) must lie in [1, {INT32_MAX}]"
                )
            for h, lo, hi in taken:
                if first < hi and lo < first + count:
                    raise ValueError(f"preset {self.name}: block ids of groups {h} and {g} overlap")
            taken.append((g, first, first + count))

    def describe(self) -> dict:
        """Every field, for reports (JSON-ready)."""
        d = dataclasses.asdict(self)
        d["corners"] = sorted(self.corners)
        d["max_num_blocks_per_group"] = self.max_num_blocks_per_group()
        return d
