"""MkDocs hook: figures that cannot drift from the code.

- `<!-- help: COMMAND -->` (the reference page) becomes the console script's own `--help`, run at build time; every
  script of pyproject.toml must have a marker.
- `<!-- bench: data/FILE.json -->` becomes the table and the plot that `dflash-bench` itself prints and draws from
  that JSON (its --json output, kept in docs/data/ as measured), so a page shows no figure the file does not hold."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mkdocs.exceptions import PluginError

REPO = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^<!-- help: ([\w-]+) -->$", re.MULTILINE)
BENCH_MARKER = re.compile(r"^<!-- bench: ([\w./-]+\.json) -->$", re.MULTILINE)
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


def bench_figures(path: Path) -> str:
    """dflash-bench's own summary table and plot of a JSON it wrote: the table as text, the plot as inline SVG."""
    from dflash_tools.benchmark import plot, summary_table

    if not path.is_file():
        raise PluginError(f"no benchmark JSON at {path}")
    summary = json.loads(path.read_text())
    with tempfile.TemporaryDirectory() as folder:
        plot(summary, f"{folder}/plot.svg")
        svg = Path(f"{folder}/plot.svg").read_text()
    svg = svg[svg.index("<svg"):]  # the XML prolog and doctype have no place inside HTML
    return f"```text\n{summary_table(summary)}\n```\n\n<figure>\n{svg}\n</figure>"


def on_page_markdown(markdown: str, page, **_) -> str:
    docs = Path(page.file.abs_src_path).parent
    markdown = BENCH_MARKER.sub(lambda m: bench_figures(docs / m.group(1)), markdown)
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
