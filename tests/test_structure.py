"""The import rules of the design notes, held by walking the import graph of nmt/ (imports
inside functions count: a lazy import is a dependency too). When a new module needs an
exception, change the rule here and say why, rather than import around it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "nmt"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def resolve(name: str, imported: str | None = None) -> str:
    """`from name import imported`: the module it reads (a submodule when there is one)."""
    if imported and f"{name}.{imported}" in MODULES:
        return f"{name}.{imported}"
    return name


def imports(path: Path) -> set[str]:
    """Every module `path` imports (absolute names; nmt's and others')."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update(resolve(node.module, alias.name) for alias in node.names)
    return found


GRAPH = {name: imports(path) for name, path in MODULES.items()}


def nmt_imports(module: str) -> set[str]:
    return {m for m in GRAPH[module] if m == "nmt" or m.startswith("nmt.")}


def under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_graph_sees_every_module():
    assert {"nmt.train", "nmt.run", "nmt.search", "nmt.models.base", "nmt.cli"} <= set(GRAPH)
    assert "nmt.models.base" in nmt_imports("nmt.search")  # the walker reads imports


def test_nothing_imports_the_cli():
    importers = [m for m in GRAPH if "nmt.cli" in nmt_imports(m) and m != "nmt.__main__"]
    assert importers == []


def test_the_data_pipeline_and_the_models_never_meet():
    """They meet in train, translate and evaluate, through batch tensors."""
    for module in GRAPH:
        if under(module, "nmt.data"):
            assert not any(under(m, "nmt.models") for m in nmt_imports(module)), module
        if under(module, "nmt.models"):
            assert not any(under(m, "nmt.data") for m in nmt_imports(module)), module


def test_models_know_nothing_of_process_settings():
    """nmt.device holds the process' policy (precision, host tuning); models may ask the CPU
    what it can do (nmt.cpu, a leaf that imports only torch)."""
    for module in GRAPH:
        if under(module, "nmt.models"):
            assert "nmt.device" not in nmt_imports(module), module
    assert nmt_imports("nmt.cpu") == set()


def test_search_uses_only_the_model_contract():
    assert nmt_imports("nmt.search") <= {"nmt.models.base", "nmt.special"}


def test_only_the_cli_draws_on_the_terminal():
    """typer and rich belong to the CLI (reporters are passed in); no print in the library."""
    for module, path in MODULES.items():
        if module in ("nmt.cli", "nmt.__main__"):
            continue
        drawing = {m for m in GRAPH[module] if m.split(".")[0] in ("typer", "rich", "click")}
        assert not drawing, f"{module} imports {drawing}"
        tree = ast.parse(path.read_text(encoding="utf-8"))
        prints = [
            n.lineno
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "print"
        ]
        assert not prints, f"{module} prints at lines {prints}"


def test_only_the_export_modules_touch_the_export_runtimes():
    """ctranslate2 and transformers (the optional `export` extra) are imported by nmt.export,
    which builds the exports, and nmt.engine, which decodes with CTranslate2; both import them
    inside functions, so nothing else needs the extra (tests/test_export.py checks that
    decoding with nmt loads neither)."""
    runtimes = ("ctranslate2", "transformers", "safetensors")
    for module in GRAPH:
        used = {m for m in GRAPH[module] if m.split(".")[0] in runtimes}
        if module not in ("nmt.export", "nmt.engine"):
            assert not used, f"{module} imports {used}"
    tree = ast.parse(MODULES["nmt.export"].read_text(encoding="utf-8"))
    top = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    top |= {n.module.split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom) and n.module}
    assert not top & set(runtimes)


def test_the_run_layout_is_spelled_in_one_module():
    """Only nmt.run names the files of a run directory."""
    names = ['"last.pt"', '"best.pt"', '"averaged.pt"', '"metrics.jsonl"', '"train.log"']
    names += ['"config.yaml"', '/ "checkpoints"', '/ "tokenizer"', "step-{", '".lock"']
    for module, path in MODULES.items():
        if module == "nmt.run":
            continue
        text = path.read_text(encoding="utf-8")
        assert not [n for n in names if n in text], module


def test_the_import_graph_has_no_cycles():
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        seen[module] = 1
        for dep in sorted(nmt_imports(module)):
            dep = dep if dep in GRAPH else "nmt"
            if seen.get(dep) == 1 and dep != "nmt":
                pytest.fail(f"import cycle: {' -> '.join([*path, dep])}")
            if dep not in seen:
                visit(dep, [*path, dep])
        seen[module] = 2

    for module in sorted(GRAPH):
        if module not in seen:
            visit(module, [module])


@pytest.mark.parametrize("module", ["nmt.config", "nmt.models.configs", "nmt.run", "nmt.metrics"])
def test_configs_and_run_state_load_without_torch(module):
    """Model configs are plain dataclasses: reading a recipe (and so the data pipeline's
    config) or a run's layout needs no torch; scoring files neither."""
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_benchmarks_use_only_public_names():
    """scripts/ import nothing private from nmt and patch nothing in it."""
    for path in (REPO / "scripts").glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nmt"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.name} imports {private} from {node.module}"
                aliases.update(a.asname or a.name for a in node.names)
            if isinstance(node, ast.Import):
                aliases.update(
                    (a.asname or a.name).split(".")[0]
                    for a in node.names
                    if a.name.startswith("nmt")
                )
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
            ):
                pytest.fail(f"{path.name}:{node.lineno} uses {node.value.id}.{node.attr}")
