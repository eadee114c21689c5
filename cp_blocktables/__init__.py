"""Block tables and slot mappings for decode context parallelism (DCP).

Public surface (SPEC.md): `BlockTables`, the buffer classes it is built from,
the contract's constants, and the independent numpy `reference`.

Classes load on first use (PEP 562): the package's pytest plugin is
registered in every pytest run of an environment it is installed in, and
must not pay for importing torch and Triton there.
"""

from __future__ import annotations

import importlib

from .contract import NULL_BLOCK_ID, PAD_SLOT_ID, BlockTablesConfig

_LAZY = {
    "BlockTables": ".block_tables",
    "FusedStagedWriter": ".staged",
    "StagedWriteTensor": ".staged",
    "UvaBackedTensor": ".buffers",
    "UvaBufferPool": ".buffers",
}

__all__ = [
    "NULL_BLOCK_ID",
    "PAD_SLOT_ID",
    "BlockTables",
    "BlockTablesConfig",
    "FusedStagedWriter",
    "StagedWriteTensor",
    "UvaBackedTensor",
    "UvaBufferPool",
]


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
