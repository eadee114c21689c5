"""Implementations whose wake-up after sleep (SPEC.md 8.4) keeps something from before the sleep.

Each is the project's `BlockTables` with one change in or around
`init_block_table_layout_tensors()`. Every one computes every step of a
workload right (the first call, from the constructor, builds everything), so
only a sleep tells: each must fail `cp-blocktables drill wake-up` with the
check named in `WAKE_CATALOGUE`, and `verify`'s default sweep with
`VERIFY_CHECK`, its wake-up probe (`cp_blocktables/harness/wake_probe.py`).
"""

from __future__ import annotations

import torch

from cp_blocktables import BlockTables


class _KeepsOne(BlockTables):
    """Rebuilds every derived tensor except `_kept`, whose contents from before survive.

    The rebuild writes derived tensors in place (captured CUDA graphs hold their
    addresses), so keeping the object is not enough to keep the garbage: the
    bytes are saved before the rebuild and written back after it.
    """

    _kept = ""

    def _kept_tensor(self) -> torch.Tensor | None:
        obj = self.__dict__.get(self._kept)
        return obj.params if self._kept == "_layout" and obj is not None else obj

    def init_block_table_layout_tensors(self) -> None:
        old = self._kept_tensor()
        saved = None if old is None else old.view(torch.uint8).clone()  # the bytes, as they are
        super().init_block_table_layout_tensors()
        if saved is not None:
            self._kept_tensor().view(torch.uint8).copy_(saved)


class KeepsBlockSizes(_KeepsOne):
    """Keeps the per-group block sizes tensor."""

    _kept = "block_sizes_tensor"


class KeepsStrides(_KeepsOne):
    """Keeps the row strides of the block tables (read by apply and gather)."""

    _kept = "block_table_strides"


class KeepsReaches(_KeepsOne):
    """Keeps the sliding-window reaches (read by a gather that masks)."""

    _kept = "sliding_window_reach_tensor"


class KeepsShardedFlags(_KeepsOne):
    """Keeps the `dcp_sharded` flags tensor."""

    _kept = "dcp_sharded"


class KeepsPointerTable(_KeepsOne):
    """Keeps the pointer table of the forward-pass tables (read by every gather)."""

    _kept = "input_block_table_ptrs"


class KeepsKernelLayout(_KeepsOne):
    """Keeps the slot-mapping kernel's layout object (its parameter and pointer tensors)."""

    _kept = "_layout"


class CopiesStaleSizes(BlockTables):
    """Rebuilds the block sizes tensor as a copy of the device tensor it had: new memory,
    stale bytes."""

    def init_block_table_layout_tensors(self) -> None:
        old = self.__dict__.get("block_sizes_tensor")
        stale = None if old is None else old.clone()  # before the in-place rebuild
        super().init_block_table_layout_tensors()
        if stale is not None:
            self.block_sizes_tensor = stale


class ReallocatesForwardTables(BlockTables):
    """Gives the forward-pass tables fresh memory on wake-up (and rebuilds their pointers):
    correct values, but CUDA graphs captured before the sleep read the old addresses."""

    def init_block_table_layout_tensors(self) -> None:
        if "input_block_table_ptrs" in self.__dict__:
            self.input_block_tables = [torch.zeros_like(t) for t in self.input_block_tables]
        super().init_block_table_layout_tensors()


class KeepsForwardTables(BlockTables):
    """Leaves the forward-pass tables as the sleep left them on wake-up (their dirty-row
    count reset, as if they were zero): the first gather, smaller than one before the
    sleep, leaves garbage in the persistent rows past its batch."""

    def init_block_table_layout_tensors(self) -> None:
        tables = self.__dict__.get("input_block_tables")
        saved = None if tables is None else [t.clone() for t in tables]
        super().init_block_table_layout_tensors()
        for t, s in zip(self.input_block_tables, saved or [], strict=False):
            t.copy_(s)


class TrustsHostShadow(BlockTables):
    """Skips staging an overwrite whose ids equal what it staged for the row before (a host
    cache of device contents): the wake-up's re-appends stage nothing, rows keep the garbage."""

    def append_block_ids(self, req_index, new_block_ids, overwrite):
        shadow = self.__dict__.setdefault("_shadow", {})
        ids = [list(x) for x in new_block_ids]
        held = shadow.get(req_index)
        if (
            overwrite
            and held is not None
            and held[0] == ids
            and not self.redirect_writes_to_null_block
        ):
            self.num_blocks.np[:, req_index] = held[1]
            return
        super().append_block_ids(req_index, new_block_ids, overwrite)
        row = ids if overwrite or held is None else [a + b for a, b in zip(held[0], ids)]
        shadow[req_index] = (row, self.num_blocks.np[:, req_index].copy())


_MODULE = "tests.wrong_impls.wake_catalogue"

WAKE_CATALOGUE: dict[str, tuple[str, str]] = {
    "keeps_block_sizes": (f"{_MODULE}:KeepsBlockSizes", "rebuilt"),
    "keeps_strides": (f"{_MODULE}:KeepsStrides", "rebuilt"),
    "keeps_reaches": (f"{_MODULE}:KeepsReaches", "rebuilt"),
    "keeps_sharded_flags": (f"{_MODULE}:KeepsShardedFlags", "rebuilt"),
    "keeps_pointer_table": (f"{_MODULE}:KeepsPointerTable", "rebuilt"),
    "keeps_kernel_layout": (f"{_MODULE}:KeepsKernelLayout", "rebuilt"),
    "copies_stale_sizes": (f"{_MODULE}:CopiesStaleSizes", "rebuilt"),
    "reallocates_forward_tables": (f"{_MODULE}:ReallocatesForwardTables", "stable-addresses"),
    "trusts_host_shadow": (f"{_MODULE}:TrustsHostShadow", "6"),
    # The drill's first serving stage runs verify's wake-up probe, which names it first.
    "keeps_forward_tables": (f"{_MODULE}:KeepsForwardTables", "11"),
}
"""name -> (`--impl` spec, the drill check, or SPEC.md section 6 check, that must report it)."""

VERIFY_CHECK = 11
"""The check of `verify` (its wake-up probe) that must report every one of `WAKE_CATALOGUE`."""
