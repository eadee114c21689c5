"""Named harness workloads: the registry behind `--preset NAME`.

A preset is a `BlockTables` configuration plus the knobs of its traffic and
the corners its workload must reach; `preset_spec` says what one is
(`GroupSpec`, `Preset`, `CORNERS`). The presets themselves are defined by
family: `preset_catalog`, `preset_groups` and `preset_span` hold the sweep's,
`preset_extras` the benchmark and mutation-testing ones. This module validates
and registers them all in `PRESETS`, in that order, and resolves names and
aliases.

`SWEEP` is what `make verify` runs: together its presets cover cp_size 1, 2, 3,
4 and 8, interleave 1 up to the block size, mixed groups, sliding windows and
every corner of the contract.
"""

from __future__ import annotations

from .preset_catalog import SWEEP_PRESETS
from .preset_extras import BENCH_PRESETS, MUTATION_PRESETS
from .preset_groups import GROUP_PRESETS
from .preset_span import SPAN_PRESETS
from .preset_spec import CORNERS, GroupSpec, Preset

__all__ = ["ALIASES", "CORNERS", "PRESETS", "SWEEP", "GroupSpec", "Preset", "resolve"]

PRESETS: dict[str, Preset] = {}


def _register(p: Preset) -> Preset:
    p.validate()
    PRESETS[p.name] = p
    return p


for _p in (*SWEEP_PRESETS, *GROUP_PRESETS, *SPAN_PRESETS, *BENCH_PRESETS):
    _register(_p)

SWEEP: tuple[str, ...] = (
    "cp1-window",
    "cp2-past-2-31",
    "cp2-i1",
    "cp2-unit-blocks",
    "default",
    "cp4-interleave",
    "cp8-large-ids",
    "cp8-span-2-31",
    "cp3-no-power-of-two",
    "large-steps",
    "kbs-cp1",
    "kbs-cp4",
    "groups-0",
    "groups-1",
    "groups-6",
    "cp2-below-2-31",
    "cp3-all-ones",
)
"""The default sweep: cp_size 1, 2, 3, 4 and 8, interleave 1 to block size, every corner.

The order matters only to `--fail-fast` (a mutant, a catalogue entry): the
presets that catch most defects, and are cheapest, come first, and
`cp2-past-2-31` second, as the first preset with exactly two groups. The last two
reach one narrow regime each (positions past 2**30 on the int32 path, sizes one below a
power of two), so few implementations that fail get that far.
"""

# `all` was fixed before the mutation presets were registered: it leaves them out.
ALIASES: dict[str, tuple[str, ...]] = {"sweep": SWEEP, "all": tuple(PRESETS)}

for _p in MUTATION_PRESETS:
    _register(_p)
del _p


def resolve(names: list[str]) -> list[Preset]:
    """Presets by name or alias, in order, without repeats; `ValueError` for unknown names."""
    out: list[Preset] = []
    for name in names:
        expanded = ALIASES.get(name, (name,))
        for n in expanded:
            if n not in PRESETS:
                known = ", ".join([*PRESETS, *ALIASES])
                raise ValueError(f"unknown preset {n!r}; known: {known}")
            if PRESETS[n] not in out:
                out.append(PRESETS[n])
    return out
