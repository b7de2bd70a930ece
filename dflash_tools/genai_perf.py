"""NVIDIA genai-perf, unmodified, against our Triton front models: one table of TTFT, ITL and throughput.

`make genai-perf` runs this: it installs genai-perf 0.0.16 into its own venv (.venv/genai-perf; its perf_analyzer
binary comes from tritonclient 2.50.0, whose build runs on glibc 2.36, with Debian's libb64 and PyPI's CUDA runtime),
builds the embedded default, and then this script

1. starts `dflash-serve BUILD/model_repository` on free ports (its "ready: grpc HOST:PORT ..." line gives the port;
   the server log is ARTIFACTS/server.log), unless --url names a running server;
2. sends one short warm-up request (dflash-client);
3. runs `genai-perf profile -m MODEL --endpoint-type kserve --backend tensorrtllm [--streaming] --tokenizer
   BUILD/target --url HOST:PORT --concurrency N --request-count R ...` for every model, streaming mode and
   concurrency: synthetic prompts of --input-tokens tokens, --output-tokens tokens each (genai-perf sends them as
   max_tokens and min_length, --output-tokens-mean-deterministic), artifacts in ARTIFACTS/MODEL-{stream,nostream}/;
4. stops the server with SIGTERM (it drains) and prints one table from genai-perf's own JSON export
   (profile_export_genai_perf.json); the rows also go to ARTIFACTS/summary.json.

genai-perf's tensorrtllm backend always talks to Triton through perf_analyzer's gRPC stream (`-i grpc --streaming`):
"streaming" here is the request's `stream` input (tokens as they are accepted) versus one complete response. Without
streaming, genai-perf's time to first token is the whole request's latency and it reports no inter-token latency:
the table shows the latency column for those rows.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
READY = re.compile(r"^ready: grpc (\S+):(\d+)\b", re.MULTILINE)

COLUMNS = [  # (header, row key, format)
    ("model", "model", "{}"),
    ("streaming", "streaming", "{}"),
    ("conc", "concurrency", "{}"),
    ("requests", "request_count", "{:.0f}"),
    ("TTFT p50 ms", "ttft_p50_ms", "{:.0f}"),
    ("ITL p50 ms", "itl_p50_ms", "{:.1f}"),
    ("latency p50 ms", "latency_p50_ms", "{:.0f}"),
    ("out tok/s", "output_tokens_per_s", "{:.2f}"),
    ("req/s", "requests_per_s", "{:.3f}"),
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m dflash_tools.genai_perf",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example (what `make genai-perf` runs):\n"
               "  .venv/bin/python -m dflash_tools.genai_perf --build builds/smollm2-135m "
               "--genai-perf-venv .venv/genai-perf --artifacts builds/genai-perf",
    )
    p.add_argument("--build", type=Path, default=ROOT / "builds" / "smollm2-135m",
                   help="a build from builder/build.py: serves BUILD/model_repository, tokenizer BUILD/target")
    p.add_argument("--genai-perf-venv", type=Path, default=ROOT / ".venv" / "genai-perf",
                   help="the venv holding genai-perf and tritonclient's perf_analyzer")
    p.add_argument("--artifacts", type=Path, default=ROOT / "builds" / "genai-perf",
                   help="genai-perf's artifacts, the server log and summary.json (a previous run's are replaced)")
    p.add_argument("--url", help="HOST:PORT of a running server's gRPC port (default: start one on free ports)")
    p.add_argument("--models", nargs="+", default=["ensemble", "dflash_bls"])
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 2, 8])
    p.add_argument("--streaming", choices=["both", "on", "off"], default="both")
    p.add_argument("--input-tokens", type=int, default=64, help="synthetic prompt length (stddev 0)")
    p.add_argument("--output-tokens", type=int, default=32, help="max_tokens = min_length of every request")
    p.add_argument("--request-count", type=int,
                   help="requests measured per run (default: 4, or 2 x concurrency when that is more)")
    p.add_argument("--seed", type=int, default=0, help="genai-perf's --random-seed (same prompts every run)")
    p.add_argument("--run-timeout", type=float, default=300, help="seconds one genai-perf run may take")
    p.add_argument("--ready-timeout", type=float, default=900, help="seconds the server may take to become ready")
    return p.parse_args(argv)


def genai_perf_env(venv: Path) -> dict:
    """perf_analyzer on PATH (genai-perf calls it by name), libcudart.so.12 from PyPI's nvidia-cuda-runtime-cu12 on
    LD_LIBRARY_PATH (perf_analyzer links it even without a GPU), and no Hugging Face hub: the tokenizer is local."""
    env = dict(os.environ)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    libs = sorted(str(p) for p in venv.glob("lib/python3*/site-packages/nvidia/cuda_runtime/lib"))
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [env["LD_LIBRARY_PATH"]] if env.get("LD_LIBRARY_PATH") else libs)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def check_tools(venv: Path, env: dict) -> None:
    for tool in ("genai-perf", "perf_analyzer"):
        if not (venv / "bin" / tool).exists():
            sys.exit(f"{venv / 'bin' / tool} is missing: `make genai-perf` installs it")
    # a missing shared library stops perf_analyzer in the loader, before it parses any option
    probe = subprocess.run([str(venv / "bin" / "perf_analyzer"), "--version"], env=env, capture_output=True, text=True)
    if "error while loading shared libraries" in probe.stderr:
        sys.exit(f"perf_analyzer cannot start: {probe.stderr.strip()}\n"
                 "(libb64.so.0d: apt-get install libb64-0d; libcudart.so.12: pip install nvidia-cuda-runtime-cu12 "
                 "into the genai-perf venv)")


class Server:
    """dflash-serve on free ports; stop() sends SIGTERM and waits for its drain."""

    def __init__(self, repository: Path, log_path: Path, ready_timeout: float):
        serve = Path(sys.executable).with_name("dflash-serve")
        serve = str(serve) if serve.exists() else shutil.which("dflash-serve")
        if not serve:
            sys.exit("dflash-serve not found: run this with the project's venv (.venv/bin/python)")
        cmd = [serve, str(repository), "--grpc-port", "0", "--http-port", "0", "--metrics-port", "0"]
        helptext = subprocess.run([serve, "--help"], capture_output=True, text=True).stdout
        if "--openai-port" in helptext:
            cmd += ["--openai-port", "0"]
        self.log_path = log_path
        self.log = open(log_path, "w")
        print("$ " + " ".join(cmd), flush=True)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            self.url = self._wait_ready(ready_timeout)
        except BaseException:  # not ready in time, or interrupted while waiting: no server left behind
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            match = READY.search(self.log_path.read_text(errors="replace"))
            if match:
                print(match.group(0), flush=True)
                host = "127.0.0.1" if match.group(1) in ("localhost", "0.0.0.0") else match.group(1)
                return f"{host}:{match.group(2)}"
            if self.proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"dflash-serve did not become ready (status {self.proc.poll()}); "
                         f"last lines of {self.log_path}:\n{self.tail()}")
            time.sleep(1)

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=90)  # drain: DRAIN_SECONDS (30 s), then tritonserver's own exit
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def warm_up(url: str) -> None:
    client = Path(sys.executable).with_name("dflash-client")
    if client.exists():
        subprocess.run([str(client), "generate", "--url", url, "--max-tokens", "8", "--json",
                        "--prompt", "Warm-up: say hello."], capture_output=True, text=True, timeout=300)


def profile_command(args, model: str, streaming: bool, concurrency: int, url: str, artifact_dir: Path) -> list[str]:
    requests = args.request_count or max(4, 2 * concurrency)
    cmd = [str(args.genai_perf_venv / "bin" / "genai-perf"), "profile",
           "-m", model, "--endpoint-type", "kserve", "--backend", "tensorrtllm"]
    if streaming:
        cmd.append("--streaming")
    cmd += ["--tokenizer", str(args.build / "target"), "--url", url,
            "--concurrency", str(concurrency), "--request-count", str(requests),
            "--num-dataset-entries", str(max(requests, 4)),
            "--synthetic-input-tokens-mean", str(args.input_tokens), "--synthetic-input-tokens-stddev", "0",
            "--output-tokens-mean", str(args.output_tokens), "--output-tokens-stddev", "0",
            "--output-tokens-mean-deterministic", "--random-seed", str(args.seed),
            "--artifact-dir", str(artifact_dir)]
    return cmd


def read_export(export: Path) -> dict:
    data = json.loads(export.read_text())

    def stat(metric: str, key: str):
        value = data.get(metric, {}).get(key)
        return float(value) if value is not None else None

    return {
        "request_count": stat("request_count", "avg"),
        "ttft_p50_ms": stat("time_to_first_token", "p50"),
        "itl_p50_ms": stat("inter_token_latency", "p50"),
        "latency_p50_ms": stat("request_latency", "p50"),
        "output_tokens_per_s": stat("output_token_throughput", "avg"),
        "requests_per_s": stat("request_throughput", "avg"),
        "output_sequence_length_avg": stat("output_sequence_length", "avg"),
        "input_sequence_length_avg": stat("input_sequence_length", "avg"),
    }


def run_one(args, env: dict, model: str, streaming: bool, concurrency: int, url: str) -> dict:
    mode = "stream" if streaming else "nostream"
    artifact_dir = args.artifacts / f"{model}-{mode}"
    artifact_dir.mkdir(parents=True, exist_ok=True)
    cmd = profile_command(args, model, streaming, concurrency, url, artifact_dir)
    row = {"model": model, "streaming": "yes" if streaming else "no", "concurrency": concurrency,
           "command": cmd}
    print(f"\n$ {' '.join(cmd)}", flush=True)
    log = artifact_dir / f"genai-perf-concurrency{concurrency}.log"
    start = time.monotonic()
    with open(log, "w") as out:
        try:
            proc = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=artifact_dir,
                                  timeout=args.run_timeout)
            status = proc.returncode
        except subprocess.TimeoutExpired:
            status = None
    row["seconds"] = round(time.monotonic() - start, 1)
    # genai-perf names the run's folder MODEL-triton-tensorrtllm-concurrencyN under --artifact-dir.
    export = artifact_dir / f"{model}-triton-tensorrtllm-concurrency{concurrency}" / "profile_export_genai_perf.json"
    if status == 0 and export.exists():
        row.update(read_export(export))
        if not streaming:  # one response: genai-perf's "first token" is the whole answer (= latency)
            row["ttft_p50_ms"] = None
        row["export"] = str(export)
    else:
        reason = f"timed out after {args.run_timeout:.0f} s" if status is None else f"exit status {status}"
        row["error"] = f"{reason}: {failure_text(log.read_text(errors='replace')) or 'see ' + str(log)}"
    print(f"  {row['seconds']} s: " + (row.get("error") or
          f"{row['request_count']:.0f} requests, {row['output_tokens_per_s']:.2f} output tokens/s"), flush=True)
    return row


def failure_text(log: str) -> str:
    """perf_analyzer's own complaint: genai-perf discards its stdout, so it is the stderr text that genai-perf's log
    shows between "Running Perf Analyzer" and its traceback (e.g. "error: failed to get model metadata: ...").
    Failing that, genai-perf's last error line."""
    lines = log.splitlines()
    start = next((i for i, line in enumerate(lines) if "Running Perf Analyzer" in line), None)
    if start is not None:
        said = []
        for line in lines[start + 1:]:
            if line.startswith("Traceback"):
                break
            if line.strip() and not line.startswith(" " * 20) and not line.startswith("Progress"):
                said.append(line.strip())
        if said:
            return " ".join(said)[:400]
    errors = [line.strip() for line in lines if re.search(r"error|exception|failed", line, re.IGNORECASE)]
    return errors[-1][:400] if errors else ""


def table(rows: list[dict]) -> str:
    """One line per run; a failed run shows its error after the model, streaming and concurrency columns."""
    head = [h for h, _, _ in COLUMNS]
    body = [None if "error" in row else ["-" if row.get(k) is None else fmt.format(row[k]) for _, k, fmt in COLUMNS]
            for row in rows]
    widths = [max([len(head[i])] + [len(str(row[COLUMNS[i][1]])) for row in rows if i < 3]
                  + [len(cells[i]) for cells in body if cells]) for i in range(len(COLUMNS))]

    def line(cells):
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    lines = [line(head)]
    for row, cells in zip(rows, body):
        lines.append(line(cells) if cells else
                     line([str(row[k]) for _, k, _ in COLUMNS[:3]]) + "  failed: " + row["error"])
    return "\n".join(lines)


MARKER = ".dflash-genai-perf"  # marks a folder this script made, so that a rerun may empty it


def prepare_artifacts(folder: Path) -> None:
    """An empty folder for this run's artifacts: a previous run's is emptied, any other non-empty folder refused."""
    if folder.exists() and any(folder.iterdir()):
        if not (folder / MARKER).exists():
            sys.exit(f"{folder} is not empty and was not made by this script: choose another --artifacts")
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MARKER).touch()


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # the server is stopped on the way out
    args.build, args.genai_perf_venv, args.artifacts = (p.resolve() for p in (args.build, args.genai_perf_venv,
                                                                              args.artifacts))
    env = genai_perf_env(args.genai_perf_venv)
    check_tools(args.genai_perf_venv, env)
    if not (args.build / "target" / "tokenizer.json").exists():
        sys.exit(f"{args.build} is not a build (no target/tokenizer.json): run builder/build.py --output {args.build}")
    prepare_artifacts(args.artifacts)
    versions = {"genai-perf": subprocess.run([str(args.genai_perf_venv / "bin" / "genai-perf"), "--version"],
                                             env=env, capture_output=True, text=True).stdout.strip()}

    server = None
    if args.url:
        url = args.url
    else:
        server = Server(args.build / "model_repository", args.artifacts / "server.log", args.ready_timeout)
        url = server.url
    rows, started = [], time.monotonic()
    try:
        warm_up(url)
        modes = {"both": [True, False], "on": [True], "off": [False]}[args.streaming]
        for model in args.models:
            for streaming in modes:
                for concurrency in args.concurrency:
                    rows.append(run_one(args, env, model, streaming, concurrency, url))
    finally:
        if server is not None:
            status = server.stop()
            print(f"\ndflash-serve stopped (status {status}); its log: {server.log_path}", flush=True)
    summary = {"versions": versions, "url": url, "input_tokens": args.input_tokens,
               "output_tokens": args.output_tokens, "seconds": round(time.monotonic() - started, 1), "runs": rows}
    (args.artifacts / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\n{versions['genai-perf']}, {args.input_tokens} prompt tokens, {args.output_tokens} output tokens; "
          f"{summary['seconds']:.0f} s; artifacts in {args.artifacts}\n")
    print(table(rows))
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
