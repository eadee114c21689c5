"""The kernel benchmark's rows for what SPEC.md section 8 added: the integrity
checks' cost beside the slot-mapping kernel (8.3), and kernel block sizes
against the same batch with K == B (8.1)."""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from .. import integrity
from ..block_tables import BlockTables
from .cases import BLOCK_SIZES, MAX_CONTEXT, MAX_REQS, batch, guarded, random_table_ids
from .report import Row, tokens_label
from .timing import Timer

# ---------------------------------------------------------------- integrity checks

INTEGRITY_TOKENS = (8192, 65536)
INTEGRITY_GROUPS = 4


def _integrity(timer: Timer, gen, tokens: int, batch_, row: Row) -> None:

    device = timer.device
    req_rows, lens, positions = batch_
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    block_sizes = list(BLOCK_SIZES[:INTEGRITY_GROUPS])
    widths = [int(positions.max()) // bs + 1 for bs in block_sizes]
    bt = BlockTables(block_sizes, MAX_REQS, tokens, widths, device)
    bt.validate_inputs = False
    for g, t in enumerate(bt.block_tables):
        unique = (torch.randperm(t.gpu.numel(), device=device) * 7919 + 1) % (2**31 - 1)
        t.gpu.copy_(unique.reshape(t.gpu.shape))  # distinct ids: no slot is shared
        bt.num_blocks.np[g, :] = t.gpu.shape[1]
    bt.num_blocks.copy_to_uva()
    idx, qsl_t, pos = (torch.tensor(a, device=device) for a in (req_rows, qsl, positions))
    out = torch.empty((INTEGRITY_GROUPS, tokens), dtype=torch.int64, device=device)
    kernel = timer.time([partial(bt.compute_slot_mappings, idx, qsl_t, pos, tokens, out=out)])
    count = partial(integrity.count_slot_mapping_faults, out, qsl_t, block_sizes, tokens)
    check = partial(integrity.check_slot_mappings, out, qsl_t, idx, pos, block_sizes, tokens)
    dev = timer.time([count], host=False).device_us
    host = timer.time([check], graph=False).host_us
    row.device_us, row.host_us, row.bytes = dev, host, 8 * INTEGRITY_GROUPS * tokens
    row.agrees = int(count()) == 0
    row.extra.update(
        kernel_us=kernel.device_us,
        kernel_host_us=kernel.host_us,
        ratio=dev / kernel.device_us,
        host_ratio=host / kernel.host_us,
    )


def integrity_rows(timer: Timer, cfg: dict, rng, gen) -> list[Row]:
    """Cost of SPEC 8.3's slot-mapping check beside the slot-mapping kernel it follows.

    At 8K and 64K tokens (else the plan's largest), 4 groups, CP 1; tables hold
    distinct ids, so a correct mapping has no shared slot and the check must
    report none (`agrees`). Device time: the detection kernels alone (no
    read-back); host time: the whole check, read-back included. `extra`
    holds the kernel's figures and both ratios. No rival: upstream has no such check.
    """
    rows: list[Row] = []
    chosen = [t for t in cfg["tokens"] if t in INTEGRITY_TOKENS] or [max(cfg["tokens"])]
    for tokens in chosen:
        batch_ = batch(tokens, rng, cfg.get("max_context", MAX_CONTEXT))
        params = dict(tokens=tokens, groups=INTEGRITY_GROUPS, check="slot_mappings")
        case = f"T={tokens_label(tokens)} G={INTEGRITY_GROUPS} slots"
        measure = partial(_integrity, timer, gen, tokens, batch_)
        guarded(rows, Row("integrity_checks", case, params), measure)
    return rows


# ---------------------------------------------------------------- kernel block sizes

KBS_BLOCK, KBS_KERNEL = 64, 16  # allocator block B, kernel block K (SPEC.md 8.1): m = 4


def _kernel_blocks(timer: Timer, gen, tokens: int, batch_, row: Row) -> None:
    """The same batch through B = 64 split into K = 16 kernel blocks, and through K == B.

    The split table holds each allocator id `b` as kernel ids `b*m .. b*m+m-1`, so
    both must give the same slot for every token (a slot is a token address)."""
    device, m = timer.device, KBS_BLOCK // KBS_KERNEL
    req_rows, lens, positions = batch_
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    width = int(positions.max()) // KBS_BLOCK + 1
    whole = BlockTables([KBS_BLOCK], MAX_REQS, tokens, [width], device)
    split = BlockTables(
        [KBS_BLOCK], MAX_REQS, tokens, [width], device, kernel_block_sizes=[KBS_KERNEL]
    )
    ids = random_table_ids((MAX_REQS, width), gen, device) // m  # [max_num_reqs, width]
    kernel_ids = ids.to(torch.int64)[:, :, None] * m + torch.arange(m, device=device)
    whole.block_tables[0].gpu.copy_(ids)
    split.block_tables[0].gpu.copy_(kernel_ids.reshape(MAX_REQS, width * m).to(torch.int32))
    for bt, n in ((whole, width), (split, width * m)):
        bt.num_blocks.np[0, :] = n
        bt.num_blocks.copy_to_uva()
        bt.validate_inputs = False
    idx, qsl_t, pos = (torch.tensor(a, device=device) for a in (req_rows, qsl, positions))
    ours = timer.time([partial(split.compute_slot_mappings, idx, qsl_t, pos, tokens)])
    base = timer.time([partial(whole.compute_slot_mappings, idx, qsl_t, pos, tokens)])
    row.device_us, row.host_us, row.timing = ours.device_us, ours.host_us, ours.method
    row.agrees = torch.equal(
        split.compute_slot_mappings(idx, qsl_t, pos, tokens).clone(),
        whole.compute_slot_mappings(idx, qsl_t, pos, tokens),
    )
    row.extra.update(
        k_eq_b_device_us=base.device_us,
        k_eq_b_host_us=base.host_us,
        ratio=ours.device_us / base.device_us if base.device_us > 0 else None,
    )


def kernel_block_rows(timer: Timer, cfg: dict, rng, gen) -> list[Row]:
    """Slot mappings with K < B beside the same token count with K == B (issue: no dearer)."""
    rows: list[Row] = []
    for tokens in cfg["tokens"]:
        if tokens > 1 << 16:
            continue
        params = dict(tokens=tokens, block_size=KBS_BLOCK, kernel_block_size=KBS_KERNEL)
        row = Row("kernel_blocks", f"T={tokens_label(tokens)} B={KBS_BLOCK} K={KBS_KERNEL}", params)
        batch_ = batch(tokens, rng, cfg.get("max_context", MAX_CONTEXT))
        guarded(rows, row, partial(_kernel_blocks, timer, gen, tokens, batch_))
    return rows
