"""MkDocs hook: the reference page's `<!-- help: COMMAND -->` markers become each console script's own `--help`,
run at build time, so the page cannot drift from the code. Every script of pyproject.toml must have a marker."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mkdocs.exceptions import PluginError

REPO = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^<!-- help: ([\w-]+) -->$", re.MULTILINE)
HELP_WIDTH = "100"  # argparse wraps to $COLUMNS: fixed, so the page is the same on every terminal


def console_scripts() -> dict[str, str]:
    """{command: "module:function"} from the project's pyproject.toml."""
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def help_text(command: str, entry: str) -> str:
    """`command --help` as the installed script prints it (run through this interpreter: no PATH needed)."""
    module, function = entry.split(":")
    code = f"import sys; from {module} import {function}; sys.argv[0] = {command!r}; sys.exit({function}())"
    done = subprocess.run([sys.executable, "-c", code, "--help"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": HELP_WIDTH}, timeout=120)
    if done.returncode != 0:
        raise PluginError(f"{command} --help exited with {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout


def on_page_markdown(markdown: str, page, **_) -> str:
    named = MARKER.findall(markdown)
    if not named:
        return markdown
    scripts = console_scripts()
    unknown, missing = set(named) - set(scripts), set(scripts) - set(named)
    if unknown or missing:
        raise PluginError(f"{page.file.src_path}: markers for no console script {sorted(unknown)}, "
                          f"console scripts without a marker {sorted(missing)}")
    with ThreadPoolExecutor(4) as pool:
        texts = dict(zip(named, pool.map(lambda name: help_text(name, scripts[name]), named)))
    return MARKER.sub(lambda m: "```text\n" + texts[m.group(1)].rstrip() + "\n```", markdown)
