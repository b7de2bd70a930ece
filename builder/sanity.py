"""A build's sanity check: its artifacts loaded as the server loads them, decoded plainly and with DFlash (token
identity, tau, speed), and block size auto's profile of step times written for the server."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from builder.options import BuildOptions
from dflash_contract.layout import DRAFTER_DIR, TARGET_DIR, VERIFY_PROFILE_FILE
from dflash_contract.presets import AUTO_BLOCK_SIZE

SANITY_PROMPTS = ["Explain what a hash table is and when to use one.", "Write a haiku about autumn."]


def say(stage: str) -> None:
    """A stage of a long build, on stderr as it starts (the summary goes to stdout)."""
    print(f"build.py: {stage}", file=sys.stderr, flush=True)


def sanity_run(build: Path, opts: BuildOptions, has_drafter: bool, block_size: int | str, max_context: int) -> dict:
    """Autoregressive vs DFlash on the built artifacts: token identity, tau and speed. With block size
    auto, the engine's profile of step times (all batch sizes up to the build's) and the acceptance it learned go
    to VERIFY_PROFILE_FILE for the server. Without a drafter: plain decoding only, its speed (the build loads
    and generates; there is nothing to compare)."""
    from dflash_runtime.pipeline import load_pipeline
    from dflash_runtime.verify_length import auto_in_words
    from dflash_tools.benchmark import measure

    drafter = str(build / DRAFTER_DIR) if has_drafter else None
    say("sanity check: loading the built target" + " and drafter" * bool(drafter)
        + (" (the CPU's weight format is chosen by timing each)" if opts.device == "cpu" else ""))
    pipe = load_pipeline(str(build / TARGET_DIR), drafter, opts.dtype, opts.device, cpu_weights=opts.cpu_weights)
    prompts = [pipe.encode(p) for p in SANITY_PROMPTS]
    autoregressive = pipe.engine(block_size=1, max_batch_size=1, max_context=max_context)
    if drafter is None:
        plain = measure(pipe, None, autoregressive, {}, prompts, opts.sanity_tokens, "sanity")
        return {"num_prompts": plain["num_prompts"], "tokens_per_second": plain["tokens_per_second"]}
    if block_size == AUTO_BLOCK_SIZE:
        say(f"sanity check: timing steps of every verify length at batch 1-{opts.max_batch_size} "
            "(block size auto starts from this profile; the server reads it)")
    dflash = pipe.engine(block_size=block_size, max_batch_size=opts.max_batch_size,
                         max_context=max_context, suffix_drafts=opts.suffix_drafts)
    result = measure(pipe, None, autoregressive, {str(block_size): dflash}, prompts, opts.sanity_tokens,
                     "sanity")
    served = pipe.target.served_weights
    if served is not None:
        result["cpu_weights"] = served.describe()
        if served.chosen != "float32":  # another model than the float32 one: how far, briefly (4 prompts)
            from dflash_tools.weights_quality import weights_quality

            say(f"sanity check: {served.chosen} against float32 (4 prompts)")
            result["cpu_weights_quality"] = weights_quality(build / TARGET_DIR, served.chosen, prompts=4, tokens=32,
                                                            texts=2, progress=False, served=pipe.target)
    if dflash.graphs.capture:
        report = dflash.graphs.report
        result["cuda_graphs"] = {"graphs": report.graphs, "MiB": round(report.pool_bytes / 2 ** 20, 1),
                                 "seconds": round(report.seconds, 2)}
    if dflash.policy is not None:
        profile = dflash.policy.costs.to_json()
        # what the run learned of acceptance goes with it: the server's first requests need not probe the drafter
        # and the suffix drafts again from the benefit of the doubt
        learned = {**profile, "acceptance": dflash.policy.learned()}
        (build / VERIFY_PROFILE_FILE).write_text(json.dumps(learned, indent=2) + "\n")
        rates = [round(p, 4) for p in dflash.policy.acceptance["greedy"].rates()]  # the sanity run is greedy
        result["verify_profile"] = {**profile, "acceptance_rates": rates}
        # in words, from the costs the engine ended with (its steps' timings over the profile's): the console
        # prints this line of the manifest, so the two cannot disagree
        result["auto"] = auto_in_words(dflash.policy.costs, result["dflash"][str(block_size)]["by_source"])
    return result
