"""The packages import only downward: registry <- runner <- workflows <- server <- ferry.

Read from the source with `ast`, so the rule holds for lazy imports inside functions too; a test
that walks the real tree, so a new upward edge fails here before review sees it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ORDER = ["registry", "runner", "workflows", "server", "ferry"]
REPO = Path(__file__).resolve().parents[1]
# Imports no package may make, whatever its level: the registry and the transfer client run
# where MLX does not.
FORBIDDEN = {"registry": {"mlx"}}


def imported_packages(path: Path) -> list[tuple[int, str]]:
    """(line, top-level package) for every absolute import in `path`."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def upward_edges(package: str) -> list[str]:
    allowed = set(ORDER[: ORDER.index(package) + 1])
    refused = (set(ORDER) - allowed) | FORBIDDEN.get(package, set())
    edges = []
    for path in sorted((REPO / package).rglob("*.py")):
        for line, top in imported_packages(path):
            if top in refused:
                edges.append(f"{path.relative_to(REPO)}:{line} imports {top}")
    return edges


@pytest.mark.parametrize("package", ORDER)
def test_package_imports_only_downward(package: str) -> None:
    assert (REPO / package).is_dir(), f"package {package}/ is missing"
    assert upward_edges(package) == []


def test_the_check_sees_an_upward_edge(tmp_path: Path) -> None:
    """The walker itself: an import of a higher package is reported with its line."""
    source = tmp_path / "m.py"
    source.write_text("import os\n\ndef f():\n    from server.scheduler import Scheduler\n")
    assert (4, "server") in imported_packages(source)
