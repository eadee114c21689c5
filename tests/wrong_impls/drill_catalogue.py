"""Implementations whose redirect to the null block breaks only around a warm-up on live state.

Each passes the harness's serve phases (its warm-up step runs on empty tables
and sets and clears the flag itself) and must fail the null-block drill, with
the drill check named in `DRILL_CATALOGUE`.
"""

from __future__ import annotations

from cp_blocktables.contract import NULL_BLOCK_ID

from .stand_in import STAND_IN_SIGNATURE, StandInBlockTables


class RedirectReadAtConstruction(StandInBlockTables):
    """Reads the flag once, when built: a warm-up that sets it later redirects nothing."""

    __signature__ = STAND_IN_SIGNATURE

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._redirect = self.redirect_writes_to_null_block

    def _staged_ids(self, ids):
        return [NULL_BLOCK_ID] * len(ids) if self._redirect else list(ids)


class RedirectOnClass(StandInBlockTables):
    """Stores the flag on the class: one instance's warm-up redirects every instance."""

    __signature__ = STAND_IN_SIGNATURE

    _shared = False

    @property
    def redirect_writes_to_null_block(self) -> bool:
        return type(self)._shared

    @redirect_writes_to_null_block.setter
    def redirect_writes_to_null_block(self, value: bool) -> None:
        type(self)._shared = bool(value)


class RedirectLatchedOnError(StandInBlockTables):
    """Keeps redirecting until the null ids it staged are applied: a warm-up that fails between
    append and apply leaves the flag set, whatever the warm-up restores."""

    __signature__ = STAND_IN_SIGNATURE

    def __init__(self, *args, **kwargs) -> None:
        self._flag = False
        self._latched = False
        super().__init__(*args, **kwargs)

    @property
    def redirect_writes_to_null_block(self) -> bool:
        return self._flag or self._latched

    @redirect_writes_to_null_block.setter
    def redirect_writes_to_null_block(self, value: bool) -> None:
        self._flag = bool(value)

    def append_block_ids(self, req_index, new_block_ids, overwrite):
        super().append_block_ids(req_index, new_block_ids, overwrite)
        self._latched = self._latched or self._flag

    def apply_staged_writes(self):
        super().apply_staged_writes()
        self._latched = False


class RedirectDropsIds(StandInBlockTables):
    """Drops the ids of a redirected append instead of staging zeros (the count still advances):
    the row keeps the ids it held before, blocks that now hold other requests' KV."""

    __signature__ = STAND_IN_SIGNATURE

    def append_block_ids(self, req_index, new_block_ids, overwrite):
        if not self.redirect_writes_to_null_block:
            return super().append_block_ids(req_index, new_block_ids, overwrite)
        for g, ids in enumerate(new_block_ids):
            self.counts[g, req_index] = self._start(g, req_index, overwrite) + len(ids)
        return None


_MODULE = "tests.wrong_impls.drill_catalogue"

DRILL_CATALOGUE: dict[str, tuple[str, str]] = {
    "redirect_read_at_construction": (f"{_MODULE}:RedirectReadAtConstruction", "live-kv"),
    "redirect_on_class": (f"{_MODULE}:RedirectOnClass", "per-instance"),
    "redirect_latched_on_error": (f"{_MODULE}:RedirectLatchedOnError", "flag-restored"),
    "redirect_drops_ids": (f"{_MODULE}:RedirectDropsIds", "live-kv"),
}
"""name -> (`--impl` spec, the drill check that must report it)."""
