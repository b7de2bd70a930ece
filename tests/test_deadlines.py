"""Deadlines on the real server (the embedded default): a client that gives up frees its slot within a second (on a
loaded machine, within the cancellation polls and a few engine steps: test_serving.freed_promptly).

Our clients' `timeout` ends the request on the server: the client closes the stream (over HTTP always a
stream: Triton notices a gone HTTP client only when it writes to it), Triton cancels the request, and the engine
loop drops it at its next cancellation check. A bare gRPC deadline (tritonclient's stream_timeout) does the same:
Triton cancels the request when the deadline passes. The seconds from giving up to a free slot are printed
(pytest -s).
"""
from __future__ import annotations

import time

import pytest
import tritonclient.grpc as grpcclient

from clients import DFlashClient, GenerationParams, RequestTimeout
from test_serving import freed_promptly, inputs, until_no_active_sequence

LONG = "Write a long story about a lighthouse keeper who befriends a whale."


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_client_timeout_frees_the_slot_within_a_second(default_server, protocol):
    url = default_server.grpc_url if protocol == "grpc" else default_server.http_url
    with DFlashClient(url, protocol) as client:
        with pytest.raises(RequestTimeout):
            client.generate(LONG, GenerationParams(max_tokens=1500), timeout=1.5)
    freed, steps = until_no_active_sequence(default_server)
    print(f"\n{protocol} client timeout: slot free {freed:.2f} s ({steps:.0f} steps) after the client gave up")
    assert freed_promptly(freed, steps), (freed, steps)


def test_a_grpc_deadline_frees_the_slot_within_a_second(default_server):
    client = grpcclient.InferenceServerClient(default_server.grpc_url)
    errors = []
    client.start_stream(callback=lambda result, error: error is not None and errors.append(error), stream_timeout=1.5)
    try:
        client.async_stream_infer("dflash_bls", inputs(text_input=LONG, max_tokens=1500, stream=True, end_id=-1))
        deadline = time.monotonic() + 30
        while not errors and time.monotonic() < deadline:
            time.sleep(0.02)
        assert errors and "Deadline" in str(errors[0]), errors
        freed, steps = until_no_active_sequence(default_server)
    finally:
        client.stop_stream()
        client.close()
    print(f"\ngRPC deadline: slot free {freed:.2f} s ({steps:.0f} steps) after the deadline")
    assert freed_promptly(freed, steps), (freed, steps)
