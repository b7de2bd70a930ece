"""Python clients for the DFlash Triton server: blocking and asyncio, gRPC streaming and HTTP generate.

    from clients import DFlashClient, GenerationParams
    with DFlashClient("localhost:8001") as client:
        print(client.generate("Why is the sky blue?", GenerationParams(max_tokens=64)).text)

See clients/README.md. Needs only tritonclient[grpc,http] (no torch).
"""
from .client import AsyncDFlashClient, AsyncTextStream, RetryPolicy
from .errors import (DFlashClientError, IncompleteResponse, InvalidRequest, RequestCancelled, RequestTimeout,
                     ServerError, ServerUnavailable)
from .params import GenerationParams, Message, Prompt
from .results import Generation, Health, SpeculationStats, TextChunk, Timings
from .sync import DFlashClient, TextStream
from .transport import TLS

__all__ = ["AsyncDFlashClient", "AsyncTextStream", "DFlashClient", "TextStream", "RetryPolicy", "TLS",
           "GenerationParams", "Message", "Prompt", "Generation", "Health", "SpeculationStats", "TextChunk",
           "Timings", "DFlashClientError", "InvalidRequest", "ServerUnavailable", "RequestTimeout",
           "RequestCancelled", "IncompleteResponse", "ServerError"]
