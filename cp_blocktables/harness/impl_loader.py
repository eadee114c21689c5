"""Load the implementation under test from a `MODULE:ATTR` spec (SPEC.md section 7).

`MODULE` is a dotted module name, imported with the current directory on
`sys.path` (as `python -m` does, so `tests.wrong_impls.catalogue:WrongOwner`
works from the repository root in every rank), or a path to a `.py` file.
`ATTR` may be dotted (`pkg.mod:Outer.Inner`). It names a class or any other
callable (a factory, e.g. an adapter around an engine's own class, see
docs/adapter.md) that takes SPEC.md section 3's arguments and returns the
object to test; what it accepts is read from its signature (`features`).
Anything else raises `ImplSpecError` with a message a person can act on.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence

DEFAULT_IMPL = "cp_blocktables:BlockTables"


class ImplSpecError(ValueError):
    """The `--impl` spec names nothing importable or nothing usable."""


def load_impl(spec: str) -> Callable[..., object]:
    """The class or factory named by `spec`; raises `ImplSpecError` naming what went wrong."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ImplSpecError(f"--impl {spec!r}: expected MODULE:ATTR, e.g. {DEFAULT_IMPL}")
    module = _import(spec, module_name)
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImplSpecError(
                f"--impl {spec!r}: module {module_name!r} has no attribute {attr!r}"
            ) from None
    if not callable(obj):
        raise ImplSpecError(
            f"--impl {spec!r}: {attr!r} is a {type(obj).__name__}, not a class or factory "
            f"taking the BlockTables constructor's arguments"
        )
    return obj


def preload(specs: Sequence[str]) -> None:
    """Import this package's own implementation now, when `specs` name it.

    `spawn_local` calls it in the parent before the ranks fork: each rank then
    inherits Triton and the kernels instead of importing them itself (0.2-0.3 s
    of CPU a rank, paid by every rank at once: eight ranks on two cores waited
    about a second).
    Only ours, whose import touches no CUDA state (a forked rank cannot inherit
    a CUDA context); other implementations load in the ranks, which report
    what fails.
    """
    if DEFAULT_IMPL in specs:
        with contextlib.suppress(Exception):
            load_impl(DEFAULT_IMPL)


def _import(spec: str, module_name: str):
    if module_name.endswith(".py") or os.sep in module_name:
        return _import_file(spec, module_name)
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        raise ImplSpecError(f"--impl {spec!r}: cannot import module {module_name!r}: {e}") from None
    except Exception as e:  # noqa: BLE001 - any import-time failure is the user's module's
        raise ImplSpecError(
            f"--impl {spec!r}: importing {module_name!r} raised {type(e).__name__}: {e}"
        ) from None


def _import_file(spec: str, path: str):
    if not os.path.isfile(path):
        raise ImplSpecError(f"--impl {spec!r}: no such file {path!r}")
    name = "_cp_blocktables_impl_" + os.path.splitext(os.path.basename(path))[0]
    loader_spec = importlib.util.spec_from_file_location(name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise ImplSpecError(f"--impl {spec!r}: cannot load {path!r} as a Python module")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001
        del sys.modules[name]
        raise ImplSpecError(
            f"--impl {spec!r}: executing {path!r} raised {type(e).__name__}: {e}"
        ) from None
    return module
