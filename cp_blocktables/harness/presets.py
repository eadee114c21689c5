"""Named harness workloads: a `BlockTables` configuration plus the knobs of its traffic.

A preset is what a person names on the command line (`--preset cp4-interleave`).
It fixes the KV-cache groups, the CP size and interleave, the table sizes, the
number of steps and how often each kind of traffic occurs, and it promises a
set of corners (SPEC.md section 6) that its workload must reach. The workload
generator counts every corner; a preset whose run misses a promised corner
fails (`missing_corners`).

`SWEEP` is what `make verify` runs: together its presets cover cp_size 1, 2, 4
and 8, interleave 1 up to the block size, mixed groups, sliding windows and
every corner of the contract.
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
    "warmup_redirect",
    "positions_tail_garbage",
    "request_finished",
    # Size regimes and argument paths an implementation may branch on (docs/harness.md).
    "giant_request_step",
    "giant_shrink",
    "wide_row",
    "full_batch",
    "writes_past_max_reqs",
    "two_appends_one_row",
    "append_then_overwrite",
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
    "many_groups",
    "kernel_blocks",
    "kernel_blocks_mixed",
    "interleave_eq_kernel",
)
"""Every corner the workload generator counts (SPEC.md section 6's list, spelled out)."""


@dataclass(frozen=True)
class GroupSpec:
    """One KV-cache group: block size, DCP sharding, slot mapping on/off, sliding window.

    `kernel_block_size` (SPEC.md 8.1): the attention kernel's block, dividing
    `block_size`; 0 means equal to it (the constructor keyword is then omitted).
    """

    block_size: int
    sharded: bool = True
    enabled: bool = True
    window: int = 0
    kernel_block_size: int = 0

    @property
    def kernel(self) -> int:
        return self.kernel_block_size or self.block_size


@dataclass(frozen=True)
class Preset:
    """A configuration and the traffic to drive through it.

    `max_model_len` bounds every position any request reaches (speculative
    tokens included); each group's table width is derived from it, so a
    request never passes its row capacity.
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
        m = max((self.kernel_factor(g) for g in range(len(self.groups))), default=1)
        end = (self.block_id_base + len(self.groups) * self.block_pool_size()) * m
        if self.giant_prefill and (
            self.giant_prefill > min(self.max_prefill_chunk, self.max_num_batched_tokens - 16)
            or self.giant_prefill + self.max_decode_len + self.spec_tokens + 1 > self.max_model_len
        ):
            raise ValueError(
                f"preset {self.name}: giant_prefill {self.giant_prefill} must fit one chunk, "
                f"one step and max_model_len"
            )
        if self.block_id_base < 1 or end > INT32_MAX:
            raise ValueError(
                f"preset {self.name}: block ids [{self.block_id_base}, {end}) "
                f"(in kernel blocks) must lie in [1, {INT32_MAX}]"
            )
        unknown = self.corners - set(CORNERS)
        if unknown:
            raise ValueError(f"preset {self.name}: unknown corners {sorted(unknown)}")

    def describe(self) -> dict:
        """Every field, for reports (JSON-ready)."""
        d = dataclasses.asdict(self)
        d["corners"] = sorted(self.corners)
        d["max_num_blocks_per_group"] = self.max_num_blocks_per_group()
        return d


_COMMON = frozenset(
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

PRESETS: dict[str, Preset] = {}


def _register(p: Preset) -> Preset:
    p.validate()
    PRESETS[p.name] = p
    return p


_register(
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
        num_steps=24,
        max_num_reqs=24,
        max_num_batched_tokens=384,
        max_model_len=1536,
        max_batch_reqs=12,
        max_prefill_chunk=160,
        max_prompt_len=900,
        max_decode_len=40,
        spec_tokens=3,
        warmup_steps=1,
        corners=_COMMON
        | {"profiled_rows_reclaimed"}
        | {
            "interleave_between",
            "mixed_groups",
            "several_block_sizes",
            "spec_decode",
            "spec_rejected",
            "window_configured_under_cp",
            "warmup_redirect",
        },
    )
)

_register(
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
        corners=_COMMON
        | {"profiled_rows_reclaimed"}
        | {
            "several_block_sizes",
            "spec_decode",
            "spec_rejected",
            "slot_past_2_31",
            "window_freed_reused",
            "window_boundary",
            "warmup_redirect",
        },
    )
)

_register(
    Preset(
        name="cp2-i1",
        description="cp 2, interleave 1: sharded, unsharded and disabled groups side by side",
        groups=(
            GroupSpec(16),
            GroupSpec(32, sharded=False),
            GroupSpec(16, enabled=False),
            GroupSpec(8),
        ),
        cp_size=2,
        cp_interleave=1,
        num_steps=24,
        max_num_reqs=16,
        max_num_batched_tokens=256,
        max_model_len=1024,
        max_batch_reqs=8,
        max_prefill_chunk=96,
        max_prompt_len=600,
        max_decode_len=40,
        spec_tokens=2,
        corners=_COMMON
        | {"profiled_rows_reclaimed"}
        | {"interleave_1", "mixed_groups", "several_block_sizes", "spec_decode", "spec_rejected"},
    )
)

_register(
    Preset(
        name="cp4-interleave",
        description="cp 4, interleave 8: equal to one group's block size and between 1 and "
        "another's",
        groups=(GroupSpec(8), GroupSpec(32), GroupSpec(16, sharded=False)),
        cp_size=4,
        cp_interleave=8,
        num_steps=22,
        max_num_reqs=16,
        max_num_batched_tokens=256,
        max_model_len=1536,
        max_batch_reqs=8,
        max_prefill_chunk=128,
        max_prompt_len=900,
        max_decode_len=40,
        spec_tokens=3,
        corners=_COMMON
        | {
            "interleave_eq_block",
            "interleave_between",
            "several_block_sizes",
            "spec_decode",
            "spec_rejected",
        },
    )
)

_register(
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
        corners=_COMMON
        | {"interleave_between", "several_block_sizes", "slot_past_2_31", "spec_decode"},
    )
)

_register(
    Preset(
        name="large-steps",
        description="cp 4: a request of 8,400 tokens in one step, then a step 8,192+ tokens "
        "smaller; rows of 2,100+ blocks; batches of exactly max_num_reqs requests; one apply "
        "with more writes than max_num_reqs",
        groups=(GroupSpec(16), GroupSpec(4, sharded=False), GroupSpec(32, enabled=False)),
        cp_size=4,
        cp_interleave=4,
        num_steps=8,
        max_num_reqs=6,
        max_num_batched_tokens=9216,
        max_model_len=10240,
        max_batch_reqs=6,
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
                "wide_row",
                "full_batch",
                "writes_past_max_reqs",
                "two_appends_one_row",
                "decode",
                "smaller_step",
                "mixed_groups",
                "interleave_between",
            }
        ),
    )
)

_KERNEL = frozenset({"kernel_blocks", "kernel_blocks_mixed", "warmup_redirect"})

_register(
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
        num_steps=21,
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
        corners=_COMMON
        | _KERNEL
        | {"several_block_sizes", "slot_past_2_31", "window_boundary", "window_freed_reused"},
    )
)

_register(
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
        corners=_COMMON | _KERNEL | {"interleave_eq_kernel", "interleave_between"},
    )
)

_register(
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
    )
)

_register(
    Preset(
        name="groups-1",
        description="cp 2, one group: the single-table apply path (no fused writer)",
        groups=(GroupSpec(16),),
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
        corners=frozenset(
            {
                "one_group",
                "writes_past_max_reqs",
                "two_appends_one_row",
                "overflow_refused",
                "full_batch",
                "gather_out",
                "slot_out",
                "profiling_writes",
                "request_finished",
            }
        ),
    )
)

_register(
    Preset(
        name="groups-6",
        description="cp 1, six groups: block sizes 4 to 128, two windows of other reaches",
        groups=(
            GroupSpec(16),
            GroupSpec(32, window=64),
            GroupSpec(8),
            GroupSpec(128),
            GroupSpec(16, enabled=False),
            GroupSpec(4, window=10),
        ),
        cp_size=1,
        cp_interleave=1,
        num_steps=16,
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
                "writes_past_max_reqs",
                "append_then_overwrite",
                "overflow_refused",
                "window_boundary",
                "nct_absent",
                "profiling_writes",
            }
        ),
    )
)

_register(
    Preset(
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
)

_register(
    dataclasses.replace(
        PRESETS["bench-64k"],
        name="bench-1m",
        description="cp 4: steps of about 1M tokens (benchmark, not in the sweep; for GPUs)",
        num_steps=3,
        max_num_batched_tokens=1 << 20,
        max_model_len=1 << 21,
        max_prefill_chunk=1 << 17,
        max_prompt_len=1 << 20,
    )
)

SWEEP: tuple[str, ...] = (
    "cp1-window",
    "cp2-i1",
    "default",
    "cp4-interleave",
    "cp8-large-ids",
    "large-steps",
    "kbs-cp1",
    "kbs-cp4",
    "groups-0",
    "groups-1",
    "groups-6",
)
"""The default sweep: cp_size 1, 2, 4 and 8, interleave 1 to block size, every corner."""

ALIASES: dict[str, tuple[str, ...]] = {"sweep": SWEEP, "all": tuple(PRESETS)}


def resolve(names: list[str]) -> list[Preset]:
    """Presets by name or alias, in order, without repeats; `ValueError` for unknown names."""
    out: list[Preset] = []
    for name in names:
        expanded = ALIASES.get(name, (name,))
        for n in expanded:
            if n not in PRESETS:
                known = ", ".join([*PRESETS, *ALIASES])
                raise ValueError(f"unknown preset {n!r}; known: {known}")
            if PRESETS[n] not in out:
                out.append(PRESETS[n])
    return out


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
_register(
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
        corners=_COMMON
        | {"writes_past_max_reqs"}
        | _KERNEL
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
    )
)
_register(
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
        ),
        integrity_checks=True,  # SPEC.md 8.3: a false alarm of a check fails the run
        cp_size=1,
        cp_interleave=1,
        max_model_len=160,
        max_prompt_len=120,
        block_id_base=2**29 + 7,
        corners=_COMMON
        | {"profiled_rows_reclaimed"}
        | {"warmup_redirect"}
        | {
            "several_block_sizes",
            "spec_decode",
            "spec_rejected",
            "slot_past_2_31",
            "window_freed_reused",
            "window_boundary",
        },
        **{**_MUTATION_COMMON, "num_steps": 18},
    )
)
_register(
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
        corners=_COMMON
        | {
            "one_group",
            "interleave_between",
            "kernel_blocks",
            "spec_decode",
            "spec_rejected",
            "warmup_redirect",
            "slot_past_2_31",
        },
        **{**_MUTATION_COMMON, "num_steps": 17},
    )
)
