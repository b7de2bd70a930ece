"""dflash-serve: run a real `tritonserver` on a rendered model repository, and the OpenAI gateway beside it.

On a GPU machine (the NGC Triton TensorRT-LLM container) `tritonserver` is on PATH with its own
backends. Elsewhere the server binary and Python backend bundled in the `nvidia-pytriton` wheel are
used (server_process.bundled_server).

Once tritonserver is ready, dflash-serve watches it (dflash_contract.server: the health watch): when a
model's backend process or the engine dies, it stops tritonserver and exits non-zero, so that the
container is restarted, since Triton itself never restarts a backend process.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from dflash_contract import DFlashError
from dflash_contract.engine_counts import ENGINE_COUNTS_FILE_ENV, EngineCounts
from dflash_contract.layout import SERVED_MODEL_NAME_ENV, read_manifest, resolve_in_build, served_name
from dflash_contract.protocol import range_error
from dflash_contract.server import (DRAIN_FILE_ENV, DRAIN_SECONDS, DRAIN_SECONDS_ENV, DRAIN_SLACK_S, EXIT_TIMEOUT_S,
                                    FAILURE_FILE_ENV, HANG_FLOOR_SECONDS, HANG_STEP_MULTIPLE, HEALTH_CHECK_SECONDS,
                                    KV_EVENTS_ENDPOINT_ENV, KV_EVENTS_REPLAY_ENV, KV_EVENTS_TOPIC_ENV,
                                    OPENAI_API_KEY_ENV, PORTS, PROGRESS_FILE_ENV, QUEUE_TIMEOUT_ENV,
                                    QUEUE_TIMEOUT_SECONDS, UNHEALTHY_EXIT_CODE, StepProgress)
from dflash_contract.versions import version_warning

from .ports import PortError, pick_ports
from .server_process import (ANY_ADDRESS, COUNTS_FILE, DRAIN_FILE, FAILURE_FILE, PROGRESS_FILE, ServeError,
                             TritonServer, backend_processes, bundled_server, reachable, say, start_gateway)

# The NGC image nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3 ships TensorRT-LLM's LLM-API Triton
# model code (model.py + helpers.py, matched to the tensorrt_llm inside the image) here. A `--runtime
# trtllm` build has only our model.yaml beside it: the launcher adds the image's code (see
# stage_trtllm_repository), so the code always matches the installed library.
TRTLLM_MODEL_CODE = Path("/app/all_models/llmapi/tensorrt_llm/1")
TRTLLM_MODEL = "tensorrt_llm"


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
                 served_model_name: str | None = None, default_max_tokens: int | None = None,
                 kv_events_port: int | None = None, kv_events_replay_port: int | None = None,
                 kv_events_topic: str | None = None) -> TritonServer:
    """Start tritonserver on `repository` and wait until it is ready, then the OpenAI gateway on openai_port
    (None: no gateway), serving the model as served_model_name (None: the build's, layout.served_name): the OpenAI
    API's model id and the metrics' model_name label. Port 0 picks a free port. A dflash engine step running longer
    than max(HANG_STEP_MULTIPLE x its usual cost, hang_seconds) makes the server unhealthy; a request waiting longer
    than queue_timeout for a slot is refused (0: no bound).
    kv_events_port: publish the prefix cache's changes there (ZMQ PUB, dflash_serving/kv_events.py; None: not at
    all), replays on kv_events_replay_port, under kv_events_topic (default kv@<host name>@<served model>). Every port
    is bound to `host`."""
    repository = Path(repository).resolve()
    if not repository.is_dir():
        raise ServeError(f"model repository {repository} does not exist (build one with builder/build.py)")
    optional = {"openai": openai_port, "kv_events": kv_events_port, "kv_events_replay": kv_events_replay_port}
    ports = _ports({"http": http_port, "grpc": grpc_port, "metrics": metrics_port,
                    **{name: port for name, port in optional.items() if port is not None}}, host)
    runtime = Path(tempfile.mkdtemp(prefix="dflash-serve-"))
    # from the build beside the repository, not the staged copy's runtime folder
    served_id, target_dir = served_model_name or served_name(repository), gateway_target_dir(repository)
    try:
        repository = stage_trtllm_repository(repository, runtime, Path(trtllm_model_code))
    except BaseException:
        shutil.rmtree(runtime, ignore_errors=True)
        raise
    progress = StepProgress.create(runtime / PROGRESS_FILE)  # all zeros: no step running, until the engine's first
    EngineCounts.create(runtime / COUNTS_FILE)  # none until the engine's first: the gateway serves no counts yet
    env = _model_environment(runtime, drain_seconds, queue_timeout, served_id)
    if kv_events_port is not None:
        env.update(_kv_events_environment(ports, host, kv_events_topic or f"kv@{socket.gethostname()}@{served_id}"))
    command = _tritonserver_command(repository, runtime, env, ports, host, log_verbose)
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
                                           default_max_tokens=default_max_tokens, counts_file=runtime / COUNTS_FILE)
    except BaseException:  # also SIGINT/SIGTERM while models load: never leave tritonserver behind
        process.kill()
        process.wait()
        server._reap_group()
        shutil.rmtree(runtime, ignore_errors=True)
        raise
    server.backends = backend_processes(process.pid)
    return server


def _ports(wanted: dict[str, int], host: str) -> dict[str, int]:
    """Every port at once, before anything loads: a busy one is refused now, not after the models (0: a free one)."""
    flags = {name: f"--{name.replace('_', '-')}-port" for name in wanted}  # how a refusal names each
    try:
        picked = pick_ports({flags[name]: port for name, port in wanted.items()}, host)
    except PortError as e:
        raise ServeError(str(e)) from None
    return {name: picked[flags[name]] for name in wanted}


def _model_environment(runtime: Path, drain_seconds: float, queue_timeout: float, served_id: str) -> dict[str, str]:
    """The models' environment: where this launcher and they signal each other (dflash_contract.server), and the
    name their metrics label the model with."""
    env = {**os.environ, DRAIN_FILE_ENV: str(runtime / DRAIN_FILE), DRAIN_SECONDS_ENV: str(drain_seconds),
           FAILURE_FILE_ENV: str(runtime / FAILURE_FILE), PROGRESS_FILE_ENV: str(runtime / PROGRESS_FILE),
           QUEUE_TIMEOUT_ENV: str(queue_timeout), ENGINE_COUNTS_FILE_ENV: str(runtime / COUNTS_FILE),
           SERVED_MODEL_NAME_ENV: served_id}
    env.pop(OPENAI_API_KEY_ENV, None)  # the gateway's alone: the models' processes have no use for it
    return env


def _kv_events_environment(ports: dict[str, int], host: str, topic: str) -> dict[str, str]:
    """Where the dflash model publishes the prefix cache's changes (ZMQ endpoints; `*`: every interface)."""
    address = reachable(host, every_interface="*")
    env = {KV_EVENTS_ENDPOINT_ENV: f"tcp://{address}:{ports['kv_events']}", KV_EVENTS_TOPIC_ENV: topic}
    if "kv_events_replay" in ports:
        env[KV_EVENTS_REPLAY_ENV] = f"tcp://{address}:{ports['kv_events_replay']}"
    return env


def _tritonserver_command(repository: Path, runtime: Path, env: dict[str, str], ports: dict[str, int], host: str,
                          log_verbose: int) -> list[str]:
    """tritonserver's argv: the one on PATH, else the nvidia-pytriton wheel's (its backends laid out in `runtime`,
    what it needs added to `env`)."""
    binary = shutil.which("tritonserver")
    backend_args = []
    if binary is None:
        binary, extra_env = bundled_server(runtime)
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
    return command


def ready_line(server: TritonServer) -> str:
    """stdout's first line once serving: where each door listens (port 0 picked a free one)."""
    openai = f"  openai {server.gateway.url}/v1" if server.gateway else ""
    events = "".join(f"  {name} tcp://{reachable(server.host)}:{server.ports[name]}"
                     for name in ("kv_events", "kv_events_replay") if name in server.ports)
    return f"ready: grpc {server.grpc_url}  http {server.http_url}  metrics {server.metrics_url}{openai}{events}"


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
            say(f"{problem}; stopping tritonserver so that the server is restarted")
            return _ended_on_its_own(server.process.returncode) if server.abort(problem) else UNHEALTHY_EXIT_CODE
        time.sleep(HEALTH_CHECK_SECONDS)
    code = server.stop()
    if shutdown.ident is not None:
        say(f"stopped (tritonserver exit code {code})")
        return code
    return _ended_on_its_own(code)


def _ended_on_its_own(code: int) -> int:
    """dflash-serve's exit status for a tritonserver that ended without being asked: 128 + N for signal N."""
    say(f"tritonserver ended on its own ({f'killed by signal {-code}' if code < 0 else f'exit code {code}'})")
    return 128 - code if code < 0 else UNHEALTHY_EXIT_CODE


def build_parser() -> argparse.ArgumentParser:
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
    _add_kv_events_options(parser)
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
    return parser


def _add_kv_events_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("prefix-cache events, for a router (off by default)")
    group.add_argument("--kv-events-port", type=int,
                       help="publish the prefix cache's changes on this port, as vLLM publishes its KV-cache events "
                            "(ZMQ PUB, msgpack; for llm-d's precise prefix-cache routing); 0 = pick a free port; "
                            "default: off")
    group.add_argument("--kv-events-replay-port", type=int,
                       help="with --kv-events-port: answer replay requests there (ZMQ ROUTER, vLLM's replay)")
    group.add_argument("--kv-events-topic",
                       help="with --kv-events-port: the messages' topic (default: kv@<host name>@<served model>; "
                            "llm-d's picker (v0.7 and later) names a pod kv@<pod IP>:<the port it routes to>@<model>, "
                            "which the chart passes)")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    error = args.default_max_tokens is not None and range_error("max_tokens", args.default_max_tokens)
    if error:  # the gateway's own check, made before the models load
        parser.error(f"--default-max-tokens: {error}")
    if args.kv_events_port is None and (args.kv_events_replay_port is not None or args.kv_events_topic):
        parser.error("--kv-events-replay-port and --kv-events-topic need --kv-events-port")
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
                              served_model_name=args.served_model_name, default_max_tokens=args.default_max_tokens,
                              kv_events_port=args.kv_events_port, kv_events_replay_port=args.kv_events_replay_port,
                              kv_events_topic=args.kv_events_topic)
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
