"""The processes dflash-serve runs and watches: tritonserver (the NGC image's, or the one bundled in the
`nvidia-pytriton` wheel with a backend directory laid out for it), its Python backend stubs, and the OpenAI gateway.

The bundled server: the wheel ships the backend stub per Python version, so we lay out a backend directory with
the stub, put the wheel's libraries on LD_LIBRARY_PATH, and make the stub's embedded Python see this environment's
packages (the stub links the system libpython, not this interpreter).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from dflash_contract.engine_counts import ENGINE_COUNTS_FILE_ENV
from dflash_contract.server import (ABORT_SECONDS, DRAIN_SECONDS, DRAIN_SLACK_S, EXIT_TIMEOUT_S, FLUSH_SECONDS,
                                    GATEWAY_HEALTH_PATH, HANG_FLOOR_SECONDS, METRICS_PATH, NOT_READY_CHECKS,
                                    OPENAI_API_KEY_ENV, READY_PATH, STREAMS_END_SECONDS, UNHEALTHY_EXIT_CODE,
                                    StepProgress, acknowledged_path)

ANY_ADDRESS = "0.0.0.0"  # tritonserver's default: every interface
DRAIN_FILE = "draining"
PROGRESS_FILE = "engine-progress"
COUNTS_FILE = "engine-counts"
FAILURE_FILE = "engine-failed"
STREAM_ENDING_MODEL = "dflash_bls"  # the model that ends its streams with the cause of a failure
STUB_BINARY = "triton_python_backend_stub"
SOUND_STUB_PYTHON = "3.11"  # the one Python whose stub of nvidia-pytriton 0.7.0 serves our models without a crash
SHM_DIR = Path("/dev/shm")


class ServeError(RuntimeError):
    """Why dflash-serve could not start or keep a server: its message is the line the user sees."""


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


def bundled_server(runtime: Path) -> tuple[Path, dict[str, str]]:
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
        say(f"warning: the CPU tritonserver's Python {version} backend stub crashes when a client cancels a stream "
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
                  reasoning_parser: str | None = None, default_max_tokens: int | None = None,
                  counts_file: Path | None = None) -> Gateway:
    """Start the gateway on host:port (port 0: a free one) for the tritonserver at grpc_url, and wait until it serves.
    target_dir: the target checkpoint whose chat template and tokenizer the gateway uses (gateway_target_dir);
    reasoning_parser: the build's (build_reasoning_parser); default_max_tokens: None, the gateway's own; counts_file:
    the engine's counts (dflash_contract.engine_counts), which its /metrics serves to a router."""
    env = {k: v for k, v in os.environ.items() if k not in (OPENAI_API_KEY_ENV, ENGINE_COUNTS_FILE_ENV)}
    if counts_file is not None:
        env[ENGINE_COUNTS_FILE_ENV] = str(counts_file)
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
    gateway = Gateway(process, f"http://{reachable(host)}:{bound_port}")
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
        return f"{reachable(self.host)}:{self.ports['http']}"

    @property
    def grpc_url(self) -> str:
        return f"{reachable(self.host)}:{self.ports['grpc']}"

    @property
    def metrics_url(self) -> str:
        return f"http://{reachable(self.host)}:{self.ports['metrics']}{METRICS_PATH}"

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
        say(f"draining: new requests are refused, requests in flight may finish for up to {self.drain_seconds:g} s")
        if self.gateway is not None:
            self.gateway.stop_accepting()
        drain_file = self.runtime_dir / DRAIN_FILE
        drain_file.touch()
        # the dflash model says when it has no request left; metrics gauges lag behind it
        drained = self._acknowledged(drain_file, self.drain_seconds + DRAIN_SLACK_S)
        say(f"{'no request left' if drained else 'the drain timed out'} after {time.monotonic() - started:.1f} s; "
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
            say(f"{STREAM_ENDING_MODEL} did not end its streams within {STREAMS_END_SECONDS} s; they end unanswered")

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


def say(message: str) -> None:
    print(f"dflash-serve: {message}", file=sys.stderr, flush=True)


def reachable(host: str, every_interface: str = "localhost") -> str:
    """Where this machine reaches a server bound to `host` (an address of every interface: `every_interface`)."""
    return every_interface if host in (ANY_ADDRESS, "::", "") else f"[{host}]" if ":" in host else host
