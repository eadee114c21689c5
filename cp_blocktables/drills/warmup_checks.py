"""The null-block drill's own checks around a warm-up (`report.WARMUP_CHECKS`), one rank each.

Each appends findings (`report.finding` dicts) to `found`; the warm-up stage
(`null_block.NullBlockEra`) all-gathers them to the CP group's leader.
"""

from __future__ import annotations

import torch

from ..contract import NULL_BLOCK_ID
from ..harness import presets
from ..harness.features import constructor_kwargs, inspect_factory
from ..harness.probes import constructor_args
from .report import finding
from .serving import LiveBlocks, ServingState

FLAG = "redirect_writes_to_null_block"


def construct(cls: type, preset: presets.Preset, cp_rank: int, device: torch.device):
    """A fresh instance of `cls` for `preset`, as the harness builds one: every keyword the
    preset sets (kernel block sizes, integrity checks, ...) that `cls` takes."""
    kwargs = constructor_kwargs(preset, cp_rank, inspect_factory(cls))
    return cls(*constructor_args(preset.config(cp_rank), device), **kwargs)


def probe(
    impl: object, preset: presets.Preset, row: int, device: torch.device
) -> tuple[list[int], list[int]]:
    """Append each group's first block id `b` to `row`, apply, gather it: `(got, want)`,
    the first entry of each group and what it must be, `b`'s first kernel id `b*m`
    (SPEC.md 8.1: `b` is staged as its kernel ids `b*m .. b*m+m-1`)."""
    ids = [preset.block_id_range(g)[0] for g in range(len(preset.groups))]
    impl.append_block_ids(row, tuple([i] for i in ids), True)
    impl.apply_staged_writes()
    idx = torch.tensor([row], dtype=torch.int32, device=device)
    got = [int(t[0, 0]) for t in impl.gather_block_tables(idx, 1)]
    return got, [b * preset.kernel_factor(g) for g, b in enumerate(ids)]


def staged_not_null(impl: object, rank: int) -> list[dict]:
    """For the project's own class: the staged lists themselves must hold only the null
    block, that is its kernel blocks `0..m-1` where `m` kernel blocks make one block
    (SPEC.md 8.1; just 0 when `m == 1`)."""
    from ..block_tables import BlockTables

    if not isinstance(impl, BlockTables):
        return []
    out = []
    for g, t in enumerate(impl.block_tables):
        m = impl.block_sizes[g] // impl.kernel_block_sizes[g]
        bad = [v for v in t._staged_write_contents if not NULL_BLOCK_ID <= v < NULL_BLOCK_ID + m]
        if bad:
            out.append(
                finding(
                    "null-ids",
                    "a warm-up's append staged real block ids",
                    rank,
                    g,
                    expected="0",
                    actual=f"{bad[:4]}",
                )
            )
    return out


def after_exit(
    found: list[dict],
    st: ServingState,
    rank: int,
    live: list[LiveBlocks],
    flag0: bool,
    pool0: tuple,
    when: str,
) -> None:
    """Flag, pool, block 0 and every live block as they must be once a warm-up ended."""
    flag = getattr(st.impl, FLAG)
    if flag != flag0:
        found.append(
            finding(
                "flag-restored",
                f"{when}, the flag is not back",
                rank,
                expected=repr(flag0),
                actual=repr(flag),
            )
        )
    if st.pool.snapshot() != pool0:
        found.append(
            finding(
                "pool-restored",
                f"{when}, the pool differs",
                rank,
                expected=str(pool0)[:200],
                actual=str(st.pool.snapshot())[:200],
            )
        )
    for g, cache in enumerate(st.caches):
        if not cache.null_block_is_zero():
            found.append(finding("null-zeroed", f"{when}, block 0 is not zero", rank, g))
    for c in st.changed_blocks(live):
        found.append(
            finding(
                "live-kv",
                f"{when}, block {c['block']} changed at offset {c['offset']}",
                rank,
                c["group"],
                expected=c["before"],
                actual=c["after"],
            )
        )


def other_instance(
    found: list[dict],
    cls: type,
    preset: presets.Preset,
    cp_rank: int,
    rank: int,
    device: torch.device,
) -> None:
    """Another instance, built during the warm-up, must stage what it is given."""
    try:
        other = construct(cls, preset, cp_rank, device)
        flag = getattr(other, FLAG)
        got, ids = probe(other, preset, 0, device)
    except Exception as e:  # noqa: BLE001
        found.append(
            finding("per-instance", f"a second instance raised {type(e).__name__}: {e}", rank)
        )
        return
    if flag is not False or got != ids:
        found.append(
            finding(
                "per-instance",
                "an instance built during another's warm-up is redirected "
                f"too (its flag reads {flag!r})",
                rank,
                expected=f"ids {ids}",
                actual=f"ids {got}",
            )
        )


def appends_after(
    found: list[dict], st: ServingState, preset: presets.Preset, rank: int, device: torch.device
) -> None:
    """After the warm-up, an append must be staged as given (read back through a gather)."""
    try:
        got, ids = probe(st.impl, preset, st.pool.free_rows()[0], device)
    except Exception as e:  # noqa: BLE001
        found.append(
            finding(
                "appends-after",
                f"an append after the warm-up raised {type(e).__name__}: {e}",
                rank,
            )
        )
        return
    if got != ids:
        found.append(
            finding(
                "appends-after",
                "ids appended after the warm-up were redirected",
                rank,
                expected=f"ids {ids}",
                actual=f"ids {got}",
            )
        )
