"""The shape of the code, held by tests: layers that import only downward, no import circle, short
functions, and one list of the public names.

The layers are the import-linter contracts in pyproject.toml (``[tool.importlinter]``), top to bottom:
compat, tools, serve | testing, api | engine, served (the served runtime, with a contract of its own inside),
select, plan, ranks, load, authoring, parallel, cut, log, progress, and the leaves (configs, errors, version).
``nox -s lint`` checks them too; here they are part of the suite CI runs. The root of tpcore holds entry points
and leaves only, no file name is used twice, and ``import tpcore`` installs no import hook.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

import tpcore

ROOT = Path(__file__).resolve().parents[2]
#: a function whose code (its lines after the docstring) is longer than this is split; bench/ is exempt
MAX_FUNCTION_LINES = 60


def test_every_import_goes_down_the_layers():
    linter = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(linter), "--config", str(ROOT / "pyproject.toml")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "2 kept, 0 broken" in done.stdout


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    """tpcore's import graph, built once for the tests that read it."""
    return grimp.build_graph("tpcore")


def test_no_module_imports_itself_through_others(graph):
    """Imports inside functions count too: a lazy import that closes a circle is still a circle."""
    assert len(graph.modules) > 40
    assert _cycles(graph) == []


def _functions(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]  # the docstring
            yield node.name, node.end_lineno - body[0].lineno + 1, node.lineno


def test_no_function_is_longer_than_sixty_lines():
    sources = [*ROOT.glob("tpcore/**/*.py"), *ROOT.glob("plugins/*/src/**/*.py")]
    assert len(sources) > 40
    long = [
        f"{path.relative_to(ROOT)}:{line} {name} ({length} lines)"
        for path in sources
        for name, length, line in _functions(path)
        if length > MAX_FUNCTION_LINES
    ]
    assert long == []


def test_the_public_names_are_listed_once_and_each_resolves():
    assert sorted(tpcore.__all__) == sorted(tpcore._EXPORTS)
    for name in tpcore.__all__:
        assert getattr(tpcore, name) is getattr(importlib.import_module(tpcore._EXPORTS[name]), name)


#: the most modules at tpcore's root beside ``__init__`` and ``__main__``: entry points (api, engine) and leaves
MAX_ROOT_MODULES = 9


def test_the_root_holds_entry_points_and_leaves_and_no_file_name_is_used_twice():
    root = sorted(path.name for path in ROOT.glob("tpcore/*.py") if path.name not in ("__init__.py", "__main__.py"))
    assert 0 < len(root) <= MAX_ROOT_MODULES, root
    names = [path.name for path in ROOT.glob("tpcore/**/*.py") if path.name != "__init__.py"]
    assert len(names) > 40
    assert sorted({name for name in names if names.count(name) > 1}) == []


def test_a_served_call_is_written_and_resolved_inside_the_served_runtime(graph):
    """The walk of one served call, caller to rank and back, stays in ``tpcore/served/``: no other module of tpcore
    imports the call's codecs or what runs on a rank (the server above it uses the caches' batch operations only)."""
    runtime = {"tpcore.served.call", "tpcore.served.rank_side", "tpcore.served.lookahead"}
    runtime |= {f"tpcore.served.{name}" for name in ("kept_tensors", "config_changes", "random_state")}
    outside = sorted(
        f"{importer} imports {module}"
        for module in runtime
        for importer in graph.find_modules_that_directly_import(module)
        if not importer.startswith("tpcore.served.")
    )
    assert outside == []
    walk = {"tpcore.served.handle", "tpcore.served.call", "tpcore.served.lookahead", "tpcore.served.rank_side"}
    assert walk <= graph.modules


def test_importing_tpcore_adds_no_import_hook():
    code = "import sys; before = len(sys.meta_path), len(sys.path_hooks); import tpcore; import tpcore.compat; "
    code += "print(before == (len(sys.meta_path), len(sys.path_hooks)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["True"]


def test_importing_tpcore_costs_no_torch_import():
    code = "import sys, tpcore; print(tpcore.__version__, 'torch' in sys.modules, 'transformers' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == [tpcore.__version__, "False", "False"]


@pytest.mark.parametrize("plugin", sorted(path.name for path in ROOT.glob("plugins/*/src/*") if path.is_dir()))
def test_a_plugin_imports_tpcore_s_public_names_alone(plugin):
    """Plugins depend on tpcore alone (no other plugin) and import only ``tpcore`` itself, never its modules."""
    sources = list(ROOT.glob(f"plugins/*/src/{plugin}/**/*.py"))
    assert sources
    wrong = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            for name in names:
                top = name.split(".")[0]
                if (top == "tpcore" and name != "tpcore") or (top.startswith("tp_") and top != plugin):
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert wrong == []
