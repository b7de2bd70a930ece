"""A build folder, as builder/build.py writes it and the server, tools and deployment read it.

    <build>/
      target/            the target checkpoint (a ModelOpt unified HF checkpoint when quantized)
      drafter/           the DFlash drafter (z-lab format), absent without one
      model_repository/  the Triton model repository rendered for this build
      extra_llm_api_options.yaml   (--runtime trtllm) options for trtllm-serve
      manifest.json      inputs with hashes, options, versions, reports; `build_key` identifies it
"""
from __future__ import annotations

import hashlib
import json
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from . import DFlashError
from .presets import PRESETS

REPO_ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = REPO_ROOT / "model_repository"  # the Triton model templates a build renders

TARGET_DIR = "target"
DRAFTER_DIR = "drafter"
REPOSITORY_DIR = "model_repository"
TRTLLM_OPTIONS_FILE = "extra_llm_api_options.yaml"
MANIFEST_FILE = "manifest.json"
SERVED_MODEL_NAME_ENV = "DFLASH_SERVED_MODEL_NAME"  # dflash-serve --served-model-name, to the models' processes
VERIFY_PROFILE_FILE = "verify_profile.json"  # step seconds by batch size and verify length, for block size auto


def in_build(name: str) -> str:
    """How a build's own files name another of its parts: "./target", relative to the build folder, so a
    build can move (a volume, a container). The "./" tells it apart from a Hugging Face repo id."""
    return f"./{name}"


def resolve_in_build(value: str, build: Path) -> str:
    """A path written by in_build() made absolute under `build`, where the build is now; anything else
    (an absolute path, a repo id) as it is."""
    return str(build.resolve() / value[2:]) if value.startswith("./") else value


@dataclass(frozen=True)
class BuildManifest:
    folder: Path
    data: dict

    @property
    def target_dir(self) -> Path:
        return self.folder / self.data["artifacts"]["target"]

    @property
    def drafter_dir(self) -> Path | None:
        drafter = self.data["artifacts"]["drafter"]
        return self.folder / drafter if drafter else None

    @property
    def repository_dir(self) -> Path:
        return self.folder / self.data["artifacts"]["model_repository"]

    @property
    def options(self) -> dict:
        return self.data["options"]

    @property
    def reasoning_parser(self) -> str | None:
        """The gateway's reasoning parser (presets.REASONING_PARSERS), None for none (and for builds made before)."""
        return self.options.get("reasoning_parser")

    @property
    def model_id(self) -> str:
        """The name clients call the build by (the OpenAI API's model id): its target preset, or the target
        directory's name."""
        target = self.options["target"]
        return target if target in PRESETS else Path(target).name


def read_manifest(build: str | Path) -> BuildManifest:
    path = Path(build) / MANIFEST_FILE
    if not path.is_file():
        raise DFlashError(f"{build} is not a build: no {MANIFEST_FILE} (make one with builder/build.py)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DFlashError(f"{path}: not valid JSON ({e})") from None
    missing = [key for key in ("build_key", "artifacts", "options") if key not in data]
    if missing:
        raise DFlashError(f"{path}: not a build manifest (no {', '.join(missing)})")
    return BuildManifest(Path(build), data)


def served_name(repository: Path) -> str:
    """The name the build is served under, in the OpenAI API and in every metric's model_name label: dflash-serve's
    --served-model-name (SERVED_MODEL_NAME_ENV), else the build's model_id (its manifest, beside the repository),
    else the build folder's name."""
    if os.environ.get(SERVED_MODEL_NAME_ENV):
        return os.environ[SERVED_MODEL_NAME_ENV]
    try:
        return read_manifest(repository.parent).model_id
    except DFlashError:
        return repository.parent.name


def file_hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder` (compiled Python caches aside), by relative path."""
    hashes = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
        hashes[str(path.relative_to(folder))] = digest.hexdigest()
    return hashes


def project_version() -> str:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]


def build_key(options: dict, input_hashes: dict, templates: Path = TEMPLATES) -> str:
    """What a build depends on: its options, its input files, the templates it renders and the
    project version. An existing build with the same key is reused."""
    blob = json.dumps({"options": options, "inputs": input_hashes, "templates": file_hashes(templates),
                       "version": project_version()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()
