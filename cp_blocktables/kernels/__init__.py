"""The Triton kernels, one module each, every kernel beside the function that launches it.

| module | kernel (name in `launch_counts`) | launcher |
| --- | --- | --- |
| `staged_writes` | `_apply_writes_kernel` | `apply_writes`, `apply_fused_writes` |
| `gather` | `_gather_block_tables_kernel` | `gather_block_tables` |
| `slot_mappings` | `_compute_slot_mappings_kernel` | `compute_slot_mappings`, `SlotMappingPlan` |
| `fused_reads` | `_gather_and_slot_mappings_kernel` | `gather_and_compute_slot_mappings` |

`slot_programs` holds the slot mapping's programs in both layouts (the two
kernels that map slots call them), `layout` the per-group device tensors
(`GroupLayout`, `refill`) and `_common` the launchers' tile arithmetic.

All run on CUDA (compiled) and on CPU (Triton's interpreter) through
`dual_jit`. They call only Triton builtins and this package's own device
functions (`dual_device_fn`): `triton.language` helpers that are themselves
`@triton.jit` functions (`tl.zeros`, `tl.max`, `tl.sum`, ...) are compiled or
interpreted once, when Triton is imported, so they cannot serve both back
ends. Launchers pick the back end from the tensors' device and a tile shape
that suits it (large tiles on CPU, where each program instance costs
Python-level work; GPU-sized tiles on CUDA).

Per-group data reaches the kernels as small device tensors (`ptrs`, `strides`,
`widths`, ...) so that one launch serves every KV-cache group; a table's data
pointer is loaded and cast to a typed pointer inside the kernel.

Memory safety holds even for inputs the contract forbids: rows outside
`[0, max_num_reqs)` act as dummy requests, positions outside a table's width
write `PAD_SLOT_ID`, and no index is dereferenced past a buffer's bound.
"""

from ._common import next_power_of_2
from .fused_reads import _gather_and_slot_mappings_kernel, gather_and_compute_slot_mappings
from .gather import _gather_block_tables_kernel, gather_block_tables
from .layout import GroupLayout, refill
from .slot_mappings import SlotMappingPlan, _compute_slot_mappings_kernel, compute_slot_mappings
from .staged_writes import _apply_writes_kernel, apply_fused_writes, apply_writes

__all__ = [
    "GroupLayout",
    "SlotMappingPlan",
    "_apply_writes_kernel",
    "_compute_slot_mappings_kernel",
    "_gather_and_slot_mappings_kernel",
    "_gather_block_tables_kernel",
    "apply_fused_writes",
    "apply_writes",
    "compute_slot_mappings",
    "gather_and_compute_slot_mappings",
    "gather_block_tables",
    "next_power_of_2",
    "refill",
]
