"""The ports a start needs: picked together and distinct, and a busy one refused before anything loads."""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

import deploy.ports
from deploy.ports import PortError, free_ports, pick_ports
from deploy.server_process import ServeError, start_gateway

REPO = Path(__file__).resolve().parent.parent


def test_a_number_the_os_hands_out_twice_is_drawn_again(monkeypatch):
    """The failure seen in CI: two probes closed one after the other got the same number. Here every draw first
    reports one number twice (as a kernel may after a close); the picker still returns distinct ports."""
    real_bound, draws = deploy.ports._bound, []

    class Repeating:
        def __init__(self, sock: socket.socket):
            self.sock = sock

        def getsockname(self):
            number = draws[0] if len(draws) in (1, 2) else self.sock.getsockname()[1]
            draws.append(number)
            return ("127.0.0.1", number)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.sock.close()

    monkeypatch.setattr(deploy.ports, "_bound", lambda host, port, name: Repeating(real_bound(host, port, name)))
    picked = pick_ports({"--http-port": 0, "--grpc-port": 0, "--metrics-port": 0})
    assert draws[0] == draws[1] == draws[2]  # the same number came three times...
    assert len(set(picked.values())) == 3  # ...and three distinct ports went out
    assert len(draws) == 5


def test_ports_are_distinct_free_and_the_given_ones_kept():
    with socket.create_server(("127.0.0.1", 0)) as busy:
        taken = busy.getsockname()[1]
        (given,) = free_ports(1)
        picked = pick_ports({"a": 0, "b": given, "c": 0, "d": 0})
        assert picked["b"] == given and len(set(picked.values())) == 4 and taken not in picked.values()
        for port in picked.values():  # free: a server can listen there now
            socket.create_server(("127.0.0.1", port)).close()
        with pytest.raises(PortError, match=f"b {taken} is in use on 127.0.0.1 .another process listens there."):
            pick_ports({"a": 0, "b": taken})
        with pytest.raises(PortError, match=f"b {taken} is in use on 0.0.0.0"):  # every interface includes it
            pick_ports({"b": taken}, "0.0.0.0")
    with pytest.raises(PortError, match="--grpc-port and --metrics-port are both 8001: every port must differ"):
        pick_ports({"--http-port": 0, "--grpc-port": 8001, "--metrics-port": 8001})


def test_dflash_serve_refuses_a_busy_port_in_one_line_before_anything_starts(tmp_path):
    """A busy --openai-port used to be found once every model had loaded (minutes on a GPU), ending in a traceback
    and a message with nothing after its colon. An empty repository would load in a second: the one-line answer
    shows that tritonserver never started."""
    (tmp_path / "model_repository").mkdir()
    with socket.create_server(("0.0.0.0", 0)) as busy:
        port = busy.getsockname()[1]
        for flags, message in (
                ([f"--openai-port={port}", "--http-port=0", "--grpc-port=0", "--metrics-port=0"],
                 f"dflash-serve: --openai-port {port} is in use on 0.0.0.0 (another process listens there): pick "
                 "another port, or 0 for a free one"),
                (["--openai-port=0", "--http-port=0", "--grpc-port=9101", "--metrics-port=9101"],
                 "dflash-serve: --grpc-port and --metrics-port are both 9101: every port must differ")):
            done = subprocess.run([sys.executable, "-m", "deploy.serve", str(tmp_path / "model_repository"), *flags],
                                  cwd=REPO, capture_output=True, text=True, timeout=60)
            assert done.returncode == 1 and done.stdout == ""
            assert done.stderr.strip().splitlines() == [message]


def test_a_gateway_that_cannot_listen_says_why():
    """The gateway binds its port only after tritonserver is ready: another process may take it in between."""
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        with pytest.raises(ServeError, match=rf"the OpenAI gateway did not start \(exit code 1\): dflash-gateway: "
                                             rf"cannot listen on 127.0.0.1:{port}: Address already in use"):
            start_gateway(f"127.0.0.1:{free_ports(1)[0]}", "m", port, None, 1, host="127.0.0.1")
