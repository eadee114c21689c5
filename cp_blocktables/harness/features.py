"""What an implementation under test accepts (SPEC.md section 8), read from what it declares.

The harness never guesses a feature from behaviour. From the constructor's
(or factory's) signature it learns which keywords it takes; from the built
object, which optional methods it has. A preset that needs a keyword at a
value other than its default runs only where that keyword is accepted; a
check that needs a method runs only where the method exists. Everything left
out is reported as "not supported by this implementation", never as a pass.

A factory that takes `**kwargs` is taken to accept every keyword: it says it
forwards what it is given, so an error from below is the implementation's.
Keywords at their default value are not passed at all, so an implementation
of the seed's shape (no `kernel_block_sizes`) runs every other preset.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

from .presets import Preset

UNSUPPORTED = "not supported by this implementation"

OPTIONAL_KEYWORDS = (
    "cp_size",
    "cp_rank",
    "cp_interleave",
    "slot_mapping_enabled",
    "dcp_sharded",
    "sliding_window_reach",
    "kernel_block_sizes",
    "integrity_checks",
)
"""Constructor keywords after `device` (SPEC.md sections 3, 8.1 and 8.3)."""

OPTIONAL_METHODS = {"gather_and_compute_slot_mappings": "SPEC.md 8.2"}


@dataclass(frozen=True)
class Accepts:
    """The constructor keywords an implementation's factory declares."""

    keywords: frozenset[str]
    any_keyword: bool  # **kwargs: forwards everything

    def accepts(self, name: str) -> bool:
        return self.any_keyword or name in self.keywords

    def missing(self, preset: Preset) -> dict[str, str]:
        """Keywords `preset` needs that the factory does not take, with why it needs them."""
        return {k: why for k, why in preset.constructor_needs().items() if not self.accepts(k)}


def inspect_factory(factory: Callable) -> Accepts:
    """Read the keywords a class or factory declares (anything unreadable accepts all)."""
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return Accepts(frozenset(), True)
    names, any_kw = set(), False
    for p in sig.parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            any_kw = True
        elif p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            names.add(p.name)
    return Accepts(frozenset(names), any_kw)


def constructor_kwargs(preset: Preset, cp_rank: int, accepts: Accepts) -> dict:
    """The optional keywords to pass rank `cp_rank`: those the preset needs, plus any the
    factory takes whose value is not the default (`integrity_checks` when the preset asks)."""
    cfg = preset.config(cp_rank)
    values = {
        "cp_size": cfg.cp_size,
        "cp_rank": cfg.cp_rank,
        "cp_interleave": cfg.cp_interleave,
        "slot_mapping_enabled": cfg.slot_mapping_enabled,
        "dcp_sharded": cfg.dcp_sharded,
        "sliding_window_reach": cfg.sliding_window_reach,
        "kernel_block_sizes": cfg.kernel_block_sizes,
        "integrity_checks": preset.integrity_checks,
    }
    needed = set(preset.constructor_needs())
    if preset.integrity_checks:
        needed.add("integrity_checks")
    return {k: v for k, v in values.items() if k in needed and accepts.accepts(k)}


def missing_methods(impl: object) -> list[str]:
    """Optional methods (SPEC.md section 8) the built object lacks."""
    return [
        f"{name} ({where})"
        for name, where in OPTIONAL_METHODS.items()
        if not callable(getattr(impl, name, None))
    ]
