"""The contract's constants and the configuration every part of the project shares.

`BlockTablesConfig` holds the constructor arguments of `BlockTables` (SPEC.md
section 3) after validation, so that the implementation, the harness and the
drills agree on one reading of them. Validation raises `ValueError` naming the
offending argument and never half-builds anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PAD_SLOT_ID = -1
"""A slot-mapping entry that writes nothing: dummy tokens, disabled groups, padding, non-owners."""

NULL_BLOCK_ID = 0
"""The reserved block: never given to a real request; warm-up writes are redirected into it."""

MAX_SLOT_ENTRIES = 2**30
"""The most entries of the slot-mapping buffer, `num_groups * max_num_batched_tokens`: the
kernels index tokens in int32, a tile past the last token included (docs/contract-notes.md)."""

INT32_MAX = 2**31 - 1


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_list(name: str, values: object, num_groups: int, kind: type) -> list:
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{name} must be a list, got {type(values).__name__}")
    if len(values) != num_groups:
        raise ValueError(
            f"{name} has {len(values)} entries but there are {num_groups} KV-cache groups "
            f"(len(block_sizes))"
        )
    out = []
    for g, v in enumerate(values):
        if kind is bool:
            if not isinstance(v, bool):
                raise ValueError(f"{name}[{g}] must be a bool, got {v!r}")
        elif isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name}[{g}] must be an int, got {v!r}")
        out.append(v)
    return out


@dataclass
class BlockTablesConfig:
    """Validated `BlockTables` constructor arguments (device excluded).

    Invariants after construction: every per-group list has `num_kv_cache_groups`
    entries; sizes are positive; `0 <= cp_rank < cp_size`; every kernel block
    size divides its group's block size (SPEC.md 8.1; default: equal to it);
    a group that is DCP-sharded under `cp_size > 1` has
    `kernel_block_size % cp_interleave == 0`.
    """

    block_sizes: list[int]
    max_num_reqs: int
    max_num_batched_tokens: int
    max_num_blocks_per_group: list[int]
    cp_size: int = 1
    cp_rank: int = 0
    cp_interleave: int = 1
    slot_mapping_enabled: list[bool] | None = None
    dcp_sharded: list[bool] | None = None
    sliding_window_reach: list[int] | None = None
    kernel_block_sizes: list[int] | None = None
    num_kv_cache_groups: int = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.block_sizes, (list, tuple)):
            raise ValueError(f"block_sizes must be a list, got {type(self.block_sizes).__name__}")
        n = len(self.block_sizes)
        self.num_kv_cache_groups = n
        self.block_sizes = _check_list("block_sizes", self.block_sizes, n, int)
        for g, bs in enumerate(self.block_sizes):
            if bs < 1:
                raise ValueError(f"block_sizes[{g}] must be >= 1, got {bs}")
        _check_int("max_num_reqs", self.max_num_reqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if max(n, 1) * self.max_num_batched_tokens > MAX_SLOT_ENTRIES:
            raise ValueError(
                f"max_num_batched_tokens times the number of groups must be at most 2**30 "
                f"(the slot mappings index tokens in int32), got {self.max_num_batched_tokens} "
                f"for {n} groups"
            )
        blocks = _check_list("max_num_blocks_per_group", self.max_num_blocks_per_group, n, int)
        for g, m in enumerate(blocks):
            if m < 1:
                raise ValueError(f"max_num_blocks_per_group[{g}] must be >= 1, got {m}")
        self.max_num_blocks_per_group = blocks
        _check_int("cp_size", self.cp_size, 1)
        _check_int("cp_rank", self.cp_rank, 0)
        if self.cp_rank >= self.cp_size:
            raise ValueError(
                f"cp_rank must satisfy 0 <= cp_rank < cp_size={self.cp_size}, got {self.cp_rank}"
            )
        _check_int("cp_interleave", self.cp_interleave, 1)
        defaults = {
            "slot_mapping_enabled": ([True] * n, bool),
            "dcp_sharded": ([True] * n, bool),
            "sliding_window_reach": ([0] * n, int),
        }
        for name, (default, kind) in defaults.items():
            value = getattr(self, name)
            setattr(self, name, default if value is None else _check_list(name, value, n, kind))
        for g, w in enumerate(self.sliding_window_reach):
            if w < 0:
                raise ValueError(f"sliding_window_reach[{g}] must be >= 0, got {w}")
        self._check_kernel_block_sizes()
        if self.cp_size > 1:
            for g, k in enumerate(self.kernel_block_sizes):
                if self.dcp_sharded[g] and k % self.cp_interleave != 0:
                    name = "block_sizes" if k == self.block_sizes[g] else "kernel_block_sizes"
                    raise ValueError(
                        f"cp_interleave={self.cp_interleave} does not divide {name}[{g}]={k} "
                        f"of DCP-sharded group {g}: a rank's share of a virtual block would "
                        f"overflow its physical block"
                    )

    def _check_kernel_block_sizes(self) -> None:
        n = self.num_kv_cache_groups
        if self.kernel_block_sizes is None:
            self.kernel_block_sizes = list(self.block_sizes)
            return
        self.kernel_block_sizes = _check_list("kernel_block_sizes", self.kernel_block_sizes, n, int)
        for g, (b, k) in enumerate(zip(self.block_sizes, self.kernel_block_sizes)):
            if k < 1:
                raise ValueError(f"kernel_block_sizes[{g}] must be >= 1, got {k}")
            if b % k != 0:
                raise ValueError(
                    f"kernel_block_sizes[{g}]={k} does not divide block_sizes[{g}]={b} of "
                    f"group {g}: an allocator block must be a whole number of kernel blocks"
                )

    def kernel_blocks_per_block(self, g: int) -> int:
        """`m = block_sizes[g] // kernel_block_sizes[g]`: kernel blocks in one allocator block."""
        return self.block_sizes[g] // self.kernel_block_sizes[g]

    def table_width(self, g: int) -> int:
        """Columns of group `g`'s tables: `max_num_blocks_per_group[g] * m` kernel blocks."""
        return self.max_num_blocks_per_group[g] * self.kernel_blocks_per_block(g)

    def effective_sliding_window_reach(self) -> list[int]:
        """Reaches used for masking: all 0 under `cp_size > 1`, where a column is no token range."""
        if self.cp_size > 1:
            return [0] * self.num_kv_cache_groups
        return list(self.sliding_window_reach)

    def group_cp_size(self, g: int) -> int:
        """Ranks that share group `g`'s tokens: `cp_size` when sharded, else 1."""
        return self.cp_size if self.dcp_sharded[g] else 1
