"""dflash-serve: run a real `tritonserver` on a rendered model repository.

On a GPU machine (the NGC Triton TensorRT-LLM container) `tritonserver` is on PATH with its own
backends. Elsewhere the server binary and Python backend bundled in the `nvidia-pytriton` wheel are
used: the wheel ships the backend stub per Python version, so we lay out a backend directory with
the 3.11 stub, put the wheel's libraries on LD_LIBRARY_PATH, and make the stub's embedded Python
see this environment's packages (the stub links the system libpython, not this interpreter).

Once tritonserver is ready, dflash-serve watches it (dflash_contract.server: the health watch): when a
model's backend process or the engine dies, it stops tritonserver and exits non-zero, so that the
container is restarted, since Triton itself never restarts a backend process.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from dflash_contract import DFlashError
from dflash_contract.layout import read_manifest, resolve_in_build
from dflash_contract.protocol import range_error
from dflash_contract.server import (ABORT_SECONDS, DRAIN_FILE_ENV, DRAIN_SECONDS, DRAIN_SECONDS_ENV, DRAIN_SLACK_S,
                                    EXIT_TIMEOUT_S, FAILURE_FILE_ENV, FLUSH_SECONDS, GATEWAY_HEALTH_PATH,
                                    HANG_FLOOR_SECONDS, HANG_STEP_MULTIPLE, HEALTH_CHECK_SECONDS, METRICS_PATH,
                                    NOT_READY_CHECKS, OPENAI_API_KEY_ENV, PORTS, PROGRESS_FILE_ENV, QUEUE_TIMEOUT_ENV,
                                    QUEUE_TIMEOUT_SECONDS, READY_PATH, STREAMS_END_SECONDS, UNHEALTHY_EXIT_CODE,
                                    StepProgress, acknowledged_path)
from dflash_contract.versions import version_warning

from .ports import PortError, pick_ports

ANY_ADDRESS = "0.0.0.0"  # tritonserver's default: every interface
DRAIN_FILE = "draining"
PROGRESS_FILE = "engine-progress"
FAILURE_FILE = "engine-failed"
STREAM_ENDING_MODEL = "dflash_bls"  # the model that ends its streams with the cause of a failure
STUB_BINARY = "triton_python_backend_stub"
SOUND_STUB_PYTHON = "3.11"  # the one Python whose stub of nvidia-pytriton 0.7.0 serves our models without a crash
SHM_DIR = Path("/dev/shm")
# The NGC image nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3 ships TensorRT-LLM's LLM-API Triton
# model code (model.py + helpers.py, matched to the tensorrt_llm inside the image) here. A `--runtime
# trtllm` build has only our model.yaml beside it: the launcher adds the image's code (see
# stage_trtllm_repository), so the code always matches the installed library.
TRTLLM_MODEL_CODE = Path("/app/all_models/llmapi/tensorrt_llm/1")
TRTLLM_MODEL = "tensorrt_llm"


class ServeError(RuntimeError):
    pass


def stub_python(version: str) -> tuple[Path, str | None]:
    """(the python for the backend stub's prefix, the folder of its libpython where the loader would not find it).
    The system's python of this version first: the stub finds its libpython where the loader looks (this
    environment's own python may be another build of the version, whose extension modules do not link against it);
    else this environment's base python, where it was built with a shared libpython (pyenv's, `--enable-shared`)."""
    system = Path(f"/usr/bin/python{version}")
    if system.exists():
        return system, None
    base = Path(sysconfig.get_config_var("BINDIR")) / f"python{version}"
    if sysconfig.get_config_var("Py_ENABLE_SHARED") and base.exists():
        return base, sysconfig.get_config_var("LIBDIR")
    raise ServeError(f"the Python backend stub needs a Python {version} with a shared libpython: the system's "
                     f"({system}: apt install python{version}), or a build with --enable-shared")


def _bundled_server(runtime: Path) -> tuple[Path, dict[str, str]]:
    """(tritonserver binary, extra environment) from the nvidia-pytriton wheel; backends go into `runtime`."""
    try:
        import pytriton
    except ImportError:
        raise ServeError("no `tritonserver` on PATH and the nvidia-pytriton package is not installed "
                         "(pip install nvidia-pytriton==0.7.0 on Python 3.11 or 3.12: it needs numpy<2, which has "
                         "no wheel for 3.13; or run in the NGC Triton container)") from None
    root = Path(pytriton.__file__).parent / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise ServeError(f"nvidia-pytriton ships no Python backend stub for Python {version}")
    if version != SOUND_STUB_PYTHON:
        _say(f"warning: the CPU tritonserver's Python {version} backend stub crashes when a client cancels a stream "
             f"(seen on 3.12: a segfault in libpython, a thread of the stub's own; the server then exits with status "
             f"{UNHEALTHY_EXIT_CODE} to be restarted); on a CPU, serve with Python {SOUND_STUB_PYTHON}")
    backend = runtime / "backends" / "python"
    backend.mkdir(parents=True)
    for source in (root / "backends" / "python").iterdir():
        (backend / source.name).symlink_to(source)
    (backend / stub.name).symlink_to(stub)
    # The stub embeds a libpython of this version in isolated mode (PYTHONPATH is ignored) and takes
    # its prefix from the `python3` found on PATH. So we put a tiny virtual environment first on PATH:
    # a python whose standard library matches the libpython the stub links (stub_python), whose
    # site-packages holds one .pth that adds this environment's site directories (with their own .pth
    # files: editable installs).
    shim = runtime / "python"
    (shim / "bin").mkdir(parents=True)
    python, libdir = stub_python(version)
    (shim / "bin" / "python3").symlink_to(python)
    (shim / "pyvenv.cfg").write_text(f"home = {python.parent}\ninclude-system-site-packages = false\n")
    site = shim / "lib" / f"python{version}" / "site-packages"
    site.mkdir(parents=True)
    site_dirs = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    (site / "dflash_serve_environment.pth").write_text(
        "import site; " + "; ".join(f"site.addsitedir({d!r})" for d in site_dirs) + "\n")
    libs = Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs"
    env = {
        "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(libs), libdir, os.environ.get("LD_LIBRARY_PATH")])),
        "PATH": os.pathsep.join([str(shim / "bin"), os.environ.get("PATH", "")]),
    }
    return root / "bin" / "tritonserver", env


@dataclass(frozen=True)
class BackendProcess:
    """A Python backend stub of tritonserver: the process that runs one instance of a Python model."""

    pid: int
    start_time: str  # from /proc: tells the process apart from a later one that reuses its pid
    model: str
    shm_region: str  # its shared-memory file, which a killed server leaves behind in /dev/shm

    def alive(self) -> bool:
        stat = _proc_stat(self.pid)
        # tritonserver 2.51 never reaps a dead stub: it stays a zombie
        return stat is not None and stat[0] not in "ZX" and stat[19] == self.start_time


def _proc_stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat from the state on (state, ppid, pgrp, ...; starttime at 19), None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def backend_processes(server_pid: int) -> list[BackendProcess]:
    """The Python backend stubs tritonserver runs (its children; none where there is no /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        stat = _proc_stat(int(entry.name)) if entry.name.isdigit() else None
        if stat is None or int(stat[1]) != server_pid:
            continue
        try:  # argv: the stub, <model>/<version>/model.py, its shared-memory region, ...
            args = [a.decode(errors="replace") for a in (entry / "cmdline").read_bytes().split(b"\0")]
        except OSError:
            continue
        if len(args) > 2 and Path(args[0]).name == STUB_BINARY:
            found.append(BackendProcess(int(entry.name), stat[19], Path(args[1]).parent.parent.name, args[2]))
    return found


@dataclass
class Gateway:
    """The OpenAI-compatible gateway (the `gateway` package), a process of its own beside tritonserver: no
    torch in it, and its death is seen like a backend's."""

    process: subprocess.Popen
    url: str  # http://HOST:PORT

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop_accepting(self) -> None:
        """SIGTERM: uvicorn stops accepting and lets open requests finish (up to its graceful seconds)."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout: float) -> None:
        self.stop_accepting()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_gateway(grpc_url: str, model_id: str, port: int, api_key: str | None, graceful_seconds: float,
                  timeout: float = 60, target_dir: Path | None = None, host: str = ANY_ADDRESS,
                  reasoning_parser: str | None = None, default_max_tokens: int | None = None) -> Gateway:
    """Start the gateway on host:port (port 0: a free one) for the tritonserver at grpc_url, and wait until it serves.
    target_dir: the target checkpoint whose chat template and tokenizer the gateway uses (gateway_target_dir);
    reasoning_parser: the build's (build_reasoning_parser); default_max_tokens: None, the gateway's own."""
    env = {k: v for k, v in os.environ.items() if k != OPENAI_API_KEY_ENV}
    if api_key:
        env[OPENAI_API_KEY_ENV] = api_key  # not in argv, where ps would show it
    command = [sys.executable, "-m", "gateway.main", "--triton-url", grpc_url, "--model-id", model_id,
               "--host", host, "--port", str(port), "--graceful-seconds", str(graceful_seconds)]
    if target_dir is not None:
        command += ["--target-dir", str(target_dir)]
    if reasoning_parser is not None:
        command += ["--reasoning-parser", reasoning_parser]
    if default_max_tokens is not None:
        command += ["--default-max-tokens", str(default_max_tokens)]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline()  # "dflash-gateway: listening on http://HOST:PORT ...", or nothing if it died
    if "listening on http://" not in line:
        try:  # its exit code, when it ended by itself
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        said = line.strip() or "it said nothing; its error output went to dflash-serve's stderr"
        raise ServeError(f"the OpenAI gateway did not start (exit code {process.returncode}): {said}")
    # its output is log (stderr): stdout's first line stays dflash-serve's "ready: ..."
    print(line, end="", file=sys.stderr, flush=True)
    threading.Thread(target=lambda: [print(out, end="", file=sys.stderr, flush=True) for out in process.stdout],
                     daemon=True).start()
    bound_port = int(line.split("listening on http://", 1)[1].split()[0].rsplit(":", 1)[1])
    gateway = Gateway(process, f"http://{_reachable(host)}:{bound_port}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and gateway.alive():
        try:
            with urllib.request.urlopen(gateway.url + GATEWAY_HEALTH_PATH, timeout=2) as r:
                if r.status == 200:
                    return gateway
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    gateway.stop(5)
    raise ServeError(f"the OpenAI gateway at {gateway.url} did not answer {GATEWAY_HEALTH_PATH} within {timeout:.0f} s")


def model_id(repository: Path) -> str:
    """The id the gateway serves the build under: the target preset's name, else the target directory's name
    (from the build's manifest, beside the repository); without one, the build folder's name."""
    try:
        return read_manifest(repository.parent).model_id
    except DFlashError:
        return repository.parent.name


def build_reasoning_parser(repository: Path) -> str | None:
    """The reasoning parser the build names for the gateway (its manifest, beside the repository); None without."""
    try:
        return read_manifest(repository.parent).reasoning_parser
    except DFlashError:
        return None


def gateway_target_dir(repository: Path) -> Path | None:
    """The build's target checkpoint, for a repository whose front model takes raw text only (TensorRT-LLM's
    LLM-API model): the gateway templates conversations and counts tokens with it. None otherwise."""
    if not (repository / TRTLLM_MODEL).is_dir():
        return None
    try:
        return read_manifest(repository.parent).target_dir
    except DFlashError:
        return None


@dataclass
class TritonServer:
    """A running tritonserver process and where to reach it."""

    process: subprocess.Popen
    ports: dict[str, int]
    log_path: Path | None
    runtime_dir: Path  # the drain file (and the bundled server's backends); removed on stop
    drain_seconds: float = DRAIN_SECONDS
    backends: list[BackendProcess] = field(default_factory=list)  # watched once the server is ready
    gateway: Gateway | None = None  # the OpenAI-compatible gateway, when started
    progress: StepProgress | None = None  # the dflash engine loop's, when the repository has one
    hang_seconds: float = HANG_FLOOR_SECONDS  # the least a step may run before it counts as hung
    host: str = ANY_ADDRESS  # the address every port is bound to
    _not_ready_checks: int = 0

    @property
    def http_url(self) -> str:
        return f"{_reachable(self.host)}:{self.ports['http']}"

    @property
    def grpc_url(self) -> str:
        return f"{_reachable(self.host)}:{self.ports['grpc']}"

    @property
    def metrics_url(self) -> str:
        return f"http://{_reachable(self.host)}:{self.ports['metrics']}{METRICS_PATH}"

    @property
    def failure_file(self) -> Path:
        return self.runtime_dir / FAILURE_FILE

    def is_ready(self) -> bool:
        return self.readiness() is True

    def readiness(self) -> bool | None:
        """tritonserver's answer to READY_PATH; None when it did not answer."""
        try:
            with urllib.request.urlopen(f"http://{self.http_url}{READY_PATH}", timeout=2) as r:
                return r.status == 200
        except urllib.error.HTTPError:
            return False
        except (urllib.error.URLError, OSError):
            return None

    def health_problem(self) -> str | None:
        """Why this server can serve no more (dflash_contract.server: the health watch), or None."""
        if self.failure_file.exists():
            return f"the dflash engine stopped ({self.failure_file.read_text(errors='replace')})"
        if self.gateway is not None and not self.gateway.alive():
            return f"the OpenAI gateway exited (code {self.gateway.process.returncode})"
        dead = [b for b in self.backends if not b.alive()]
        if dead:
            return "; ".join(f"the backend process of model {b.model!r} (pid {b.pid}) died" for b in dead)
        hung = self.progress.hung(self.hang_seconds) if self.progress is not None else None
        if hung:
            return hung
        # Triton's own verdict (a dead backend from 26.01, the model's is_ready from 26.03). Only an
        # answer counts: a server too busy to answer in time is not a dead one.
        ready = self.readiness()
        self._not_ready_checks = self._not_ready_checks + 1 if ready is False else 0
        if self._not_ready_checks >= NOT_READY_CHECKS:
            return f"tritonserver answers {READY_PATH}: not ready"
        return None

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.stop()
                raise ServeError(f"tritonserver exited with code {self.process.returncode} before it was ready"
                                 + self._log_hint())
            if self.is_ready():
                return
            time.sleep(0.25)
        self.stop()
        raise ServeError(f"tritonserver was not ready after {timeout:.0f} s" + self._log_hint())

    def shut_down(self) -> None:
        """Drain (requests finish, or end with an error after drain_seconds), then SIGTERM tritonserver. The
        gateway stops accepting first and exits once its open requests ended with the drain."""
        started = time.monotonic()
        _say(f"draining: new requests are refused, requests in flight may finish for up to {self.drain_seconds:g} s")
        if self.gateway is not None:
            self.gateway.stop_accepting()
        drain_file = self.runtime_dir / DRAIN_FILE
        drain_file.touch()
        # the dflash model says when it has no request left; metrics gauges lag behind it
        drained = self._acknowledged(drain_file, self.drain_seconds + DRAIN_SLACK_S)
        _say(f"{'no request left' if drained else 'the drain timed out'} after {time.monotonic() - started:.1f} s; "
             f"stopping tritonserver (models unload within {EXIT_TIMEOUT_S} s)")
        time.sleep(FLUSH_SECONDS)
        if self.gateway is not None:
            self.gateway.stop(FLUSH_SECONDS + DRAIN_SLACK_S)
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def stop(self) -> int:
        """Shut down cleanly; SIGKILL if tritonserver has not exited well after its exit timeout."""
        if self.process.poll() is None:
            self.shut_down()
            try:
                self.process.wait(EXIT_TIMEOUT_S + 15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._clean_up()
        return self.process.returncode

    def abort(self, cause: str) -> bool:
        """Stop now, for a server that cannot serve: what a dead backend held never completes, and
        tritonserver's graceful exit waits for it (measured on 2.51: past its exit timeout). True if
        tritonserver ended by itself first (2.51 sometimes aborts when a stub dies: its streams end unanswered)."""
        if not self.failure_file.exists():  # tells dflash_bls, which ends its streams with it
            self.failure_file.write_text(cause)
        if self.process.poll() is None:
            self._wait_for_streams_ended()
            time.sleep(FLUSH_SECONDS)  # for those final errors to leave
            if self.gateway is not None:
                self.gateway.stop(FLUSH_SECONDS)
        ended_by_itself = self.process.poll() is not None
        if not ended_by_itself:
            self.process.send_signal(signal.SIGTERM)  # it stops listening at once: probes and clients see it
            try:
                self.process.wait(ABORT_SECONDS)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._clean_up()
        return ended_by_itself

    def _wait_for_streams_ended(self) -> None:
        """Until dflash_bls has handed every stream in flight its final error (at most STREAMS_END_SECONDS)."""
        if not any(b.model == STREAM_ENDING_MODEL and b.alive() for b in self.backends):
            return  # nobody to wait for
        if not self._acknowledged(self.failure_file, STREAMS_END_SECONDS) and self.process.poll() is None:
            _say(f"{STREAM_ENDING_MODEL} did not end its streams within {STREAMS_END_SECONDS} s; they end unanswered")

    def _acknowledged(self, signal_file: Path, seconds: float) -> bool:
        """Whether a model acknowledged `signal_file` (acknowledged_path) within `seconds`, while tritonserver runs."""
        done, deadline = acknowledged_path(signal_file), time.monotonic() + seconds
        while not done.exists() and time.monotonic() < deadline and self.process.poll() is None:
            time.sleep(0.05)
        return done.exists()

    def _clean_up(self) -> None:
        if self.gateway is not None:
            self.gateway.stop(ABORT_SECONDS)
        self._reap_group()
        for backend in self.backends:  # a killed server's backends never removed their shared memory
            if "/" not in backend.shm_region:
                with contextlib.suppress(OSError):
                    (SHM_DIR / backend.shm_region).unlink()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)

    def _reap_group(self) -> None:
        """Python backend stubs left behind when tritonserver exits past its exit timeout."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def _log_hint(self) -> str:
        tail = "\n".join(self.log().splitlines()[-30:])
        return f"\n--- server log ({self.log_path}) ---\n{tail}" if tail else ""

    def __enter__(self) -> "TritonServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _say(message: str) -> None:
    print(f"dflash-serve: {message}", file=sys.stderr, flush=True)


def _reachable(host: str) -> str:
    """Where this machine reaches a server bound to `host`."""
    return "localhost" if host in (ANY_ADDRESS, "::", "") else f"[{host}]" if ":" in host else host


def stage_trtllm_repository(repository: Path, runtime: Path, model_code: Path = TRTLLM_MODEL_CODE) -> Path:
    """The repository to serve: `repository` itself, or, for a TensorRT-LLM build whose LLM-API model has
    no code yet, a copy in `runtime` (files linked, the build stays read-only) with the image's model
    code added beside our model.yaml."""
    version_dir = Path(TRTLLM_MODEL) / "1"
    if not (repository / version_dir / "model.yaml").is_file() or (repository / version_dir / "model.py").is_file():
        return repository
    if not (model_code / "model.py").is_file():
        raise ServeError(
            f"{repository} is a TensorRT-LLM build and {model_code / 'model.py'} does not exist: the LLM-API model "
            "code comes with the NGC image nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3 (at "
            f"{TRTLLM_MODEL_CODE}); run dflash-serve inside it, or pass --trtllm-model-code with the directory "
            "holding model.py and helpers.py from TensorRT-LLM's triton_backend/all_models/llmapi/tensorrt_llm/1/ "
            "at the tag of the installed tensorrt_llm")
    staged = runtime / "model_repository"
    shutil.copytree(repository, staged, copy_function=os.symlink)
    for source in sorted(model_code.glob("*.py")):
        shutil.copyfile(source, staged / version_dir / source.name)
    model_yaml = staged / version_dir / "model.yaml"
    text = model_yaml.read_text()
    model_yaml.unlink()  # a link into the build, which stays as it is
    model_yaml.write_text(_llmapi_paths_resolved(text, repository.resolve().parent))
    return staged


def _llmapi_paths_resolved(text: str, build: Path) -> str:
    """model.yaml with the build's own paths ("./target", "./drafter": relative to the build folder, so a
    build can move) made absolute where the build is now: upstream's model.py hands `model` and
    `speculative_model` to LLM(), which would resolve them against tritonserver's working directory."""
    import yaml

    config = yaml.safe_load(text)
    speculative = config.get("speculative_config") or {}
    for section, key in ((config, "model"), (speculative, "speculative_model")):
        value = section.get(key)
        if isinstance(value, str):
            section[key] = resolve_in_build(value, build)
            if section[key] != value and not (Path(section[key]) / "config.json").is_file():
                raise ServeError(f"the TensorRT-LLM build names {key} {value}, and {section[key]} holds no "
                                 "checkpoint: move a build folder whole (target/, drafter/ and model_repository/)")
    header = f"# staged by dflash-serve from {build}: the build's paths made absolute\n"
    return header + yaml.safe_dump(config, sort_keys=False)


def start_server(repository: str | Path, http_port: int = PORTS["http"], grpc_port: int = PORTS["grpc"],
                 metrics_port: int = PORTS["metrics"], log_path: Path | None = None, log_verbose: int = 0,
                 ready_timeout: float = 300, drain_seconds: float = DRAIN_SECONDS,
                 trtllm_model_code: Path = TRTLLM_MODEL_CODE, openai_port: int | None = None,
                 openai_api_key: str | None = None, hang_seconds: float = HANG_FLOOR_SECONDS,
                 queue_timeout: float = QUEUE_TIMEOUT_SECONDS, host: str = ANY_ADDRESS,
                 served_model_name: str | None = None, default_max_tokens: int | None = None) -> TritonServer:
    """Start tritonserver on `repository` and wait until it is ready, then the OpenAI gateway on openai_port
    (None: no gateway), serving the model as served_model_name (None: the build's target, model_id). Port 0 picks a
    free port. A dflash engine step running longer than max(HANG_STEP_MULTIPLE x its usual cost, hang_seconds)
    makes the server unhealthy; a request waiting longer than queue_timeout for a slot is refused (0: no bound).
    Every port is bound to `host`."""
    repository = Path(repository).resolve()
    if not repository.is_dir():
        raise ServeError(f"model repository {repository} does not exist (build one with builder/build.py)")
    wanted = {"http": http_port, "grpc": grpc_port, "metrics": metrics_port}
    if openai_port is not None:
        wanted["openai"] = openai_port
    try:  # every port at once, before anything loads: a busy one is refused now, not after the models
        picked = pick_ports({f"--{name}-port": port for name, port in wanted.items()}, host)
    except PortError as e:
        raise ServeError(str(e)) from None
    ports = {name: picked[f"--{name}-port"] for name in wanted}
    runtime = Path(tempfile.mkdtemp(prefix="dflash-serve-"))
    # from the build beside the repository, not the staged copy's runtime folder
    served_id, target_dir = served_model_name or model_id(repository), gateway_target_dir(repository)
    try:
        repository = stage_trtllm_repository(repository, runtime, Path(trtllm_model_code))
    except BaseException:
        shutil.rmtree(runtime, ignore_errors=True)
        raise
    progress = StepProgress.create(runtime / PROGRESS_FILE)  # all zeros: no step running, until the engine's first
    env = {**os.environ, DRAIN_FILE_ENV: str(runtime / DRAIN_FILE), DRAIN_SECONDS_ENV: str(drain_seconds),
           FAILURE_FILE_ENV: str(runtime / FAILURE_FILE), PROGRESS_FILE_ENV: str(runtime / PROGRESS_FILE),
           QUEUE_TIMEOUT_ENV: str(queue_timeout)}
    env.pop(OPENAI_API_KEY_ENV, None)  # the gateway's alone: the models' processes have no use for it
    binary = shutil.which("tritonserver")
    backend_args = []
    if binary is None:
        binary, extra_env = _bundled_server(runtime)
        env.update(extra_env)
        # the wheel's server is a CPU one: without these it asks CUDA for a pinned pool and DCGM/NVML for GPU metrics
        # at every start, and logs that both failed
        backend_args = [f"--backend-directory={runtime / 'backends'}", "--pinned-memory-pool-byte-size=0",
                        "--allow-gpu-metrics=false"]
    command = [str(binary), f"--model-repository={repository}", *backend_args,
               f"--http-address={host}", f"--http-port={ports['http']}", f"--grpc-address={host}",
               f"--grpc-port={ports['grpc']}", f"--metrics-address={host}", f"--metrics-port={ports['metrics']}",
               "--allow-metrics=true",
               f"--exit-timeout-secs={EXIT_TIMEOUT_S}", f"--log-verbose={log_verbose}"]
    # If this process dies without stopping the server (SIGKILL, OOM), the server gets SIGTERM rather
    # than living on as an orphan that holds the ports, memory and a core (found once: a killed test
    # run's server still decoding 50 minutes later). setpriv (util-linux) sets that up before the exec;
    # the signal follows the thread that starts the server, so start it from one that lives as long.
    setpriv = shutil.which("setpriv")
    if setpriv is not None:
        command = [setpriv, "--pdeathsig", "TERM", *command]
    log = open(log_path, "ab") if log_path else None
    # its own process group: backend stubs orphaned by an abrupt exit are reaped with the group
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT if log else None,
                               start_new_session=True)
    server = TritonServer(process, ports, log_path, runtime, drain_seconds, progress=progress,
                          hang_seconds=hang_seconds, host=host)
    try:
        server.wait_ready(ready_timeout)
        if openai_port is not None:
            server.gateway = start_gateway(server.grpc_url, served_id, ports["openai"], openai_api_key,
                                           drain_seconds + DRAIN_SLACK_S, target_dir=target_dir, host=host,
                                           reasoning_parser=build_reasoning_parser(repository),
                                           default_max_tokens=default_max_tokens)
    except BaseException:  # also SIGINT/SIGTERM while models load: never leave tritonserver behind
        process.kill()
        process.wait()
        server._reap_group()
        shutil.rmtree(runtime, ignore_errors=True)
        raise
    server.backends = backend_processes(process.pid)
    return server


def ready_line(server: TritonServer) -> str:
    """stdout's first line once serving: where each door listens (port 0 picked a free one)."""
    openai = f"  openai {server.gateway.url}/v1" if server.gateway else ""
    return f"ready: grpc {server.grpc_url}  http {server.http_url}  metrics {server.metrics_url}{openai}"


def ready_ports(line: str) -> dict[str, int]:
    """The ports a ready_line names, by door: {"grpc": ..., "http": ..., "metrics": ..., "openai": ...}."""
    return {door: int(port) for door, port in re.findall(r"(\w+) (?:http://)?\S+:(\d+)", line.removeprefix("ready:"))}


def supervise(server: TritonServer, shutdown: threading.Thread) -> int:
    """Serve until a signal starts `shutdown` (a drain), or until the server can serve no more: then
    stop it and exit non-zero (a new one must start: Triton does not restart dead backends)."""
    while server.process.poll() is None:
        # not while draining: models unload then, and their processes end (a drain may begin mid-check)
        problem = server.health_problem() if shutdown.ident is None else None
        if problem and shutdown.ident is None:
            _say(f"{problem}; stopping tritonserver so that the server is restarted")
            return _ended_on_its_own(server.process.returncode) if server.abort(problem) else UNHEALTHY_EXIT_CODE
        time.sleep(HEALTH_CHECK_SECONDS)
    code = server.stop()
    if shutdown.ident is not None:
        _say(f"stopped (tritonserver exit code {code})")
        return code
    return _ended_on_its_own(code)


def _ended_on_its_own(code: int) -> int:
    """dflash-serve's exit status for a tritonserver that ended without being asked: 128 + N for signal N."""
    _say(f"tritonserver ended on its own ({f'killed by signal {-code}' if code < 0 else f'exit code {code}'})")
    return 128 - code if code < 0 else UNHEALTHY_EXIT_CODE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dflash-serve",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Start tritonserver on a model repository rendered by builder/build.py, wait until it is "
                    "ready, and keep serving until interrupted (SIGINT/SIGTERM drain in-flight requests).",
        epilog="examples:\n"
               "  dflash-serve builds/smollm2-135m/model_repository\n"
               "  dflash-serve REPO --grpc-port 0 --http-port 0 --metrics-port 0 --openai-port 0   # free ports, "
               "printed once ready\n\n"
               "GPU: in nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3 the same command uses the container's "
               "tritonserver and backends.\n\n"
               "While serving it watches the models' backend processes, the engine (alive, and not stuck in a "
               "step: --hang-seconds) and Triton's readiness every "
               f"{HEALTH_CHECK_SECONDS:g} s;\non a failure it stops tritonserver and exits: run it under a supervisor "
               "that restarts it\n(Kubernetes, docker --restart on-failure, systemd).\n\n"
               "exit status: 0 stopped on request; 1 could not start (or tritonserver failed its own shutdown);\n"
               f"{UNHEALTHY_EXIT_CODE} a backend or the engine died, or tritonserver ended by itself; "
               "128+N tritonserver was killed by signal N.")
    parser.add_argument("repository", help="rendered model repository (<build>/model_repository)")
    parser.add_argument("--host", default=ANY_ADDRESS,
                        help="the address every port listens on (default: all interfaces); 127.0.0.1 keeps a "
                             "developer's server to this machine")
    parser.add_argument("--http-port", type=int, default=PORTS["http"], help="0 = pick a free port")
    parser.add_argument("--grpc-port", type=int, default=PORTS["grpc"], help="0 = pick a free port")
    parser.add_argument("--metrics-port", type=int, default=PORTS["metrics"], help="0 = pick a free port")
    parser.add_argument("--openai-port", type=int, default=PORTS["openai"],
                        help="the OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models); "
                             "0 = pick a free port")
    parser.add_argument("--no-openai", action="store_true", help="serve without the OpenAI-compatible API")
    parser.add_argument("--served-model-name", help="the model's id on the OpenAI API (/v1/models, a request's "
                        "`model`; vLLM's flag); default: the build's target preset, or its target directory's name")
    parser.add_argument("--default-max-tokens", type=int,
                        help="the OpenAI API's answer length for a chat request that sets none (default: the "
                             "gateway's, lowered to what the context leaves after the prompt)")
    parser.add_argument("--openai-api-key", default=os.environ.get(OPENAI_API_KEY_ENV) or None,
                        help=f"require this bearer token on the OpenAI API (default: ${OPENAI_API_KEY_ENV}; unset: "
                             "no key)")
    parser.add_argument("--log-verbose", type=int, default=0, help="tritonserver verbosity (0 = info)")
    parser.add_argument("--ready-timeout", type=float, default=600,
                        help="seconds to wait for readiness (default: 600)")
    parser.add_argument("--hang-seconds", type=float, default=HANG_FLOOR_SECONDS,
                        help=f"an engine step running longer than max(this, {HANG_STEP_MULTIPLE} x its usual cost) "
                             f"counts as a hung engine: the server stops, exit status {UNHEALTHY_EXIT_CODE} "
                             f"(default: {HANG_FLOOR_SECONDS:g})")
    parser.add_argument("--queue-timeout", type=float, default=QUEUE_TIMEOUT_SECONDS,
                        help="seconds a request may wait for a KV-cache slot before it is refused as UNAVAILABLE "
                             f"(retry later); 0 = no bound (default: {QUEUE_TIMEOUT_SECONDS:g})")
    parser.add_argument("--trtllm-model-code", type=Path, default=TRTLLM_MODEL_CODE,
                        help="--runtime trtllm builds: the directory of TensorRT-LLM's LLM-API model.py and helpers.py "
                             "(default: where the NGC trtllm image has them)")
    args = parser.parse_args(argv)
    error = args.default_max_tokens is not None and range_error("max_tokens", args.default_max_tokens)
    if error:  # the gateway's own check, made before the models load
        parser.error(f"--default-max-tokens: {error}")
    warning = version_warning("dflash-serve")
    if warning:
        print(warning, file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # while loading: stop it
    try:
        server = start_server(args.repository, args.http_port, args.grpc_port, args.metrics_port,
                              log_verbose=args.log_verbose, ready_timeout=args.ready_timeout,
                              trtllm_model_code=args.trtllm_model_code,
                              openai_port=None if args.no_openai else args.openai_port,
                              openai_api_key=args.openai_api_key, hang_seconds=args.hang_seconds,
                              queue_timeout=args.queue_timeout, host=args.host,
                              served_model_name=args.served_model_name, default_max_tokens=args.default_max_tokens)
    except ServeError as e:
        print(f"dflash-serve: {e}", file=sys.stderr)
        return 1
    print(ready_line(server), flush=True)
    # the drain takes seconds: run it beside the main thread, which keeps waiting for the process
    shutdown = threading.Thread(target=server.shut_down, daemon=True)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: shutdown.ident is None and shutdown.start())
    return supervise(server, shutdown)


if __name__ == "__main__":
    sys.exit(main())
