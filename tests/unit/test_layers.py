"""hpcft's layers (docs/design.md "A module map"): no import runs up the declared order and no packages import each
other. Every import counts: those inside functions too (a late import is a dependency all the same). And no file
over 400 lines."""
from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import hpcft

ROOT = Path(hpcft.__file__).parent

# The units of hpcft/, lowest first: a package (a directory) or a module directly in hpcft/ ("hpcft" is its
# __init__). A unit imports only units of earlier rows: two of one row are independent of each other.
ORDER = (
    ("hpcft", "errors", "events"),
    ("deps", "slurm"),
    ("env",),
    ("store",),
    ("nodemem",),
    ("snapshot",),
    ("durable",),
    ("agent",),
    ("elastic", "options", "runtime"),
    ("inprocess",),
    ("checkpointer",),
    ("launch",),
    ("status", "doctor"),
    ("report",),
    ("sandbox",),
    ("bench",),
    ("chaos",),
    ("demo",),
    ("cli",),
)
# Inside a package, lowest first: every sub-package, and root modules that sit below them; the package's other root
# modules are its top (a sub-package never imports them). The snapshot's plan and device checksums are the ground
# its copiers stand on.
INSIDE = {
    "launch": ("config", "policy", "node", "fabric", "steps", "watch"),
    "agent": ("transport", "protection"),
    "snapshot": ("plan", "_crc_kernel", "devcrc", "copiers", "calibration"),
}
ROW = {name: row for row, names in enumerate(ORDER) for name in names}


def _modules() -> dict[str, Path]:
    """Every module of hpcft by dotted name (a package by its __init__)."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> Iterator[tuple[int, str]]:
    """(line, module of hpcft) for every import in the module `name`: `import a.b`, `from a import b` (b a module or
    a name of a), relative ones resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from . import x` in a.b.c is a.b.x, `from ..d import x` is a.d.x
                anchor = package.split(".")[:len(package.split(".")) + 1 - node.level]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            targets = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # `from a import name`: the module is a
                target = target.rpartition(".")[0]
            if target:
                yield node.lineno, target


def unit(name: str) -> tuple[str, str]:
    """(top-level unit, part of it) of module `name`: the part is a sub-package or root module named in INSIDE, or
    "" for the rest of the package (its top)."""
    parts = name.split(".")[1:] or ["hpcft"]
    inner = parts[1] if len(parts) > 2 or parts[1:2] and parts[1] in INSIDE.get(parts[0], ()) else ""
    return parts[0], inner


def _key(u: tuple[str, str]) -> tuple[int, int]:
    inner = INSIDE.get(u[0], ())
    return ROW[u[0]], inner.index(u[1]) if u[1] else len(inner)


def _edges() -> Iterator[tuple[str, str, str]]:
    """(file:line, importer, imported) of every import between two units."""
    for name, path in sorted(MODULES.items()):
        for line, target in _imports(name, path):
            if unit(name) != unit(target):
                yield f"{path.relative_to(ROOT.parent)}:{line}", name, target


def _label(u: tuple[str, str]) -> str:
    return f"{u[0]}.{u[1]}" if u[1] else u[0]


def test_every_unit_has_its_place() -> None:
    units = {unit(name) for name in MODULES}
    assert {u for u, _ in units} <= set(ROW), f"not in ORDER: {sorted({u for u, _ in units} - set(ROW))}"
    subpackages = {(top, inner) for top, inner in units if inner and (ROOT / top / inner).is_dir()}
    dirs = {(p.parent.parent.name, p.parent.name) for p in ROOT.glob("*/*/__init__.py")}
    assert dirs == subpackages, f"sub-packages missing from INSIDE: {sorted(dirs - subpackages)}"
    stale = [(top, n) for top, names in INSIDE.items() for n in names if (top, n) not in units]
    assert not stale, f"INSIDE names what is not there: {stale}"


def test_no_cycle_between_packages() -> None:
    graph: dict[tuple[str, str], dict[tuple[str, str], str]] = {}
    for where, name, target in _edges():
        graph.setdefault(unit(name), {}).setdefault(unit(target), f"{where} imports {target}")
    done: set = set()

    def visit(u: tuple[str, str], path: list[tuple[str, str]]) -> None:
        if u in path:
            loop = path[path.index(u):] + [u]
            raise AssertionError("packages import each other:\n" + "\n".join(
                f"  {_label(a)} -> {_label(b)}: {graph[a][b]}" for a, b in zip(loop, loop[1:])))
        if u not in done:
            for v in graph.get(u, {}):
                visit(v, [*path, u])
            done.add(u)

    for u in sorted(graph):
        visit(u, [])


def test_no_import_up_the_layers() -> None:
    wrong = []
    for where, name, target in _edges():
        a, b = unit(name), unit(target)
        if _key(b) >= _key(a):
            inside = [_label(u) if u[1] else f"{u[0]}'s root modules" for u in (b, a)]
            why = (f"ORDER puts {b[0]} on the row of {a[0]} or above" if a[0] != b[0] else
                   f"INSIDE puts {inside[0]} at or above {inside[1]} (a package's root modules are its top)")
            wrong.append(f"{where} imports {target}: {why}")
    assert not wrong, "imports up the layers (tests/unit/test_layers.py ORDER, INSIDE):\n  " + "\n  ".join(wrong)


def test_no_file_over_400_lines() -> None:
    """STYLE.md: no module over 400 lines, the tests' own files included (a file that fits on a few screens)."""
    files = [*ROOT.rglob("*.py"), *(ROOT.parent / "tests").rglob("*.py")]
    long = {str(p.relative_to(ROOT.parent)): n for p in files if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"split these files (STYLE.md: no module over 400 lines): {long}"
