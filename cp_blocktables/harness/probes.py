"""Contract probes: calls SPEC.md says must fail, and one that must not, on instances of their own.

The workload makes legal calls and checks what they compute. Two rules of the
contract are about calls that must raise, and no legal workload makes them:

- construction validates everything it is given and raises `ValueError`
  naming the offending argument (SPEC.md sections 2, 3 and 8.1), so a bad
  config cannot silently build tables that overflow a block;
- with integrity checks on (section 8.3), a slot shared by two tokens, a
  gather that reads a count never published, and a gathered row that differs
  from its source raise `RuntimeError`.

Four more must succeed: a legal config whose blocks are far larger than any
preset's (SPEC.md bounds only the slots) must build and map, so must a
position past the table of a group without slot mapping (SPEC.md 3: that
group's slots are all `PAD_SLOT_ID`, whatever the position) and a position
past 2**61 (docs/contract-notes.md bounds positions below 2**62; its slot is
compared with the reference's), and a model of 257 groups must build,
apply, gather and map (SPEC.md 1: 0..N groups).

An implementation that skips a rule computes every legal step right, so only
a probe can tell. Each probe starts from the preset's own valid constructor
arguments and changes exactly one thing (a correct implementation has one
reason to refuse), and builds its own instance, so the workload's instance
never sees a refused or faulty call. Every rank probes with its own
`cp_rank`: a defect on one rank fails the run. Findings are check 9
(construction) and check 10 (integrity checks, `integrity_probes`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .features import Accepts
from .integrity_probes import names_number, probe_integrity, probe_reference
from .planted import i32, i64
from .row_probe import probe_many_rows
from .violations import Violation

CONSTRUCTION = 9
_HUGE_BITS = 44  # the huge-block probe scales every block size to [2**43, 2**45)
_HUGE_ID = 3  # the block id row 0 holds there: its slots, below 4 * 2**45, fit int64
_FAR_BITS = 59  # the far-position probe scales every block size to [2**58, 2**59)
_FAR_POSITION = 2**61 + 5  # past 2**61, below the positions' bound of 2**62
_MANY_GROUPS = 257  # one past the ints CPython shares: a length compared by identity fails
_MANY_GROUPS_FROM = 6  # presets of this many groups or more probe it (`groups-6`)
_PER_GROUP_DEFAULTS = {  # the optional per-group lists of SPEC.md 3 and 8.1, and their default
    "slot_mapping_enabled": True,
    "dcp_sharded": True,
    "sliding_window_reach": 0,
    "kernel_block_sizes": None,  # the group's block size
}


@dataclass
class _Refusal:
    """One invalid configuration: the preset's arguments with one entry made wrong."""

    label: str
    args: list
    kwargs: dict
    names: tuple[str, ...]  # the message must contain one of these
    group: int | None = None  # ... and name this group (SPEC.md 8.1: "naming the group")


def _refusals(args: list, kwargs: dict, accepts: Accepts) -> list[_Refusal]:
    """Every single-fault variant of the valid `(args, kwargs)` worth refusing."""
    block_sizes, _, _, max_blocks, _ = args
    n = len(block_sizes)
    out: list[_Refusal] = []

    def arg(label: str, i: int, value, name: str, group: int | None = None) -> None:
        a = list(args)
        a[i] = value
        out.append(_Refusal(label, a, dict(kwargs), (name,), group))

    def kw(label: str, key: str, value, name: str, group: int | None = None) -> None:
        if accepts.accepts(key):
            out.append(_Refusal(label, list(args), {**kwargs, key: value}, (name,), group))

    arg("max_num_reqs=0", 1, 0, "max_num_reqs")
    arg("max_num_batched_tokens=0", 2, 0, "max_num_batched_tokens")
    blocks = "max_num_blocks_per_group"
    arg(f"{blocks} one entry too many", 3, [*max_blocks, 1], blocks)
    if n:
        g = n - 1
        arg(f"block_sizes[{g}]=0", 0, [*block_sizes[:g], 0], "block_sizes")
        arg(f"{blocks}[{g}]=0", 3, [*max_blocks[:g], 0], blocks)
    for key, pad in _PER_GROUP_DEFAULTS.items():
        current = kwargs.get(key)
        if current is None:
            current = list(block_sizes) if key == "kernel_block_sizes" else [pad] * n
        extra = current[-1] if current else (1 if key == "kernel_block_sizes" else pad)
        kw(f"{key} one entry too many", key, [*current, extra], key)
    cp_size = int(kwargs.get("cp_size", 1))
    kw(f"cp_rank={cp_size} with cp_size={cp_size}", "cp_rank", cp_size, "cp_rank")
    kw("cp_rank=-1", "cp_rank", -1, "cp_rank")
    kernel = kwargs.get("kernel_block_sizes") or list(block_sizes)
    sharded = kwargs.get("dcp_sharded") or [True] * n
    if cp_size > 1 and "cp_interleave" in kwargs:
        for g in range(n):
            if sharded[g]:
                bad = kernel[g] + 1  # never divides kernel[g]
                kw(f"cp_interleave={bad} for group {g}", "cp_interleave", bad, "cp_interleave")
                kw("cp_interleave=0", "cp_interleave", 0, "cp_interleave")
                break
    if n and accepts.accepts("kernel_block_sizes"):
        g = n - 1
        bad = block_sizes[g] + 1  # never divides block_sizes[g]
        kw(f"kernel_block_sizes[{g}]={bad}", "kernel_block_sizes", [*kernel[:g], bad],
           "kernel_block_sizes", g)  # fmt: skip
        kw(f"kernel_block_sizes[{g}]=0", "kernel_block_sizes", [*kernel[:g], 0],
           "kernel_block_sizes", g)  # fmt: skip
    return out


def run_probes(
    factory: Callable,
    cfg,
    device: torch.device,
    kwargs: dict,
    accepts: Accepts,
    cp_rank: int,
    fused: bool,
    first_cp_group: bool = True,
) -> list[Violation]:
    """Every probe for one rank; `cfg` and `kwargs` built its workload instance.

    `first_cp_group`: this rank belongs to the first CP group running the
    preset; the probes that cost seconds run there alone (the other groups
    build the same config)."""
    args = constructor_args(cfg, device)
    found = probe_construction(factory, args, kwargs, accepts, cp_rank)
    found += probe_huge_blocks(factory, args, kwargs, cp_rank)
    found += probe_far_positions(factory, args, kwargs, cp_rank)
    if accepts.accepts("slot_mapping_enabled"):
        found += probe_disabled_group_positions(factory, args, kwargs, cp_rank)
    if len(cfg.block_sizes) >= _MANY_GROUPS_FROM:
        found += probe_many_groups(factory, args, kwargs, cp_rank, reads=first_cp_group)
        if first_cp_group:
            found += probe_many_rows(factory, args, kwargs, cp_rank)
    if kwargs.get("integrity_checks"):
        found += probe_integrity(factory, args, kwargs, cp_rank, fused)
    return found


def constructor_args(cfg, device: torch.device) -> list:
    """The positional arguments of SPEC.md section 3's constructor for config `cfg`."""
    return [cfg.block_sizes, cfg.max_num_reqs, cfg.max_num_batched_tokens,
            cfg.max_num_blocks_per_group, device]  # fmt: skip


def _names_group(message: str, group: int) -> bool:
    return names_number(message, str(group))


def probe_construction(
    factory: Callable, args: list, kwargs: dict, accepts: Accepts, cp_rank: int
) -> list[Violation]:
    """Each invalid configuration must raise `ValueError` naming what is wrong."""
    found = []
    for r in _refusals(args, kwargs, accepts):
        expected = f"ValueError naming {' or '.join(r.names)}"
        if r.group is not None:
            expected += f" and group {r.group}"
        try:
            factory(*r.args, **r.kwargs)
        except ValueError as e:
            text = str(e)
            if any(name in text for name in r.names) and (
                r.group is None or _names_group(text, r.group)
            ):
                continue
            actual = f"ValueError: {text}"
        except Exception as e:  # noqa: BLE001 - any other type is the finding
            actual = f"{type(e).__name__}: {e}"
        else:
            actual = "the constructor accepted it"
        found.append(
            Violation(
                CONSTRUCTION,
                f"construction with {r.label} (the rest of the preset's arguments valid)",
                -1,
                rank=cp_rank,
                expected=expected,
                actual=actual[:300],
            )
        )
    return found


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
    reference's wherever the controls map right (`_maps_as_reference`).
    """
    block_sizes = args[0]
    if not block_sizes or args[1] < 1 or args[2] < 2:
        return []
    far, kw = _scaled_blocks(block_sizes, kwargs, _FAR_BITS)
    rules = probe_reference([far, *args[1:]], kw, cp_rank).rules
    needed = [_FAR_POSITION // (b * c) + 1 for b, c in zip(far, rules.group_cp)]
    device = args[4]
    ids = tuple(list(range(1, n + 1)) for n in needed)
    ref = probe_reference([far, args[1], args[2], needed, device], kw, cp_rank)
    ref.append_block_ids(0, ids, True)
    spans = [b * c for b, c in zip(far, rules.group_cp)]  # each group's virtual block
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
    return _maps_as_reference(what, call, want.tolist(), cp_rank, controls=n - 1)


def _legal_call(
    what: str, expected: str, call: Callable[[], object], cp_rank: int
) -> list[Violation]:
    """A legal `call` must not raise: whatever it raises is the finding (check 9)."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - a legal call that fails is the finding
        actual = f"{type(e).__name__}: {e}"[:300]
        return [Violation(CONSTRUCTION, what, -1, rank=cp_rank, expected=expected, actual=actual)]
    return []


def _maps_as_reference(
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
        actual = got[0].tolist()
        controls_agree = [r[:controls] for r in actual] == [r[:controls] for r in want]
    except Exception:  # noqa: BLE001 - no tensor of slots: the workload's checks name it
        return []
    if actual == want or not controls_agree:
        return []
    return [
        Violation(CONSTRUCTION, what, -1, rank=cp_rank, expected=expected, actual=f"slots {actual}")
    ]


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
    for key in _PER_GROUP_DEFAULTS:
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
