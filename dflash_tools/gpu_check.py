"""Step timings of the engine on random-weight targets: what `make gpu-check` prints on a GPU machine.

    python3 -m dflash_tools.gpu_check [--shapes smollm2-135m qwen3-8b] [--batch-sizes 1 32] [--json FILE]

For each target shape (bfloat16 on CUDA; random weights and a random DFlash drafter of the matching
shape: a step's time does not depend on the weights), batch size and context (a short prompt, and one
that makes every step read ~2,048 keys), side by side in one process: transformers `generate` per
token, this engine's autoregressive step, and its draft + verify step at block 8 and 16 (CUDA graphs
on, as served). Printed as one table, with the bandwidth floor of an autoregressive step (weight bytes,
plus at long context the K/V it reads, over the measured device copy bandwidth), verify/AR,
draft/verify, the Gumbel-max of a block's positions over the vocabulary per verify (n/v: the noise and its
argmax, the Triton kernel on CUDA) and a whole sampled choice per verify (s/v: temperature, top-k, top-p,
the Gumbel-max; greedy steps do neither), and
the tokens/s a step time gives at acceptance lengths tau = 1, 3, 6; then which SDPA
backend each kind of attention ran on, and the CUDA graphs each engine captured when it started. Then one
layer's attention over the paged KV cache (its blocks gathered through a block table, as the engine reads
them) against the same keys read as one contiguous view, at each batch size with 2,048 and 16,384 keys. It
needs no checkpoint, no network and no package beyond torch and transformers, so it runs on a bare
lent machine.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from dflash_runtime.engine import SpeculativeEngine
from dflash_runtime.engine_sizes import cache_capacity
from dflash_runtime.kv_cache import BLOCK_SIZE, KVCache
from dflash_runtime.layers import AttentionMask
from dflash_runtime.sampling import GumbelNoise, RowParams, SamplingParams, sample_tokens

from .random_models import SHAPES, random_models
from .step_profile import profile_rows, table as host_table

BLOCKS = (8, 16)
PROMPT_TOKENS = 64
MAX_CONTEXT = 1024  # room for the timed steps even if random drafts were accepted
# Long context: a cache of 2,048 keys (max context + block), and prompts that leave room for every timed
# step to accept a whole block, so that all of them read the 2,048-key bucket
LONG_CONTEXT = 2048 - max(BLOCKS)
CONTEXTS = ("short", "long")
PAGED_KEYS = (2048, 16384)
PARTS = ("steps", "host", "paged", "masks")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, mib: int = 1024) -> float:
    """Bytes per second a device-to-device copy moves (read + write), the best of a few."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() / best


def hf_seconds_per_token(hf, batch: int, new_tokens: int, prompt: int) -> float:
    prompts = torch.randint(2, hf.config.vocab_size, (batch, prompt), device=hf.device)
    for tokens in (2, new_tokens):  # the first call warms up
        sync(hf.device)
        start = time.perf_counter()
        hf.generate(prompts, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
        sync(hf.device)
    return (time.perf_counter() - start) / new_tokens


def prompt_tokens(context: str, steps: int) -> int:
    # long: room for the warm-up and timed steps to accept a whole block each, and the last one's block
    return PROMPT_TOKENS if context == "short" else LONG_CONTEXT - (steps + 4) * max(BLOCKS) - 1


def step_seconds(engine: SpeculativeEngine, batch: int, steps: int, prompt: int) -> tuple[float, float, float]:
    """Median seconds of one engine step over a full batch (draft, verify, whole step)."""
    vocab = engine.target.config.shape.vocab_size
    params = SamplingParams(max_new_tokens=10 ** 6, ignore_eos=True)
    generator = torch.Generator().manual_seed(0)
    seqs = [engine.add_request(torch.randint(2, vocab, (prompt,), generator=generator).tolist(), params)
            for _ in range(batch)]
    engine.step()  # the prefills
    draft, verify, whole = [], [], []
    for _ in range(steps + 3):  # the first steps warm up (the allocator, the first replays)
        sync(engine.device)
        start = time.perf_counter()
        engine.step()
        whole.append(time.perf_counter() - start)
        draft.append(engine.last_step_seconds["draft"])
        verify.append(engine.last_step_seconds["verify"])
    for seq in seqs:
        engine.cancel(seq)
    return tuple(sorted(values[3:])[steps // 2] for values in (draft, verify, whole))


@contextmanager
def sdpa_backends(found: dict[str, set[str]]):
    """Record the SDPA backend of every attention the engine runs meanwhile (its start-up captures run every
    pass it serves), by kind: prefill, decode (one query), verify (a block, causal), draft (a block, open)."""
    attend = AttentionMask.attend

    def recording(mask, q, k, v):
        kind = ("prefill" if mask.visible is None else "decode" if q.shape[2] == 1
                else "draft" if mask.visible.shape[2] == 1 else "verify")
        found.setdefault(kind, set()).add(mask.backend(q, k, v))
        return attend(mask, q, k, v)

    AttentionMask.attend = recording
    try:
        yield found
    finally:
        AttentionMask.attend = attend


def timed_engine(target, drafter, block: int, batch: int, steps: int, context: str, backends: dict):
    """(draft, verify, step) seconds of an engine at a fixed block size, and what its graphs cost."""
    max_context = MAX_CONTEXT if context == "short" else LONG_CONTEXT
    with sdpa_backends(backends):
        engine = SpeculativeEngine(target, drafter if block > 1 else None, block_size=block, max_batch_size=batch,
                                   max_context=max_context)
        seconds = step_seconds(engine, batch, steps, prompt_tokens(context, steps))
    report = engine.graphs.report
    graphs = {"graphs": report.graphs, "MiB": round(report.pool_bytes / 2 ** 20, 1),
              "seconds": round(report.seconds, 2)}
    del engine
    return seconds, graphs


def sampling_seconds(vocab: int, batch: int, block: int, steps: int, device: torch.device) -> tuple[float, float]:
    """Median seconds of the Gumbel-max (noise and argmax) of batch x block positions over the vocabulary, and
    of a whole sampled choice there (temperature 1, top-k 50, top-p 0.95, the Gumbel-max) on random logits."""
    rows = RowParams.of([SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=n) for n in range(batch)], vocab,
                        device)
    positions = torch.arange(block, device=device).expand(batch, block) + PROMPT_TOKENS
    logits = torch.randn(batch, block, vocab, device=device, dtype=torch.bfloat16 if device.type == "cuda" else None)
    scores = logits.float()
    timings = {"noise": [], "sample": []}
    for _ in range(steps + 3):
        for name, run in (("noise", lambda: GumbelNoise(rows.seeds, positions, vocab).argmax(scores)),
                          ("sample", lambda: sample_tokens(logits, rows, GumbelNoise(rows.seeds, positions, vocab)))):
            sync(device)
            start = time.perf_counter()
            run()
            sync(device)
            timings[name].append(time.perf_counter() - start)
    return tuple(sorted(values[3:])[steps // 2] for values in timings.values())


def kv_bytes_per_token(target) -> int:
    s = target.config.shape
    return 2 * s.num_layers * s.num_kv_heads * s.head_dim * target.dtype.itemsize


def measure_shape(name: str, batch: int, context: str, steps: int, bandwidth: float, models) -> dict:
    hf, target, drafter = models
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    # what an autoregressive step must read: the weights, and each sequence's K/V (its bucket of keys)
    keys = 0 if context == "short" else cache_capacity(LONG_CONTEXT, 1)  # the last length bucket: the capacity
    read_bytes = weight_bytes + batch * keys * kv_bytes_per_token(target)
    hf_s = hf_seconds_per_token(hf, batch, steps, prompt_tokens(context, steps))
    backends, graphs = {}, {}
    (_, _, ar_s), graphs["ar"] = timed_engine(target, drafter, 1, batch, steps, context, backends)
    row = {"shape": name, "batch": batch, "context": context, "keys": keys, "weight_GB": round(weight_bytes / 1e9, 3),
           "hf_generate_ms_per_token": round(hf_s * 1e3, 3), "ar_step_ms": round(ar_s * 1e3, 3),
           "bandwidth_floor_ms": round(read_bytes / bandwidth * 1e3, 3),
           "ar_tokens_per_second": round(batch / ar_s, 1), "ar_vs_hf_generate": round(hf_s / ar_s, 2)}
    row["ar_vs_floor"] = round(row["ar_step_ms"] / row["bandwidth_floor_ms"], 2)
    for block in BLOCKS:
        (draft_s, verify_s, step_s), graphs[f"block{block}"] = timed_engine(target, drafter, block, batch, steps,
                                                                             context, backends)
        row[f"block{block}"] = {"step_ms": round(step_s * 1e3, 3), "draft_ms": round(draft_s * 1e3, 3),
                                "verify_ms": round(verify_s * 1e3, 3), "verify_vs_ar": round(verify_s / ar_s, 2),
                                "draft_vs_verify": round(draft_s / verify_s, 3),
                                "tokens_per_second": {tau: round(batch * tau / step_s, 1) for tau in (1, 3, 6)}}
        noise_s, sample_s = sampling_seconds(target.config.shape.vocab_size, batch, block, steps, target.device)
        row[f"block{block}"].update({"noise_ms": round(noise_s * 1e3, 3), "sample_ms": round(sample_s * 1e3, 3),
                                     "noise_vs_verify": round(noise_s / verify_s, 3),
                                     "sample_vs_verify": round(sample_s / verify_s, 3)})
    row["sdpa_backends"] = {kind: sorted(names) for kind, names in sorted(backends.items())}
    row["cuda_graphs"] = graphs
    return row


def paged_attention_row(name: str, batch: int, keys: int, steps: int, device: torch.device, dtype: torch.dtype) -> dict:
    """One layer's decode attention (a query per sequence) over `keys` keys per sequence: gathered from a paged
    cache whose blocks are shuffled (as a busy pool hands them out), and read as a view of a contiguous cache."""
    config = SHAPES[name][0]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim", config["hidden_size"] // heads)
    width = keys // BLOCK_SIZE
    cache = KVCache(1, batch * width + 1, BLOCK_SIZE, kv_heads, head_dim, dtype, device)
    cache.k.normal_()
    cache.v.normal_()
    table = (torch.randperm(batch * width, device=device) + 1).view(batch, width)
    contiguous = torch.randn(2, batch, kv_heads, keys, head_dim, dtype=dtype, device=device)
    query = torch.randn(batch, heads, 1, head_dim, dtype=dtype, device=device)
    mask = AttentionMask(torch.ones(batch, 1, 1, keys, dtype=torch.bool, device=device), heads, kv_heads)
    address = cache.address(table, keys)
    runs = {"paged": lambda: mask.attend(query, *cache.read(0, address)),
            "contiguous": lambda: mask.attend(query, contiguous[0], contiguous[1])}
    seconds = {}
    for kind, run in runs.items():
        timings = []
        for _ in range(steps + 2):
            sync(device)
            start = time.perf_counter()
            run()
            sync(device)
            timings.append(time.perf_counter() - start)
        seconds[kind] = sorted(timings[2:])[steps // 2]
    return {"shape": name, "batch": batch, "keys": keys, "paged_ms": round(seconds["paged"] * 1e3, 3),
            "contiguous_ms": round(seconds["contiguous"] * 1e3, 3),
            "paged_vs_contiguous": round(seconds["paged"] / seconds["contiguous"], 2)}


def synthetic_vocab(size: int) -> list[str]:
    """A raw vocabulary of `size` distinct tokens for xgrammar: id 0 the end (empty: special), then every printable
    ASCII character, then strings of 2+ characters (a real tokenizer's is not needed: a mask's cost is per token)."""
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 _-.,:\"{}"
    tokens = [""] + [chr(c) for c in range(32, 127)]
    n = 0
    while len(tokens) < size:
        word, i = "", n + len(alphabet)  # at least two characters
        while i:
            i, r = divmod(i, len(alphabet))
            word += alphabet[r]
        tokens.append(word)
        n += 1
    return tokens


# Inside a JSON string, free and bounded: xgrammar checks a bounded string's multi-character tokens at run time
# (measured on a CPU with SmolLM2's tokenizer, a fill and an accept: 8 us against 19 us per position with
# maxLength 40 in xgrammar 0.2.9; 6 against 208 us in 0.2.8)
MASK_SCHEMAS = {"string": {"type": "object", "properties": {"topic": {"type": "string"}}, "required": ["topic"]},
                "maxLength 40": {"type": "object", "properties": {"topic": {"type": "string", "maxLength": 40}},
                                 "required": ["topic"]}}


def grammar_mask_row(name: str, batch: int, steps: int, device: torch.device, dtype: torch.dtype,
                     schema: str) -> dict:
    """Guided decoding's mask work in a verify step of the widest block, each sequence inside a JSON string of
    MASK_SCHEMAS[schema] (every draft a letter): filling xgrammar's bitmasks along the drafts on the host, and
    applying them to the logits."""
    import xgrammar

    from dflash_contract.guided_decoding import Guide
    from dflash_runtime.grammar import GrammarCompiler, mask_logits, new_bitmask

    vocab, k = SHAPES[name][0]["vocab_size"], max(BLOCKS)
    tokens = synthetic_vocab(vocab)
    info = xgrammar.TokenizerInfo(tokens, xgrammar.VocabType.RAW, vocab_size=vocab, stop_token_ids=[0])
    compiler = GrammarCompiler(info)
    grammars = [compiler.grammar(Guide("json_schema", json.dumps(MASK_SCHEMAS[schema])), [0]) for _ in range(batch)]
    for grammar in grammars:
        grammar.matcher.accept_string('{"topic": "')
    drafts = [tokens.index("a")] * (k - 1)
    logits = torch.randn(batch * k, vocab, dtype=dtype, device=device)
    rows = list(range(batch * k))
    timings = {"fill": [], "apply": []}
    for _ in range(steps + 2):
        start = time.perf_counter()
        bitmask = new_bitmask(batch * k, vocab)
        for i, grammar in enumerate(grammars):
            grammar.fill_along(drafts, bitmask, i * k)
        filled = time.perf_counter()
        sync(device)
        applied = time.perf_counter()
        mask_logits(logits, bitmask, rows)
        sync(device)
        timings["fill"].append(filled - start)
        timings["apply"].append(time.perf_counter() - applied)
    fill, apply = (sorted(t[2:])[steps // 2] * 1e3 for t in timings.values())
    return {"shape": name, "batch": batch, "schema": schema, "positions": k, "vocab": vocab,
            "fill_ms": round(fill, 3), "apply_ms": round(apply, 3)}


def mask_table(rows: list[dict], steps: list[dict]) -> str:
    verify = {(r["shape"], r["batch"]): r[f"block{max(BLOCKS)}"]["verify_ms"] for r in steps if not r["keys"]}
    lines = [f"guided decoding masks, a verify of {max(BLOCKS)} positions per sequence (host fill, device apply)",
             f"{'shape':13s} {'B':>3s} {'vocab':>7s} {'in a JSON string':16s} {'fill ms':>8s} {'apply ms':>9s} "
             f"{'vs verify':>9s}"]
    for r in rows:
        pass_ms = verify.get((r["shape"], r["batch"]))
        share = f"{(r['fill_ms'] + r['apply_ms']) / pass_ms:9.3f}" if pass_ms else f"{'-':>9s}"
        lines.append(f"{r['shape']:13s} {r['batch']:>3d} {r['vocab']:>7d} {r['schema']:16s} {r['fill_ms']:>8.3f} "
                     f"{r['apply_ms']:>9.3f} {share}")
    return "\n".join(lines)


def paged_table(rows: list[dict]) -> str:
    lines = [f"paged attention, one layer, a query per sequence, blocks of {BLOCK_SIZE}",
             f"{'shape':13s} {'B':>3s} {'keys':>6s} {'paged ms':>9s} {'view ms':>8s} {'ratio':>6s}"]
    lines += [f"{r['shape']:13s} {r['batch']:>3d} {r['keys']:>6d} {r['paged_ms']:>9.3f} {r['contiguous_ms']:>8.3f} "
              f"{r['paged_vs_contiguous']:>6.2f}" for r in rows]
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    head = (f"{'shape':13s} {'B':>3s} {'keys':>5s} {'hf ms/tok':>9s} {'AR ms':>7s} {'floor':>6s} {'AR/fl':>5s} "
            f"{'AR/hf':>6s} " + " ".join(f"{f'v{b}/AR':>6s} {f'd/v{b}':>6s} {f'n/v{b}':>6s} {f's/v{b}':>6s} "
                                         f"{f'tok/s@tau1,3,6 (b{b})':>24s}" for b in BLOCKS))
    lines = [head]
    for r in rows:
        cells = [f"{r['shape']:13s} {r['batch']:3d} {r['keys']:5d} {r['hf_generate_ms_per_token']:9.2f} "
                 f"{r['ar_step_ms']:7.2f} {r['bandwidth_floor_ms']:6.2f} {r['ar_vs_floor']:5.2f} "
                 f"{r['ar_vs_hf_generate']:6.1f}"]
        for b in BLOCKS:
            s = r[f"block{b}"]
            rates = "/".join(f"{v:.0f}" for v in s["tokens_per_second"].values())
            cells.append(f"{s['verify_vs_ar']:6.2f} {s['draft_vs_verify']:6.3f} {s['noise_vs_verify']:6.3f} "
                         f"{s['sample_vs_verify']:6.3f} {rates:>24s}")
        lines.append(" ".join(cells))
    lines.append("")
    lines.append(f"{'shape':13s} {'B':>3s} {'keys':>5s}  SDPA backend by attention; "
                 "CUDA graphs (count/MiB/s) by engine")
    for r in rows:
        backends = ", ".join(f"{kind} {'+'.join(names)}" for kind, names in r["sdpa_backends"].items())
        graphs = ", ".join(f"{engine} {g['graphs']}/{g['MiB']:.0f}/{g['seconds']:.1f}"
                           for engine, g in r["cuda_graphs"].items())
        lines.append(f"{r['shape']:13s} {r['batch']:3d} {r['keys']:5d}  {backends}; {graphs}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["smollm2-135m", "qwen3-8b"], choices=list(SHAPES))
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--contexts", nargs="+", default=list(CONTEXTS), choices=CONTEXTS,
                        help=f"short: {PROMPT_TOKENS}-token prompts; long: steps that read ~2,048 keys")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per measurement (the median counts)")
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu runs the same code, slowly")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS,
                        help="steps: the engine's step timings; host: each step's time by phase, host and passes "
                             "apart (dflash-profile-step's table); paged: paged attention against a view; masks: "
                             "guided decoding's grammar masks (needs xgrammar; skipped without it) (default: all)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: error: torch sees no CUDA GPU here", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(device)
    print(f"device copy bandwidth {bandwidth / 1e9:.0f} GB/s", file=sys.stderr)
    rows, host, paged, masks = [], [], [], []
    with torch.inference_mode():
        for name in args.shapes:
            if "paged" in args.parts:
                paged += [paged_attention_row(name, batch, keys, args.steps, device, dtype)
                          for batch in args.batch_sizes for keys in PAGED_KEYS]
            if "masks" in args.parts and importlib.util.find_spec("xgrammar") is not None:
                masks += [grammar_mask_row(name, batch, args.steps, device, dtype, schema)
                          for schema in MASK_SCHEMAS for batch in args.batch_sizes]
            if "steps" not in args.parts and "host" not in args.parts:
                continue
            with tempfile.TemporaryDirectory() as folder:
                models = random_models(name, device, dtype, Path(folder))
                for context in args.contexts if "steps" in args.parts else ():
                    for batch in args.batch_sizes:
                        rows.append(measure_shape(name, batch, context, args.steps, bandwidth, models))
                        print(f"{name} batch {batch} {context}: {json.dumps(rows[-1])}", file=sys.stderr)
                if "host" in args.parts:
                    host += profile_rows(name, *models[1:], args.batch_sizes, [1, 8], args.steps)
                del models
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if rows:
        print(table(rows))
    if host:
        print(host_table(host))
    if paged:
        print(paged_table(paged))
    if masks:
        print(mask_table(masks, rows))
    elif "masks" in args.parts:
        print("guided decoding masks: skipped, xgrammar is not installed here", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": str(torch.cuda.get_device_name(device)
                                                             if device.type == "cuda" else "cpu"),
                                               "copy_bandwidth_GBps": round(bandwidth / 1e9, 1), "rows": rows,
                                               "host_phases": host,
                                               "paged_attention": paged, "grammar_masks": masks},
                                              indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
