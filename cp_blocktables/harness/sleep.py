"""A simulated sleep: every device tensor an implementation owns is overwritten with garbage.

An engine's sleep mode may discard the contents of the block tables' device
memory and keep its addresses (SPEC.md 8.4). `simulate_sleep` does that to a
live instance:

- **Which tensors.** Found by walking the instance, not from a list of
  names: its `__dict__` and `__slots__`, lists, tuples, sets, dicts,
  dataclass fields and nested objects (a writer, a layout dataclass,
  `StagedWriteTensor.gpu`, `UvaBackedTensor`, a buffer pool), each object
  visited once. Every `torch.Tensor` on the instance's device is a
  candidate; tensors that share a storage are one (deduplicated by storage).
- **Host truth survives.** A sleeping engine keeps host memory: the pinned
  buffers behind `UvaBackedTensor` and every numpy array. A candidate whose
  memory overlaps a numpy array that the instance holds, or a pinned host
  tensor it holds, is host memory and is left alone: on CPU runs `.cpu`,
  `.np` and the CPU "device view" of `UvaBackedTensor` share memory with its
  `.np`; on CUDA the zero-copy `.gpu` view points into the pinned buffer
  (same address under unified addressing). A plain CPU tensor that no numpy
  array shares counts as device memory on CPU runs.
- **Garbage in place.** Each storage is viewed as bytes and filled with
  random bytes that differ from its old bytes at every position, so that a
  tensor rebuilt with its old values never looks like the garbage; no
  `data_ptr` changes.

`survivors` then says which device tensors still hold the sleep's garbage
(or a copy of it) after the engine's `init_block_table_layout_tensors()`,
other than section 3's buffers, which the wake-up refills by re-appending,
gathering and mapping slots: the block tables, the forward-pass tables, the
slot mappings and `num_blocks.gpu`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import types
from dataclasses import dataclass, field

import numpy as np
import torch

_LEAVES = (
    str,
    bytes,
    bytearray,
    int,
    float,
    complex,
    bool,
    type(None),
    torch.device,
    torch.dtype,
    types.ModuleType,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    np.generic,
)
_MAX_OBJECTS = 100_000


@dataclass
class Owned:
    """What the walk found: device tensors by storage, and the host memory to leave alone."""

    tensors: dict[tuple, tuple[str, torch.Tensor]] = field(default_factory=dict)
    host: list[tuple[int, int, str]] = field(default_factory=list)  # [start, end), path

    def on_host(self, t: torch.Tensor) -> str | None:
        """The path of host memory that `t`'s storage overlaps, else None."""
        start, end = _extent(t)
        for lo, hi, path in self.host:
            if start < hi and lo < end:
                return path
        return None


@dataclass
class Sleep:
    """One simulated sleep of one instance: what was overwritten, what was left."""

    garbage: dict[tuple, tuple[str, bytes]]  # storage key -> (path, the bytes written)
    host_paths: list[str]  # device-typed tensors left alone as host memory
    buffers: set[tuple]  # storage keys of section 3's buffers
    addresses: dict[str, int]  # stable-address buffers -> data_ptr before the sleep

    @property
    def nbytes(self) -> int:
        return sum(len(g) for _, g in self.garbage.values())


def _extent(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


def _key(t: torch.Tensor) -> tuple:
    return (str(t.device), t.untyped_storage().data_ptr())


def _on(t: torch.Tensor, device: torch.device) -> bool:
    if t.device.type != device.type:
        return False
    return device.index is None or t.device.index == device.index


def walk(obj: object, device: torch.device) -> Owned:
    """Every tensor on `device` reachable from `obj`, and the host memory it holds."""
    device = torch.device(device)
    owned, seen, found = Owned(), set(), []
    stack: list[tuple[object, str]] = [(obj, "")]
    while stack and len(seen) < _MAX_OBJECTS:
        x, path = stack.pop()
        if isinstance(x, _LEAVES) or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            if _on(x, device):
                found.append((path, x))
            if x.device.type == "cpu" and x.is_pinned():
                owned.host.append((*_extent(x), path))
            continue
        if isinstance(x, np.ndarray):
            if x.nbytes:
                start = x.__array_interface__["data"][0]
                owned.host.append((start, start + x.nbytes, path))
            continue
        stack.extend(reversed(list(_children(x, path))))
    for path, t in found:
        if t.untyped_storage().nbytes():
            owned.tensors.setdefault(_key(t), (path, t))
    return owned


def _children(x: object, path: str):
    if isinstance(x, dict):
        for k, v in x.items():
            yield v, f"{path}[{k!r}]"
        return
    if isinstance(x, (list, tuple, set, frozenset)):
        for i, v in enumerate(x):
            yield v, f"{path}[{i}]"
        return
    dot = f"{path}." if path else ""
    if dataclasses.is_dataclass(x):
        for f in dataclasses.fields(x):
            if hasattr(x, f.name):
                yield getattr(x, f.name), dot + f.name
    for name, v in getattr(x, "__dict__", {}).items():
        yield v, dot + name
    for cls in type(x).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(x, name):
                yield getattr(x, name), dot + name


def _buffers(impl: object) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Section 3's buffers (refilled by the wake-up) and those whose addresses must stay."""
    stable = {"slot_mappings": getattr(impl, "slot_mappings", None)}
    for g, t in enumerate(getattr(impl, "input_block_tables", ()) or ()):
        stable[f"input_block_tables[{g}]"] = t
    refilled = [getattr(t, "gpu", None) for t in getattr(impl, "block_tables", ()) or ()]
    refilled.append(getattr(getattr(impl, "num_blocks", None), "gpu", None))
    refilled += stable.values()
    keep = {k: t for k, t in stable.items() if isinstance(t, torch.Tensor)}
    return [t for t in refilled if isinstance(t, torch.Tensor)], keep


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage of `t` as a uint8 tensor on its device (same memory)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def simulate_sleep(impl: object, device: torch.device, rng: np.random.Generator) -> Sleep:
    """Overwrite every device tensor `impl` owns (host truth aside) with garbage, in place."""
    owned = walk(impl, device)
    refilled, stable = _buffers(impl)
    garbage, host_paths = {}, []
    for key, (path, t) in owned.tensors.items():
        if owned.on_host(t) is not None:
            host_paths.append(path)
            continue
        view = _bytes(t)
        old = view.cpu().numpy()
        new = rng.integers(0, 256, old.shape, dtype=np.uint8)
        same = new == old
        new[same] ^= 0xFF
        view.copy_(torch.from_numpy(new).to(view.device))
        garbage[key] = (path, new.tobytes())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return Sleep(
        garbage,
        host_paths,
        {_key(t) for t in refilled},
        {k: t.data_ptr() for k, t in stable.items()},
    )


def survivors(impl: object, device: torch.device, sleep: Sleep) -> list[dict]:
    """Device tensors of `impl`, other than section 3's buffers, that hold the sleep's garbage.

    Each: `path`, and `what` (kept from before the sleep, or a copy of another's garbage).
    """
    owned = walk(impl, device)
    refilled, _ = _buffers(impl)
    buffers = sleep.buffers | {_key(t) for t in refilled}
    by_digest = {hashlib.sha256(g).digest(): p for p, g in sleep.garbage.values()}
    found = []
    for key, (path, t) in owned.tensors.items():
        if key in buffers or owned.on_host(t) is not None:
            continue
        now = _bytes(t).cpu().numpy().tobytes()
        if key in sleep.garbage and sleep.garbage[key][1] == now:
            found.append({"path": path, "what": "still holds the garbage the sleep left in it"})
            continue
        source = by_digest.get(hashlib.sha256(now).digest())
        if source is not None:
            found.append(
                {"path": path, "what": f"holds a copy of the garbage the sleep left in {source}"}
            )
    return found


def moved(impl: object, sleep: Sleep) -> list[str]:
    """Buffers whose address changed across the sleep (CUDA graphs captured them)."""
    _, stable = _buffers(impl)
    return [
        f"{name}: data_ptr {sleep.addresses[name]:#x} before the sleep, {t.data_ptr():#x} after"
        for name, t in stable.items()
        if name in sleep.addresses and t.data_ptr() != sleep.addresses[name]
    ]
