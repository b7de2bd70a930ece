"""dflash-loadbench: load-test a running DFlash server, optionally side by side with a baseline server.

Replays a prompt set (chat, ShareGPT held-out, HumanEval, MT-Bench, MATH-500, or a .jsonl file) at fixed concurrency
levels (N clients, each sending its next request when the last one completed) or at fixed request
rates (Poisson arrivals, the same schedule for both servers). Every request streams, so the time to
first token (TTFT) and the inter-token latency (ITL) are measured as a backend service sees them.

With --baseline-url (a build with `--drafter none`: the same engine decoding one token per pass),
the levels alternate between the two servers (A B, B A, ...) so drifting machine load hits both
alike, and the speedup is printed per level. With --openai-url (the same server's OpenAI-compatible
gateway, HOST:PORT) the gateway joins the rotation, and its overhead over direct gRPC is printed
per level (time to first token, throughput, identical texts).

Output tokens are counted by re-tokenizing the returned text with the model's tokenizer (--tokenizer;
the server returns text only). With --turns 2 (mtbench, math500) each request is a conversation: its
second turn re-sends the first turn's answer, as chat clients do, and is measured apart (its TTFT, and the
share of its prompt the server's prefix cache held); a baseline then is the same build with
--no-prefix-caching, for the cache's A/B. ITL spreads each streamed group's gap over its tokens (DFlash commits
several tokens per verify pass); its mean is (latency - TTFT) / (tokens - 1).

This is not dflash-bench, which times the runtime in-process (no server).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from dflash_contract.presets import SPECULATIVE_SAMPLING

from .client import AsyncDFlashClient
from .errors import DFlashClientError
from .openai_http import OpenAIHttpClient
from .params import GenerationParams
from .results import Generation

EXAMPLES = """\
examples:
  # DFlash server against a baseline built with --drafter none, 3 concurrency levels, ShareGPT prompts
  dflash-loadbench --url localhost:8001 --baseline-url localhost:9001 --tokenizer builds/smollm2-135m/target \\
      --prompts sharegpt --num-prompts 32 --concurrency 1 4 8 --max-tokens 128 --json bench.json --plot bench.png
  # the OpenAI gateway beside direct gRPC on one server (dflash-serve's --openai-port)
  dflash-loadbench --url localhost:8001 --openai-url localhost:9000 --tokenizer builds/smollm2-135m/target \\
      --prompts mtbench --num-prompts 16 --concurrency 1 8
  # MT-Bench's two turns, the prefix cache against the same build with --no-prefix-caching
  dflash-loadbench --url localhost:8001 --baseline-url localhost:9001 --tokenizer builds/smollm2-135m/target \\
      --prompts mtbench --turns 2 --num-prompts 80 --concurrency 1 8 --max-tokens 128
  # Poisson arrivals at 0.5, 1 and 2 requests/s, HumanEval prompts, over HTTP
  dflash-loadbench --url localhost:8000 --protocol http --tokenizer builds/smollm2-135m/target \\
      --prompts humaneval --request-rate 0.5 1 2
"""
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Level:
    kind: str  # "concurrency" or "request_rate"
    value: float

    @property
    def label(self) -> str:
        return f"c={self.value:g}" if self.kind == "concurrency" else f"{self.value:g} req/s"


@dataclass(frozen=True)
class Workload:
    prompts: list[str]
    params: GenerationParams
    chat: bool
    seed: int  # request-rate arrival times
    second_turns: list[str] | None = None  # each conversation's second user turn (--turns 2)


@dataclass(frozen=True)
class Outcome:
    """One request: its Generation, or the error that ended it."""

    prompt: int
    generation: Generation | None
    error: str | None = None
    second: Generation | None = None  # the second turn's, with --turns 2


async def run_level(client: AsyncDFlashClient, workload: Workload, level: Level, on_done: Callable[[], None]
                    ) -> tuple[list[Outcome], float]:
    """Send every prompt once at this level; (outcomes in prompt order, wall-clock seconds)."""
    outcomes: list[Outcome | None] = [None] * len(workload.prompts)

    async def send(i: int) -> None:
        try:
            generation = await client.generate(workload.prompts[i], workload.params, chat=workload.chat, stream=True)
            second = None
            if workload.second_turns:
                conversation = [{"role": "user", "content": workload.prompts[i]},
                                {"role": "assistant", "content": generation.text},
                                {"role": "user", "content": workload.second_turns[i]}]
                second = await client.generate(conversation, workload.params, stream=True)
            outcomes[i] = Outcome(i, generation, second=second)
        except DFlashClientError as e:
            outcomes[i] = Outcome(i, None, f"{type(e).__name__}: {e}")
        on_done()

    start = time.perf_counter()
    if level.kind == "concurrency":
        queue = iter(range(len(workload.prompts)))  # shared: each worker takes the next prompt when free

        async def worker() -> None:
            for i in queue:
                await send(i)

        await asyncio.gather(*(worker() for _ in range(int(level.value))))
    else:
        rng = random.Random(workload.seed)  # the same arrival schedule for every server
        tasks = []
        for i in range(len(workload.prompts)):
            if i:
                await asyncio.sleep(rng.expovariate(level.value))
            tasks.append(asyncio.create_task(send(i)))
        await asyncio.gather(*tasks)
    return outcomes, time.perf_counter() - start


def summarize(outcomes: list[Outcome], seconds: float, count_tokens: Callable[[str], int]) -> dict:
    """Throughput, latency percentiles and acceptance of one level on one server."""
    done = [o for o in outcomes if o.generation is not None]
    tokens = [count_tokens(o.generation.text) for o in done]
    latencies = [t for o in done for t in o.generation.timings.token_latencies(count_tokens)]
    steps = sum(o.generation.stats.draft_steps for o in done)
    committed = sum(o.generation.stats.draft_steps + o.generation.stats.accepted_draft_tokens for o in done)
    return {
        "requests": len(outcomes),
        "failed": len(outcomes) - len(done),
        "errors": sorted({o.error for o in outcomes if o.error})[:5],
        "seconds": round(seconds, 3),
        "requests_per_s": round(len(done) / seconds, 4),
        "output_tokens": sum(tokens),
        "output_tokens_per_s": round(sum(tokens) / seconds, 3),
        "ttft_s": distribution([o.generation.timings.ttft for o in done]),
        "itl_s": distribution(latencies),
        "latency_s": distribution([o.generation.timings.total for o in done]),
        "mean_acceptance_length": round(committed / steps, 4) if steps else None,
        **({"turn2": second_turn_summary([o.second for o in done])} if done and done[0].second else {}),
        "per_request": [request_record(o.prompt, o.generation, n, o.second) for o, n in zip(done, tokens)],
    }


def second_turn_summary(seconds: list[Generation]) -> dict:
    """Second turns: their TTFT, and the share of their prompt tokens the prefix cache held."""
    prompt = sum(g.stats.prompt_tokens for g in seconds)
    cached = sum(g.stats.cached_tokens for g in seconds)
    return {"ttft_s": distribution([g.timings.ttft for g in seconds]), "prompt_tokens": prompt,
            "cached_tokens": cached, "cached_fraction": round(cached / prompt, 4) if prompt else None}


def request_record(prompt: int, generation: Generation, output_tokens: int, second: Generation | None = None) -> dict:
    record = {"prompt": prompt, "output_tokens": output_tokens, "finish_reason": generation.finish_reason,
              "ttft_s": round(generation.timings.ttft, 4), "latency_s": round(generation.timings.total, 4),
              "stats": asdict(generation.stats), "text": generation.text}
    if second is not None:  # compared as one text: both turns must agree
        record.update(text=generation.text + "\n--- turn 2 ---\n" + second.text,
                      turn2={"ttft_s": round(second.timings.ttft, 4), "stats": asdict(second.stats)})
    return record


def distribution(values: list[float]) -> dict:
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    points = np.percentile(values, PERCENTILES)
    return {"mean": round(float(np.mean(values)), 5),
            **{f"p{p}": round(float(v), 5) for p, v in zip(PERCENTILES, points)}}


SAME_WORK_TAU = 0.05  # two runs whose tau differ by more than this share did different work per token


def compare(main: dict, baseline: dict) -> dict:
    """Speedup of the DFlash server over the baseline at one level (> 1: DFlash is better)."""
    def ratio(a, b):
        return round(a / b, 3) if a and b else None

    same = sum(a["text"] == b["text"] for a, b in zip(main["per_request"], baseline["per_request"])
               if a["prompt"] == b["prompt"])
    speedup = {"output_tokens_per_s": ratio(main["output_tokens_per_s"], baseline["output_tokens_per_s"]),
               "ttft_p50": ratio(baseline["ttft_s"]["p50"], main["ttft_s"]["p50"]),
               "itl_p50": ratio(baseline["itl_s"]["p50"], main["itl_s"]["p50"]),
               "identical_texts": f"{same}/{len(main['per_request'])}"}
    if "turn2" in main and "turn2" in baseline:  # the prefix cache's A/B: turn-2 TTFT, main over baseline
        speedup["turn2_ttft_p50_ratio"] = ratio(main["turn2"]["ttft_s"]["p50"], baseline["turn2"]["ttft_s"]["p50"])
    return speedup


def gateway_overhead(gateway: dict, grpc: dict) -> dict:
    """What the OpenAI gateway adds to direct gRPC at one level: TTFT p50 in ms, and the throughput ratio; with
    `not_comparable` saying why where the two runs' engines did different work (the ratios then measure that)."""
    same = sum(a["text"] == b["text"] for a, b in zip(gateway["per_request"], grpc["per_request"])
               if a["prompt"] == b["prompt"])
    ttft = (gateway["ttft_s"]["p50"], grpc["ttft_s"]["p50"])
    taus = (gateway["mean_acceptance_length"], grpc["mean_acceptance_length"])
    overhead = {"ttft_p50_ms": round((ttft[0] - ttft[1]) * 1e3, 2) if None not in ttft else None,
                "output_tokens_per_s": round(gateway["output_tokens_per_s"] / grpc["output_tokens_per_s"], 3)
                if grpc["output_tokens_per_s"] else None,
                "identical_texts": f"{same}/{len(grpc['per_request'])}", "tau": {"openai": taus[0], "grpc": taus[1]}}
    through_gateway, over_grpc = (tau or 1 for tau in taus)  # None: no verify step, one token a step
    if same < len(grpc["per_request"]) or abs(through_gateway - over_grpc) > SAME_WORK_TAU * over_grpc:
        overhead["not_comparable"] = (f"the engine did different work for each door (tau {_fmt(taus[0])} through "
                                      f"the gateway, {_fmt(taus[1])} over gRPC; identical texts {same}/"
                                      f"{len(grpc['per_request'])}): the ratios measure that, not the gateway")
    return overhead


async def run(args, workload: Workload, levels: list[Level], count_tokens: Callable[[str], int]) -> dict:
    from tqdm import tqdm

    servers = {"dflash": args.url, **({"baseline": args.baseline_url} if args.baseline_url else {})}
    clients = {name: AsyncDFlashClient(url, args.protocol, timeout=args.timeout) for name, url in servers.items()}
    if args.openai_url:
        clients["openai"] = OpenAIHttpClient(args.openai_url, args.openai_api_key, timeout=args.timeout)
    total = (len(levels) * len(workload.prompts) + args.warmup) * len(clients)
    results: dict[str, dict] = {}
    in_process = None
    try:
        with tqdm(total=total, unit="req", file=sys.stderr) as progress:
            for name, client in clients.items():
                progress.set_description(f"ready? {name}")
                await client.wait_ready(args.wait)
                progress.set_description(f"warm-up {name}")
                warm = Workload(workload.prompts[:1] * args.warmup, workload.params, workload.chat, workload.seed)
                await run_level(client, warm, Level("concurrency", 1), lambda: progress.update())
            if args.in_process:
                progress.set_description("server vs in-process")
                in_process = await server_vs_in_process(clients["dflash"], workload, args.in_process, count_tokens)
            for n, level in enumerate(levels):
                order = list(clients) if n % 2 == 0 else list(clients)[::-1]  # A B, B A: drift hits all alike
                row = results.setdefault(level.label, {"level": asdict(level)})
                for name in order:
                    progress.set_description(f"{level.label} {name}")
                    outcomes, seconds = await run_level(clients[name], workload, level, lambda: progress.update())
                    row[name] = summarize(outcomes, seconds, count_tokens)
                if "baseline" in row:
                    row["speedup"] = compare(row["dflash"], row["baseline"])
                if "openai" in row:
                    row["gateway"] = gateway_overhead(row["openai"], row["dflash"])
    finally:
        for client in clients.values():
            await client.close()
    return {"config": {"url": args.url, "baseline_url": args.baseline_url, "openai_url": args.openai_url,
                       "protocol": args.protocol,
                       "prompts": args.prompts, "num_prompts": len(workload.prompts), "chat": workload.chat,
                       "params": asdict(workload.params), "warmup": args.warmup, "tokenizer": args.tokenizer},
            "server_vs_in_process": in_process, "levels": list(results.values())}


async def server_vs_in_process(client: AsyncDFlashClient, workload: Workload, build: str,
                               count_tokens: Callable[[str], int]) -> dict:
    """Single-stream tokens/s through the server against the same build's engine in this process.

    Prompt by prompt, alternating which goes first, so machine noise hits both alike. Greedy only:
    the two must return the same text (checked).
    """
    from dflash_contract.layout import read_manifest
    from dflash_runtime.pipeline import load_pipeline
    from dflash_runtime.sampling import SamplingParams

    manifest = read_manifest(build)
    drafter = str(manifest.drafter_dir) if manifest.drafter_dir else None
    pipe = load_pipeline(str(manifest.target_dir), drafter, manifest.options["dtype"])
    engine = pipe.engine(block_size=manifest.options["block_size"], max_batch_size=1)
    params = SamplingParams(max_new_tokens=workload.params.max_tokens, ignore_eos=workload.params.end_id == -1,
                            stop_token_ids=() if workload.params.end_id is None else (workload.params.end_id,))
    seconds = {"server": 0.0, "in_process": 0.0}
    tokens, identical, ttft = 0, 0, []

    def local(prompt: str) -> str:
        start = time.perf_counter()
        seq = engine.generate([pipe.encode(prompt, chat=workload.chat)], params)[0]
        seconds["in_process"] += time.perf_counter() - start
        return pipe.decode(seq.output_ids)

    async def remote(prompt: str) -> str:
        generation = await client.generate(prompt, workload.params, chat=workload.chat, stream=True)
        seconds["server"] += generation.timings.total
        ttft.append(generation.timings.ttft)
        return generation.text

    for n, prompt in enumerate(workload.prompts):
        if n % 2 == 0:
            mine, theirs = local(prompt), await remote(prompt)
        else:
            theirs, mine = await remote(prompt), local(prompt)
        identical += mine == theirs
        tokens += count_tokens(mine)
    rates = {k: tokens / max(v, 1e-9) for k, v in seconds.items()}
    return {"tokens": tokens, "tokens_per_second": {k: round(v, 2) for k, v in rates.items()},
            "ratio_server_vs_in_process": round(rates["server"] / rates["in_process"], 3),
            "server_ttft_p50_s": round(float(np.percentile(ttft, 50)), 3),
            "identical_texts": f"{identical}/{len(workload.prompts)}"}


def table(summary: dict) -> str:
    header = (f"{'level':<12}{'server':<10}{'req/s':>8}{'out tok/s':>11}{'TTFT p50/p90/p99 s':>22}"
              f"{'ITL p50/p90/p99 ms':>22}{'tau':>7}{'failed':>8}")
    lines = [header, "-" * len(header)]
    for row in summary["levels"]:
        label = Level(**row["level"]).label
        for name in ("dflash", "baseline", "openai"):
            if name in row:
                r = row[name]
                ttft = "/".join(_fmt(r["ttft_s"][f"p{p}"]) for p in PERCENTILES)
                itl = "/".join(_fmt(r["itl_s"][f"p{p}"], 1000, 1) for p in PERCENTILES)
                tau = _fmt(r["mean_acceptance_length"])
                lines.append(f"{label:<12}{name:<10}{r['requests_per_s']:>8.3f}{r['output_tokens_per_s']:>11.2f}"
                             f"{ttft:>22}{itl:>22}{tau:>7}{r['failed']:>8}")
                if "turn2" in r:
                    t2 = r["turn2"]
                    lines.append(f"{'':<12}{'  turn 2':<10}{'':>8}{'':>11}"
                                 + "{:>22}".format("/".join(_fmt(t2["ttft_s"][f"p{p}"]) for p in PERCENTILES))
                                 + f"   prompt tokens cached {_fmt(t2['cached_fraction'], 100, 1, '%')}")
        if "speedup" in row:
            s = row["speedup"]
            lines.append(f"{'':<12}{'speedup':<10}{'':>8}{_fmt(s['output_tokens_per_s'], suffix='x'):>11}"
                         f"{_fmt(s['ttft_p50'], suffix='x'):>22}{_fmt(s['itl_p50'], suffix='x'):>22}"
                         f"   identical texts {s['identical_texts']}"
                         + (f", turn-2 TTFT p50 ratio {s['turn2_ttft_p50_ratio']}" if "turn2_ttft_p50_ratio" in s
                            else ""))
        if "gateway" in row:
            g = row["gateway"]
            lines.append(f"{'':<12}{'gateway':<10}{'':>8}{_fmt(g['output_tokens_per_s'], suffix='x'):>11}"
                         f"{_fmt(g['ttft_p50_ms'], suffix=' ms'):>22}{'':>22}   identical texts {g['identical_texts']}")
            if "not_comparable" in g:
                lines.append(f"{'':<22}not comparable: {g['not_comparable']}")
    return "\n".join(lines)


def _fmt(value, scale: float = 1.0, digits: int = 2, suffix: str = "") -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}{suffix}"


def plot(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["levels"]
    x = [row["level"]["value"] for row in rows]
    kind = rows[0]["level"]["kind"]
    fig, (throughput, latency) = plt.subplots(1, 2, figsize=(11, 4))
    # a colour per server in both panels; on the latency panel a line style per measure
    for name, color in (("dflash", "C0"), ("baseline", "C1"), ("openai", "C2")):
        if name not in rows[0]:
            continue
        throughput.plot(x, [row[name]["output_tokens_per_s"] for row in rows], "-", color=color, marker="o",
                        label=name)
        latency.plot(x, [row[name]["ttft_s"]["p50"] for row in rows], "-", color=color, marker="o",
                     label=f"{name} TTFT p50")
        latency.plot(x, [row[name]["itl_s"]["p50"] for row in rows], "--", color=color, marker="s",
                     label=f"{name} ITL p50")
    xlabel = "concurrent requests" if kind == "concurrency" else "request rate (req/s)"
    throughput.set(xlabel=xlabel, ylabel="output tokens/s", title="throughput")
    latency.set(xlabel=xlabel, ylabel="seconds", yscale="log", title="latency")
    for ax in (throughput, latency):
        ax.set_xticks(x)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def token_counter(tokenizer: str) -> Callable[[str], int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    return lambda text: len(tok.encode(text, add_special_tokens=False)) if text else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-loadbench", description=__doc__, epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True, metavar="HOST:PORT", help="the DFlash server (gRPC port by default)")
    parser.add_argument("--baseline-url", metavar="HOST:PORT", help="a baseline server (build with --drafter none)")
    parser.add_argument("--openai-url", metavar="HOST:PORT",
                        help="also measure the server's OpenAI-compatible gateway (dflash-serve --openai-port)")
    parser.add_argument("--openai-api-key", metavar="KEY", help="the gateway's API key, if it requires one")
    parser.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    parser.add_argument("--tokenizer", required=True, metavar="DIR",
                        help="the served model's tokenizer, to count output tokens: <build>/target")
    parser.add_argument("--prompts", default="sharegpt", metavar="SET",
                        help="chat, sharegpt (held-out split), humaneval, mtbench, math500, or a .jsonl file "
                             "(default: sharegpt)")
    parser.add_argument("--num-prompts", type=int, default=32, metavar="N", help="requests per level (default: 32)")
    parser.add_argument("--turns", type=int, choices=[1, 2], default=1,
                        help="2: each request is a two-turn conversation whose second turn re-sends the first "
                             "turn's answer (mtbench, math500), measured apart (default: 1)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=int, nargs="+", metavar="N", help="concurrency levels (default: 1 4 8)")
    mode.add_argument("--request-rate", type=float, nargs="+", metavar="R", help="Poisson arrival rates, requests/s")
    parser.add_argument("--max-tokens", type=int, default=128, metavar="N", help="default: 128")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T",
                        help="0 = greedy (default): both servers must agree")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P")
    parser.add_argument("--speculative-sampling", choices=SPECULATIVE_SAMPLING,
                        help="how sampled requests verify drafts: exact or rejection (default: each server's build)")
    parser.add_argument("--seed", type=int, default=0, metavar="S",
                        help="sampling seed and arrival schedule (default: 0)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="run every answer to --max-tokens (sends end_id -1): the same work per request")
    parser.add_argument("--raw", action="store_true", help="send prompts as raw text, without the chat template")
    parser.add_argument("--warmup", type=int, default=2, metavar="N",
                        help="unmeasured requests per server first (default: 2)")
    parser.add_argument("--timeout", type=float, default=600, metavar="S",
                        help="per-request limit in seconds (default: 600)")
    parser.add_argument("--wait", type=float, default=60, metavar="S",
                        help="seconds to wait for the servers to be ready (default: 60)")
    parser.add_argument("--in-process", metavar="BUILD",
                        help="first compare single-stream tokens/s through the server with BUILD's engine run in "
                             "this process (the server's overhead); greedy")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--plot", metavar="PATH", help="PNG: throughput and latency against the level")
    return parser


def check_reach(source: str, asked: int, found: int, levels: list[Level]) -> None:
    """Refuses a run that would measure less than it says: fewer prompts than --num-prompts (a prompt sent twice
    would hit the prefix cache), or a concurrency that its prompts per level never reach."""
    if found < asked:
        raise ValueError(f"--prompts {source} has {found} prompts, fewer than --num-prompts {asked}: ask for at most "
                         f"{found}, or use a larger set (sharegpt, mtbench, humaneval, or a .jsonl file)")
    unreached = [level.value for level in levels if level.kind == "concurrency" and level.value > found]
    if unreached:
        raise ValueError(f"--concurrency {unreached[0]:g} is never reached with {found} prompts per level: "
                         f"give --num-prompts at least {max(unreached):g}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    levels = ([Level("request_rate", r) for r in args.request_rate] if args.request_rate
              else [Level("concurrency", c) for c in args.concurrency or (1, 4, 8)])
    try:
        if any(level.value <= 0 for level in levels) or args.num_prompts < 1 or args.warmup < 0:
            raise ValueError("levels and --num-prompts must be > 0, --warmup >= 0")
        from dflash_tools.prompts import prompt_set, second_turns  # dflash-bench's prompt sets (no torch)

        params = GenerationParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                  seed=args.seed if args.temperature > 0 else None,
                                  end_id=-1 if args.ignore_eos else None,
                                  speculative_sampling=args.speculative_sampling)
        if args.turns == 2 and args.raw:
            raise ValueError("--turns 2 sends conversations: it needs the chat template (drop --raw)")
        prompts = prompt_set(args.prompts, args.num_prompts)
        check_reach(args.prompts, args.num_prompts, len(prompts), levels)
        workload = Workload(prompts, params, not args.raw, args.seed,
                            second_turns(args.prompts, args.num_prompts) if args.turns == 2 else None)
        summary = asyncio.run(run(args, workload, levels, token_counter(args.tokenizer)))
    except (DFlashClientError, ValueError, OSError) as e:  # DFlashError (bad prompt set) is a ValueError
        print(f"dflash-loadbench: error: {e}", file=sys.stderr)
        return 1
    if summary["server_vs_in_process"]:
        print(f"server vs in-process (single stream): {json.dumps(summary['server_vs_in_process'])}")
    print(table(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        plot(summary, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
