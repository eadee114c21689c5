"""Small host-side helpers of the launchers: tile arithmetic and back-end checks.

Plain Python on purpose: Triton's helpers of the same names cost microseconds
a call on the launch path.
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


def search_steps(n: int) -> int:
    """Binary-search iterations for `n` segments, rounded up to a multiple of 4.

    Loop bounds are compile-time constants (some Triton interpreters cannot
    loop over a runtime scalar); rounding keeps the number of variants small.
    """
    return -(-n.bit_length() // 4) * 4


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
