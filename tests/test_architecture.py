"""The words that describe the code, checked by the code: docs/architecture.md's module
table, the import direction (launch/ at the edge), one channel for notices, and names quoted in docstrings."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dtrain"
TABLE_ROW = re.compile(r"^\| (?P<cell>[^|]*`[^|]*) \|")


def modules() -> dict:
    """``{"dtrain.engine.loss": path}`` of every module of the package."""
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
            for p in sorted(PACKAGE.rglob("*.py"))}


def table_modules() -> set:
    """Files named in the first column of docs/architecture.md's module table; a bare
    ``name.py`` after a path is in that path's folder (``dtrain/engine/arch.py``, ``head.py``)."""
    out, in_table = set(), False
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        if line.startswith("| Module |"):
            in_table = True
        elif in_table and not line.startswith("|"):
            break
        elif in_table and (m := TABLE_ROW.match(line)):
            folder = None
            for name in re.findall(r"`([^`]+)`", m["cell"]):
                if name.startswith("dtrain/"):
                    folder = name.rsplit("/", 1)[0]
                    out.add(name)
                else:
                    out.add(f"{folder}/{name}")
    return out


def test_the_module_table_names_every_module_and_only_those():
    listed = table_modules()
    files = {str(p.relative_to(ROOT)) for p in modules().values() if p.name not in ("__init__.py", "__main__.py")}
    assert sorted(files - listed) == [], "modules missing from docs/architecture.md's table"
    stale = sorted(n for n in listed if not (ROOT / n).exists())
    assert stale == [], "docs/architecture.md's table names files that do not exist"


def imports_of(path: Path, name: str) -> set:
    """Absolute names of the dtrain modules ``path`` (module ``name``) imports."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out |= {mod} | {f"{mod}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m.split(".")[0] == "dtrain"}


def test_only_the_edges_import_the_launcher():
    """launch/ sits at the edge: nothing below it (config, distributed, the run) imports it;
    the command line and ``dtrain doctor`` (which reports where mlx.launch is) are edges too."""
    edges = ("dtrain.cli", "dtrain.doctor")
    bad = [f"{name} imports {m}" for name, path in modules().items()
           if not name.startswith("dtrain.launch") and name not in edges
           for m in imports_of(path, name) if m.startswith("dtrain.launch")]
    assert bad == []


def test_notices_have_one_channel():
    """Below the edges nothing prints: what the user is told goes through a ``report`` callable,
    which a run fills with ``dtrain.notices.notice`` on rank 0 (the command line, ``dtrain doctor``,
    the launcher and the BLAS probe's child print their own output)."""
    edges = ("dtrain.cli", "dtrain.doctor", "dtrain.notices", "dtrain.blas_probe")
    bad = [f"{name}:{node.lineno}" for name, path in modules().items()
           if not name.startswith("dtrain.launch") and name not in edges
           for node in ast.walk(ast.parse(path.read_text()))
           if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"]
    assert bad == []


def defined_names(tree: ast.AST) -> set:
    """Names a module defines: functions, classes, their methods and class attributes, assignments."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                out |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)} | \
                       {n.attr for n in ast.walk(t) if isinstance(n, ast.Attribute)}
                if isinstance(t, ast.Name) and t.id == "__all__":  # names a package exports lazily
                    out |= {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)}
        elif isinstance(node, ast.ImportFrom):
            out |= {a.asname or a.name for a in node.names}
    return out


def docstrings(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            text = ast.get_docstring(node, clean=False)
            if text:
                yield getattr(node, "name", "<module>"), text


# ``a.b`` that are no code names: files, other libraries, GGUF metadata keys
NOT_CODE = re.compile(r".*\.(json|jsonl|yaml|safetensors|gguf|md|py|sh|jinja)$|(mlx|gguf|random|tokenizer\.ggml)\.")


def config_keys() -> set:
    from dtrain.config import Config, describe_fields

    return {f"{s}.{k}" for s in Config.__dataclass_fields__
            for k, *_ in describe_fields(type(getattr(Config(), s)))}


def unresolved(mods: dict, docs: dict | None = None) -> list:
    """Dotted names in docstrings (``:func:`x```, ``mod.name``) and in ``docs`` (name -> markdown
    text: `mod.name`) whose module part is a dtrain module and whose name that module (or, for a
    package, one of its modules) does not define; config keys (``data.fields``), file names and
    other libraries' names are not checked."""
    trees = {name: ast.parse(path.read_text()) for name, path in mods.items()}
    names = {name: defined_names(tree) for name, tree in trees.items()}
    for name, path in mods.items():  # a package answers for what its modules define
        if path.name == "__init__.py":
            names[name] |= set().union(*(names[m] for m in mods if m.startswith(name + ".")))
    keys = config_keys()
    everything = set().union(*names.values()) | {n.rsplit(".", 1)[-1] for n in mods}
    bad = []
    texts = [(name, where, text, "``") for name, tree in trees.items() for where, text in docstrings(tree)]
    texts += [(doc, "markdown", text, "`") for doc, text in (docs or {}).items()]
    for name, where, text, tick in texts:
        for ref in re.findall(r":(?:func|meth|class|data|attr):`~?([\w.]+)`", text):
            if ref.rsplit(".", 1)[-1] not in everything and not NOT_CODE.match(ref):
                bad.append(f"{name} ({where}): {ref}")
        for ref in re.findall(tick + r"([A-Za-z_][\w.]*\.[A-Za-z_]\w*)(?:\([^`]*\))?" + tick, text):
            if ref in keys or NOT_CODE.match(ref):
                continue
            parts = ref.split(".")
            for i in range(len(parts) - 1, 0, -1):  # the longest prefix that names a module
                owner = [m for m in mods if m == ".".join(parts[:i]) or m.endswith("." + ".".join(parts[:i]))]
                if owner:
                    if not any(parts[i] in names[m] or f"{m}.{parts[i]}" in mods for m in owner):
                        bad.append(f"{name} ({where}): {ref}")
                    break
    return bad


def test_names_quoted_in_docstrings_exist():
    assert unresolved(modules()) == []


def test_names_quoted_in_the_docs_exist():
    """docs/*.md and bench/README.md name code as `module.name` too (`lora.DropoutKeys`,
    `dtrain.run.step.Step`); scaling.md named `train_step` after it had become `Step`."""
    docs = {str(p.relative_to(ROOT)): p.read_text() for p in [*sorted((ROOT / "docs").glob("*.md")),
                                                               ROOT / "bench/README.md"]}
    assert unresolved(modules(), docs) == []
    assert unresolved(modules(), {"doc.md": "runs `dtrain.run.step.train_step`"}) == [
        "doc.md (markdown): dtrain.run.step.train_step"]


def test_the_docstring_check_finds_a_missing_name(tmp_path):
    pkg = tmp_path / "dtrain"
    (pkg / "data").mkdir(parents=True)
    (pkg / "data" / "render.py").write_text('"""Rows."""\ndef encode(): pass\n')
    (pkg / "data" / "cache.py").write_text('"""Uses ``render.encode_rows`` and :func:`lock_output`."""\n')
    mods = {"dtrain.data.render": pkg / "data" / "render.py", "dtrain.data.cache": pkg / "data" / "cache.py"}
    assert unresolved(mods) == ["dtrain.data.cache (<module>): lock_output",
                                "dtrain.data.cache (<module>): render.encode_rows"]


def test_the_engine_doc_lists_every_engine_key_at_its_default():
    """docs/engine.md's ``engine:`` block says it is "the defaults (dtrain/config.py)": every key of
    ``EngineConfig``, each at its default (it missed ``kernels``)."""
    import yaml

    from dtrain.config import EngineConfig, describe_fields

    text = (ROOT / "docs" / "engine.md").read_text()
    block = re.search(r"```yaml\n(engine: +# the defaults \(dtrain/config.py\)\n.*?)```", text, re.S)
    assert block, "docs/engine.md has no engine: block of the defaults"
    listed = yaml.safe_load(block[1])["engine"]
    assert listed == {key: default for key, _, default, _ in describe_fields(EngineConfig)}


def test_the_engine_doc_counts_the_engine_tests_it_names():
    """docs/engine.md gives the test count of test_engine_segmented.py and test_engine_gemma4.py; the first
    said 95 when pytest collected 139."""
    import subprocess
    import sys

    text = " ".join((ROOT / "docs" / "engine.md").read_text().split())
    stated = {name: int(n) for name, n in re.findall(r"`tests/(test_engine_\w+\.py)` \((\d+) tests", text)}
    assert set(stated) == {"test_engine_segmented.py", "test_engine_gemma4.py"}
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          *(f"tests/{name}" for name in stated)], cwd=ROOT, capture_output=True, text=True).stdout
    collected = {name: sum(line.startswith(f"tests/{name}::") for line in out.splitlines()) for name in stated}
    assert collected == stated


def test_the_public_surface_lists_dtrain_engines_all():
    """docs/architecture.md's "Public surface" spells out the ``__all__`` of ``dtrain.engine``; it lacked
    ``DPO``, ``SimPO``, ``SFT`` and ``fit_dataset``, which bench/ may import by it."""
    import dtrain.engine

    text = " ".join((ROOT / "docs" / "architecture.md").read_text().split())
    listed = re.search(r"the `__all__` of `dtrain\.engine` \(([^)]*)\)", text)
    assert listed, "docs/architecture.md does not list dtrain.engine's __all__"
    assert sorted(re.findall(r"`(\w+)`", listed[1])) == sorted(dtrain.engine.__all__)
