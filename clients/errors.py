"""Exceptions raised by the clients, and how a server's error message maps to one of them.

The server's error codes do not survive the trip: a Triton gRPC stream carries an error as a bare
message (no status code), and through an ensemble an HTTP request reports a full queue as 400 like a
bad parameter. So the retryable failures are recognised by the phrases of dflash_contract.protocol,
which the server's engine loop uses in its messages.
"""
from __future__ import annotations

from dflash_contract.protocol import (CANCELLED_MESSAGE, CAPACITY_MESSAGE, INTERNAL_ERROR_PREFIX,
                                      SHUTTING_DOWN_MESSAGE)

# "retry later": queue full, or shutting down (another replica may answer)
CAPACITY_PHRASES = (CAPACITY_MESSAGE, SHUTTING_DOWN_MESSAGE)


class DFlashClientError(Exception):
    """Base class: every failure of a request or a health check. `url` is the address tried."""

    def __init__(self, message: str, url: str = ""):
        super().__init__(message)
        self.url = url


class InvalidRequest(DFlashClientError, ValueError):
    """Bad parameters or prompt, caught client-side or refused by the server. Never retried."""


class ServerUnavailable(DFlashClientError):
    """Not reachable, at capacity or shutting down: retried with backoff before any output arrived."""


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
    """Any other failure the server reported (an internal error while decoding, a missing model)."""


def from_server_message(message: str, url: str, http_status: int | None = None) -> DFlashClientError:
    """The exception for an error the server reported (in a gRPC stream, or as an HTTP error body)."""
    if any(phrase in message for phrase in CAPACITY_PHRASES) or http_status == 503:
        return ServerUnavailable(message, url)
    if CANCELLED_MESSAGE in message:
        return RequestCancelled(message, url)
    if INTERNAL_ERROR_PREFIX in message or (http_status is not None and http_status >= 500):
        return ServerError(message, url)
    # What is left is a request refused at the door: bad parameters, a bad prompt, missing inputs.
    return InvalidRequest(message, url)
