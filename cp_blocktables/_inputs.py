"""Checks of `BlockTables`' call inputs, kept apart from the hot path's logic.

Shapes, dtypes and devices are always checked (no device sync). Values
(`idx_mapping` rows, `query_start_loc`, positions) need the data on the host:
`rows` and `tokens` run only when the caller validates (see
`BlockTables.validate_inputs`). Every check runs before any kernel, so a
refused call changes nothing. Messages name the offending argument.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from . import guards
from .contract import INT32_MAX, BlockTablesConfig

_INDEX_DTYPES = (torch.int32, torch.int64)
_POSITION_LIMIT = 2**62
"""Positions at or past it map to `PAD_SLOT_ID` (`kernels.slot_programs.token_positions`
keeps the slot arithmetic of int64 positions clear of overflow): refused when validating."""


class InputChecks:
    """The checks for one `BlockTables` (its device, row count and table widths)."""

    def __init__(self, config: BlockTablesConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.max_num_reqs = config.max_num_reqs
        self.num_kv_cache_groups = n = config.num_kv_cache_groups
        self.factors = [config.kernel_blocks_per_block(g) for g in range(n)]
        self.widths = [config.table_width(g) for g in range(n)]  # columns, in kernel blocks
        # Largest allocator id whose last kernel id still fits an int32 table entry.
        self.max_block_ids = [(INT32_MAX + 1) // m - 1 for m in self.factors]
        # get_device() of tensors on our device: -1 for CPU, None for any CUDA device.
        self._device_index = -1 if device.type == "cpu" else device.index

    def append(self, req_index: object, new_block_ids: Sequence) -> None:
        """`append_block_ids`' row and group count."""
        if (
            isinstance(req_index, bool)
            or not isinstance(req_index, (int, np.integer))
            or not 0 <= req_index < self.max_num_reqs
        ):
            raise ValueError(
                f"req_index must be an int in [0, {self.max_num_reqs}), got {req_index!r}"
            )
        n = self.num_kv_cache_groups
        if len(new_block_ids) != n:
            raise ValueError(
                f"new_block_ids has {len(new_block_ids)} entries for {n} KV-cache groups"
            )

    def append_ends(self, req_index: int, new_block_ids: Sequence, ends: list[int]) -> None:
        """Capacity (in kernel blocks, `RuntimeError`) and id range of every group's append."""
        for g, (end, ids) in enumerate(zip(ends, new_block_ids)):
            if end > self.widths[g]:
                unit = "kernel blocks" if self.factors[g] > 1 else "blocks"
                raise RuntimeError(
                    f"append_block_ids: request {req_index}, group {g}: {unit} would end at "
                    f"{end}, past the row capacity {self.widths[g]}"
                )
            if len(ids) and (min(ids) < 0 or max(ids) > self.max_block_ids[g]):  # numpy too
                raise ValueError(
                    f"append_block_ids: request {req_index}, group {g}: block ids "
                    f"must lie in [0, {self.max_block_ids[g]}]"
                )

    def gather(
        self,
        idx_mapping: torch.Tensor,
        num_reqs_padded: int,
        num_computed_tokens: torch.Tensor | None,
    ) -> int:
        """Shapes of a gather's inputs; returns `num_reqs`."""
        num_reqs = self.index_tensor("idx_mapping", idx_mapping)
        if not num_reqs <= num_reqs_padded <= self.max_num_reqs:
            raise ValueError(
                f"num_reqs_padded must lie in [num_reqs={num_reqs}, "
                f"max_num_reqs={self.max_num_reqs}], got {num_reqs_padded}"
            )
        if num_computed_tokens is not None:
            self.index_tensor("num_computed_tokens", num_computed_tokens, min_len=self.max_num_reqs)
        return num_reqs

    def slots(
        self,
        idx_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        num_tokens_padded: int,
        out: torch.Tensor | None,
        default: torch.Tensor,
        num_reqs: int | None = None,
    ) -> torch.Tensor:
        """Shapes of a slot mapping's inputs; returns the buffer it writes.

        `num_reqs`: `idx_mapping` was checked by the caller (the fused reads)."""
        if num_reqs is None:
            num_reqs = self.index_tensor("idx_mapping", idx_mapping)
        self.index_tensor("query_start_loc", query_start_loc, exact_len=num_reqs + 1)
        self.index_tensor("positions", positions)
        if out is None:
            buf = default  # the persistent buffer: its rows are disjoint by construction
        else:
            buf = self.out_slots(out)
            guards.check_rows_disjoint(buf, "out")
        if not 0 <= num_tokens_padded <= buf.shape[1]:
            raise ValueError(
                f"num_tokens_padded must lie in [0, {buf.shape[1]}] (the output "
                f"buffer's length), got {num_tokens_padded}"
            )
        return buf

    def on_my_device(self, t: torch.Tensor) -> bool:
        """`cuda` (no index) matches any CUDA tensor; the caller set the current device.
        A tensor of a device without an index (`meta`) reports -1 as a CPU tensor does."""
        index = t.get_device()  # -1 on CPU; cheaper than building `t.device`
        if self._device_index is None:
            return index >= 0
        return index == self._device_index and (index >= 0 or t.is_cpu)

    def index_tensor(
        self, name: str, t: object, exact_len: int | None = None, min_len: int = 0
    ) -> int:
        """Shape, dtype and device of a 1-D integer input (no device sync).

        The common case costs one combined test; messages are built only on failure.
        """
        if isinstance(t, torch.Tensor) and t.dtype in _INDEX_DTYPES and t.dim() == 1:
            n = t.shape[0]
            if (
                self.on_my_device(t)
                and (exact_len is None or n == exact_len)
                and n >= min_len
                and (n <= self.max_num_reqs or name != "idx_mapping")
                and t.is_contiguous()
            ):
                return n
        return self._refuse_index_tensor(name, t, exact_len, min_len)

    def _refuse_index_tensor(
        self, name: str, t: object, exact_len: int | None, min_len: int
    ) -> int:
        """`index_tensor`'s slow path: raise the message that names the fault."""
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 1 or t.dtype not in _INDEX_DTYPES:
            raise ValueError(
                f"{name} must be a 1-D int32 or int64 tensor, got "
                f"{t.dtype} of shape {tuple(t.shape)}"
            )
        if not self.on_my_device(t):
            raise ValueError(f"{name} is on {t.device}, BlockTables on {self.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        n = t.shape[0]
        if exact_len is not None and n != exact_len:
            raise ValueError(f"{name} must have {exact_len} entries, got {n}")
        if n < min_len:
            raise ValueError(f"{name} must have at least {min_len} entries, got {n}")
        if name == "idx_mapping" and n > self.max_num_reqs:
            raise ValueError(
                f"idx_mapping has {n} entries, more than max_num_reqs={self.max_num_reqs}"
            )
        return n

    def rows(self, idx_mapping: torch.Tensor) -> None:
        rows = idx_mapping.cpu().numpy()
        bad = (rows < -1) | (rows >= self.max_num_reqs)
        if bad.any():
            b = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"idx_mapping[{b}] = {rows[b]} is neither -1 (dummy) nor a row "
                f"in [0, {self.max_num_reqs})"
            )

    def tokens(
        self,
        idx_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        num_tokens_padded: int,
    ) -> None:
        qsl = query_start_loc.cpu().numpy().astype(np.int64)
        if qsl[0] != 0 or (np.diff(qsl) < 0).any():
            raise ValueError(
                f"query_start_loc must start at 0 and never decrease, got {qsl.tolist()[:16]}"
            )
        num_tokens = int(qsl[-1])
        if num_tokens > positions.shape[0]:
            raise ValueError(
                f"query_start_loc ends at {num_tokens} tokens but positions has "
                f"{positions.shape[0]}"
            )
        if num_tokens > num_tokens_padded:
            raise ValueError(
                f"num_tokens_padded={num_tokens_padded} is less than the batch's "
                f"{num_tokens} tokens"
            )
        rows = np.repeat(idx_mapping.cpu().numpy(), np.diff(qsl))  # [num_tokens]
        pos = positions[:num_tokens].cpu().numpy()[rows >= 0]
        if pos.size == 0:
            return
        if pos.min() < 0:
            raise ValueError(f"positions must be >= 0, got {int(pos.min())}")
        if pos.max() >= _POSITION_LIMIT:
            raise ValueError(f"positions must be below 2**62, got {int(pos.max())}")
        cfg = self.config
        for g in range(self.num_kv_cache_groups):
            if not cfg.slot_mapping_enabled[g]:
                continue
            span = cfg.block_sizes[g] * cfg.group_cp_size(g) * cfg.max_num_blocks_per_group[g]
            if pos.max() >= span:
                raise ValueError(
                    f"position {int(pos.max())} lies past group {g}'s table "
                    f"({cfg.max_num_blocks_per_group[g]} blocks cover {span})"
                )

    def out_tables(self, out: Sequence[torch.Tensor], rows: int) -> list[torch.Tensor]:
        if len(out) != self.num_kv_cache_groups:
            raise ValueError(f"out has {len(out)} tables for {self.num_kv_cache_groups} groups")
        for g, t in enumerate(out):
            width = self.widths[g]
            if (
                t.dtype != torch.int32
                or t.dim() != 2
                or t.shape[0] < rows
                or t.shape[1] < width
                or t.stride(1) != 1
                or not self.on_my_device(t)
            ):
                raise ValueError(
                    f"out[{g}] must be an int32 [>= {rows}, >= {width}] tensor "
                    f"with unit column stride on {self.device}, got {t.dtype} "
                    f"{tuple(t.shape)} on {t.device}"
                )
        return list(out)

    def out_slots(self, out: torch.Tensor) -> torch.Tensor:
        if (
            out.dtype != torch.int64
            or out.dim() != 2
            or not self.on_my_device(out)
            or out.shape[0] != self.num_kv_cache_groups
            or out.stride(1) != 1
        ):
            raise ValueError(
                f"out must be an int64 [{self.num_kv_cache_groups}, n] tensor with "
                f"unit column stride on {self.device}, got {out.dtype} "
                f"{tuple(out.shape)} on {out.device}"
            )
        return out
