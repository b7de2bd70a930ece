"""The versions of the serving stack's dependencies that this release ran with, and what is installed.

Three software sets were run (docs/verified.md): this project's CPU machines
(pyproject.toml's pins, `make test`); the lent GPU machine's, rehearsed on a CPU by `make
gpu-rehearsal`; and the GPU serving image's (Triton 26.07: its PyTorch 2.10 and the transformers and
numpy of its TensorRT-LLM 1.2.1), rehearsed by `make image-rehearsal`. Another version may well work,
but nothing here ran on it, so the server says so when it starts instead of failing later in a way
that names nothing.
"""
from __future__ import annotations

import re
import sys
from importlib import metadata

# distribution -> the major.minor releases that ran (Python: the interpreter)
CHECKED = {
    "python": ("3.11", "3.12"),
    "torch": ("2.10", "2.11", "2.13"),
    "transformers": ("4.57", "5.14", "5.17"),
    "numpy": ("1.26", "2.5"),
}


def installed_version(name: str) -> str | None:
    if name == "python":
        return ".".join(map(str, sys.version_info[:3]))
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def unchecked_versions() -> list[str]:
    """One line per installed dependency whose release is outside CHECKED, e.g. 'torch 2.9.1 (checked: ...)'."""
    lines = []
    for name, releases in CHECKED.items():
        version = installed_version(name)
        release = re.match(r"\d+\.\d+", version or "")
        if release and release.group() not in releases:
            lines.append(f"{name} {version} (this release ran with {', '.join(releases)})")
    return lines


def version_warning(program: str) -> str | None:
    """What `program` prints at start-up when something installed was never run with this release."""
    lines = unchecked_versions()
    if not lines:
        return None
    return (f"{program}: warning: not checked with this release: {'; '.join(lines)}. It may work; if it fails, "
            "install a checked version (docs/verified.md).")
