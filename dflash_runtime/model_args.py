"""Reading a Triton Python model's `args` (a plain dict; no Triton import needed).

Artifact paths in a rendered model repository are relative to the repository root, so a build can
be moved or mounted anywhere (a PersistentVolumeClaim in Kubernetes, a folder here).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

# The launcher's drain protocol: on SIGTERM dflash-serve creates this file before it signals
# tritonserver. Triton tells a Python model nothing until it unloads it, which happens only after
# in-flight requests end; the engine loop watches the file, refuses new requests, and fails the ones
# still running after DRAIN_SECONDS so every client gets a final response and the server exits cleanly.
DRAIN_FILE_ENV = "DFLASH_DRAIN_FILE"
DRAIN_SECONDS_ENV = "DFLASH_DRAIN_SECONDS"


def model_parameters(args: dict) -> dict[str, str]:
    config = json.loads(args["model_config"])
    return {key: value["string_value"] for key, value in config.get("parameters", {}).items()}


def artifact_path(args: dict, value: str) -> Path:
    """A path from a model's parameters; relative paths start at the model repository root."""
    path = Path(value)
    # args["model_repository"] is this model's own folder inside the repository
    return path if path.is_absolute() else (Path(args["model_repository"]).parent / path).resolve()


def drained_path(drain_file: Path) -> Path:
    """The file the model creates once draining left it no requests: the launcher may stop the server."""
    return drain_file.with_name(drain_file.name + ".done")


def drain_signal() -> tuple[Path, float] | None:
    """(file whose appearance means "drain", seconds to let requests finish), when launched by dflash-serve."""
    path = os.environ.get(DRAIN_FILE_ENV)
    return (Path(path), float(os.environ.get(DRAIN_SECONDS_ENV, "0"))) if path else None
