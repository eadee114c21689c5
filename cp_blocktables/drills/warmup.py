"""The null-block warm-up: what an engine does when it re-runs dummy forwards on live state.

After the world of an elastic expert-parallel deployment changes size, the
engine runs its warm-up again (dummy forwards, CUDA-graph capture) while the
KV cache still holds cached prefixes. The warm-up's requests are made up, and
so are their block ids; if their KV writes landed where the ids point, they
would overwrite live data. `null_block_warmup` makes every such write land in
the null block 0 instead, by setting `redirect_writes_to_null_block` on the
`BlockTables` instance for the duration:

    with null_block_warmup(block_tables, pool, kv_caches):
        ...  # warm-up requests in any row, appends, gathers, slot mappings, KV writes

Invariants:

- Entry requires that no serving request is left in the pool
  (`WarmupError` otherwise, and nothing changes). Warm-up requests of an
  enclosing warm-up are allowed, so warm-ups nest.
- Inside, the pool is open to warm-up requests in every free row, and the
  instance's `redirect_writes_to_null_block` is True.
- On exit, also when the body raises (the exception propagates): the
  warm-up requests admitted inside are gone and the pool is as it was at
  entry, the flag has its value from before entry (a nested warm-up thus
  leaves the outer one's True), and block 0 of every group's KV cache is
  zero, wiping what the warm-up wrote there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from .serving import RequestPool

_FLAG = "redirect_writes_to_null_block"


class WarmupError(RuntimeError):
    """A warm-up was started while serving requests still hold rows."""


@contextlib.contextmanager
def null_block_warmup(
    block_tables: object, pool: RequestPool, kv_caches: Sequence[torch.Tensor]
) -> Iterator[None]:
    """Redirect `block_tables`' appends to block 0 while the body runs; see the module doc.

    `kv_caches`: one tensor per KV-cache group whose first dimension indexes
    blocks (block 0 first); block 0 of each is zeroed on exit.
    """
    serving = pool.serving()
    if serving:
        rows = ", ".join(f"row {r}: request {u}" for r, u in sorted(serving.items())[:8])
        raise WarmupError(
            f"a null-block warm-up needs an empty request pool, but {len(serving)} serving "
            f"request(s) still hold rows ({rows}{', ...' if len(serving) > 8 else ''}); "
            f"drain them first"
        )
    previous = getattr(block_tables, _FLAG)
    saved = pool.open_for_warmup()
    try:
        setattr(block_tables, _FLAG, True)
        yield
    finally:
        try:
            pool.close_warmup(saved)
            setattr(block_tables, _FLAG, previous)
        finally:
            for cache in kv_caches:
                cache[0].zero_()
