"""Reading a Triton Python model's `args` (a plain dict; no Triton import needed).

Artifact paths in a rendered model repository are relative to the repository root, so a build can
be moved or mounted anywhere (a PersistentVolumeClaim in Kubernetes, a folder here).
"""
from __future__ import annotations

import json
from pathlib import Path

from dflash_contract.layout import served_name


def model_parameters(args: dict) -> dict[str, str]:
    config = json.loads(args["model_config"])
    return {key: value["string_value"] for key, value in config.get("parameters", {}).items()}


def artifact_path(args: dict, value: str) -> Path:
    """A path from a model's parameters; relative paths start at the model repository root."""
    path = Path(value)
    # args["model_repository"] is this model's own folder inside the repository
    return path if path.is_absolute() else (Path(args["model_repository"]).parent / path).resolve()


def served_model_name(args: dict) -> str:
    """What the metrics' model_name label calls the model: the name it is served under (layout.served_name)."""
    return served_name(Path(args["model_repository"]).parent)
