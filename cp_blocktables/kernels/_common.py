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

import torch


def on_cpu(device: torch.device) -> bool:
    return device.type == "cpu"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1). Plain Python: Triton's helper
    of the same name costs microseconds a call on the launch path."""
    return 1 << max(n - 1, 0).bit_length()


HOST_TILE = 1 << 16
"""Most elements one interpreted program works on. Past this numpy's own work
dominates an operation's cost, and bigger temporaries only cost memory."""


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
