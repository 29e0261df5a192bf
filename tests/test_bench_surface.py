"""bench/ uses dtrain's public surface only, and tests use nothing from bench/ but its two
libraries (perfmodel.py and netns.py, each imported by its own test; conftest.py puts bench/ on
the path) and tests/test_bench_scripts.py, which runs some scripts' command lines as separate processes.

The surface (docs/architecture.md, "Public surface"): public names of the
top-level modules (``dtrain.config``, ...) and of the modules of ``dtrain.run``, the ``__all__``
of the subpackages ``dtrain.engine``, ``dtrain.data`` and ``dtrain.models``,
and the modules of ``dtrain.launch`` (its ``__init__`` lists them and imports
nothing). Private names (``_x``) and modules inside the other subpackages
(``dtrain.engine.segmented``, ``dtrain.data.cache``, ...) are not part of it.
"""

from __future__ import annotations

import ast
import re
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ("dtrain.engine", "dtrain.data", "dtrain.models")
BENCH = sorted((ROOT / "bench").glob("*.py"))
LIBRARIES = {"perfmodel": "test_perfmodel.py", "netns": "test_launch_netns.py"}  # bench/ module -> its test


def dtrain_uses(path: Path):
    """``(line, module, name)`` of each ``from dtrain... import name`` / ``import dtrain...``,
    and ``(line, module, attr)`` of each ``alias.attr`` on a module imported from dtrain."""
    tree = ast.parse(path.read_text(), str(path))
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "dtrain":
            for a in node.names:
                yield node.lineno, node.module, a.name
                if node.module == "dtrain" or node.module == "dtrain.launch":
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "dtrain":
                    yield node.lineno, a.name, None
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            yield node.lineno, aliases[node.value.id], node.attr


def public(module: str, name: str | None) -> str | None:
    """None when ``module``/``name`` is on the surface, else why not."""
    parts = module.split(".")
    if any(p.startswith("_") for p in parts) or (name or "").startswith("_"):
        return "a private name"
    if module in SUBPACKAGES:
        return None if name is None or name in importlib.import_module(module).__all__ else f"not in {module}.__all__"
    if len(parts) == 3 and parts[1] in ("launch", "run"):  # their modules are the surface
        return None
    if len(parts) == 2 and importlib.util.find_spec(module).submodule_search_locations is None:
        return None  # a top-level module: its public names
    if module == "dtrain" and name is not None:
        return public(f"dtrain.{name}", None)
    if module == "dtrain.launch" and name is not None:
        return None
    return "a module inside a subpackage"


@pytest.mark.parametrize("path", BENCH, ids=lambda p: p.name)
def test_bench_uses_only_the_public_surface(path):
    bad = [f"{path.name}:{line}: {module}{'.' + name if name else ''} ({why})"
           for line, module, name in dtrain_uses(path) if (why := public(module, name))]
    assert bad == []


def test_the_rule_rejects_what_it_should():
    assert public("dtrain.engine.segmented", "SegmentedEngine") == "a module inside a subpackage"
    assert public("dtrain.engine", "loss_from_token_logps") == "not in dtrain.engine.__all__"
    assert public("dtrain.blas", "_openblas_candidates") == "a private name"
    assert public("dtrain.data", "tokenize_cached") is None and public("dtrain.launch.plan", "base_env") is None
    assert public("dtrain.run.step", "Step") is None


def test_tests_import_nothing_from_bench():
    """No test imports a bench script, and each of bench/'s libraries only its own test;
    test_bench_scripts.py runs scripts as processes, and conftest.py (which puts bench/ on
    the path) and it are the only test files that name bench/."""
    scripts = {p.stem for p in BENCH} - {p.stem for p in (ROOT / "tests").glob("*.py")}
    for path in sorted((ROOT / "tests").glob("*.py")):
        if path.name == Path(__file__).name:
            continue
        tree = ast.parse(path.read_text(), str(path))
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        allowed = {name for name, test in LIBRARIES.items() if test == path.name}
        assert not names & scripts - allowed, (path.name, names & scripts - allowed)
        assert '"bench"' not in path.read_text() or path.name in ("test_bench_scripts.py", "conftest.py"), path.name


def test_bench_readme_indexes_every_script():
    """bench/README.md's table has one row per script in bench/, and no row for a script that is gone."""
    rows = {line.split("`")[1] for line in (ROOT / "bench" / "README.md").read_text().splitlines()
            if line.startswith("| `")}
    scripts = {p.name for p in (ROOT / "bench").iterdir() if p.suffix in (".py", ".sh")}
    assert rows == scripts


def test_bench_readme_names_every_gpu_stage():
    """bench/README.md's gpu.sh row lists the stages ``bash bench/gpu.sh STAGE`` runs; it missed
    ``dpf32`` and ``groups``, which docs/gpu.md and docs/benchmarks.md quote."""
    row = next(line for line in (ROOT / "bench" / "README.md").read_text().splitlines() if line.startswith("| `gpu.sh`"))
    stages = re.findall(r"^([a-z0-9]+)\)$", (ROOT / "bench" / "gpu.sh").read_text(), re.M)
    assert stages and [s for s in stages if not re.search(rf"\b{s}\b", row)] == [], row


def test_only_the_prelude_puts_the_repository_on_the_path():
    """bench/prelude.py is the one place bench/ edits ``sys.path``; every other script that
    imports dtrain gets there through it (directly or through common.py)."""
    for path in BENCH:
        text = path.read_text()
        assert ("sys.path.insert" in text) == (path.name == "prelude.py"), path.name
        if any(True for _ in dtrain_uses(path)) and path.name != "prelude.py":
            assert re.search(r"^(import prelude|from (prelude|common) import)", text, re.M), path.name
