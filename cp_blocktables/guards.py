"""Guards for what kernels take on trust: raw pointers, strides, rows and staged values.

A Triton kernel dereferences whatever address it is handed. On CUDA a wrong
one is an illegal-address error that poisons the context; in the CPU
interpreter it is a segmentation fault that kills the process, or a silent
write into the heap. So every public entry point that passes caller-given
pointers, strides, rows or values on to a kernel checks them first and
raises `ValueError` naming what was wrong, before anything changes.

Cost on the hot path: pointer and stride tensors are compared with the
tensors they must name. On CPU that is a host read, done on every call. On
CUDA reading a device tensor synchronises, so a verified tensor is
remembered with its version counter and the values it was checked against;
it is read again only when it is a new tensor, was written in place through
torch (which bumps `_version`), or its destinations moved. Writes that
bypass torch's version counter (a kernel, a raw pointer) are not seen on
CUDA: hand over a fresh tensor after such writes.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Sequence

import numpy as np
import torch

_CACHE_LIMIT = 64
_verified: dict[int, tuple[weakref.ref, int, tuple[int, ...]]] = {}

_INT_RANGES = {
    torch.int32: (-(2**31), 2**31 - 1),
    torch.int64: (-(2**63), 2**63 - 1),
}
_FLOAT32_MAX = float(np.finfo(np.float32).max)


class OutOfRangeError(ValueError, IndexError):
    """A row, column or length outside a tensor: a `ValueError` like every guard, and an
    `IndexError` for callers written against the earlier behaviour."""


def _is_int(v: object) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def check_size(size: object, name: str = "size") -> tuple[int, ...]:
    """An int or a non-empty sequence of ints >= 0, as a shape tuple."""
    shape = (size,) if _is_int(size) else size
    if (
        not isinstance(shape, (tuple, list, torch.Size))
        or not shape
        or not all(_is_int(n) and n >= 0 for n in shape)
    ):
        raise ValueError(f"{name} must be an int >= 0 or a non-empty list of them, got {size!r}")
    return tuple(int(n) for n in shape)


def same_device(t: torch.Tensor, device: torch.device) -> bool:
    """`cuda` without an index matches any CUDA tensor (the caller set the current device).
    Host tensors carry no index, so `cpu:0` matches every CPU tensor."""
    if device.type == "cpu":
        return t.device.type == "cpu"
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


# ---------------------------------------------------------------- staged writes


def check_staged_write(
    index: object, start: object, values: Iterable, shape: tuple[int, ...], dtype: torch.dtype
) -> list:
    """`values` as a list, after checking that row `index`, columns `[start, start + n)`
    lie inside a tensor of `shape` and every value fits `dtype` (ints for int
    tensors; finite floats within float32's range).

    A 1-D tensor holds one element a row. Raises `OutOfRangeError` for a bad place,
    `ValueError` for a bad value; the caller stages nothing in either case.
    """
    if not _is_int(index) or not _is_int(start):
        raise OutOfRangeError(f"staged write row and column must be ints, got {index!r}, {start!r}")
    vals = values if isinstance(values, list) else list(values)
    width = math.prod(shape[1:])
    if not 0 <= index < shape[0] or start < 0 or start + len(vals) > width:
        raise OutOfRangeError(
            f"staged write at row {index}, columns [{start}, {start + len(vals)}) is outside "
            f"{shape}"
        )
    if vals:
        _check_values(vals, dtype, index)
    return vals


def _check_values(vals: list, dtype: torch.dtype, index: int) -> None:
    kinds = set(map(type, vals))
    bounds = _INT_RANGES.get(dtype)
    if bounds is not None:
        if not all(issubclass(k, (int, np.integer)) and k is not bool for k in kinds):
            bad = next(v for v in vals if not _is_int(v))
            raise ValueError(f"staged write to row {index}: {bad!r} is not an int ({dtype})")
        lo, hi = min(vals), max(vals)
        if lo < bounds[0] or hi > bounds[1]:
            bad = lo if lo < bounds[0] else hi
            raise ValueError(
                f"staged write to row {index}: {bad} does not fit {dtype} "
                f"[{bounds[0]}, {bounds[1]}]"
            )
        return
    if not all(issubclass(k, (int, float, np.integer, np.floating)) for k in kinds) or any(
        issubclass(k, bool) for k in kinds
    ):
        bad = next(v for v in vals if isinstance(v, bool) or not isinstance(v, (int, float)))
        raise ValueError(f"staged write to row {index}: {bad!r} is not a number ({dtype})")
    lo, hi = min(vals), max(vals)
    for v in (lo, hi):
        if math.isfinite(v) and abs(v) > _FLOAT32_MAX:
            raise ValueError(f"staged write to row {index}: {v} overflows {dtype}")


# ---------------------------------------------------------------- pointers and strides


def check_address_tensor(
    t: object,
    expected: Sequence[int],
    name: str,
    what: str,
    device: torch.device,
    fmt: str = "#x",
) -> None:
    """`t` must be a 1-D int64/uint64 tensor on `device` holding exactly `expected`.

    `what` names entry `{i}` of what the values are, e.g. "tensors[{i}].gpu.data_ptr()";
    the message names the first entry that differs. See the module doc for
    when a CUDA tensor is read.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1 or t.dtype not in (torch.uint64, torch.int64) or t.shape[0] != len(expected):
        raise ValueError(
            f"{name} must be a 1-D uint64 or int64 tensor of {len(expected)} entries "
            f"({what.format(i='i')} for each i), got {t.dtype} of shape {tuple(t.shape)}"
        )
    if not same_device(t, device):
        raise ValueError(f"{name} is on {t.device}; the kernel runs on {device}")
    want = tuple(int(v) for v in expected)
    key = id(t)
    seen = _verified.get(key)
    if t.device.type == "cuda" and seen and seen[0]() is t and seen[1:] == (t._version, want):
        return
    got = t.view(torch.int64).tolist()
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            raise ValueError(
                f"{name}[{i}] = {g & (2**64 - 1):{fmt}} but {what.format(i=i)} is {w:{fmt}}: "
                f"{name} must hold exactly these values (uninitialised or stale?)"
            )
    if t.device.type == "cuda":
        if len(_verified) >= _CACHE_LIMIT:
            _verified.clear()
        _verified[key] = (weakref.ref(t), t._version, want)


def check_write_target(t: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
    """A staged-write destination the apply kernel can address as it does:
    element `col` of row `row` at `row * t.stride(0) + col`. So each row's
    elements must be contiguous (any row pitch is fine, a 1-D tensor of any
    stride too), and `t` must hold at least the rows and row width of `shape`,
    the shape its writes were checked against when staged."""
    inner = 1
    for size, stride in zip(t.shape[:0:-1], t.stride()[:0:-1]):
        if size != 1 and stride != inner:
            raise ValueError(
                f"{name} has strides {t.stride()} for shape {tuple(t.shape)}: the elements "
                f"of a row must be contiguous"
            )
        inner *= size
    if t.dim() != len(shape) or t.shape[0] < shape[0] or inner < math.prod(shape[1:]):
        raise ValueError(
            f"{name} has shape {tuple(t.shape)}, smaller than the {shape} its writes were "
            f"staged for"
        )


def check_rows_disjoint(t: torch.Tensor, name: str) -> None:
    """A 2-D output whose rows must not overlap (a kernel writes them in parallel)."""
    if t.dim() == 2 and t.shape[0] > 1 and t.stride(0) < t.shape[1]:
        raise ValueError(
            f"{name} has row stride {t.stride(0)} for {t.shape[1]} columns: its rows overlap "
            f"(an expanded or strided view); pass a tensor with disjoint rows"
        )


def check_out_tables(
    out: Sequence[torch.Tensor], out_ptrs: torch.Tensor | None, device: torch.device
) -> None:
    """Caller-owned gather destinations: disjoint rows, and `out_ptrs` naming them."""
    for g, t in enumerate(out):
        check_rows_disjoint(t, f"out[{g}]")
    if out_ptrs is not None:
        check_address_tensor(
            out_ptrs, [t.data_ptr() for t in out], "out_ptrs", "out[{i}].data_ptr()", device
        )


def check_layout(
    tables: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    max_num_reqs: int,
    device: torch.device,
) -> None:
    """Tables whose addresses are about to be handed to kernels: int32 on `device`,
    `max_num_reqs` disjoint rows of unit column stride; each forward-pass table at
    least as large as its table."""
    for kind, group in (("block_tables[{g}].gpu", tables), ("input_block_tables[{g}]", inputs)):
        for g, t in enumerate(group):
            name = kind.format(g=g)
            if (
                not isinstance(t, torch.Tensor)
                or t.dtype != torch.int32
                or t.dim() != 2
                or t.shape[0] < max_num_reqs
                or t.stride(1) != 1
                or not same_device(t, device)
            ):
                raise ValueError(
                    f"{name} must be an int32 [>= {max_num_reqs}, n] tensor with unit column "
                    f"stride on {device}, got {getattr(t, 'dtype', type(t).__name__)} "
                    f"{tuple(getattr(t, 'shape', ()))} on {getattr(t, 'device', '?')}"
                )
            check_rows_disjoint(t, name)
    for g, (t, i) in enumerate(zip(tables, inputs)):
        if i.shape[1] < t.shape[1]:
            raise ValueError(
                f"input_block_tables[{g}] has {i.shape[1]} columns, fewer than "
                f"block_tables[{g}].gpu's {t.shape[1]}"
            )
