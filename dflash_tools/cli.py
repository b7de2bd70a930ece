"""dflash-generate: generate from a prompt with DFlash speculative decoding (or plainly, with --block-size 1)."""
from __future__ import annotations

import argparse
import json
import sys
import time

from dflash_contract import DFlashError
from dflash_contract.cli import ArgumentParser
from dflash_contract.presets import (AUTO_BLOCK_SIZE, CPU_WEIGHTS, DEFAULT_PRESET, SPECULATIVE_SAMPLING,
                                     block_size_argument, preset_table)
from dflash_runtime.sampling import SamplingParams
from dflash_runtime.stop_text import StopText


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="dflash-generate",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Generate text with DFlash speculative decoding: a drafter proposes a block of tokens in one "
                    "pass, the target verifies them in one pass. Output is token-identical to the target's own "
                    "decoding (greedy, or sampled with the same seed).",
        epilog=f"presets:\n{preset_table()}\n\nexamples:\n"
               "  dflash-generate --prompt 'Write a haiku about CPUs.'\n"
               "  dflash-generate --prompt 'Hi' --block-size 1 --json     # plain autoregressive baseline\n"
               "  dflash-generate --target ./my-qwen3 --drafter ./my-drafter --prompt-ids 1,2,3",
    )
    parser.add_argument("--target", default=DEFAULT_PRESET,
                        help=f"preset name or HF checkpoint directory (default: {DEFAULT_PRESET})")
    parser.add_argument("--drafter", default="preset",
                        help="drafter directory (z-lab / ModelOpt DFlash format); default: the preset's; 'none' to "
                             "run without")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="a user message (the target's chat template is applied unless --raw)")
    prompt.add_argument("--prompt-ids", help="comma-separated prompt token ids, sent as they are")
    parser.add_argument("--raw", action="store_true", help="send --prompt as plain text, without the chat template")
    parser.add_argument("--allow-special-tokens", action="store_true",
                        help="read special-token text in --prompt (e.g. <|im_end|>) as those tokens, for a trusted "
                             "prompt; by default it is ordinary text, so that a prompt cannot end its turn or forge "
                             "a system turn")
    parser.add_argument("--max-tokens", "--max-new-tokens", dest="max_new_tokens", type=int, default=128,
                        help="tokens to generate at most (default: 128); --max-tokens as in dflash-client and the "
                             "OpenAI API")
    parser.add_argument("--block-size", type=block_size_argument, default=AUTO_BLOCK_SIZE,
                        help=f"{AUTO_BLOCK_SIZE!r} (default): each step verifies the length that maximises expected "
                             "tokens per second, from a startup profile of step times and the measured acceptance "
                             "(1 = plain decoding when the drafter does not pay); a number fixes the block; "
                             "1 = plain autoregressive")
    parser.add_argument("--no-suffix-drafts", dest="suffix_drafts", action="store_false",
                        help="block size auto without draft-free suffix drafts (the continuation of an earlier "
                             "occurrence of the request's own text, verified where it is expected to pay more than "
                             "the drafter's block)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int,
                        help="sampling seed; the same seed gives the same output for any block size")
    parser.add_argument("--stop", action="append", default=[],
                        help="stop string (repeatable): generation ends at the token that completes it; the text "
                             "ends before the string (as the server and OpenAI's API give it)")
    parser.add_argument("--include-stop-str-in-output", action="store_true",
                        help="end the text after the stop string instead of before it")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    parser.add_argument("--speculative-sampling", choices=SPECULATIVE_SAMPLING,
                        help="how sampling verifies drafts: exact (default; the same output as block size 1) or "
                             "rejection (min(1, p/q): the same distribution, another sample)")
    parser.add_argument("--max-context", type=int, help="context limit in tokens (default: the preset's, else 2048)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto (default): bfloat16 on CUDA, float32 on a CPU")
    parser.add_argument("--device", default="auto", help="auto (default: CUDA when there is a GPU), cpu, cuda, cuda:N")
    parser.add_argument("--cpu-weights", choices=CPU_WEIGHTS,
                        help="the format a CPU serves the target's linears in (default: $DFLASH_CPU_WEIGHTS, else "
                             "auto: measured on this host among the checkpoint's own formats)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    return parser


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise DFlashError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise DFlashError("empty prompt")
    return ids


def request_ids(pipe, args: argparse.Namespace) -> list[int]:
    """The prompt's token ids: --prompt-ids as given, or --prompt encoded (its special-token text ordinary text
    unless --allow-special-tokens)."""
    if args.prompt_ids is not None:
        return parse_ids(args.prompt_ids)
    return pipe.encode(args.prompt, chat=not args.raw, allow_special_tokens=args.allow_special_tokens)


def run(args: argparse.Namespace) -> dict:
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop_strings=tuple(args.stop),
                            ignore_eos=args.ignore_eos, speculative_sampling=args.speculative_sampling)
    from dflash_runtime.pipeline import load_pipeline

    drafter = None if args.drafter == "none" or args.block_size == 1 else args.drafter
    pipe = load_pipeline(args.target, drafter, args.dtype, args.device, cpu_weights=args.cpu_weights)
    if args.max_context is not None:
        pipe.target.config.check_max_context(args.max_context)
    if pipe.drafter is None and args.block_size == AUTO_BLOCK_SIZE:
        print("dflash-generate: no drafter, so block size auto means plain decoding", file=sys.stderr)
    engine = pipe.engine(block_size=args.block_size, max_batch_size=1, max_context=args.max_context,
                         suffix_drafts=args.suffix_drafts)
    prompt_ids = request_ids(pipe, args)
    seq = engine.add_request(prompt_ids, params)
    start = time.perf_counter()
    text = _decoded(pipe, engine, seq, StopText(args.stop, args.include_stop_str_in_output), echo=not args.json)
    elapsed = time.perf_counter() - start
    stats = seq.stats
    result = {
        "output_ids": seq.output_ids,
        "finish_reason": seq.finish_reason,
        "num_prompt_tokens": len(prompt_ids),
        "num_output_tokens": len(seq.output_ids),
        "block_size": args.block_size if pipe.drafter is not None else 1,
        "verify_lengths": stats.verify_lengths,
        "acceptance_lengths": stats.acceptance_lengths,
        "mean_acceptance_length": stats.mean_acceptance_length and round(stats.mean_acceptance_length, 3),
        "accepted_by_position": stats.accepted_by_position,
        "reached_by_position": stats.reached_by_position,
        "draft_sources": stats.sources.summary(),
        "draft_seconds": round(stats.draft_seconds, 4),
        "verify_seconds": round(stats.verify_seconds, 4),
        "seconds": round(elapsed, 4),
        "tokens_per_second": round(len(seq.output_ids) / elapsed, 2),
    }
    if text is not None:
        result["text"] = text
    return result


def _decoded(pipe, engine, seq, stop_text: StopText, echo: bool) -> str | None:
    """Runs the engine to the end of `seq`; its text (stop strings as the server gives them), shown as it grows
    where `echo`; None without a tokenizer."""
    if pipe.tokenizer is None:
        while engine.has_unfinished():
            engine.step()
        return None
    decoded, text = "", ""
    while engine.has_unfinished():
        engine.step()
        safe = pipe.decode(seq.output_ids)  # without an unfinished character: the next token may complete it
        grown, final = safe.startswith(decoded), not engine.has_unfinished()
        delta = stop_text.push(safe[len(decoded):] if grown else "", final=final,
                               stopped=final and seq.finish_reason == "stop")
        decoded, text = safe if grown else decoded, text + delta
        if echo:
            sys.stdout.write(delta)
            sys.stdout.flush()
    return text


def sources_in_words(sources: dict) -> str:
    """e.g. "drafts: suffix 12 steps, 40/71 accepted; none 30 steps"."""
    parts = [f"{source} {s['steps']} steps" + (f", {s['accepted']}/{s['drafted']} accepted" if s["drafted"] else "")
             for source, s in sources.items()]
    return "drafts: " + ("; ".join(parts) or "none")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = run(args)
    except DFlashError as e:
        print(f"dflash-generate: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        print()
        print(f"[{result['num_output_tokens']} tokens, {result['tokens_per_second']} tokens/s, "
              f"block {result['block_size']} (verify lengths used: {sorted(set(result['verify_lengths']))}), "
              f"mean acceptance length {result['mean_acceptance_length'] or 'none (no verify step)'}, "
              f"{sources_in_words(result['draft_sources'])}, "
              f"finish: {result['finish_reason']}]",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
