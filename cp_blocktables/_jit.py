"""One Triton kernel, two back ends: compiled for CUDA tensors, interpreted for CPU tensors.

`triton.jit` decides at decoration time whether it builds a compiled
`JITFunction` or an `InterpretedFunction` (it reads `TRITON_INTERPRET`).
`dual_jit` decorates the same Python function once each way, so a CPU-only
machine runs the very kernels a GPU runs, with no environment variable set by
hand, and a GPU machine can use both in one process.

Device functions (`dual_device_fn`) are kernel pieces that several kernels
call, so that a fused kernel shares its code with the kernels it fuses. A
compiled kernel must call compiled helpers and an interpreted one interpreted
helpers, but both look a helper up by name in the same module globals. Each
back end therefore gets its own copy of the Python function whose globals
(a snapshot taken at decoration: helpers must be defined before their callers)
name that back end's variant of every helper.

Every launch goes through `DualKernel.launch`, which also counts launches per
kernel (`launch_counts`): tests use it to prove that a fused path is one launch.

An interpreted launch runs with the interpreter's integer-overflow sanitizer
off unless its debug option is on (`_lean`): the sanitizer only feeds
`device_assert`, which Triton drops without debug, so it changes no result,
yet it redoes every int32 add, sub and mul in int64 with two compares, 30-40%
of an interpreted kernel's operations. Compiled kernels drop the same dead
code in the compiler.
"""

from __future__ import annotations

import dataclasses
import os
import types
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import contextmanager

import torch
import triton

launch_counts: Counter[str] = Counter()
"""Launches per kernel name since import (both back ends)."""


@contextmanager
def _triton_interpret(value: str):
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


def _for_backend(fn: Callable, interpret: bool, **jit_options) -> Callable:
    """`fn` decorated by `triton.jit` for one back end, its helpers resolved for it too."""
    names = fn.__code__.co_names  # the globals (and attributes) the body names
    helpers = {
        k: v
        for k in names
        if isinstance(v := fn.__globals__.get(k), DualFunction) and v.fn is not fn
    }
    if helpers:
        scope = dict(fn.__globals__)
        scope.update({k: v.variant(interpret) for k, v in helpers.items()})
        copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
        copy.__kwdefaults__ = fn.__kwdefaults__
        copy.__annotations__ = fn.__annotations__
        copy.__module__ = fn.__module__
        copy.__qualname__ = fn.__qualname__
        copy.__doc__ = fn.__doc__
        fn = copy
    with _triton_interpret("1" if interpret else "0"):
        try:
            return triton.jit(fn, **jit_options)
        except TypeError:  # a Triton whose interpreter takes no such option: it needs none
            if not jit_options:
                raise
            return triton.jit(fn)


try:
    from triton.runtime.interpreter import interpreter_builder as _builder
except ImportError:  # a Triton without this interpreter: launches run as they are
    _builder = None

_lean_cache: list = [None, None]
"""`[options, options without the sanitizer or None]` for the options seen last."""


def _lean(options: object) -> object | None:
    """`options` without the overflow sanitizer, or `None` when there is nothing to drop
    (debug on, or options without the field). Computed once per options object."""
    if _lean_cache[0] is not options:
        lean = None
        if (
            dataclasses.is_dataclass(options)
            and not getattr(options, "debug", True)
            and getattr(options, "sanitize_overflow", False)
        ):
            lean = dataclasses.replace(options, sanitize_overflow=False)
        _lean_cache[:] = [options, lean]
    return _lean_cache[1]


class DualFunction:
    """A `@triton.jit` device function that compiled and interpreted kernels can both call."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.name = fn.__name__
        self._variants: dict[bool, Callable] = {}

    def variant(self, interpret: bool) -> Callable:
        if interpret not in self._variants:
            self._variants[interpret] = _for_backend(self.fn, interpret)
        return self._variants[interpret]


class DualKernel:
    """A kernel usable from CUDA and CPU tensors; pick the back end by device.

    `do_not_specialize` names scalar arguments that change from step to step
    (batch sizes, row counts): Triton then compiles one variant for all their
    values instead of new ones when a value happens to be 1 or a multiple of
    16, which would stall a serving step on a compile.
    """

    def __init__(self, fn: Callable, do_not_specialize: Sequence[str] = ()) -> None:
        self.name = fn.__name__
        options = {"do_not_specialize": list(do_not_specialize)} if do_not_specialize else {}
        self._compiled = _for_backend(fn, interpret=False, **options)
        self._interpreted = _for_backend(fn, interpret=True, **options)

    def launch(self, device: torch.device, grid: tuple[int, ...], *args, **kwargs) -> None:
        """Run `grid` program instances on `device` (empty grids launch nothing).

        The launch path is lean on purpose (it runs on the CPU's critical path
        every step): `grid` must be a tuple.
        """
        if 0 in grid:
            return
        launch_counts[self.name] += 1
        if device.type == "cpu":
            self._interpret(grid, args, kwargs)
            return
        index = device.index
        if index is None or index == torch.cuda.current_device():
            self._compiled[grid](*args, **kwargs)
        else:  # Triton launches on the current device
            with torch.cuda.device(index):
                self._compiled[grid](*args, **kwargs)

    def _interpret(self, grid: tuple[int, ...], args: tuple, kwargs: dict) -> None:
        """Run the interpreted kernel, its dead overflow checks off for this launch only."""
        options = getattr(_builder, "options", None)
        lean = _lean(options)
        if lean is None:
            self._interpreted[grid](*args, **kwargs)
            return
        _builder.options = lean
        try:
            self._interpreted[grid](*args, **kwargs)
        finally:
            _builder.options = options


def dual_jit(
    fn: Callable | None = None, *, do_not_specialize: Sequence[str] = ()
) -> DualKernel | Callable[[Callable], DualKernel]:
    """Decorate a kernel for both back ends: `@dual_jit` or
    `@dual_jit(do_not_specialize=("num_reqs", ...))`."""
    if fn is None:
        return lambda f: DualKernel(f, do_not_specialize)
    return DualKernel(fn, do_not_specialize)


def dual_device_fn(fn: Callable) -> DualFunction:
    """Decorate a device function (called from kernels, never launched) for both back ends."""
    return DualFunction(fn)
