"""The ports a server start needs, picked together and checked free before anything loads.

Picking each free port on its own (bind to port 0, read the number, close) lets the operating system hand
out the same number twice: it happened, and tritonserver refused to listen for gRPC and metrics on one
port. So every probe socket is held until all ports are chosen, a number already taken is drawn again, and
the ports given explicitly are part of the set. A port given explicitly is checked by binding it as the
servers will (SO_REUSEADDR: a port whose last connections linger in TIME_WAIT is free to them), so a busy one
is refused in one line before a model loads, not minutes later.

What stays open: between this check and the servers' own bind another process may take a port. tritonserver
takes no listening socket from its parent, so that window cannot be closed from here.
"""
from __future__ import annotations

import contextlib
import errno
import socket

LOCALHOST = "127.0.0.1"
MAX_DRAWS = 64  # draws of a free port before giving up: the OS repeating itself this often means no port is free


class PortError(RuntimeError):
    """A port cannot be used: the message names it (by the caller's name for it) and says why."""


def pick_ports(wanted: dict[str, int], host: str = LOCALHOST) -> dict[str, int]:
    """name -> port as in `wanted`, with every 0 replaced by a free port on `host`: all distinct, all free on
    `host` at the time of the call. PortError names the first port that is taken, repeated or cannot be bound."""
    repeated = _first_repeated({name: port for name, port in wanted.items() if port})
    if repeated:
        (first, second), port = repeated
        raise PortError(f"{first} and {second} are both {port}: every port must differ")
    chosen: dict[str, int] = {}
    with contextlib.ExitStack() as held:
        for name, port in wanted.items():
            if port:
                held.enter_context(_bound(host, port, name))
                chosen[name] = port
        taken = set(chosen.values())
        for name, port in wanted.items():
            if not port:
                chosen[name] = _draw(host, taken, held)
                taken.add(chosen[name])
    return {name: chosen[name] for name in wanted}


def free_ports(count: int, host: str = LOCALHOST) -> list[int]:
    """`count` distinct ports free on `host` now (tests: servers to start, addresses where nothing listens)."""
    return list(pick_ports({f"port {i}": 0 for i in range(count)}, host).values())


def _first_repeated(ports: dict[str, int]) -> tuple[tuple[str, str], int] | None:
    seen: dict[int, str] = {}
    for name, port in ports.items():
        if port in seen:
            return (seen[port], name), port
        seen[port] = name
    return None


def _draw(host: str, taken: set[int], held: contextlib.ExitStack) -> int:
    """A free port not in `taken`; its socket stays bound (in `held`) until every port is chosen."""
    for _ in range(MAX_DRAWS):
        sock = held.enter_context(_bound(host, 0, "a free port"))
        port = sock.getsockname()[1]
        if port not in taken:
            return port
    raise PortError(f"no free port on {host} after {MAX_DRAWS} tries")


def _bound(host: str, port: int, name: str) -> socket.socket:
    """A TCP socket bound to (host, port) as a listening server binds it; PortError naming `name` if it cannot be."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise PortError(f"cannot listen on host {host!r}: {e.strerror}") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if port:  # as tritonserver and uvicorn bind; a drawn port is fresh, and sharing must not hide a collision
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        where = f"{name} {port}" if port else name
        if e.errno == errno.EADDRINUSE:
            raise PortError(f"{where} is in use on {host} (another process listens there): pick another port, or 0 "
                            "for a free one") from None
        raise PortError(f"{where} cannot be bound on {host}: {e.strerror}") from None
    return sock

