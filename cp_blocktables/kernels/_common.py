"""Small host-side helpers of the launchers: tile arithmetic and back-end checks.

Plain Python on purpose: Triton's helpers of the same names cost microseconds
a call on the launch path.

Tiles differ by back end. A GPU wants many small programs; Triton's
interpreter runs each program's every operation as a numpy call behind tens of
microseconds of Python, whatever the operation's size, so on CPU a launch runs
as few, large programs as `HOST_TILE` allows, and loop bounds need no rounding
(the interpreter compiles nothing, so a new constant costs nothing).
"""

from __future__ import annotations

import os

import torch


def on_cpu(device: torch.device) -> bool:
    return device.type == "cpu"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1). Plain Python: Triton's helper
    of the same name costs microseconds a call on the launch path."""
    return 1 << max(n - 1, 0).bit_length()


HOST_TILE_ENV = "CPBT_HOST_TILE"


def _host_tile_setting() -> int:
    """`HOST_TILE`, or the power of two >= 16 that `CPBT_HOST_TILE` names.

    `cp-blocktables mutate` sets it to 16 for every mutant: the mutation
    presets' steps of a few dozen tokens then take several programs a launch,
    the paths a GPU always takes and large CPU tiles never reach.
    """
    text = os.environ.get(HOST_TILE_ENV)
    if text is None:
        return 1 << 16
    if not text.isdigit() or int(text) < 16 or int(text) & (int(text) - 1):
        raise ValueError(f"{HOST_TILE_ENV} must be a power of two >= 16, got {text!r}")
    return int(text)


HOST_TILE = _host_tile_setting()
"""Most elements one interpreted program works on (default 65,536). Past this
numpy's own work dominates an operation's cost, and bigger temporaries only
cost memory."""


def host_tile(n: int) -> int:
    """Elements per interpreted program for a launch over `n`: all of them, up to `HOST_TILE`."""
    return min(next_power_of_2(n), HOST_TILE)


def search_steps(n: int, exact: bool = False) -> int:
    """Binary-search iterations for `n` segments (`n.bit_length()`), rounded up
    to a multiple of 4 unless `exact`.

    Loop bounds are compile-time constants (some Triton interpreters cannot
    loop over a runtime scalar); rounding keeps the number of compiled variants
    small. The interpreter compiles nothing: it takes the `exact` count.
    """
    steps = n.bit_length()
    return steps if exact else -(-steps // 4) * 4


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
