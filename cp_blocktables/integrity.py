"""Integrity checks an engine can leave on (SPEC.md section 8.3).

A slot shared by two tokens silently overwrites KV data; a gathered table
entry that differs from its source makes attention read another request's
cache. Neither raises anywhere by itself. These checks turn both into a
`RuntimeError` (`IntegrityError`) at the call that produced them:

- slot mappings, per group over tokens `[0, num_tokens)`: no slot other than
  `PAD_SLOT_ID` is negative, and no two tokens share a slot. Slots of the
  null block (`slot < null_slots[g]`, the allocator's block size) are
  exempt: writes there are harmless by contract, and a warm-up sends every
  token there.
- gathers, per group and real batch row `b`: entries `[0, num_blocks)` equal
  row `idx_mapping[b]` of the source table after sliding-window masking, and
  the published `num_blocks.gpu` equals the host truth `num_blocks.np` for
  every row read.

Cost model: detection runs on the device with torch ops and ends in one
read-back of a single count (`count_*` return it without reading it, so a
fused caller can add two counts and read once). Only when the count is not
zero do `explain_*` copy everything to the host and name the group, rows,
slot and tokens. The count truth reaches the device through pinned memory
and the null-block bounds are cached per device, so detection adds no
synchronisation of its own before that one read-back.

The functions take plain tensors and lists, not a `BlockTables`, so that
every method that maps slots or gathers rows (fused or not) can call them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import numpy as np
import torch

from .contract import PAD_SLOT_ID

ENV_VAR = "CPBT_INTEGRITY_CHECKS"
_MAX_LINES = 8  # violations named per message; the count says how many there were


class IntegrityError(RuntimeError):
    """A slot mapping or gathered table broke an invariant of SPEC.md section 8.3."""


def enabled(flag: bool) -> bool:
    """Checks are on when asked for, or when `CPBT_INTEGRITY_CHECKS=1` is set now."""
    return bool(flag) or os.environ.get(ENV_VAR) == "1"


def _to_device(values: np.ndarray | Sequence[int], device: torch.device) -> torch.Tensor:
    """A host array on `device` without a synchronisation (pinned, non-blocking copy).

    The caching host allocator keeps the pinned block until the copy is done.
    """
    host = torch.as_tensor(np.asarray(values, dtype=np.int64))
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def raise_on_faults(counts: Sequence[torch.Tensor], explain: Sequence[Callable[[], str]]) -> None:
    """Read the summed `counts` once; on a fault raise with every non-empty explanation."""
    if not counts or int(sum(counts).item()) == 0:
        return
    lines = [text for text in (e() for e in explain) if text]
    raise IntegrityError("integrity check failed: " + "; ".join(lines))


# ---------------------------------------------------------------- slot mappings


def _slot_view(slot_mappings: torch.Tensor, limit: int | None) -> torch.Tensor:
    return slot_mappings if limit is None else slot_mappings[:, :limit]


def _floors(null_slots: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """`[groups, 1]` int64 null-block bounds on `device`, built once per value and device.

    `BlockTables` passes a device tensor of its own, rebuilt by
    `init_block_table_layout_tensors` (so a wake-up after sleep rebuilds it
    too). Other callers pass a list, served from a module cache rather than a
    per-call upload: each upload costs a launch and host work on every step.
    """
    if isinstance(null_slots, torch.Tensor):
        return null_slots.view(-1, 1)
    key = (tuple(int(v) for v in null_slots), str(device))
    floors = _FLOORS.get(key)
    if floors is None:
        if len(_FLOORS) >= 64:
            _FLOORS.clear()
        floors = _FLOORS[key] = _to_device(key[0], device).unsqueeze(1)
    return floors


_FLOORS: dict[tuple, torch.Tensor] = {}


def count_slot_mapping_faults(
    slot_mappings: torch.Tensor,
    query_start_loc: torch.Tensor,
    null_slots: Sequence[int],
    limit: int | None = None,
) -> torch.Tensor:
    """Negative non-PAD slots plus repeated slots, as a 0-dim device tensor (no read-back).

    `slot_mappings` `[groups, n]`; `num_tokens` is `query_start_loc[-1]`, read
    on the device. Only columns `[0, limit)` are examined (the view a caller
    returns). Repeats: each group's slots are sorted and neighbours compared.
    Tokens that cannot repeat (PAD, negative, null block, past `num_tokens`)
    get distinct negative keys (`-2 - t`) that sort below every live slot,
    so one equality finds every repeat.
    """
    s = _slot_view(slot_mappings, limit)
    groups, n = s.shape
    if groups == 0 or n == 0:
        return torch.zeros((), dtype=torch.int64, device=s.device)
    t = torch.arange(n, device=s.device)
    in_batch = t < query_start_loc[-1]  # [n]
    live = in_batch & (s >= _floors(null_slots, s.device))
    keys = torch.where(live, s, -2 - t).sort(dim=1).values
    negative = (in_batch & (s < PAD_SLOT_ID)).sum()
    return negative + (keys[:, 1:] == keys[:, :-1]).sum()


def _token_names(
    idx_mapping: np.ndarray, qsl: np.ndarray, positions: np.ndarray | None
) -> Callable[[int], str]:
    def name(t: int) -> str:
        b = int(np.searchsorted(qsl, t, side="right")) - 1
        where = f"token {t} (batch entry {b}, row {int(idx_mapping[b])}"
        if positions is not None and t < positions.shape[0]:
            where += f", position {int(positions[t])}"
        return where + ")"

    return name


def explain_slot_mapping_faults(
    slot_mappings: torch.Tensor,
    query_start_loc: torch.Tensor,
    idx_mapping: torch.Tensor,
    positions: torch.Tensor | None,
    null_slots: Sequence[int],
    limit: int | None = None,
) -> str:
    """Name every group's negative and shared slots and the tokens involved (slow, host)."""
    s = _slot_view(slot_mappings, limit).cpu().numpy()
    if isinstance(null_slots, torch.Tensor):
        null_slots = null_slots.cpu().tolist()
    qsl = query_start_loc.cpu().numpy().astype(np.int64)
    num_tokens = min(int(qsl[-1]), s.shape[1])
    pos = None if positions is None else positions.cpu().numpy()
    name = _token_names(idx_mapping.cpu().numpy(), qsl, pos)
    lines = []
    for g in range(s.shape[0]):
        row = s[g, :num_tokens]
        for t in np.flatnonzero((row < 0) & (row != PAD_SLOT_ID))[:_MAX_LINES].tolist():
            lines.append(f"group {g}: {name(t)} has negative slot {int(row[t])}")
        live = np.flatnonzero(row >= null_slots[g])
        order = live[np.argsort(row[live], kind="stable")]
        same = np.flatnonzero(row[order[1:]] == row[order[:-1]])
        if same.size:
            lines.append(f"group {g}: {same.size} token(s) share a slot with an earlier one")
        for i in same[:_MAX_LINES].tolist():
            a, b = int(order[i]), int(order[i + 1])
            lines.append(f"group {g}: slot {int(row[a])} is shared by {name(a)} and {name(b)}")
    return "compute_slot_mappings: " + "; ".join(lines) if lines else ""


def check_slot_mappings(
    slot_mappings: torch.Tensor,
    query_start_loc: torch.Tensor,
    idx_mapping: torch.Tensor,
    positions: torch.Tensor | None,
    null_slots: Sequence[int],
    limit: int | None = None,
) -> None:
    """Raise `IntegrityError` naming group, slot and tokens if a slot is negative or shared."""
    count = count_slot_mapping_faults(slot_mappings, query_start_loc, null_slots, limit)
    raise_on_faults(
        [count],
        [
            lambda: explain_slot_mapping_faults(
                slot_mappings, query_start_loc, idx_mapping, positions, null_slots, limit
            )
        ],
    )


# ---------------------------------------------------------------- gathers


def _expected_rows(
    source: torch.Tensor,
    rows: torch.Tensor,
    block_size: int,
    reach: int,
    num_computed_tokens: torch.Tensor | None,
) -> torch.Tensor:
    """Source rows `rows` with the entries wholly below the sliding window zeroed."""
    expected = source.index_select(0, rows)  # [R, W]
    if num_computed_tokens is None or reach <= 0:
        return expected
    cols = torch.arange(source.shape[1], device=source.device, dtype=torch.int64)
    live_from = num_computed_tokens.index_select(0, rows).to(torch.int64) - reach  # [R]
    dead = (cols[None, :] + 1) * block_size <= live_from[:, None]
    return expected.masked_fill(dead, 0)


def _gather_state(
    idx_mapping: torch.Tensor,
    sources: Sequence[torch.Tensor],
    num_blocks_published: torch.Tensor,
    num_blocks_truth: np.ndarray,
):
    """`(rows clamped, real mask, published counts, true counts)`; counts `[groups, R]`."""
    max_num_reqs = num_blocks_truth.shape[1]
    r = idx_mapping.to(torch.int64)
    real = (r >= 0) & (r < max_num_reqs)
    rows = r.clamp(0, max_num_reqs - 1)
    published = num_blocks_published.index_select(1, rows)
    truth = _to_device(num_blocks_truth, idx_mapping.device).index_select(1, rows)
    return rows, real, published, truth


def count_gather_faults(
    tables: Sequence[torch.Tensor],
    sources: Sequence[torch.Tensor],
    idx_mapping: torch.Tensor,
    num_blocks_published: torch.Tensor,
    num_blocks_truth: np.ndarray,
    block_sizes: Sequence[int],
    reaches: Sequence[int],
    num_computed_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Differing entries of real rows plus stale counts, as a 0-dim device tensor.

    `tables[g]`: the gathered output (row `b` for batch entry `b`);
    `sources[g]`: the persistent table; `num_blocks_truth`: the host counts
    `[groups, max_num_reqs]`; `block_sizes`, `reaches`: what masking uses.
    Entries are compared over `[0, true count)`, so a count published stale
    shows up twice: as itself and as the entries it left uncopied.
    """
    device = idx_mapping.device
    total = torch.zeros((), dtype=torch.int64, device=device)
    if not sources or idx_mapping.shape[0] == 0:
        return total
    rows, real, published, truth = _gather_state(
        idx_mapping, sources, num_blocks_published, num_blocks_truth
    )
    total = total + ((published != truth) & real).sum()
    num_reqs = rows.shape[0]
    for g, source in enumerate(sources):
        width = source.shape[1]
        expected = _expected_rows(source, rows, block_sizes[g], reaches[g], num_computed_tokens)
        cols = torch.arange(width, device=device)
        covered = (cols[None, :] < truth[g][:, None]) & real[:, None]
        total = total + (covered & (tables[g][:num_reqs, :width] != expected)).sum()
    return total


def explain_gather_faults(
    tables: Sequence[torch.Tensor],
    sources: Sequence[torch.Tensor],
    idx_mapping: torch.Tensor,
    num_blocks_published: torch.Tensor,
    num_blocks_truth: np.ndarray,
    block_sizes: Sequence[int],
    reaches: Sequence[int],
    num_computed_tokens: torch.Tensor | None = None,
) -> str:
    """Name every group's stale counts and differing rows, with the first entry that differs."""
    if not sources or idx_mapping.shape[0] == 0:
        return ""
    rows_t, real_t, published_t, truth_t = _gather_state(
        idx_mapping, sources, num_blocks_published, num_blocks_truth
    )
    idx = idx_mapping.cpu().numpy()
    real, published, truth = real_t.cpu().numpy(), published_t.cpu().numpy(), truth_t.cpu().numpy()
    num_reqs = idx.shape[0]
    lines = []
    for g, source in enumerate(sources):
        stale = np.flatnonzero(real & (published[g] != truth[g]))
        for b in stale[:_MAX_LINES].tolist():
            lines.append(
                f"group {g}: batch row {b} (request row {int(idx[b])}) read num_blocks.gpu = "
                f"{int(published[g, b])} but num_blocks.np = {int(truth[g, b])}: counts "
                f"changed on the host without apply_staged_writes (stale count)"
            )
        width = source.shape[1]
        expected = (
            _expected_rows(source, rows_t, block_sizes[g], reaches[g], num_computed_tokens)
            .cpu()
            .numpy()
        )
        got = tables[g][:num_reqs, :width].cpu().numpy()
        covered = (np.arange(width)[None, :] < truth[g][:, None]) & real[:, None]
        differs = covered & (got != expected)
        bad_rows = np.flatnonzero(differs.any(axis=1))
        for b in bad_rows[:_MAX_LINES].tolist():
            cols = np.flatnonzero(differs[b])
            j = int(cols[0])
            lines.append(
                f"group {g}: batch row {b} differs from its source, request row {int(idx[b])}, "
                f"in {cols.size} of {int(truth[g, b])} entries; first at column {j}: "
                f"gathered {int(got[b, j])}, expected {int(expected[b, j])}"
            )
    return "gather_block_tables: " + "; ".join(lines) if lines else ""


def check_gathered_block_tables(
    tables: Sequence[torch.Tensor],
    sources: Sequence[torch.Tensor],
    idx_mapping: torch.Tensor,
    num_blocks_published: torch.Tensor,
    num_blocks_truth: np.ndarray,
    block_sizes: Sequence[int],
    reaches: Sequence[int],
    num_computed_tokens: torch.Tensor | None = None,
) -> None:
    """Raise `IntegrityError` naming group and rows if a gathered row or count is wrong."""
    args = (
        tables,
        sources,
        idx_mapping,
        num_blocks_published,
        num_blocks_truth,
        block_sizes,
        reaches,
        num_computed_tokens,
    )
    raise_on_faults([count_gather_faults(*args)], [lambda: explain_gather_faults(*args)])
