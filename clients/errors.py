"""Exceptions raised by the clients, and how a server's error message maps to one of them.

The server's error codes do not survive the trip: a Triton gRPC stream carries an error as a bare
message (no status code), HTTP generate answers 400 for every model's error (500 for a body Triton cannot
read), and an ensemble prefixes its own words. So the class of an error is read from its message
(dflash_contract.protocol.error_class: the phrases the server's models use, and Triton's own), and the
clients act on the class.
"""
from __future__ import annotations

from dflash_contract.protocol import error_class


class DFlashClientError(Exception):
    """Base class: every failure of a request or a health check. `url` is the address tried."""

    def __init__(self, message: str, url: str = ""):
        super().__init__(message)
        self.url = url


class InvalidRequest(DFlashClientError, ValueError):
    """A malformed request (INVALID_ARG): bad parameters or prompt, caught client-side or refused by the
    server. Never retried: the same request would be refused again."""


class ServerUnavailable(DFlashClientError):
    """UNAVAILABLE: not reachable, at capacity, shutting down, or its engine died. Retried with backoff
    before any output arrived: later, or another replica behind the same address, can answer."""


class RequestTimeout(DFlashClientError, TimeoutError):
    """The request did not complete within its timeout (it was cancelled)."""


class RequestCancelled(DFlashClientError):
    """The caller (or the server) cancelled the request before it completed."""


class IncompleteResponse(DFlashClientError):
    """The stream ended or broke before the server's final response: `partial_text` is NOT the answer."""

    def __init__(self, message: str, url: str = "", partial_text: str = ""):
        super().__init__(message, url)
        self.partial_text = partial_text


class ServerError(DFlashClientError):
    """INTERNAL: any other failure the server reported (a fault while decoding, a missing model)."""


def from_server_message(message: str, url: str, http_status: int | None = None) -> DFlashClientError:
    """The exception for an error the server reported (in a gRPC stream, or as an HTTP error body)."""
    kind = error_class(message)
    if kind == "UNAVAILABLE" or http_status == 503:
        return ServerUnavailable(message, url)
    if kind == "CANCELLED":
        return RequestCancelled(message, url)
    if kind == "INVALID_ARG":
        return InvalidRequest(message, url)
    # Unknown words are a server fault, not the caller's: retrying or fixing the request would not help.
    return ServerError(message, url)
