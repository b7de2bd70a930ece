"""How `dflash-serve` is reached and stopped: ports, probe paths and the drain protocol.

The launcher (deploy/serve.py), the `dflash` Triton model, the clients' defaults and the Kubernetes
manifests all read these.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}
READY_PATH = "/v2/health/ready"
LIVE_PATH = "/v2/health/live"
METRICS_PATH = "/metrics"

# The drain protocol: on SIGTERM dflash-serve creates the drain file before it signals tritonserver.
# Triton tells a Python model nothing until it unloads it, which happens only after in-flight
# requests end; the dflash model watches the file, refuses new requests, fails the ones still running
# after DRAIN_SECONDS (so every client gets a final response), then creates `drained_path` to say no
# request is left, and the launcher stops tritonserver, which waits at most EXIT_TIMEOUT_S for models
# to unload.
DRAIN_FILE_ENV = "DFLASH_DRAIN_FILE"
DRAIN_SECONDS_ENV = "DFLASH_DRAIN_SECONDS"
DRAIN_SECONDS = 30
EXIT_TIMEOUT_S = 15
DRAIN_SLACK_S = 5  # beyond DRAIN_SECONDS, for the model to end the last requests and say so
FLUSH_SECONDS = 1.5  # for the last responses to leave before tritonserver closes the connections
# the most a clean shutdown takes, in whole seconds (Kubernetes' grace period is an integer)
SHUTDOWN_SECONDS = math.ceil(DRAIN_SECONDS + DRAIN_SLACK_S + FLUSH_SECONDS + EXIT_TIMEOUT_S)


def drained_path(drain_file: Path) -> Path:
    """The file the model creates once draining left it no requests: the launcher may stop the server."""
    return drain_file.with_name(drain_file.name + ".done")


def drain_signal() -> tuple[Path, float] | None:
    """(file whose appearance means "drain", seconds to let requests finish), when launched by dflash-serve."""
    path = os.environ.get(DRAIN_FILE_ENV)
    return (Path(path), float(os.environ.get(DRAIN_SECONDS_ENV, "0"))) if path else None
