"""dflash-client: talk to a DFlash Triton server from the terminal (generate, chat, health)."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from dflash_contract.presets import SPECULATIVE_SAMPLING
from dflash_contract.protocol import INVALID_REQUEST_PREFIX, invalid_request

from .client import RetryPolicy
from .errors import DFlashClientError, IncompleteResponse, InvalidRequest, ServerUnavailable
from .params import GenerationParams, Prompt
from .results import Generation
from .sync import DFlashClient
from .transport import TLS

EXAMPLES = """\
examples:
  dflash-client health --url localhost:8001 --wait 600       # exit 0 once the server and model are ready
  dflash-client generate --url localhost:8001 --prompt "Why is the sky blue?"
  dflash-client generate --url localhost:8000 --protocol http --prompt "def fib(n):" --raw --max-tokens 64
  dflash-client generate --url localhost:8001 --prompt "Hi" --temperature 0.7 --top-p 0.9 --seed 7 --json
  dflash-client chat --url localhost:8001                     # interactive; Ctrl-C stops an answer, Ctrl-D quits

Exit status: 0 success; 1 server fault (an internal error, a timeout, an incomplete answer): report it;
2 invalid request (refused client-side with the server's rules, or by the server): fix it;
3 server unavailable (unreachable, not ready, at capacity, shutting down, engine down) after the retries:
try again later; 130 interrupted.
"""
# Exit statuses by exception class, most specific first (see EXAMPLES)
EXIT_CODES = ((InvalidRequest, 2), (ServerUnavailable, 3), (DFlashClientError, 1))


def build_parser() -> argparse.ArgumentParser:
    connection = argparse.ArgumentParser(add_help=False)
    group = connection.add_argument_group("connection")
    group.add_argument("--url", required=True, metavar="HOST[:PORT]",
                       help="server address: its gRPC port or, with --protocol http, its HTTP port; without a "
                            "port, the server's default: 8001 (gRPC), 8000 (HTTP)")
    group.add_argument("--protocol", choices=["grpc", "http"], default="grpc", help="default: grpc")
    group.add_argument("--timeout", type=float, metavar="S", help="per-request limit in seconds (default: none)")
    group.add_argument("--retries", type=int, default=2, metavar="N",
                       help="retries while the server is unreachable or at capacity (default: 2)")
    group.add_argument("--tls", action="store_true", help="use TLS (gRPC: SSL channel; HTTP: https)")
    group.add_argument("--ca", metavar="PEM", help="root certificates for --tls (default: the system's)")
    group.add_argument("--cert", metavar="PEM", help="client certificate chain for mutual TLS")
    group.add_argument("--key", metavar="PEM", help="client private key for mutual TLS")

    sampling = argparse.ArgumentParser(add_help=False)
    group = sampling.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=256, metavar="N",
                       help="tokens to generate at most (default: 256)")
    group.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    group.add_argument("--top-k", type=int, default=0, metavar="K", help="0 = off")
    group.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass, in (0, 1]")
    group.add_argument("--seed", type=int, metavar="S", help="same seed, same answer (with or without the drafter)")
    group.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    group.add_argument("--speculative-sampling", choices=SPECULATIVE_SAMPLING,
                       help="how a sampled request verifies drafts: exact (the same answer as without speculation) or "
                            "rejection (min(1, p/q): the same distribution, another sample); default: the build's")

    parser = argparse.ArgumentParser(
        prog="dflash-client", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
        description="Generate text with a DFlash Triton server (model `dflash_bls`, or a --runtime trtllm "
                    "build's `tensorrt_llm`: raw text only there, --raw), check its health.")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser(
        "generate", parents=[connection, sampling], help="answer one prompt, streamed to stdout",
        description="Answer one prompt. The text streams to stdout as the server accepts it; a summary "
                    "(finish reason, acceptance length, latency) goes to stderr.")
    generate.add_argument("--prompt", required=True, help="the prompt ('-' reads stdin)")
    generate.add_argument("--raw", action="store_true", help="send the prompt as raw text, without the chat template")
    generate.add_argument("--json", action="store_true",
                          help="print one JSON object (text, finish_reason, stats, timings) instead of streaming")
    chat = commands.add_parser(
        "chat", parents=[connection, sampling], help="chat in the terminal (interactive, or one-shot with --prompt)",
        description="Chat in the terminal: the whole conversation so far (with the --system prompt) goes to the "
                    "server each turn, which puts it in the model's chat template.")
    chat.add_argument("--prompt", help="answer this one message and exit")
    chat.add_argument("--system", help="a system prompt at the start of the conversation")
    health = commands.add_parser("health", parents=[connection], help="exit 0 only when the server is ready",
                                 description="Check that the server is live and its front model "
                                 "(`dflash_bls` or `tensorrt_llm`) is ready.")
    health.add_argument("--wait", type=float, default=0, metavar="SECONDS",
                        help="poll until ready for up to SECONDS (default: check once)")
    return parser


def connect(args) -> DFlashClient:
    tls = None
    if args.tls or args.ca or args.cert:
        tls = TLS(root_certificates=args.ca, private_key=args.key, certificate_chain=args.cert)
    return DFlashClient(args.url, args.protocol, tls=tls, retry=RetryPolicy(attempts=args.retries + 1),
                        timeout=args.timeout)


def params_from(args) -> GenerationParams:
    return GenerationParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=tuple(args.stop),
                            speculative_sampling=args.speculative_sampling)


def run_health(client: DFlashClient, args) -> int:
    health = client.wait_ready(args.wait) if args.wait > 0 else client.health()
    if not health.ready:
        raise ServerUnavailable(f"{args.url} is not ready: {health.detail}", args.url)
    print(f"ready: {args.url} ({args.protocol})")
    return 0


def run_generate(client: DFlashClient, args) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    params = params_from(args)
    if args.json:
        result = client.generate(prompt, params, chat=not args.raw, stream=True)
        print(json.dumps(as_json(result), ensure_ascii=False, indent=2))
    else:
        stream_answer(client, prompt, params, chat=not args.raw)
    return 0


def run_chat(client: DFlashClient, args) -> int:
    params = params_from(args)
    conversation = [{"role": "system", "content": args.system}] if args.system else []
    if args.prompt is not None:
        stream_answer(client, [*conversation, {"role": "user", "content": args.prompt}], params, chat=True)
        return 0
    print(f"chatting with {args.url}; Ctrl-C stops an answer, Ctrl-D quits", file=sys.stderr)
    while True:
        try:
            message = input("> ").strip()
        except EOFError:
            print(file=sys.stderr)
            return 0
        if not message:
            continue
        turn = [*conversation, {"role": "user", "content": message}]
        try:
            answer = stream_answer(client, turn, params, chat=True)
        except KeyboardInterrupt:  # a stopped answer is not part of the conversation
            print("\n[stopped]", file=sys.stderr)
        except InvalidRequest as e:  # a bad message is worth a new try, not an exit
            print(f"error: {e}", file=sys.stderr)
        else:
            conversation = [*turn, {"role": "assistant", "content": answer.text}]


def stream_answer(client: DFlashClient, prompt: Prompt, params: GenerationParams, chat: bool) -> Generation:
    """Print the deltas as they arrive, then a one-line summary on stderr."""
    with client.stream(prompt, params, chat=chat) as stream:
        try:
            for delta in stream:
                sys.stdout.write(delta)
                sys.stdout.flush()
        except IncompleteResponse:
            print(file=sys.stderr)
            print("[the answer above is incomplete]", file=sys.stderr)
            raise
    print()
    result = stream.result
    print(summary(result), file=sys.stderr)
    return result


def summary(result: Generation) -> str:
    s, t = result.stats, result.timings
    tau = "none" if s.mean_acceptance_length is None else f"{s.mean_acceptance_length:.2f}"
    return (f"[{result.finish_reason}; acceptance length {tau} over {s.draft_steps} steps, "
            f"{s.accepted_draft_tokens}/{s.draft_tokens} drafts accepted; "
            f"first text {t.ttft:.2f} s, total {t.total:.2f} s]")


def as_json(result: Generation) -> dict:
    return {"text": result.text, "finish_reason": result.finish_reason, "stats": asdict(result.stats),
            "timings": {"ttft": result.timings.ttft, "total": result.timings.total,
                        "chunks": len(result.timings.chunks)},
            "attempts": result.attempts}


COMMANDS = {"health": run_health, "generate": run_generate, "chat": run_chat}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with connect(args) as client:
            return COMMANDS[args.command](client, args)
    except DFlashClientError as e:
        message = str(e)
        if isinstance(e, InvalidRequest) and INVALID_REQUEST_PREFIX not in message:  # a client-side refusal
            message = invalid_request(message)
        print(f"dflash-client: {message}", file=sys.stderr)
        return next(code for kind, code in EXIT_CODES if isinstance(e, kind))
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
