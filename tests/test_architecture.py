"""The layering the code promises: a torch-free contract, a core that imports nothing above it, tools
that run without torch where they say so, small functions and files throughout the product, and a layout table
(docs/architecture.md) that maps the tree."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CORE = "dflash_runtime"
ABOVE_THE_CORE = ("builder", "clients", "deploy", "dflash_serving", "dflash_training", "dflash_tools", "gateway",
                  "plugins")
# A finder that refuses torch (and what needs it), as on a machine where only the client is installed.
HIDE_TORCH = """
import importlib.abc, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "modelopt"):
            raise ImportError(f"{name} is hidden by this test")
sys.meta_path.insert(0, NoTorch())
"""


def imported_modules(path: Path, lazy: bool = True) -> set[str]:
    """Every module a file imports, at any depth (lazy imports inside functions count too, unless not lazy)."""
    names = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree) if lazy else tree.body:
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def python_files(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def test_the_core_imports_nothing_above_it():
    for path in python_files(CORE):
        above = {m for m in imported_modules(path) if m.split(".")[0] in ABOVE_THE_CORE}
        assert not above, f"{path.relative_to(REPO)} imports {sorted(above)}"


def test_the_contract_is_plain_python():
    for path in python_files("dflash_contract"):
        outside = {m for m in imported_modules(path) if m.split(".")[0] not in sys.stdlib_module_names}
        assert not outside, f"{path.relative_to(REPO)} imports {sorted(outside)}"


@pytest.mark.parametrize("code", [
    # the client library and its CLI, as a backend service installs them
    "import clients, clients.cli; assert clients.cli.main(['--help']) == 0",
    # the OpenAI gateway, as `pip install ./gateway` installs it: it builds and serves (no tritonserver needed here)
    "from fastapi.testclient import TestClient; from gateway import app, main; main.build_parser(); "
    "c = TestClient(app.create_app(app.Settings('localhost:1', 'm'))).__enter__(); "
    "assert c.get('/v1/models').json()['data'][0]['id'] == 'm'; c.__exit__(None, None, None)",
    # the Helm chart's facts from Python (files/contract.yaml), as `python -m deploy.helm.contract --check` runs it
    "from deploy.helm import contract; assert contract.main(['--check']) == 0",
])
def test_runs_without_torch(code, tmp_path):
    result = subprocess.run([sys.executable, "-c", HIDE_TORCH + code, str(tmp_path / "rendered")], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    # the check itself works: torch is really refused in that interpreter
    hidden = subprocess.run([sys.executable, "-c", HIDE_TORCH + "import torch"], capture_output=True, text=True)
    assert "hidden by this test" in hidden.stderr


@pytest.mark.parametrize("package", ["gateway", "clients"])
def test_a_package_installed_alone_imports_only_what_it_ships(package):
    """`pip install ./gateway` (or ./clients) ships the packages its pyproject lists: an import of another of ours
    would pass here, where the repository is on the path, and fail where the package is installed alone. (A lazy
    import is a tool's that says it needs the repository's install: dflash-loadbench's prompt sets.)"""
    shipped = set(tomllib.loads((REPO / package / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    ours = {p.parent.name for p in REPO.glob("*/__init__.py")}
    for name in shipped:
        for path in python_files(name):
            outside = {m for m in imported_modules(path, lazy=False) if m.split(".")[0] in ours - shipped}
            assert not outside, f"{path.relative_to(REPO)} imports {sorted(outside)}, which {package} does not ship"


def import_graph(package: str) -> dict[str, set[str]]:
    """module -> the modules of `package` it imports (relative or absolute, lazy ones included)."""
    graph = {}
    for path in python_files(package):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        graph[module] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = module.split(".")[:len(module.split(".")) - node.level + path.name.endswith("__init__.py")]
                source = ".".join(base + ([node.module] if node.module else []))
                # `from . import x` imports the module x; `from .y import x`, y (and x where it is a module)
                names = [source] * bool(node.module) + [f"{source}.{alias.name}" for alias in node.names]
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            else:
                continue
            graph[module] |= {n for n in names if n.split(".")[0] == package and n != module}
    return {m: {n for n in imports if n in graph} for m, imports in graph.items()}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph (its nodes in order, the first repeated at the end), or None."""
    state = {}  # node -> "open" while on the path, "done" after

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = "done"
        return None

    return next((found for node in sorted(graph) if node not in state and (found := visit(node, [node]))), None)


def test_no_import_cycles_among_packages_or_the_cores_modules():
    """Data flows one way: a package imports only packages below it (dflash_tools holds what the builder and the
    tools share, so no tool reaches up into the builder), and no two modules of the core import each other."""
    ours = sorted(p.parent.name for p in REPO.glob("*/__init__.py"))
    packages = {p: {m.split(".")[0] for path in python_files(p) for m in imported_modules(path)} & set(ours) - {p}
                for p in ours}
    assert cycle(packages) is None, cycle(packages)
    assert cycle(import_graph(CORE)) is None, cycle(import_graph(CORE))
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check itself finds one


def test_every_package_says_its_license():
    """Apache-2.0, as the anchors (TensorRT-LLM, vLLM, SGLang, Triton's backends): the text beside the code, and the
    license in each package's metadata, so that a wheel carries it."""
    assert (REPO / "LICENSE").read_text().split()[:4] == ["Apache", "License", "Version", "2.0,"]
    for path in ("pyproject.toml", "gateway/pyproject.toml", "clients/pyproject.toml"):
        assert tomllib.loads((REPO / path).read_text())["project"]["license"] == "Apache-2.0", path


def product_files() -> list[Path]:
    """Every Python file we ship: the packages, the model repository's models, plugins, helm's helpers (not tests)."""
    return [path for package in (CORE, "dflash_contract", *ABOVE_THE_CORE, "model_repository", "models")
            for path in python_files(package)]


def test_product_functions_fit_on_a_screen_and_files_stay_readable():
    """No function over 60 lines, no file over 600 (a file that grows past it holds two concerns)."""
    long, large = [], []
    for path in product_files():
        text = path.read_text()
        if len(text.splitlines()) > 600:
            large.append(f"{path.relative_to(REPO)} {len(text.splitlines())}")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60:
                long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}")
    assert len(product_files()) > 100  # the walk found the tree
    assert not long and not large, (long, large)


def test_the_layout_table_matches_the_tree():
    page = (REPO / "docs/architecture.md").read_text() + "\n\n"
    table = page[page.index("## Layout"):]
    table = table[:table.index("\n\n", table.index("| path"))]
    listed = set(re.findall(r"^\| `([\w./-]+?)/?` \|", table, re.MULTILINE))
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")}
    assert packages <= listed, sorted(packages - listed)
    assert all((REPO / path).exists() for path in listed), sorted(p for p in listed if not (REPO / p).exists())
