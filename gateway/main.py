"""dflash-gateway: serve OpenAI's API for a running DFlash Triton server (dflash-serve starts it for you)."""
from __future__ import annotations

import argparse
import os
import socket
import sys

from dflash_contract.presets import REASONING_PARSERS
from dflash_contract.protocol import range_error
from dflash_contract.server import DRAIN_SECONDS, GATEWAY_HEALTH_PATH, OPENAI_API_KEY_ENV, PORTS

from .app import Settings, create_app

# How long an idle keep-alive connection stays open: longer than the clients' and load balancers' own idle limits
# (httpx and the openai client 5 s, AWS ALB 60 s), so that they close it first. At uvicorn's default of 5 s a client
# reusing a connection as the gateway closed it got "Server disconnected without sending a response" (seen on a
# loaded machine, with the openai client).
KEEP_ALIVE_SECONDS = 75

EXAMPLES = f"""\
examples:
  dflash-gateway --triton-url localhost:8001 --model-id smollm2-135m
  curl localhost:{PORTS['openai']}/v1/chat/completions -H 'Content-Type: application/json' \\
      -d '{{"model": "smollm2-135m", "messages": [{{"role": "user", "content": "Hi"}}]}}'

The API key, when set (--api-key or ${OPENAI_API_KEY_ENV}), is required as 'Authorization: Bearer <key>' on
every path but {GATEWAY_HEALTH_PATH}, which answers 200 only while tritonserver is ready. On SIGTERM it stops
accepting connections and lets open requests finish for up to --graceful-seconds.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash-gateway", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
        description="OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models) in front of "
                    "a DFlash Triton server's dflash_bls model (or a --runtime trtllm build's tensorrt_llm), over gRPC.")
    parser.add_argument("--triton-url", default=f"localhost:{PORTS['grpc']}", help="tritonserver's gRPC HOST:PORT")
    parser.add_argument("--model-id", "--served-model-name", required=True, help="the model's id in /v1/models and "
                        "in requests (dflash-serve passes its --served-model-name, by default the build's target "
                        "preset or its target directory's name)")
    parser.add_argument("--target-dir", help="the build's target checkpoint (<build>/target): for a --runtime "
                        "trtllm server, whose model takes raw text only, the gateway puts conversations in its chat "
                        "template and counts tokens with its tokenizer.json (dflash-serve passes it)")
    parser.add_argument("--reasoning-parser", choices=REASONING_PARSERS,
                        help="split a thinking model's reasoning into reasoning_content (dflash-serve passes the "
                        "build's: build.py --reasoning-parser)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=PORTS["openai"], help="0 = pick a free port (printed)")
    parser.add_argument("--api-key", default=os.environ.get(OPENAI_API_KEY_ENV) or None,
                        help=f"require this bearer token (default: ${OPENAI_API_KEY_ENV}; unset: no key)")
    parser.add_argument("--default-max-tokens", type=int, default=Settings.default_max_tokens,
                        help="for chat requests that set neither max_completion_tokens nor max_tokens; the server "
                        "lowers it to what the context leaves after the prompt (vLLM's rule)")
    parser.add_argument("--max-body-bytes", type=int, default=Settings.max_body_bytes,
                        help="larger request bodies are refused with 413")
    parser.add_argument("--graceful-seconds", type=float, default=DRAIN_SECONDS,
                        help="on SIGTERM, how long open requests may take to finish")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    error = range_error("max_tokens", args.default_max_tokens)  # what a request's max_tokens may be
    if error:
        parser.error(f"--default-max-tokens: {error}")
    import uvicorn

    settings = Settings(args.triton_url, args.model_id, args.api_key, args.default_max_tokens, args.max_body_bytes,
                        args.target_dir, args.reasoning_parser)
    # bound here, so that port 0 is known before serving (and said once, for whoever started us)
    try:
        sock = socket.create_server((args.host, args.port), reuse_port=False)
    except OSError as e:  # on stdout: dflash-serve reads the first line to learn how the start went
        reason = os.strerror(e.errno) if (e.errno or 0) > 0 else str(e)  # create_server appends the address
        print(f"dflash-gateway: cannot listen on {args.host}:{args.port}: {reason}", flush=True)
        return 1
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(create_app(settings), log_level="warning", access_log=False,
                            timeout_graceful_shutdown=int(args.graceful_seconds) or None,
                            timeout_keep_alive=KEEP_ALIVE_SECONDS)
    print(f"dflash-gateway: listening on http://{host}:{port} for model {args.model_id!r} "
          f"(tritonserver {args.triton_url}; API key {'required' if args.api_key else 'off'})", flush=True)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
