"""The scratch copy: only implementation modules, imports re-pointed, line numbers kept."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from cp_blocktables.mutate import scratch

PKG_DIR = Path(scratch.__file__).resolve().parents[1]


def test_discovers_the_implementation_modules_and_nothing_else():
    found = scratch.discover_impl_modules(PKG_DIR)
    tops = {name.split(".")[0] for name in found}
    assert tops == {"block_tables", "buffers", "kernels"}
    assert not tops & scratch.NEVER_MUTATED


def test_the_copy_imports_and_uses_its_own_kernels(tmp_path):
    sp = scratch.build_scratch(tmp_path, PKG_DIR, package="cpbt_mutant_t1")
    for name, path in sp.modules.items():
        text = path.read_text()
        assert "from ." not in text, name
        assert len(text.splitlines()) == len(sp.origins[name].read_text().splitlines()), name
    sys.path.insert(0, str(tmp_path))
    try:
        mod = importlib.import_module("cpbt_mutant_t1.block_tables")
        assert mod.kernels.__name__.startswith("cpbt_mutant_t1.kernels")
        assert mod.BlockTables.__module__ == "cpbt_mutant_t1.block_tables"
        # The contract stays the real one: the copy's constants are the project's.
        assert mod.BlockTablesConfig.__module__ == "cp_blocktables.contract"
    finally:
        sys.path.remove(str(tmp_path))
        for key in [k for k in sys.modules if k.startswith("cpbt_mutant_t1")]:
            del sys.modules[key]


def _fake_package(root: Path) -> Path:
    src = root / "fake"
    (src / "kernels").mkdir(parents=True)
    (src / "block_tables.py").write_text(
        "from __future__ import annotations\n"
        "from . import kernels, contract\n"
        "from .buffers import (\n"
        "    A,\n"
        "    B,\n"
        ")  # trailing comment\n"
        "from cp_blocktables.kernels.gather import g\n"
        "LINE_8 = 8\n"
    )
    (src / "buffers.py").write_text("from .kernels import gather\nA = B = 1\n")
    (src / "kernels" / "__init__.py").write_text("from . import gather\nfrom .. import _jit\n")
    (src / "kernels" / "gather.py").write_text(
        "from .._jit import dual_jit\nfrom ..contract import PAD\nfrom . import util\n"
    )
    (src / "kernels" / "util.py").write_text("X = 1\n")
    return src


def test_relative_imports_resolve_into_the_copy_or_the_real_package(tmp_path):
    sp = scratch.build_scratch(tmp_path / "out", _fake_package(tmp_path), package="mut")
    assert set(sp.modules) == {
        "block_tables",
        "buffers",
        "kernels",
        "kernels.gather",
        "kernels.util",
    }
    bt = sp.modules["block_tables"].read_text().splitlines()
    assert bt[1] == "from mut import kernels; from cp_blocktables import contract"
    assert bt[2].startswith("from mut.buffers import A, B") and "# trailing comment" in bt[2]
    assert bt[3:6] == ["", "", ""]
    assert bt[6] == "from mut.kernels.gather import g"
    assert bt[7] == "LINE_8 = 8"
    init = sp.modules["kernels"].read_text().splitlines()
    assert init == ["from mut.kernels import gather", "from cp_blocktables import _jit"]
    gather = sp.modules["kernels.gather"].read_text().splitlines()
    assert gather == [
        "from cp_blocktables._jit import dual_jit",
        "from cp_blocktables.contract import PAD",
        "from mut.kernels import util",
    ]


def test_select_by_dotted_prefix(tmp_path):
    sp = scratch.build_scratch(tmp_path / "out", _fake_package(tmp_path), package="mut")
    assert set(sp.select(["kernels"])) == {"kernels", "kernels.gather", "kernels.util"}
    assert set(sp.select(["buffers", "kernels.util"])) == {"buffers", "kernels.util"}
    assert set(sp.select(None)) == set(sp.modules)
    with pytest.raises(ValueError, match="no such implementation module"):
        sp.select(["reference"])
