"""Block tables and slot mappings for decode context parallelism (DCP).

Public surface (SPEC.md): `BlockTables`, the buffer classes it is built from,
the contract's constants, and the independent numpy `reference`.
"""

from .block_tables import BlockTables
from .buffers import FusedStagedWriter, StagedWriteTensor, UvaBackedTensor, UvaBufferPool
from .contract import NULL_BLOCK_ID, PAD_SLOT_ID, BlockTablesConfig

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
