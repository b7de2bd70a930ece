"""dflash-bench: speed and acceptance of DFlash against autoregressive decoding, side by side.

For each prompt set and --temperature, every prompt runs through (a) transformers `generate` (unless
--no-hf; greedy runs only), (b) this runtime's autoregressive mode and (c) DFlash modes: each
--block-size ("auto" and/or fixed sizes) with each --speculative-sampling method and --draft-sharpness,
interleaved prompt by prompt in one process so machine noise hits all modes alike: the ratios are the
result. Reports per set and temperature: tokens/s; per DFlash mode its speedup over autoregressive, the
mean acceptance length tau (tokens per verify step), the per-position acceptance curve (how often draft
j was accepted when the drafts before it were), how many steps verified each length, and the
draft-to-verify time ratio; and whether all outputs were token-identical (sampled runs too: exact
sampling keeps the target's own sample; rejection sampling's outputs are left out of that check).
Writes JSON and, with --plot, a PNG. On a CPU, --cpu-weights picks the target's weight format and
--vs-llama-cpp adds llama.cpp on the same GGUF as two more modes: plain, and its prompt-lookup
speculative decoding.

Example, against llama.cpp on the same GGUF and threads, with batch 8 throughput:
  dflash-bench --prompts chat humaneval sharegpt --block-size auto 8 --no-hf --vs-llama-cpp --batch 8

Example, the drafts' survival under sampling:
  dflash-bench --prompts chat humaneval sharegpt --block-size 8 --temperature 0 0.7 1 --no-hf \
      --speculative-sampling exact rejection --draft-sharpness auto 0 0.5 1
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections import Counter
from dataclasses import replace

import torch

from dflash_contract import DFlashError
from dflash_contract.presets import (AUTO_BLOCK_SIZE, CPU_WEIGHTS, DEFAULT_KV_CONTEXT, DEFAULT_PRESET,
                                     DEFAULT_SPECULATIVE_SAMPLING, SPECULATIVE_SAMPLING, block_size_argument)
from dflash_runtime.sampling import DRAFT_SHARPNESS_CHOICES, SamplingParams, SamplingStats

from .prompts import prompt_set, second_turns


class Mode:
    """Tokens and wall-clock seconds of one decoding mode over a prompt set."""

    def __init__(self):
        self.tokens, self.seconds = 0, 0.0

    def timed(self, generate):
        """generate() -> output token ids; timed and counted."""
        start = time.perf_counter()
        out = generate()
        self.seconds += time.perf_counter() - start
        self.tokens += len(out)
        return out

    @property
    def rate(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def _run_to_end(engine, seq) -> list[int]:
    while engine.has_unfinished():
        engine.step()
    return seq.output_ids


def measure(pipe, hf, autoregressive, dflash: dict, prompts: list[list[int]], max_new_tokens: int, label: str,
            sampling: SamplingParams | None = None, llama=None) -> dict:
    """dflash: mode label ("auto", "8", "8 rejection", ...) -> engine; every prompt runs through every mode.
    sampling: temperature, top-k, top-p and seed for every mode (greedy if None); prompt n samples with seed
    + n. Token identity is checked between the modes whose sample cannot depend on the drafter (not
    rejection sampling; transformers only when greedy). llama: label -> llama_cpp.Llama on the target's GGUF
    (load_llama_cpp), each run greedy as one more mode (greedy runs only), its answers compared with our plain
    decoding's apart: other arithmetic, another model."""
    sampling = sampling or SamplingParams()
    hf = hf if sampling.greedy else None
    llama = llama if llama and sampling.greedy else {}
    eos = list(pipe.target.config.eos_token_ids)
    modes = {"autoregressive": Mode(), **{f"dflash {b}": Mode() for b in dflash}}
    if hf is not None:
        modes["hf_generate"] = Mode()
    modes.update({label: Mode() for label in llama})
    same_as_llama = Counter()
    stats, identical = {b: SamplingStats() for b in dflash}, 0
    engines = [autoregressive, *dflash.values()]
    lookups = [(e.block_manager.queried_tokens, e.block_manager.hit_tokens) for e in engines]
    for n, ids in enumerate(prompts, 1):
        params = replace(sampling, max_new_tokens=max_new_tokens, seed=None if sampling.greedy else sampling.seed + n)
        outputs = []
        if hf is not None:
            outputs.append(modes["hf_generate"].timed(lambda: hf.generate(
                torch.tensor([ids], device=hf.device), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                pad_token_id=eos[0])[0, len(ids):].tolist()))
        theirs = {label: modes[label].timed(lambda: llama_cpp_greedy(model, ids, max_new_tokens, eos))
                  for label, model in llama.items()}
        outputs.append(modes["autoregressive"].timed(lambda: autoregressive.generate([ids], params)[0].output_ids))
        same_as_llama.update(label for label, out in theirs.items() if out == outputs[-1])
        taus = _run_dflash_modes(dflash, modes, stats, ids, params, outputs)
        same = all(o == outputs[0] for o in outputs)
        identical += same
        print(f"[{label} {n}/{len(prompts)}] {len(ids)} prompt tokens, {len(outputs[0])} new, {', '.join(taus)}, "
              f"identical: {same}", file=sys.stderr)
    rate = {m: mode.rate for m, mode in modes.items()}
    queried = sum(e.block_manager.queried_tokens - q for e, (q, _) in zip(engines, lookups))
    hits = sum(e.block_manager.hit_tokens - h for e, (_, h) in zip(engines, lookups))
    result = {
        "num_prompts": len(prompts),
        # prompt tokens every engine found in its prefix cache (a shared chat template, or a set run again)
        "prefix_cache_hit_rate": round(hits / queried, 4) if queried else None,
        "tokens_per_second": {m: round(r, 2) for m, r in rate.items()},
        "dflash": {b: {"speedup_vs_autoregressive": round(rate[f"dflash {b}"] / rate["autoregressive"], 3),
                       **speculation_summary(stats[b]), **auto_summary(e, stats[b])} for b, e in dflash.items()},
        # the rule a learning engine drafts with after the set (it learns across sets, as a server would)
        "draft_sharpness": {b: e.proposal_rule.sharpness() for b, e in dflash.items()
                            if not sampling.greedy and e.speculative_sampling == "exact"},
        "token_identical_prompts": f"{identical}/{len(prompts)}",
    }
    if hf is not None:
        result["ratio_autoregressive_vs_hf"] = round(rate["autoregressive"] / rate["hf_generate"], 3)
    if llama:
        result["llama_cpp"] = {label: {"ratio_autoregressive_vs": round(rate["autoregressive"] / rate[label], 3),
                                       "identical_prompts": f"{same_as_llama[label]}/{len(prompts)}"}
                               for label in llama}
    return result


def _run_dflash_modes(dflash: dict, modes: dict, stats: dict, ids: list[int], params: SamplingParams,
                      outputs: list[list[int]]) -> list[str]:
    """One prompt through every DFlash mode: its output joins `outputs` where it must equal plain decoding's (not
    under rejection sampling); its speculation joins `stats`. Returns each mode's tau, for the progress line."""
    taus = []
    for b, engine in dflash.items():
        seq = engine.add_request(ids, params)
        output = modes[f"dflash {b}"].timed(lambda: _run_to_end(engine, seq))
        if params.greedy or engine.speculative_sampling != "rejection":
            outputs.append(output)
        stats[b].merge(seq.stats)
        tau = seq.stats.mean_acceptance_length
        taus.append(f"tau[{b}] {'none' if tau is None else f'{tau:.2f}'}")
    return taus


def llama_cpp_greedy(llama, ids: list[int], max_new_tokens: int, eos: list[int]) -> list[int]:
    """llama.cpp's greedy answer to a prompt's token ids (its KV cache reuses a shared prefix, as ours does)."""
    out = []
    for token in llama.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        if token in eos:
            break
        out.append(token)
        if len(out) == max_new_tokens:
            break
    return out


def load_llama_cpp(pipe, threads: int, context: int, lookup_tokens: int) -> dict:
    """llama-cpp-python (the optional `llama` extra) on the GGUF the target was converted from, as two modes:
    "llama.cpp" decodes plainly; "llama.cpp lookup" drafts by its prompt lookup (LlamaPromptLookupDecoding: the
    `lookup_tokens` tokens after the first earlier occurrence of the text's last 2 tokens, else its last 1) and
    verifies them in one batch, the draft-free anchor of our suffix drafts."""
    from dflash_runtime.checkpoint import gguf_source

    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        raise DFlashError("--vs-llama-cpp needs llama-cpp-python: pip install -e '.[llama]' (it builds llama.cpp "
                          "from source, ~10 minutes on 2 cores)") from None
    gguf = gguf_source(pipe.target_dir)
    if gguf is None:
        raise DFlashError(f"--vs-llama-cpp: {pipe.target_dir} was not converted from a GGUF file")
    common = dict(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=context, verbose=False)
    return {"llama.cpp": Llama(**common),
            LLAMA_LOOKUP: Llama(**common, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens))}


SECOND_TURNS = "2"  # a set name ending so (mtbench2, math5002) asks for the set's second turns


def encoded_set(pipe, engine, name: str, count: int, max_new_tokens: int) -> list[list[int]]:
    """The token ids of a prompt set's prompts; for "<set>2", each conversation's second turn after the target's
    own greedy first answer (made here by `engine`), as a chat would send it."""
    if not (name.endswith(SECOND_TURNS) and name[:-1] in ("mtbench", "math500")):
        return [pipe.encode(p) for p in prompt_set(name, count)]
    firsts = prompt_set(name[:-1], count)
    answers = engine.generate([pipe.encode(p) for p in firsts], SamplingParams(max_new_tokens=max_new_tokens))
    engine.block_manager.forget()  # the first turns' cached blocks would flatter this engine alone
    return [pipe.encode([{"role": "user", "content": first},
                         {"role": "assistant", "content": pipe.decode(answer.output_ids)},
                         {"role": "user", "content": second}])
            for first, answer, second in zip(firsts, answers, second_turns(name[:-1], count))]


def batch_throughput(engine, prompts: list[list[int]], max_new_tokens: int) -> float:
    """Tokens per second of one engine answering a full batch at once, greedy: the set's prompts, repeated
    (in turn) where the set has fewer than the engine's batch size."""
    batch = [prompts[i % len(prompts)] for i in range(max(len(prompts), engine.scheduler.num_slots))]
    start = time.perf_counter()
    seqs = engine.generate(batch, SamplingParams(max_new_tokens=max_new_tokens))
    return round(sum(len(s.output_ids) for s in seqs) / (time.perf_counter() - start), 2)


def speculation_summary(stats: SamplingStats) -> dict:
    """tau, the drafter's acceptance curve, the verify lengths used, the draft-to-verify time of a run, and per
    draft source (drafter, suffix, none) its steps, drafts and accepted drafts."""
    return {
        "mean_acceptance_length": stats.mean_acceptance_length and round(stats.mean_acceptance_length, 3),
        "acceptance_by_position": [round(p, 4) for p in stats.conditional_acceptance],
        "verify_lengths": {str(k): n for k, n in sorted(Counter(stats.verify_lengths).items())},
        "draft_to_verify_time": round(stats.draft_seconds / max(stats.verify_seconds, 1e-9), 3),
        "by_source": stats.sources.summary(),
    }


def auto_summary(engine, stats: SamplingStats) -> dict:
    """For an `auto` engine: what it did and why, in words (verify_length.auto_in_words)."""
    if engine.policy is None:
        return {}
    from dflash_runtime.verify_length import auto_in_words

    return {"auto": auto_in_words(engine.policy.costs, stats.sources.summary())}


def projections(pipe) -> str:
    """Which path the linears ran: on a CPU, the target's weight format (cpu_weights) and, for float32 linears,
    thread-split or F.linear as measured on this host (cpu_linears)."""
    if pipe.target.device.type != "cpu":
        return f"F.linear on {pipe.target.device}"
    from dflash_runtime.cpu_linears import describe

    return (f"target weights {pipe.target.served_weights.describe()}; float32 {describe(pipe.target)}; "
            f"drafter {describe(pipe.drafter).split(': ', 1)[1]}")


def run(args) -> dict:
    from dflash_runtime.pipeline import load_pipeline

    torch.manual_seed(0)
    pipe = load_pipeline(args.target, args.drafter, args.dtype, args.device, cpu_weights=args.cpu_weights)
    if pipe.drafter is None:
        raise DFlashError("the benchmark compares against DFlash: the target needs a drafter (--drafter DIR)")
    print(f"[projections] {projections(pipe)}", file=sys.stderr)
    llama = None
    if args.vs_llama_cpp:
        llama = load_llama_cpp(pipe, torch.get_num_threads(), pipe.preset.kv_context if pipe.preset else DEFAULT_KV_CONTEXT,
                               args.llama_lookup_tokens)
    hf = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(pipe.target_dir, dtype=pipe.target.dtype).eval()
        hf = hf.to(pipe.target.device)
    autoregressive = pipe.engine(block_size=1, max_batch_size=1)
    dflash = {label: pipe.engine(block_size=b, max_batch_size=1, **sampling) for label, b, sampling in modes(args)}
    sets = {name: encoded_set(pipe, autoregressive, name, args.num_prompts, args.max_new_tokens)
            for name in args.prompts}
    results = {}
    with torch.inference_mode():
        warm = next(iter(sets.values()))[:1]  # first-call allocations stay out of the numbers
        measure(pipe, hf, autoregressive, dflash, warm, 4, "warm-up")
        for engine in (autoregressive, *dflash.values()):  # nor do the warm-up prompt's cached blocks
            engine.block_manager.forget()
        for temperature in args.temperature:
            sampling = SamplingParams(temperature=temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed) \
                if temperature > 0 else None
            for round_, (name, prompts) in itertools.product(range(1, args.rounds + 1), sets.items()):
                label = name if sampling is None else f"{name} T={temperature:g}"
                label += f" round {round_}" if args.rounds > 1 else ""
                results[label] = measure(pipe, hf, autoregressive, dflash, prompts, args.max_new_tokens, label,
                                         sampling, llama)
                if args.batch and sampling is None:
                    batched = pipe.engine(block_size=1, max_batch_size=args.batch)
                    results[label][f"autoregressive_batch{args.batch}_tokens_per_second"] = batch_throughput(
                        batched, prompts, args.max_new_tokens)
    # every autoregressive token streams all weights once: the figure to hold against memory bandwidth
    weights = [*pipe.target.parameters(), *(t for m in pipe.target.modules() for t in getattr(m, "tensors", ()))]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in weights}
    ar_rate = sum(r["tokens_per_second"]["autoregressive"] for r in results.values()) / len(results)
    return {
        "target": str(pipe.target_dir), "drafter": args.drafter,
        "block_sizes": [str(b) for b in dict.fromkeys(args.block_size)],
        "modes": list(dflash), "drafter_block_size": pipe.drafter.config.block_size,
        "max_new_tokens": args.max_new_tokens, "threads": torch.get_num_threads(), "projections": projections(pipe),
        "sampling": {"top_k": args.top_k, "top_p": args.top_p, "seed": args.seed},
        "autoregressive_weight_GBps": round(sum(storages.values()) * ar_rate / 1e9, 2),
        "prompt_sets": results,
    }


AUTO_SHARPNESS = "auto"
LLAMA_LOOKUP = "llama.cpp lookup"
LLAMA_LOOKUP_TOKENS = 2
SHARED_SUFFIX_TOKENS = 65536  # --suffix-drafts shared: earlier answers held per mode (256 KB)


def sharpness_argument(text: str) -> str:
    """--draft-sharpness: "auto" or a number >= 0, kept as written (it labels the mode)."""
    if text == AUTO_SHARPNESS:
        return text
    try:
        ok = float(text) >= 0
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"a draft sharpness is auto or a number >= 0, got {text!r}")
    return text


def modes(args) -> list[tuple[str, int | str, dict]]:
    """(label, block size, engine options) per DFlash mode: every block size with every speculative sampling
    method, for "exact" every draft sharpness, and for "auto" with and without suffix drafts as asked. A label
    names only what varies ("auto" with suffix drafts, "auto drafter-only" without, "auto shared" with drafts from
    earlier answers too)."""
    result = []
    for block_size in dict.fromkeys(args.block_size):
        for method in dict.fromkeys(args.speculative_sampling):
            for sharpness in dict.fromkeys(args.draft_sharpness) if method == "exact" else [None]:
                for suffix in dict.fromkeys(args.suffix_drafts) if block_size == AUTO_BLOCK_SIZE else ["off"]:
                    label = str(block_size)
                    if len(args.speculative_sampling) > 1:
                        label += f" {method}"
                    if sharpness is not None and len(args.draft_sharpness) > 1:
                        label += f" sharpness {sharpness}"
                    if suffix != "on" and block_size == AUTO_BLOCK_SIZE:
                        label += " drafter-only" if suffix == "off" else " shared"
                    options = {"speculative_sampling": method, "suffix_drafts": suffix != "off",
                               "shared_suffix_tokens": SHARED_SUFFIX_TOKENS if suffix == "shared" else 0}
                    if sharpness not in (None, AUTO_SHARPNESS):
                        options["draft_sharpness"] = float(sharpness)
                    result.append((label, block_size, options))
    return result


def summary_table(summary: dict) -> str:
    """Per prompt set and mode: tokens/s, speedup over autoregressive decoding, tau, and token identity."""
    lines = [f"{'prompt set':<20} {'mode':<24} {'tok/s':>8} {'speedup':>8} {'tau':>6}  identical"]
    for name, r in summary["prompt_sets"].items():
        rates = r["tokens_per_second"]
        lines.append(f"{name:<20} {'autoregressive':<24} {rates['autoregressive']:>8.2f} {'1.00x':>8} {'':>6}  "
                     f"{r['token_identical_prompts']}")
        for mode, d in r["dflash"].items():
            tau = d["mean_acceptance_length"]
            lines.append(f"{'':<20} {'dflash ' + mode:<24} {rates['dflash ' + mode]:>8.2f} "
                         f"{d['speedup_vs_autoregressive']:>7.2f}x {'-' if tau is None else f'{tau:.2f}':>6}")
        for label, theirs in r.get("llama_cpp", {}).items():
            lines.append(f"{'':<20} {label:<24} {rates[label]:>8.2f} {rates[label] / rates['autoregressive']:>7.2f}x "
                         f"{'':>6}  {theirs['identical_prompts']} as ours (its own arithmetic)")
    return "\n".join(lines)


def plot(summary: dict, path: str) -> None:
    """Left: acceptance by block position, per prompt set, of the longest fixed block (auto's own when there is
    none); right: tau per prompt set, a bar per mode, each labelled with its speedup over plain decoding."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets, modes = summary["prompt_sets"], summary["modes"]
    fig, (curve, bars) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2, 3]})

    def block(mode: str) -> tuple[int, bool]:  # a fixed block before auto's of the same size: its curve is a block's
        size = mode.split()[0]
        return (summary["drafter_block_size"], False) if size == AUTO_BLOCK_SIZE else (int(size), True)

    longest = max(modes, key=block)
    for name, r in sets.items():
        acc = r["dflash"][longest]["acceptance_by_position"]
        curve.plot(range(1, len(acc) + 1), acc, marker="o", label=name)
    curve.set(xlabel="block position j", ylabel="P(draft j accepted | drafts before it were)", ylim=(0, 1),
              title=f"acceptance by position (dflash {longest})")
    curve.legend()
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        x = [n + (i - (len(modes) - 1) / 2) * width for n in range(len(sets))]
        taus = [r["dflash"][mode]["mean_acceptance_length"] or 0 for r in sets.values()]  # 0: no verify step
        drawn = bars.bar(x, taus, width, label=f"dflash {mode}")
        bars.bar_label(drawn, [f"{r['dflash'][mode]['speedup_vs_autoregressive']:.2f}x" for r in sets.values()],
                       fontsize=7)
    bars.set_xticks(range(len(sets)), list(sets))
    bars.set(ylabel="mean acceptance length tau", title="tau by prompt set and mode (labels: speedup vs plain)")
    bars.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_PRESET, help="preset name or checkpoint directory")
    parser.add_argument("--drafter", default="preset", help="drafter directory (default: the preset's)")
    parser.add_argument("--prompts", nargs="+", default=["chat"],
                        help="prompt sets: chat, humaneval, codeedit (HumanEval's solutions with an edit to make), "
                             "sharegpt (held-out split), mtbench, mtbench2 (MT-Bench's second turns after the "
                             "target's own greedy first answers), math500, or .jsonl files")
    parser.add_argument("--num-prompts", type=int, default=4, help="prompts per set (default: 4)")
    parser.add_argument("--max-tokens", "--max-new-tokens", dest="max_new_tokens", type=int, default=128,
                        help="tokens per answer at most (default: 128)")
    parser.add_argument("--block-size", nargs="+", default=[AUTO_BLOCK_SIZE], type=block_size_argument,
                        help=f"one or more: {AUTO_BLOCK_SIZE!r} (each step picks its verify length; the default) or "
                             "a fixed block size; each runs as a mode of its own, beside the others")
    parser.add_argument("--temperature", nargs="+", type=float, default=[0.0],
                        help="one or more temperatures, each a run of every prompt set and mode (default: 0, greedy; "
                             "sampled runs seed prompt n with --seed + n)")
    parser.add_argument("--top-p", type=float, default=0.95, help="top-p of sampled runs (default: 0.95)")
    parser.add_argument("--top-k", type=int, default=0, help="top-k of sampled runs (default: 0, off)")
    parser.add_argument("--seed", type=int, default=0, help="seed of sampled runs (default: 0)")
    parser.add_argument("--speculative-sampling", nargs="+", default=[DEFAULT_SPECULATIVE_SAMPLING],
                        choices=SPECULATIVE_SAMPLING,
                        help="how sampled runs verify drafts, one mode each: exact (the target's own sample, the "
                             "default) and/or rejection (min(1, p/q): the same distribution, another sample)")
    parser.add_argument("--draft-sharpness", nargs="+", type=sharpness_argument, default=[AUTO_SHARPNESS],
                        help="how exact sampling drafts, one mode each: 1 couples the drafter's sample to the "
                             "target's noise, 0 drafts the drafter's argmax, between: sharper couplings; auto "
                             "(default): the engine learns which of "
                             f"{', '.join(f'{c:g}' for c in DRAFT_SHARPNESS_CHOICES)} guesses best")
    parser.add_argument("--suffix-drafts", nargs="+", choices=["on", "off", "shared"], default=["on"],
                        help="for --block-size auto: draft-free suffix drafts on (the default: a request's own "
                             "text), off (the drafter only), shared (also earlier answers of the same mode, "
                             f"{SHARED_SUFFIX_TOKENS} tokens of them: dflash-build --shared-suffix-tokens), or "
                             "several as modes side by side")
    parser.add_argument("--rounds", type=int, default=1,
                        help="ask every set this many times in a row (round 2 on: the same requests again, as a "
                             "retry or an agent re-emitting its file would; labelled 'SET round N'); default 1")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers generate baseline")
    parser.add_argument("--vs-llama-cpp", action="store_true",
                        help="also run llama.cpp (llama-cpp-python, the optional `llama` extra) on the GGUF the target "
                             "was converted from, greedy, with torch's thread count, alternating with the other "
                             "modes prompt by prompt, twice: decoding plainly and with its prompt-lookup "
                             "speculative decoding; reports their tok/s and our plain decoding's ratio to each")
    parser.add_argument("--llama-lookup-tokens", type=int, default=LLAMA_LOOKUP_TOKENS,
                        help="tokens llama.cpp's prompt lookup drafts per step (its num_pred_tokens; default "
                             f"{LLAMA_LOOKUP_TOKENS}: llama-cpp-python's advice for CPU-only machines, and faster "
                             "than its default 10 on this project's CPU)")
    parser.add_argument("--batch", type=int, default=0,
                        help="also time our plain decoding's throughput with N requests at a time (each greedy set's "
                             "prompts, repeated to fill N)")
    parser.add_argument("--cpu-weights", choices=CPU_WEIGHTS,
                        help="the format a CPU serves the target's linears in (default: $DFLASH_CPU_WEIGHTS, else "
                             "auto: measured on this host among the checkpoint's own formats)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto (default): bfloat16 on CUDA, float32 on a CPU")
    parser.add_argument("--device", default="auto", help="auto (default: CUDA when there is a GPU), cpu, cuda")
    parser.add_argument("--json", help="also write the summary to this file")
    parser.add_argument("--plot", help="write a PNG: acceptance by position, tau by prompt set")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.llama_lookup_tokens < 1:
        parser.error(f"--llama-lookup-tokens must be >= 1, got {args.llama_lookup_tokens}")
    try:
        summary = run(args)
    except DFlashError as e:
        print(f"dflash-bench: error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(summary, indent=2)
    print(text)
    print(summary_table(summary), file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    if args.plot:
        plot(summary, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
