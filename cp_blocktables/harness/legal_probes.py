"""Legal calls at the contract's edges that must succeed, each on an instance of its own.

No preset reaches these edges, and a correct implementation takes each in
its stride: blocks far larger than any preset's (SPEC.md bounds only the
slots), a position past the table of a group without slot mapping (SPEC.md
3: that group's slots are all `PAD_SLOT_ID`), a position past 2**61
(docs/contract-notes.md bounds positions below 2**62), a model of 257
groups (SPEC.md 1: 0..N groups), and one-token blocks whose tables pass
2**31 positions only through their CP factor. A call that raises is the
finding (check 9); the slots of the far positions and the one-token blocks
are compared with the reference's too. `probes.run_probes` runs them beside
the refusals, and beside the token buffer's edges (`buffer_probes`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .integrity_probes import probe_reference
from .planted import i32, i64
from .violations import Violation

_CONSTRUCTION = 9  # the check a legal call that fails reports (`probes`)
_HUGE_BITS = 44  # the huge-block probe scales every block size to [2**43, 2**45)
_HUGE_ID = 3  # the block id row 0 holds there: its slots, below 4 * 2**45, fit int64
_FAR_BITS = 59  # the far-position probe scales every block size to [2**58, 2**59)
_FAR_POSITION = 2**61 + 5  # past 2**61, below the positions' bound of 2**62
_MANY_GROUPS = 257  # one past the ints CPython shares: a length compared by identity fails
_UNIT_CP = 2**13  # the unit-block probe's CP size: one-token blocks pass 2**31 in 2**18 columns
PER_GROUP_DEFAULTS = {  # the optional per-group lists of SPEC.md 3 and 8.1, and their default
    "slot_mapping_enabled": True,
    "dcp_sharded": True,
    "sliding_window_reach": 0,
    "kernel_block_sizes": None,  # the group's block size
}


def _scaled_blocks(block_sizes: list, kwargs: dict, bits: int) -> tuple[list[int], dict]:
    """Every block size (and kernel block size) scaled by one power of two into
    `[2**(bits - 1), 2**bits)`: every divisibility rule of the preset still holds."""
    scale = [1 << max(0, bits - b.bit_length()) for b in block_sizes]
    kw = dict(kwargs)
    if kwargs.get("kernel_block_sizes") is not None:
        kw["kernel_block_sizes"] = [k * f for k, f in zip(kwargs["kernel_block_sizes"], scale)]
    return [b * f for b, f in zip(block_sizes, scale)], kw


def probe_huge_blocks(factory: Callable, args: list, kwargs: dict, cp_rank: int) -> list[Violation]:
    """A legal config of huge blocks must build, take a row and map two positions.

    SPEC.md bounds no block size: only slots, which are int64. Every block
    size (and kernel block size) of the preset is scaled by one power of two
    to lie in `[2**43, 2**45)`, which keeps every divisibility rule the
    preset meets. A construction whose work or memory grows with the block
    size (an offset table per block, a bit test by shifting) fails here,
    and no preset's blocks come near. Row 0 holds block `_HUGE_ID` in every
    group and positions 5 and `2**43 - 1` are mapped; the slots themselves
    are not compared (a wrong mapping is the workload's finding, checks 1 to
    5, where the sweep's far presets reach blocks of 2**31).
    """
    block_sizes = args[0]
    if not block_sizes or args[1] < 1 or args[2] < 2:
        return []
    huge, kw = _scaled_blocks(block_sizes, kwargs, _HUGE_BITS)
    device = args[4]

    def call() -> None:
        impl = factory(huge, *args[1:], **kw)
        impl.append_block_ids(0, tuple([_HUGE_ID] for _ in huge), True)
        impl.apply_staged_writes()
        positions = i64([5, (1 << (_HUGE_BITS - 1)) - 1], device)
        impl.compute_slot_mappings(i32([0], device), i32([0, 2], device), positions, 2)

    what = (
        f"construction with block sizes {huge}, one row and one slot mapping (legal: "
        "SPEC.md bounds only the slots)"
    )
    return _legal_call(what, "it builds and maps", call, cp_rank)


def probe_far_positions(
    factory: Callable, args: list, kwargs: dict, cp_rank: int
) -> list[Violation]:
    """A legal position in `[2**61, 2**62)` must map.

    docs/contract-notes.md bounds positions below 2**62 (the int64 slot
    arithmetic stays clear of overflow there) and no lower: a bound taken a
    bit short refuses positions the contract allows, and the sweep's far
    presets stop near 2**31. Every block size (and kernel block size) of the
    preset is scaled by one power of two into `[2**58, 2**59)`, each row 0
    holds blocks `1, 2, ...` up to the one of position `_FAR_POSITION` (at
    most nine, so every slot stays below 2**63), and row 0 maps `_FAR_POSITION`
    after control tokens at its offset in each group's first two columns. No
    workload reaches such a position, so its slots are compared with the
    reference's wherever the controls map right (`maps_as_reference`).
    """
    block_sizes = args[0]
    if not block_sizes or args[1] < 1 or args[2] < 2:
        return []
    far, kw = _scaled_blocks(block_sizes, kwargs, _FAR_BITS)
    rules = probe_reference([far, *args[1:]], kw, cp_rank).rules
    spans = [b * c for b, c in zip(far, rules.group_cp)]  # each group's virtual block
    needed = [_FAR_POSITION // v + 1 for v in spans]
    device = args[4]
    ids = tuple(list(range(1, n + 1)) for n in needed)
    ref = probe_reference([far, args[1], args[2], needed, device], kw, cp_rank)
    ref.append_block_ids(0, ids, True)
    near = {_FAR_POSITION % v + k * v for v in spans for k in (0, 1)}  # its offset, columns 0, 1
    controls = sorted(p for p in near if p < _FAR_POSITION)[: args[2] - 1]
    tokens = [*controls, _FAR_POSITION]  # [n]: the controls, then the far one
    n = len(tokens)
    want = ref.slot_mappings([0], [0, n], tokens, n)  # [groups, n]

    def call() -> torch.Tensor:
        impl = factory(far, args[1], args[2], needed, device, **kw)
        impl.append_block_ids(0, ids, True)
        impl.apply_staged_writes()
        positions = i64(tokens, device)
        return impl.compute_slot_mappings(i32([0], device), i32([0, n], device), positions, n)

    what = (
        f"slot mapping of positions {tokens[:-1]} and {_FAR_POSITION} (2**61 + 5) in tables of "
        f"block sizes {far} (legal: positions are bounded below 2**62)"
    )
    return maps_as_reference(what, call, want.tolist(), cp_rank, controls=n - 1)


def _legal_call(
    what: str, expected: str, call: Callable[[], object], cp_rank: int
) -> list[Violation]:
    """A legal `call` must not raise: whatever it raises is the finding (check 9)."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - a legal call that fails is the finding
        actual = f"{type(e).__name__}: {e}"[:300]
        return [Violation(_CONSTRUCTION, what, -1, rank=cp_rank, expected=expected, actual=actual)]
    return []


def maps_as_reference(
    what: str,
    call: Callable[[], torch.Tensor],
    want: list[list[int]],
    cp_rank: int,
    controls: int,
) -> list[Violation]:
    """A legal slot mapping must not raise and must return the reference's slots `want`
    (`[groups, n]`; check 9, as the probe that made the call).

    Its first `controls` tokens share the far token's offset in a virtual block
    but lie in columns 0 and 1, where the workload maps too. Slots wrong there
    are wrong everywhere, and a finding here would stop the preset before the
    workload's checks 1 to 5 name the defect: so the tokens after them are
    judged only where the controls map as the reference's."""
    got: list = []
    expected = f"slots {want}"
    found = _legal_call(what, expected, lambda: got.append(call()), cp_rank)
    if found:
        return found
    try:
        slots = got[0].tolist()
        controls_agree = [r[:controls] for r in slots] == [r[:controls] for r in want]
    except Exception:  # noqa: BLE001 - no tensor of slots: the workload's checks name it
        return []
    if slots == want or not controls_agree:
        return []
    actual = f"slots {slots}"
    return [Violation(_CONSTRUCTION, what, -1, rank=cp_rank, expected=expected, actual=actual)]


def probe_disabled_group_positions(
    factory: Callable, args: list, kwargs: dict, cp_rank: int
) -> list[Violation]:
    """A position past the table of a group without slot mapping must map.

    SPEC.md 3 gives such a group `PAD_SLOT_ID` for every token, so its table
    bounds no position; only the enabled groups' tables do. Every preset
    sizes all tables from one model length, so no workload position lies
    past a disabled group's table. Here the preset's disabled groups (or,
    when it has none, its last group, disabled) keep one block a row, and
    row 0 maps the first position past all of them, which every enabled
    group's table still covers. The slots are not compared (the workload's
    checks 1 to 5 do that): the call must only not raise.
    """
    block_sizes, _, _, max_blocks, device = args
    n = len(block_sizes)
    enabled = list(kwargs.get("slot_mapping_enabled") or [True] * n)
    if n < 2 or args[1] < 1 or args[2] < 1:
        return []
    if all(enabled):
        enabled[-1] = False
    if not any(enabled):
        return []
    rules = probe_reference(args, kwargs, cp_rank).rules
    span = [b * c for b, c in zip(block_sizes, rules.group_cp)]  # V of each group
    short = [m if on else 1 for on, m in zip(enabled, max_blocks)]
    position = max(v for v, on in zip(span, enabled) if not on)
    if any(on and position >= v * m for v, on, m in zip(span, enabled, max_blocks)):
        return []
    ids = tuple(list(range(1, position // v + 2)) if on else [1] for v, on in zip(span, enabled))
    kw = {**kwargs, "slot_mapping_enabled": enabled}

    def call() -> None:
        impl = factory(block_sizes, args[1], args[2], short, device, **kw)
        impl.append_block_ids(0, ids, True)
        impl.apply_staged_writes()
        tokens = i32([0, 1], device), i64([position], device)
        impl.compute_slot_mappings(i32([0], device), *tokens, 1)

    disabled = [g for g, on in enumerate(enabled) if not on]
    what = (
        f"slot mapping of position {position}, past the one-block tables of groups "
        f"{disabled} without slot mapping and inside every other group's (legal: "
        "SPEC.md 3 maps a disabled group's tokens to PAD_SLOT_ID)"
    )
    return _legal_call(what, "it maps", call, cp_rank)


def probe_many_groups(
    factory: Callable, args: list, kwargs: dict, cp_rank: int, reads: bool = True
) -> list[Violation]:
    """A model of 257 KV-cache groups must build, take a row and apply it, and with
    `reads` gather it and map a token, each into caller-owned `out` tensors.

    SPEC.md 1 allows any number of groups; the sweep's presets have at most
    six. 257 is one past the small ints CPython shares, so a length compared
    by identity (`is not` for `!=`) refuses a correct tensor or list of 257
    entries: the writer's pointers, the gather's `out` list, the slot
    mapping's `out` rows. The preset's groups repeat to 257, every per-group
    argument with them. The gather and the slot mapping cost seconds in the
    interpreter, so only presets of six groups or more probe them, on one CP
    group. The results are not compared (the workload's checks do that).
    """
    n = len(args[0])
    if n < 1 or args[1] < 1:
        return []
    cycle = [g % n for g in range(_MANY_GROUPS)]
    kw = dict(kwargs)
    for key in PER_GROUP_DEFAULTS:
        if kwargs.get(key) is not None:
            kw[key] = [kwargs[key][g] for g in cycle]
    block_sizes = [args[0][g] for g in cycle]
    max_blocks = [args[3][g] for g in cycle]
    device = args[4]

    def call() -> None:
        impl = factory(block_sizes, args[1], args[2], max_blocks, device, **kw)
        impl.append_block_ids(0, tuple([1 + g] for g in range(_MANY_GROUPS)), True)
        impl.apply_staged_writes()
        if not reads:
            return
        idx = i32([0], device)
        out = [torch.zeros_like(t[:1]) for t in impl.input_block_tables]
        impl.gather_block_tables(idx, 1, out=out)
        slots = torch.zeros((_MANY_GROUPS, args[2]), dtype=torch.int64, device=device)
        impl.compute_slot_mappings(idx, i32([0, 1], device), i64([0], device), 1, out=slots)

    what = f"construction, one append and one apply with {_MANY_GROUPS} groups" + (
        ", a gather into `out` and a slot mapping into `out`" if reads else ""
    )
    done = "it builds, applies, gathers and maps" if reads else "it builds and applies"
    return _legal_call(f"{what} (legal: SPEC.md 1)", done, call, cp_rank)


def probe_unit_blocks_past_2_31(
    factory: Callable, args: list, kwargs: dict, cp_rank: int
) -> list[Violation]:
    """Positions past 2**31 must map in a table of one-token blocks that spans them only
    through its CP factor.

    A kernel takes int32 or int64 positions from its widest table's span,
    columns x block size x CP size. The sweep's tables that pass 2**31
    through their CP factor hold blocks of 2**18 tokens or more, where a span
    computed wrong (`bs ** cp` for `bs * cp`) still lands past 2**31; with
    one-token blocks only the factor itself carries it there, and a 2**31-
    column table costs gigabytes. So where the preset has a sharded group of
    one-token kernel blocks under CP, this rank builds one such group of its
    own under CP `_UNIT_CP` (interleave 1, as one-token blocks require):
    `2**31 / _UNIT_CP + 4` columns holding blocks 1, 2, ..., and maps the
    positions it owns in columns 0 to 3 (the controls) and in the four columns
    past 2**31, compared with the reference wherever the controls map right.
    """
    if kwargs.get("cp_size", 1) < 2:
        return []
    kernel = kwargs.get("kernel_block_sizes") or args[0]
    group_cp = probe_reference(args, kwargs, cp_rank).rules.group_cp
    if not any(k == 1 and c > 1 for k, c in zip(kernel, group_cp)):
        return []
    width = 2**31 // _UNIT_CP + 4
    device = args[4]
    kw = {"cp_size": _UNIT_CP, "cp_rank": cp_rank, "cp_interleave": 1}
    one = [[1], 1, 8, [width], device]
    ids = (list(range(1, width + 1)),)
    near = [cp_rank + j * _UNIT_CP for j in range(4)]
    tokens = [*near, *(2**31 + p for p in near)]  # [8]: columns 0 to 3, then past 2**31
    ref = probe_reference(one, kw, cp_rank)
    ref.append_block_ids(0, ids, True)
    want = ref.slot_mappings([0], [0, 8], tokens, 8)  # [1, 8]

    def call() -> torch.Tensor:
        impl = factory(*one, **kw)
        impl.append_block_ids(0, ids, True)
        impl.apply_staged_writes()
        positions = i64(tokens, device)
        return impl.compute_slot_mappings(i32([0], device), i32([0, 8], device), positions, 8)

    what = (
        f"slot mapping of positions {tokens} in a table of {width} one-token blocks under "
        f"CP {_UNIT_CP}, spanning {width * _UNIT_CP} positions (legal)"
    )
    return maps_as_reference(what, call, want.tolist(), cp_rank, controls=4)
