"""Device-side per-group layout: the small tensors that let one launch serve every group.

Built from host-side config, and rebuilt in place (`refill`) when the tables are
reallocated or after sleep mode discarded device memory (SPEC.md 8.4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._common import is_pow2


def refill(dst: torch.Tensor | None, host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host`'s values on `device`: written into `dst` when it fits, else a new tensor.

    Writing in place keeps the address that captured CUDA graphs hold, so a
    rebuild after sleep mode (or a reallocation) refreshes what they read.
    uint64 is copied through an int64 view (same bits; fewer ops support uint64).
    """
    if (
        dst is None
        or dst.shape != host.shape
        or dst.dtype != host.dtype
        or dst.device.type != device.type
        or not dst.is_contiguous()
    ):
        return host.to(device)
    if host.dtype == torch.uint64:
        dst.view(torch.int64).copy_(host.view(torch.int64))
    else:
        dst.copy_(host)
    return dst


@dataclass
class GroupLayout:
    """Per-group kernel inputs of the slot mapping, built from host-side config.

    `params` is int64 `[num_groups, 6]`: block size, CP size of the group (1
    when unsharded), usable columns (0 when slot mapping is disabled), row
    stride of the persistent table, log2 of the block size and of the CP size
    (-1 when not a power of two). Block sizes here are the tables' unit: the
    kernel block sizes.
    """

    table_ptrs: torch.Tensor  # uint64 [num_groups]
    params: torch.Tensor  # int64 [num_groups, 6]
    max_span: int  # most positions one table row covers
    pow2: bool  # every block size and group CP size is a power of two

    @classmethod
    def build(
        cls,
        tables: list[torch.Tensor],
        table_ptrs: torch.Tensor,
        block_sizes: list[int],
        group_cp_sizes: list[int],
        enabled: list[bool],
        device: torch.device,
        params_out: torch.Tensor | None = None,
    ) -> GroupLayout:
        """`params_out`: the previous layout's params, rewritten in place when it fits."""
        log2 = lambda n: n.bit_length() - 1 if is_pow2(n) else -1  # noqa: E731
        rows = [
            [bs, cp, t.shape[1] if on else 0, t.stride(0), log2(bs), log2(cp)]
            for t, bs, cp, on in zip(tables, block_sizes, group_cp_sizes, enabled)
        ]
        host = torch.tensor(rows, dtype=torch.int64).reshape(-1, 6)  # [num_groups, 6]
        return cls(
            table_ptrs=table_ptrs,
            params=refill(params_out, host, device),
            max_span=max(
                (t.shape[1] * bs * cp for t, bs, cp in zip(tables, block_sizes, group_cp_sizes)),
                default=0,
            ),
            pow2=all(is_pow2(n) for n in block_sizes + group_cp_sizes),
        )
