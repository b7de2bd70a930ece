"""Render the model repository templates (`model_repository/`) into a build.

Templates are the repository's own files with `${name}` placeholders in their config.pbtxt (the
tensorrtllm_backend convention); model.py files are copied as they are. Every rendered config is
parsed with Triton's ModelConfig protobuf, so a typo fails the build, not the server start.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

from dflash_contract import DFlashError
from dflash_contract.layout import TEMPLATES

# The PyTorch-runtime repository: what each user request flows through, in order, and the two front
# models over them (dflash_bls: the ensemble's pipeline, cancellable).
TORCH_MODELS = ("preprocessing", "dflash", "postprocessing", "ensemble", "dflash_bls")
PLACEHOLDER = re.compile(r"\$\{(\w+)\}")


def fill(text: str, values: dict[str, object], where: str) -> str:
    missing = sorted({m for m in PLACEHOLDER.findall(text) if m not in values})
    if missing:
        raise DFlashError(f"{where}: no value for placeholder(s) {', '.join(missing)}")
    return PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), text)


def parse_model_config(path: Path):
    """A config.pbtxt parsed with Triton's own ModelConfig protobuf (shipped in tritonclient)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    try:
        return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
    except text_format.ParseError as e:
        raise DFlashError(f"{path}: not a valid Triton model config: {e}") from None


def render_repository(output: Path, values: dict[str, object], models: tuple[str, ...] = TORCH_MODELS,
                      templates: Path = TEMPLATES) -> list[Path]:
    """Copy `models` from `templates` into `output`, filling every config.pbtxt; returns the configs."""
    configs = []
    for model in models:
        source = templates / model
        if not (source / "config.pbtxt").is_file():
            raise DFlashError(f"model template {source} has no config.pbtxt")
        target = output / model
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        config = target / "config.pbtxt"
        config.write_text(fill(config.read_text(), values, str(source / "config.pbtxt")))
        parsed = parse_model_config(config)
        if parsed.name != model:
            raise DFlashError(f"{config}: model name {parsed.name!r} differs from its folder {model!r}")
        configs.append(config)
    return configs
