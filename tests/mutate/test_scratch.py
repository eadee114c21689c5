"""The scratch copy: only implementation modules, imports re-pointed, line numbers kept."""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cp_blocktables.mutate import scratch

PKG_DIR = Path(scratch.__file__).resolve().parents[1]


def _relative_imports(path: Path, name: str, is_pkg: bool) -> set[str]:
    """Top-level names of `cp_blocktables` that `path` imports (relative or absolute)."""
    tops = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level == 0:
            if (node.module or "").split(".")[0] != "cp_blocktables":
                continue
            target = (node.module or "").split(".")[1:]
        else:
            base = name.split(".") if is_pkg else name.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            target = [*base, *(node.module.split(".") if node.module else [])]
        if target:
            tops.add(target[0])
        else:  # `from . import a, b` at the top level
            tops.update(a.name for a in node.names)
    return tops


def test_discovers_every_module_block_tables_is_built_from_and_nothing_else():
    found = scratch.discover_impl_modules(PKG_DIR)
    tops = {name.split(".")[0] for name in found}
    assert not tops & scratch.NEVER_MUTATED
    assert set(scratch.IMPL_ROOTS) == tops
    # The implementation as `block_tables` imports it, transitively, minus the yardstick.
    reached, todo = set(), ["block_tables"]
    while todo:
        top = todo.pop()
        if top in reached or top in scratch.NEVER_MUTATED:
            continue
        reached.add(top)
        for name, path in found.items():
            if name.split(".")[0] == top:
                todo += _relative_imports(path, name, path.name == "__init__.py")
    assert reached == tops, (
        "a top-level module that BlockTables does not use is not in "
        "NEVER_MUTATED, or one it uses is missing"
    )
    for core in ("block_tables", "_reads", "_inputs", "_layout_tensors", "buffers", "guards"):
        assert core in tops
    assert "integrity" in tops and "kernels.gather" in found and "kernels._common" in found


def test_the_copy_never_imports_a_real_implementation_module(tmp_path):
    """Importing the copy and building a BlockTables loads no implementation module of the
    real package: every class of BlockTables's MRO (the mixins of `_reads`, `_inputs`,
    `_layout_tensors`) and every module it reaches are the copy's."""
    sp = scratch.build_scratch(tmp_path, PKG_DIR, package="cpbt_mutant_t2")
    code = (
        "import sys, json\n"
        "from cp_blocktables.harness import presets\n"
        "from cpbt_mutant_t2.block_tables import BlockTables\n"
        "cfg = presets.PRESETS['mutation'].config(0)\n"
        "bt = BlockTables(**{k: getattr(cfg, k) for k in ('block_sizes', 'max_num_reqs',\n"
        "    'max_num_batched_tokens', 'max_num_blocks_per_group')}, device='cpu')\n"
        "mro = [c.__module__ for c in type(bt).__mro__ if c is not object]\n"
        "real = sorted(m for m in sys.modules if m.startswith('cp_blocktables.'))\n"
        "print(json.dumps({'mro': mro, 'real': real}))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(PKG_DIR.parent)]))
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(out["mro"]) >= 3 and all(m.startswith("cpbt_mutant_t2.") for m in out["mro"])
    leaked = {m.split(".")[1] for m in out["real"]} - scratch.NEVER_MUTATED
    assert not leaked, f"the copy imported the real {sorted(leaked)}"
    assert set(sp.modules) == set(scratch.discover_impl_modules(PKG_DIR))


def test_the_copy_imports_and_uses_its_own_kernels(tmp_path):
    sp = scratch.build_scratch(tmp_path, PKG_DIR, package="cpbt_mutant_t1")
    for name, path in sp.modules.items():
        text = path.read_text()
        assert "from ." not in text, name
        assert len(text.splitlines()) == len(sp.origins[name].read_text().splitlines()), name
    sys.path.insert(0, str(tmp_path))
    try:
        mod = importlib.import_module("cpbt_mutant_t1.block_tables")
        assert mod.integrity.__name__ == "cpbt_mutant_t1.integrity"
        for base in mod.BlockTables.__mro__[1:-1]:  # the mixins
            assert base.__module__.startswith("cpbt_mutant_t1."), base
        reads = importlib.import_module("cpbt_mutant_t1._reads")
        assert reads.kernels.__name__ == "cpbt_mutant_t1.kernels"
        assert reads.guards.__name__ == "cpbt_mutant_t1.guards"
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


def test_a_new_top_level_module_is_mutated_without_being_listed(tmp_path):
    src = _fake_package(tmp_path)
    (src / "_mixin.py").write_text("from . import kernels\nfrom .contract import PAD\n")
    (src / "contract.py").write_text("PAD = -1\n")
    (src / "harness").mkdir()
    (src / "harness" / "__init__.py").write_text("")
    (src / "notes").mkdir()  # not a package
    assert scratch.impl_roots(src) == ("_mixin", "block_tables", "buffers", "kernels")
    sp = scratch.build_scratch(tmp_path / "out", src, package="mut")
    assert "_mixin" in sp.modules and "contract" not in sp.modules
    assert sp.modules["_mixin"].read_text().splitlines() == [
        "from mut import kernels",
        "from cp_blocktables.contract import PAD",
    ]
