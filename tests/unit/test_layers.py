"""rayvit's structure, checked: imports go down the layers of pyproject.toml's import-linter contract (and
in no circle at all, function-level and annotation-only imports included), the analytic commands import no
torch, functions, classes and modules stay within their size limits, and no module imports another's
private name."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from helpers_cli import REPO

PACKAGE = REPO / "rayvit"
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 450
MAX_CLASS_LINES = 200


def test_imports_go_down_the_layers_of_the_contract():
    done = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
                           "lint_imports_command()"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Contracts: 1 kept, 0 broken." in done.stdout


def test_no_module_imports_another_in_a_circle():
    import grimp
    import networkx as nx

    # Annotation-only imports (under TYPE_CHECKING) count: a type is a dependency too.
    graph = grimp.build_graph("rayvit", exclude_type_checking_imports=False)
    edges = nx.DiGraph((m, i) for m in graph.modules for i in graph.find_modules_directly_imported_by(m))
    circles = [sorted(c) for c in nx.strongly_connected_components(edges) if len(c) > 1]
    assert circles == []


def test_the_analytic_commands_and_modules_import_no_torch(tmp_path):
    """A config check, the projection on GPU profiles and the dry runs are arithmetic: torch (seconds of
    import, a GB of memory) stays out of the process. (The ``cpu`` profile times this host's matmul
    first, with torch: a CPU has no data sheet.)"""
    code = """
import contextlib, io, sys
import rayvit.config, rayvit.projection, rayvit.strategies
from rayvit.config import load_config
load_config("cpu_default", ["parallel.strategy=fsdp"])
from rayvit.cli import main
commands = [["project", "--config", "study_a100", "--out-dir", sys.argv[1]], ["sweep", "--dry-run"],
            ["sweep", "--dry-run", "--config", "ladder_cpu"], ["search", "--dry-run", "--config", "search_a100"],
            ["plan", "--config", "study_a100", "--top", "3"],
            ["project", "--config", "study_a100", "--set", "sweep.mode=ladder", "--set", "precision.mode=amp",
             "--chips", "8"]]
for argv in commands:
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) == 0, argv
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def _modules(root: Path = PACKAGE) -> list[tuple[Path, str]]:
    return [(p, p.read_text()) for p in sorted(root.rglob("*.py"))]


def _over_the_size_limits(modules: list[tuple[Path, str]]) -> list[str]:
    """Each module over MAX_MODULE_LINES, each function over MAX_FUNCTION_LINES and each class over
    MAX_CLASS_LINES, with its length."""
    too_long = []
    for path, text in modules:
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            too_long.append(f"{path.relative_to(REPO)}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {length} lines")
            elif isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                too_long.append(f"{path.relative_to(REPO)}:{node.lineno} class {node.name}: "
                                f"{node.end_lineno - node.lineno + 1} lines")
    return too_long


def test_functions_classes_and_modules_stay_within_their_size_limits():
    assert _over_the_size_limits(_modules()) == []


def test_no_module_imports_a_private_name_of_another():
    found = []
    for path, text in _modules():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rayvit"):
                found += [f"{path.relative_to(REPO)}: {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert found == []


def test_no_file_name_is_used_twice_in_the_package():
    """A file's name says what it holds, once: two ``cli.py`` or ``checkpoint.py`` send a reader (and a
    traceback) to the wrong one. Only packages' ``__init__.py`` repeat."""
    seen: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "__init__.py":
            seen.setdefault(path.name, []).append(str(path.relative_to(REPO)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


def test_only_the_command_line_package_parses_command_lines():
    """argparse is imported under rayvit/cli/ and nowhere else in rayvit: each command's options live in
    one place, and the layers below take typed arguments."""
    found = []
    for path, text in _modules():
        if path.is_relative_to(PACKAGE / "cli"):
            continue
        for node in ast.walk(ast.parse(text)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(REPO)}:{node.lineno}" for n in names if n.split(".")[0] == "argparse"]
    assert found == []
    assert any("argparse" in text for path, text in _modules() if path.is_relative_to(PACKAGE / "cli"))


def test_the_tests_stay_within_the_same_size_limits():
    """tests/ (helpers, fixtures and test modules) is held to rayvit's own limits."""
    assert _over_the_size_limits(_modules(REPO / "tests")) == []
