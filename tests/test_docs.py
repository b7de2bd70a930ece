"""The documentation site builds with MkDocs in strict mode: a broken link or anchor, a page missing from the
navigation, or a console script without its generated `--help` on the reference page fails here."""
from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO

README_LINES = 150  # a newcomer's first two screens (the rest is in docs/)


def test_the_documentation_site_builds_strictly_with_every_commands_help(tmp_path):
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    reference = (site / "reference" / "index.html").read_text()
    assert reference.count("usage: ") >= 11 and "&lt;!-- help:" not in reference
    assert "--max-context" in reference and "--queue-timeout" in reference


def test_the_readme_fits_on_two_screens_and_points_to_the_docs():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= README_LINES
    assert "docs/" in readme and "make demo" in readme and "make test" in readme
