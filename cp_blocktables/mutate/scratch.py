"""Copy the implementation modules into a standalone scratch package for Cosmic Ray.

Cosmic Ray edits the files it mutates in place, so it must work on a copy.
The copy is the package `cpbt_mutant` (by default) holding every
implementation module: every top-level module or package of `cp_blocktables`
found on disk at run time (`impl_roots`), except the explicit
`NEVER_MUTATED` list (the contract, the reference, the product subpackages,
the CLI). So a module the core is split into is copied and mutated without
anyone having to remember to list it. Relative imports are rewritten to absolute ones: a target
that was copied resolves inside the copy, anything else (`contract`, `_jit`,
...) to the real `cp_blocktables`. Rewritten statements keep their line
numbers (padding with blank lines), so a mutant's line number is the line of
the original source.
"""

from __future__ import annotations

import ast
import shutil
from dataclasses import dataclass, field
from pathlib import Path

SOURCE_PACKAGE = "cp_blocktables"
MUTANT_PACKAGE = "cpbt_mutant"

NEVER_MUTATED: frozenset[str] = frozenset(
    {
        # The yardstick: the contract, the reference and the JIT shim they share.
        "contract",
        "reference",
        "_jit",
        # The product around the implementation: harness, drills, pytest plugin, benchmarks,
        # this tool, the command line and the package's entry points.
        "harness",
        "drills",
        "pytest_plugin",
        "bench",
        "mutate",
        "cli",
        "cli_base",
        "__init__",
        "__main__",
        # Names the harness had before it was a package (kept so an old layout stays safe).
        "checks",
        "workload",
        "presets",
    }
)
"""Top-level names of `cp_blocktables` that are never copied: the contract and the harness
are the yardstick, not the thing measured. Every other top-level module or package is
implementation (`BlockTables` and what it is built from: mixins, buffers, kernels, guards,
integrity checks) and is copied and mutated. A new product module must be added here."""


def impl_roots(source_dir: Path) -> tuple[str, ...]:
    """Every top-level module or package of `source_dir` that is not in `NEVER_MUTATED`."""
    names = []
    for path in sorted(source_dir.iterdir()):
        if path.is_file() and path.suffix == ".py":
            name = path.stem
        elif path.is_dir() and (path / "__init__.py").is_file():
            name = path.name
        else:
            continue
        if name.isidentifier() and name not in NEVER_MUTATED:
            names.append(name)
    return tuple(names)


IMPL_ROOTS: tuple[str, ...] = impl_roots(Path(__file__).resolve().parents[1])
"""The implementation roots of this `cp_blocktables` (each a module or a package), as
`impl_roots` finds them; a copy of another source tree discovers its own."""


@dataclass
class ScratchPackage:
    """A copied implementation: `root` goes on `sys.path`, `package` is its import name.

    `modules` maps a dotted name relative to the package (`"kernels"`,
    `"kernels.gather"`) to its copied file; `origins` maps the same names to the
    original files.
    """

    root: Path
    package: str
    modules: dict[str, Path] = field(default_factory=dict)
    origins: dict[str, Path] = field(default_factory=dict)

    def entry_impl(self) -> str:
        """The `--impl` spec of `BlockTables` in the copy."""
        return f"{self.package}.block_tables:BlockTables"

    def select(self, patterns: list[str] | None) -> dict[str, Path]:
        """Copied files to mutate: all, or those named by (a prefix of) a dotted name."""
        if not patterns:
            return dict(self.modules)
        chosen = {
            name: path
            for name, path in self.modules.items()
            if any(name == p or name.startswith(p + ".") for p in patterns)
        }
        unknown = [
            p for p in patterns if not any(n == p or n.startswith(p + ".") for n in self.modules)
        ]
        if unknown:
            raise ValueError(
                f"--modules {', '.join(unknown)}: no such implementation module; "
                f"known: {', '.join(sorted(self.modules))}"
            )
        return chosen


def discover_impl_modules(
    source_dir: Path, roots: tuple[str, ...] | None = None
) -> dict[str, Path]:
    """Dotted name (relative to the package) -> file, for every module under `roots`
    (default: `impl_roots(source_dir)`)."""
    found: dict[str, Path] = {}
    for root in impl_roots(source_dir) if roots is None else roots:
        if root.split(".")[0] in NEVER_MUTATED:
            continue
        module_file = source_dir / f"{root}.py"
        package_dir = source_dir / root
        if module_file.is_file():
            found[root] = module_file
        elif (package_dir / "__init__.py").is_file():
            for path in sorted(package_dir.rglob("*.py")):
                parts = path.relative_to(source_dir).with_suffix("").parts
                if "__pycache__" in parts:
                    continue
                name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                found[name] = path
        else:
            raise FileNotFoundError(f"implementation module {root!r} not found in {source_dir}")
    return found


def build_scratch(
    dest: Path,
    source_dir: Path,
    package: str = MUTANT_PACKAGE,
    roots: tuple[str, ...] | None = None,
) -> ScratchPackage:
    """Copy the implementation modules of `source_dir` into `dest/package`, imports rewritten."""
    modules = discover_impl_modules(source_dir, roots)
    pkg_dir = dest / package
    if pkg_dir.exists():
        shutil.rmtree(pkg_dir)
    pkg_dir.mkdir(parents=True)
    (pkg_dir / "__init__.py").write_text(
        f'"""A copy of {SOURCE_PACKAGE}\'s implementation modules, mutated by Cosmic Ray."""\n'
    )
    scratch = ScratchPackage(root=dest, package=package)
    copied = set(modules)
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        rel = path.relative_to(source_dir)
        target = pkg_dir / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        source = path.read_text()
        target.write_text(rewrite_imports(source, name, is_pkg, copied, package))
        scratch.modules[name] = target
        scratch.origins[name] = path
    for directory in {p.parent for p in scratch.modules.values()}:
        init = directory / "__init__.py"
        if not init.exists():  # a namespace gap: make it a regular package
            init.write_text("")
    return scratch


def _resolve(module_name: str, is_pkg: bool, level: int, target: str | None) -> str:
    """The absolute dotted name (relative to the source package) a relative import names.

    `""` is the package itself.
    """
    parts = module_name.split(".")
    base = parts if is_pkg else parts[:-1]
    up = level - 1
    if up > len(base):
        raise ValueError(f"{module_name}: relative import beyond the package")
    base = base[: len(base) - up]
    if target:
        base = [*base, *target.split(".")]
    return ".".join(base)


def _is_copied(name: str, copied: set[str]) -> bool:
    return name in copied or any(c.startswith(name + ".") for c in copied) and name != ""


def _absolute(name: str, copied: set[str], package: str) -> str:
    """Where relative-to-source name `name` lives: inside the copy, or the real package."""
    top = package if name and _is_copied(name, copied) else SOURCE_PACKAGE
    return f"{top}.{name}" if name else top


def _rewrite_node(
    node: ast.ImportFrom, module_name: str, is_pkg: bool, copied: set[str], package: str
) -> str:
    if node.level == 0:
        name = (node.module or "").removeprefix(SOURCE_PACKAGE + ".")
        if node.module != SOURCE_PACKAGE and not (node.module or "").startswith(
            SOURCE_PACKAGE + "."
        ):
            return ast.unparse(node)
        name = "" if node.module == SOURCE_PACKAGE else name
    else:
        name = _resolve(module_name, is_pkg, node.level, node.module)
    if node.module is not None and node.level > 0 or name:
        return ast.unparse(
            ast.ImportFrom(module=_absolute(name, copied, package), names=node.names, level=0)
        )
    # `from . import a, b`: each name may be a module of the copy or of the real package.
    statements = []
    for alias in node.names:
        sub = f"{name}.{alias.name}" if name else alias.name
        home = package if _is_copied(sub, copied) else SOURCE_PACKAGE
        parent = f"{home}.{name}" if name else home
        statements.append(ast.unparse(ast.ImportFrom(module=parent, names=[alias], level=0)))
    return "; ".join(statements)


def rewrite_imports(
    source: str, module_name: str, is_pkg: bool, copied: set[str], package: str = MUTANT_PACKAGE
) -> str:
    """`source` with every package-relative import made absolute (line numbers kept)."""
    tree = ast.parse(source)
    nodes = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom)
        and (n.level > 0 or (n.module or "").split(".")[0] == SOURCE_PACKAGE)
    ]
    lines = source.splitlines(keepends=True)
    for node in sorted(nodes, key=lambda n: (n.lineno, n.col_offset), reverse=True):
        new = _rewrite_node(node, module_name, is_pkg, copied, package)
        first, last = node.lineno - 1, node.end_lineno - 1
        head = lines[first][: node.col_offset]
        tail = lines[last][node.end_col_offset :]
        replacement = head + new + tail.rstrip("\n") + "\n" + "\n" * (last - first)
        lines[first : last + 1] = [replacement]
    return "".join(lines)
