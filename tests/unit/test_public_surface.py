"""rayvit's public surface: ``rayvit.trainer`` exports what its docstring documents and nothing else, and
the README's examples import only the public modules."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re

import rayvit.trainer

from helpers_cli import REPO

PUBLIC_MODULES = {"rayvit.config", "rayvit.trainer", "rayvit.datasets"}


def test_the_trainer_exports_exactly_what_its_docstring_documents():
    doc = rayvit.trainer.__doc__
    exported = set(rayvit.trainer.__all__)
    assert len(exported) == len(rayvit.trainer.__all__), "a name twice in __all__"
    spans = " ".join(re.findall(r"``(.+?)``", doc, re.S))
    undocumented = sorted(exported - set(re.findall(r"\w+", spans)))
    assert not undocumented, f"exported by rayvit.trainer, not in its docstring: {undocumented}"
    # What each entry of the docstring's list names, and the types it says they return, are exported.
    listed = set(re.findall(r"^- ``(\w+)", doc, re.M)) | set(re.findall(r"-> (\w+)``", doc))
    assert listed and listed <= exported, f"documented, not exported: {sorted(listed - exported)}"
    # Nothing public beyond __all__ (a name imported there is importable from there).
    public = {n for n in vars(rayvit.trainer) if not n.startswith("_")}
    assert public == exported, f"public in rayvit.trainer, not in __all__: {sorted(public - exported)}"
    for name in exported:
        assert getattr(rayvit.trainer, name).__doc__, f"rayvit.trainer.{name} has no docstring"


def readme_imports() -> dict[str, set[str]]:
    """Every ``rayvit`` module the README's Python blocks import, with the names taken from it."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    assert blocks, "the README has no Python examples"
    found: dict[str, set[str]] = {}
    for block in blocks:
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    found.setdefault(alias.name, set())
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.setdefault(node.module, set()).update(a.name for a in node.names)
    return {m: names for m, names in found.items() if m == "rayvit" or m.startswith("rayvit.")}


def test_the_readme_examples_import_only_public_modules():
    imports = readme_imports()
    assert {"rayvit.config", "rayvit.trainer"} <= set(imports)
    private = sorted(set(imports) - PUBLIC_MODULES)
    assert not private, f"the README's examples import non-public modules: {private}"
    for module, names in imports.items():
        public = set(getattr(importlib.import_module(module), "__all__", None) or
                     {n for n in vars(importlib.import_module(module)) if not n.startswith("_")})
        assert names <= public, f"the README imports {sorted(names - public)} from {module}"
