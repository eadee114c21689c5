"""Legal slot mappings at the token buffer's edges, each on an instance of its own.

`max_num_batched_tokens` sizes the slot-mapping buffer, and a kernel may
branch on it: fixed tiles over the buffer with a partial last one, a reach
for programs that walk one request each, tail tiles past that reach. The
sweep's buffers are few (64 to 384 tokens, and 9,216 and more), and its
steps never fill one with a single request. Each probe maps a step that a
correct implementation takes in its stride and compares every entry with
the reference's (check 9), behind a control step: where the control maps
wrong, the workload's checks 1 to 5 name the defect and the probe says
nothing (a finding here would stop the preset before them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .integrity_probes import probe_reference
from .legal_probes import maps_as_reference
from .planted import filled, i32, i64
from .violations import Violation

_SHORT_REQUEST = 40  # the most tokens of each request of the buffer-length probe's step
_SHORT_PAD = 8  # the padded tokens past that step's batch
_SHORT_START = 3  # where a probe's request starts: inside its first block
_FULL_MOST = 2**14  # the largest buffer the full-buffer probe fills (seconds past it on CPU)


def _blocks_a_row(args: list, kwargs: dict, cp_rank: int, positions: int) -> list[int]:
    """`[groups]`: the blocks a row needs to hold positions `[0, positions)` in each group."""
    rules = probe_reference(args, kwargs, cp_rank).rules
    spans = [b * c for b, c in zip(args[0], rules.group_cp)]  # each group's virtual block
    return [-(-positions // v) for v in spans]


def probe_buffer_lengths(
    factory: Callable, args: list, kwargs: dict, cp_rank: int, lengths: tuple[int, ...]
) -> list[Violation]:
    """A short step must map the reference's slots in a token buffer of each of `lengths`.

    A defect that shows only at buffer lengths no preset has passes the
    workload. Here a step of two requests of up to `_SHORT_REQUEST` tokens
    (the second in batch order starts inside its first block) and
    `_SHORT_PAD` padded tokens is mapped in a buffer of the preset's own
    length first, the control, and then in a buffer of each of `lengths`
    tokens.
    """
    block_sizes, max_num_reqs, own_len, _, device = args
    n = min(_SHORT_REQUEST, (own_len - _SHORT_PAD) // 2)
    if not block_sizes or max_num_reqs < 2 or n < 1:
        return []
    needed = _blocks_a_row(args, kwargs, cp_rank, _SHORT_START + n)
    rows = [tuple(list(range(1 + r * m, 1 + (r + 1) * m)) for m in needed) for r in (0, 1)]
    idx, qsl = [1, 0], [0, n, 2 * n]
    positions = [*range(n), *range(_SHORT_START, _SHORT_START + n)]  # row 1, then row 0
    padded = 2 * n + _SHORT_PAD
    ref = probe_reference([block_sizes, max_num_reqs, own_len, needed, device], kwargs, cp_rank)
    for r, ids in enumerate(rows):
        ref.append_block_ids(r, ids, True)
    want = ref.slot_mappings(idx, qsl, positions, padded).tolist()  # [groups, padded]

    def mapped(length: int) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            sized = [block_sizes, max_num_reqs, length, needed, device]
            impl = filled(factory, sized, kwargs, dict(enumerate(rows)))
            batch = i32(idx, device), i32(qsl, device), i64(positions, device)
            return impl.compute_slot_mappings(*batch, padded)

        return call

    try:
        if mapped(own_len)().tolist() != want:
            return []
    except Exception:  # noqa: BLE001 - wrong in the preset's own buffer: the workload's finding
        return []
    found = []
    for length in (m for m in lengths if m != own_len and m >= padded):
        what = (
            f"slot mapping of two requests of {n} tokens, padded to {padded}, with "
            f"max_num_batched_tokens {length} (legal; the same step maps right with "
            f"{own_len})"
        )
        found += maps_as_reference(what, mapped(length), want, cp_rank, controls=0)
    return found


def probe_full_buffer(
    factory: Callable, args: list, kwargs: dict, cp_rank: int, fused: bool
) -> list[Violation]:
    """A step whose first request fills the token buffer must map the reference's slots.

    Chunked prefill fills `max_num_batched_tokens` with one request's chunk,
    alone or in a batch padded with empty entries (a CUDA-graph batch size),
    and then a kernel's reach over the buffer ends exactly at the request's
    last token: a program that starts entry 0 one token early, or ends its
    reach one token short, loses that token. The workload's chunks stop
    short of the buffer. Here row 0's request starts inside its first block
    and fills the preset's buffer of `L` tokens (up to `_FULL_MOST`): alone,
    then followed by an entry of no tokens (row 1), that one through the
    fused call too where the implementation has one. The control is the same
    request one token short, in the same buffer. Each call has an instance of
    its own: a token a step leaves unwritten shows as what a new buffer holds,
    not as the slot an earlier step wrote there.
    """
    block_sizes, max_num_reqs, length, _, device = args
    if not block_sizes or not 2 <= length <= _FULL_MOST:
        return []
    needed = _blocks_a_row(args, kwargs, cp_rank, _SHORT_START + length)
    sized = [block_sizes, max_num_reqs, length, needed, device]
    ids = {0: [list(range(1, m + 1)) for m in needed]}  # row 0
    ref = probe_reference(sized, kwargs, cp_rank)
    ref.append_block_ids(0, tuple(ids[0]), True)

    def step(idx: list, qsl: list, through_fused: bool) -> tuple[Callable, list]:
        """The call mapping batch `idx`/`qsl` on a fresh instance, and its expected slots."""
        positions = range(_SHORT_START, _SHORT_START + qsl[-1])
        want = ref.slot_mappings(idx, qsl, list(positions), length).tolist()  # [groups, length]

        def call() -> torch.Tensor:
            impl = filled(factory, sized, kwargs, ids)
            batch = i32(idx, device), i32(qsl, device), i64(positions, device), length
            if through_fused:
                return impl.gather_and_compute_slot_mappings(batch[0], len(idx), *batch[1:])[1]
            return impl.compute_slot_mappings(*batch)

        return call, want

    control, want = step([0], [0, length - 1], False)  # one token short of the buffer
    try:
        if control().tolist() != want:
            return []
    except Exception:  # noqa: BLE001 - the control fails: the workload's finding
        return []
    steps = [("filling the buffer", [0], [0, length], False)]
    if max_num_reqs > 1:
        steps += [
            ("filling the buffer, then an empty entry", [0, 1], [0, length, length], f)
            for f in (False, True)[: 1 + fused]
        ]
    found = []
    for what, idx, qsl, through_fused in steps:
        label = (
            f"{'gather_and_' if through_fused else ''}compute_slot_mappings of one request "
            f"of {length} tokens {what} (max_num_batched_tokens {length}, positions from "
            f"{_SHORT_START}: legal)"
        )
        found += maps_as_reference(label, *step(idx, qsl, through_fused), cp_rank, controls=0)
    return found
