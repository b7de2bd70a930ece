"""The layering the code promises: a torch-free contract, a core that imports nothing above it, tools
that run without torch where they say so, small functions in the core, and a README that maps the tree."""
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


def test_core_functions_fit_on_a_screen():
    long = []
    for path in python_files(CORE):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60:
                long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}")
    assert not long, long


def test_the_readme_layout_table_matches_the_tree():
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("## Layout"):]
    table = table[:table.index("\n\n", table.index("| path"))]
    listed = set(re.findall(r"^\| `([\w./-]+?)/?` \|", table, re.MULTILINE))
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")}
    assert packages <= listed, sorted(packages - listed)
    assert all((REPO / path).exists() for path in listed), sorted(p for p in listed if not (REPO / p).exists())
