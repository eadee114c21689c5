"""An upstream-style rival of `BlockTables`' kernels, written here from a design description.

The kernel benchmark holds our kernels to the design that current engines ship
(vLLM's model-runner-v2, as described in the project's issue and in
FACTS.md); no upstream code is copied. What it copies is the *shape* of the
work:

- slot mappings: grid `(num_groups, num_reqs + 1)`; program `(g, b)` walks
  request `b`'s tokens in 1024-token tiles; the last program of each group
  pads `[num_tokens, max_num_tokens)` with `PAD_SLOT_ID`. Index arithmetic in
  int64 with the sizes loaded at run time, as a general kernel does.
- gather: grid `(num_groups, num_rows)`; program `(g, b)` copies row
  `idx_mapping[b]` in 1024-column tiles, or zeroes the row when `b` is past
  the batch (or a dummy entry).
- staged writes: per table, the writes' metadata (row, start, end of contents)
  in pinned host buffers that the kernel reads directly, the contents copied
  host-to-device, one program per write, one launch per table; the block
  counts published through a pinned buffer as well.
- every launch is a plain `kernel[grid](...)` through `dual_jit`, so the rival
  also runs (slowly) in Triton's interpreter on CPU.

The semantics are SPEC.md sections 2 and 3 for valid inputs, so that outputs
can be compared with ours bit for bit: dummy requests (`-1`) get PAD slots and
zero rows, disabled groups PAD slots, and with `num_computed_tokens` entries
wholly below a group's sliding window become the null block.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton.language as tl

from .._jit import dual_jit
from ..buffers import UvaBackedTensor, uva_view
from ..contract import NULL_BLOCK_ID, PAD_SLOT_ID, BlockTablesConfig

TOKEN_TILE = 1024
COLUMN_TILE = 1024


@dual_jit
def _rival_slot_mappings_kernel(
    max_num_tokens,
    idx_mapping,  # [num_reqs]
    query_start_loc,  # [num_reqs + 1]
    positions,  # [>= num_tokens] int64
    table_ptrs,  # uint64 [num_groups]
    table_strides,  # int64 [num_groups]
    group_params,  # int64 [num_groups, 3]: block size, group CP size, enabled
    cp_rank,
    cp_interleave,
    out,  # int64 [num_groups, max_num_tokens]
    out_stride,
    PAD_ID: tl.constexpr,
    TILE: tl.constexpr,
    SPAN: tl.constexpr,  # 0: loops bounded at run time; else a constant bound (interpreter)
):
    g = tl.program_id(0)
    b = tl.program_id(1)
    num_reqs = tl.num_programs(1) - 1
    out_g = out + g * out_stride
    if b == num_reqs:
        num_tokens = tl.load(query_start_loc + num_reqs)
        for i in range(0, max_num_tokens - num_tokens if SPAN == 0 else SPAN, TILE):
            t = num_tokens + i + tl.arange(0, TILE)
            tl.store(out_g + t, tl.full([TILE], PAD_ID, tl.int64), mask=t < max_num_tokens)
    else:
        r = tl.load(idx_mapping + b).to(tl.int64)
        start = tl.load(query_start_loc + b)
        end = tl.load(query_start_loc + b + 1)
        block_size = tl.load(group_params + g * 3 + 0)
        cp = tl.load(group_params + g * 3 + 1)
        enabled = tl.load(group_params + g * 3 + 2)
        rank = tl.where(cp == 1, 0, cp_rank)
        table = tl.load(table_ptrs + g).to(tl.pointer_type(tl.int32))
        stride = tl.load(table_strides + g)
        virtual = block_size * cp
        # Scalar flags enter as integers: the interpreter mis-types scalar & block bools.
        valid = tl.where((r >= 0) & (enabled != 0), 1, 0)
        for i in range(0, end - start if SPAN == 0 else SPAN, TILE):
            t = start + i + tl.arange(0, TILE)
            m = t < end
            p = tl.load(positions + t, mask=m, other=0).to(tl.int64)
            col = p // virtual
            o = p % virtual
            mine = (o // cp_interleave) % cp == rank
            local = (o // (cp_interleave * cp)) * cp_interleave + o % cp_interleave
            ok = m & mine & ((t * 0 + valid) != 0)
            block = tl.load(table + r * stride + col, mask=ok, other=0).to(tl.int64)
            slot = tl.where(ok, block * block_size + local, PAD_ID)
            tl.store(out_g + t, slot, mask=m)


@dual_jit
def _rival_gather_kernel(
    num_reqs,
    idx_mapping,  # [num_reqs]
    src_ptrs,  # uint64 [num_groups]
    src_strides,  # int64 [num_groups]
    dst_ptrs,  # uint64 [num_groups]
    dst_strides,  # int64 [num_groups]
    widths,  # int64 [num_groups]
    num_blocks,  # int32 [num_groups, max_num_reqs]
    num_blocks_stride,
    block_sizes,  # int64 [num_groups]
    reaches,  # int64 [num_groups]
    num_computed_tokens,  # [max_num_reqs] (MASK_WINDOW only)
    MASK_WINDOW: tl.constexpr,
    TILE: tl.constexpr,
    SPAN: tl.constexpr,  # 0: loops bounded at run time; else a constant bound (interpreter)
):
    g = tl.program_id(0)
    b = tl.program_id(1)
    dst = tl.load(dst_ptrs + g).to(tl.pointer_type(tl.int32))
    dst_row = dst + b.to(tl.int64) * tl.load(dst_strides + g)
    width = tl.load(widths + g)
    r = tl.load(idx_mapping + b, mask=b < num_reqs, other=-1).to(tl.int64)
    # A real row copies its n entries; a dummy or padding row is zeroed in full.
    # Scalar flags enter as integers: the interpreter mis-types scalar & block bools.
    real = tl.where(r >= 0, 1, 0)
    r = tl.where(real != 0, r, 0)  # row 0 stands in for a dummy's row: every read is masked
    n = tl.load(num_blocks + g * num_blocks_stride + r)
    length = tl.where(real != 0, n.to(tl.int64), width)
    src = tl.load(src_ptrs + g).to(tl.pointer_type(tl.int32))
    src_row = src + r * tl.load(src_strides + g)
    if MASK_WINDOW:
        reach = tl.load(reaches + g)
        block_size = tl.load(block_sizes + g)
        live_from = tl.load(num_computed_tokens + r).to(tl.int64) - reach
        live_from = tl.where(reach > 0, live_from, -1)
    for c0 in range(0, length if SPAN == 0 else SPAN, TILE):
        c = c0 + tl.arange(0, TILE)
        m = c < length
        v = tl.load(src_row + c, mask=m & ((c * 0 + real) != 0), other=0)
        if MASK_WINDOW:
            v = tl.where((c + 1).to(tl.int64) * block_size <= live_from, 0, v)
        tl.store(dst_row + c, v, mask=m)


@dual_jit
def _rival_apply_kernel(
    dst,  # [rows, cols] int32
    dst_stride,
    rows,  # int32 [num_writes] (pinned host memory on CUDA)
    starts,  # int32 [num_writes] (pinned host memory on CUDA)
    cu_lens,  # int32 [num_writes] end of each write's contents (pinned on CUDA)
    contents,  # int32 [num_elems] (device memory)
    TILE: tl.constexpr,
    SPAN: tl.constexpr,  # 0: loops bounded at run time; else a constant bound (interpreter)
):
    w = tl.program_id(0)
    row = tl.load(rows + w).to(tl.int64)
    start = tl.load(starts + w)
    end = tl.load(cu_lens + w)
    begin = tl.load(cu_lens + w - 1, mask=w > 0, other=0)
    for i in range(0, end - begin if SPAN == 0 else SPAN, TILE):
        e = begin + i + tl.arange(0, TILE)
        m = e < end
        v = tl.load(contents + e, mask=m)
        tl.store(dst + row * dst_stride + start + (e - begin), v, mask=m)


def _interpreter_span(device: torch.device, bound: int) -> int:
    """0 on GPUs (loops bounded at run time, as upstream's kernels are); on CPU a
    constant bound, since some Triton interpreters (3.6) cannot loop over a loaded
    scalar. Rounded up to a power of two to keep the interpreter's variants few."""
    if device.type != "cpu":
        return 0
    return 1 << max(bound - 1, 0).bit_length()


class _Pinned:
    """A host buffer (pinned on CUDA) and a device tensor naming the same memory."""

    def __init__(self, n: int, dtype: torch.dtype, device: torch.device) -> None:
        self.host = torch.zeros(max(n, 1), dtype=dtype, pin_memory=device.type == "cuda")
        self.np = self.host.numpy()
        self.dev = self.host if device.type == "cpu" else uva_view(self.host, device)


class _RivalTable:
    """One table's staged writes: Python lists, published through two rotating pinned buffers."""

    def __init__(self, table: torch.Tensor, max_writes: int, max_elems: int) -> None:
        self.table = table
        self.device = table.device
        self.rows: list[int] = []
        self.starts: list[int] = []
        self.cu_lens: list[int] = []
        self.contents: list[int] = []
        self._meta = [_Pinned(3 * max_writes, torch.int32, self.device) for _ in range(2)]
        self._host_contents = [_Pinned(max_elems, torch.int32, self.device) for _ in range(2)]
        self._dev_contents = torch.zeros(max(max_elems, 1), dtype=torch.int32, device=self.device)
        self._next = 0

    def stage(self, row: int, start: int, ids: Sequence[int]) -> None:
        if ids:
            self.rows.append(row)
            self.starts.append(start)
            self.contents.extend(ids)
            self.cu_lens.append(len(self.contents))

    def apply(self) -> None:
        n, m = len(self.rows), len(self.contents)
        if not n:
            return
        i = self._next
        self._next = 1 - i
        meta = self._meta[i]
        if meta.host.shape[0] < 3 * n:
            meta = self._meta[i] = _Pinned(2 * 3 * n, torch.int32, self.device)
        host = self._host_contents[i]
        if host.host.shape[0] < m:
            host = self._host_contents[i] = _Pinned(2 * m, torch.int32, self.device)
        if self._dev_contents.shape[0] < m:
            self._dev_contents = torch.zeros(2 * m, dtype=torch.int32, device=self.device)
        meta.np[:n] = self.rows
        meta.np[n : 2 * n] = self.starts
        meta.np[2 * n : 3 * n] = self.cu_lens
        host.np[:m] = self.contents
        contents = self._dev_contents[:m]
        contents.copy_(host.host[:m], non_blocking=True)
        _rival_apply_kernel.launch(
            self.device,
            (n,),
            self.table,
            self.table.stride(0),
            meta.dev[:n],
            meta.dev[n : 2 * n],
            meta.dev[2 * n : 3 * n],
            contents,
            TILE=COLUMN_TILE,
            SPAN=_interpreter_span(
                self.device, max(b - a for a, b in zip([0, *self.cu_lens], self.cu_lens))
            ),
        )
        self.rows.clear()
        self.starts.clear()
        self.cu_lens.clear()
        self.contents.clear()


class UpstreamBlockTables:
    """Upstream-style kernels over the tables of one `BlockTables`-shaped state.

    `tables[g]`: group `g`'s int32 `[max_num_reqs, width_g]` table;
    `num_blocks`: int32 `[groups, max_num_reqs]` block counts on the device
    (read by the gather). The rival reads and writes them in place, so it can
    share a `BlockTables`' state or own a copy (`owned_state`).
    """

    redirect_writes_to_null_block: bool = False

    def __init__(
        self,
        config: BlockTablesConfig,
        tables: Sequence[torch.Tensor],
        num_blocks: torch.Tensor | None = None,
    ) -> None:
        self.config = config
        self.tables = list(tables)
        self.device = tables[0].device if tables else torch.device("cpu")
        num_groups = config.num_kv_cache_groups
        dev = self.device
        # Host truth of the block counts; when no device tensor is given, published
        # as upstream does: a host memcpy into a pinned buffer the gather reads.
        self._counts = UvaBackedTensor((num_groups, config.max_num_reqs), torch.int32, device=dev)
        self._own_counts = num_blocks is None
        self.num_blocks = self._counts.gpu if num_blocks is None else num_blocks

        def tensor(values, dtype):
            return torch.tensor(list(values), dtype=dtype, device=dev)

        self.table_ptrs = tensor([t.data_ptr() for t in self.tables], torch.uint64)
        self.table_strides = tensor([t.stride(0) for t in self.tables], torch.int64)
        self.widths = tensor([t.shape[1] for t in self.tables], torch.int64)
        self.block_sizes = tensor(config.block_sizes, torch.int64)
        self.reaches = tensor(config.effective_sliding_window_reach(), torch.int64)
        self._any_reach = any(config.effective_sliding_window_reach())
        params = [
            [config.block_sizes[g], config.group_cp_size(g), int(config.slot_mapping_enabled[g])]
            for g in range(num_groups)
        ]
        self.group_params = torch.tensor(params, dtype=torch.int64, device=dev).reshape(-1, 3)
        self._out_ptrs: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self._last_out: object = None
        self._last_ptrs: tuple[torch.Tensor, torch.Tensor] | None = None
        max_writes = config.max_num_reqs
        self._writers = [_RivalTable(t, max_writes, max_writes * t.shape[1]) for t in self.tables]

    @classmethod
    def owned_state(cls, config: BlockTablesConfig, device: torch.device) -> UpstreamBlockTables:
        """A rival with tables and counts of its own, all zero."""
        tables = [
            torch.zeros((config.max_num_reqs, w), dtype=torch.int32, device=device)
            for w in config.max_num_blocks_per_group
        ]
        return cls(config, tables)

    # ------------------------------------------------------------ slot mappings

    def compute_slot_mappings(
        self,
        idx_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Fill all of `out` `[groups, max_num_tokens]` (int64)."""
        num_groups, max_num_tokens = out.shape
        _rival_slot_mappings_kernel.launch(
            self.device,
            (num_groups, idx_mapping.shape[0] + 1),
            max_num_tokens,
            idx_mapping,
            query_start_loc,
            positions,
            self.table_ptrs,
            self.table_strides,
            self.group_params,
            self.config.cp_rank,
            self.config.cp_interleave,
            out,
            out.stride(0),
            PAD_ID=PAD_SLOT_ID,
            TILE=TOKEN_TILE,
            SPAN=_interpreter_span(self.device, max_num_tokens),
        )
        return out

    # ------------------------------------------------------------ gather

    def _ptrs_of(self, out: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Device tensors of `out`'s pointers and strides, built once per list of outputs
        (an engine passes persistent tables, whose pointer tensor it builds once)."""
        if out is self._last_out:
            return self._last_ptrs
        key = tuple(t.data_ptr() for t in out)
        found = self._out_ptrs.get(key)
        if found is None:
            found = self._out_ptrs[key] = (
                torch.tensor(list(key), dtype=torch.uint64, device=self.device),
                torch.tensor([t.stride(0) for t in out], dtype=torch.int64, device=self.device),
            )
        self._last_out, self._last_ptrs = out, found
        return found

    def gather_block_tables(
        self,
        idx_mapping: torch.Tensor,
        num_rows: int,
        out: Sequence[torch.Tensor],
        num_computed_tokens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """Row `idx_mapping[b]` into row `b` of `out[g]`, rows `[num_reqs, num_rows)` zeroed."""
        dst_ptrs, dst_strides = self._ptrs_of(out)
        mask = num_computed_tokens is not None and any(self.config.effective_sliding_window_reach())
        _rival_gather_kernel.launch(
            self.device,
            (len(self.tables), num_rows),
            idx_mapping.shape[0],
            idx_mapping,
            self.table_ptrs,
            self.table_strides,
            dst_ptrs,
            dst_strides,
            self.widths,
            self.num_blocks,
            self.num_blocks.stride(0),
            self.block_sizes,
            self.reaches,
            num_computed_tokens if mask else idx_mapping,
            MASK_WINDOW=mask,
            TILE=COLUMN_TILE,
            SPAN=_interpreter_span(self.device, max(t.shape[1] for t in self.tables)),
        )
        return tuple(t[:num_rows] for t in out)

    # ------------------------------------------------------------ staged writes

    def append_block_ids(
        self, req_index: int, new_block_ids: Sequence[Sequence[int]], overwrite: bool
    ) -> None:
        """Stage every group's ids and advance the host counts (no validation, as upstream)."""
        counts = self._counts.np
        for g, ids in enumerate(new_block_ids):
            start = 0 if overwrite else int(counts[g, req_index])
            if self.redirect_writes_to_null_block:
                ids = [NULL_BLOCK_ID] * len(ids)
            self._writers[g].stage(req_index, start, ids)
            counts[g, req_index] = start + len(ids)

    def apply_staged_writes(self) -> None:
        """One launch per table with staged writes, then the counts published."""
        for w in self._writers:
            w.apply()
        if self._own_counts:
            self.num_blocks = self._counts.copy_to_uva()
        else:
            self.num_blocks.copy_(self._counts.copy_to_uva(), non_blocking=True)
