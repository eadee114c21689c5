"""Compiling a kernel for a Hopper GPU on a machine without one: what the GPU would run.

Tests use it where the interpreter and a compiled launch may differ (a division of
flags the interpreter's numpy turns into `&`, constants only a GPU launch takes).
"""

from __future__ import annotations

import re

import pytest
import triton
from triton.backends import backends as triton_backends

needs_cuda_backend = pytest.mark.skipif(
    "nvidia" not in triton_backends,
    reason="this Triton has no CUDA back end to compile with",
)


def hopper_ttir(kernel, signature: dict[str, str], constants: dict[str, object]) -> str:
    """`kernel`'s TTIR compiled for sm_90; `signature` types the arguments, `constants`
    (by name) are the constexpr ones."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**signature, **{name: "constexpr" for name in constants}}
    keyed = {(kernel.arg_names.index(name),): v for name, v in constants.items()}
    source = ASTSource(kernel, signature, keyed)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ttir"]


def flag_divisions(ttir: str) -> list[str]:
    """TTIR lines dividing (or taking the remainder of) i1 values: numpy gives `x // False
    == 0`, so a flag divided by a flag acts as `&` in the interpreter, while LLVM folds an i1
    division to its dividend (dividing by zero is undefined) and drops the divisor's
    condition on a GPU."""
    return re.findall(
        r"arith\.(?:div|rem|floordiv|ceildiv)\w*[^\n]*:\s*(?:tensor<[^>]*x)?i1\b", ttir
    )


def flag_shifts(ttir: str) -> list[str]:
    """TTIR lines shifting i1 values: Triton 3.9's interpreter wraps `1 << 1` to one bit (0),
    an older one computes it in int8 (2), and LLVM folds it to its left operand."""
    return re.findall(r"arith\.sh\w*[^\n]*:\s*(?:tensor<[^>]*x)?i1\b", ttir)
