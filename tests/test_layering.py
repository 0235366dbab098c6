"""The package reads top-down: no galaxy module imports a package above its own (docs/design.md
section 8), counting imports inside functions too."""
import ast
import pathlib

import pytest

# Bottom first; a module may import its own package and those of earlier rows.
LAYERS = [("plan", "plan_shares", "plan_pipeline"), ("config", "files", "data", "compat", "assets"), ("distributed",), ("layers",), ("models",),
          ("parallel",), ("pipeline",), ("runtime",), ("peft",), ("preflight",), ("train",), ("inference",), ("launch",),
          ("profiler",), ("planner",), ("edge",)]
RANK = {name: i for i, row in enumerate(LAYERS) for name in row}
ROOT = pathlib.Path(__file__).resolve().parent.parent / "galaxy"


def package_of(path: pathlib.Path) -> str:
    return path.relative_to(ROOT).parts[0].removesuffix(".py")


def galaxy_imports(path: pathlib.Path):
    """(line, imported top-level galaxy package) for every import of galaxy.* in the file."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "galaxy" and len(parts) > 1:
                yield node.lineno, parts[1]


MODULES = sorted(p for p in ROOT.rglob("*.py") if p.name != "__init__.py" or p.parent != ROOT)


def test_every_package_has_a_layer():
    assert {package_of(p) for p in MODULES} <= set(RANK), "add the new package to LAYERS"


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(ROOT)) for p in MODULES])
def test_no_import_points_up(path):
    own = RANK[package_of(path)]
    upward = [f"line {line}: galaxy.{pkg}" for line, pkg in galaxy_imports(path) if RANK[pkg] > own]
    assert not upward, f"{path.relative_to(ROOT)} imports a higher package: {upward}"
