"""What a build prints at its end: its manifest in words (the runtime, the quantization's quality, the sanity
check's speed and token identity, how to serve it)."""
from __future__ import annotations

import shlex
from pathlib import Path

from dflash_contract.layout import REPOSITORY_DIR


MEASURED_WITH = {"fake_quant": "on the fake-quantized model (ModelOpt's emulation of the GPU's arithmetic)",
                 "dequantized": "on the exported checkpoint as our runtime loads it (weights dequantized)"}


def quality(quantization: dict) -> str:
    """The quantization report's headline in words: perplexity against the unquantized target, and how
    long greedy decoding stays on the unquantized target's own greedy path."""
    from dflash_tools.quality import agreement_in_words

    ppl, base = quantization["perplexity"], quantization["unquantized"]["perplexity"]
    return (f"perplexity {ppl:.2f} vs {base:.2f} unquantized ({ppl / base - 1:+.1%}); "
            f"{agreement_in_words(quantization['greedy_agreement'])}; {MEASURED_WITH[quantization['measured_with']]}"
            + (f"; quantized earlier, reused {quantization['reused']}" if quantization.get("reused") else ""))


def summary(manifest: dict, output: Path) -> str:
    """The lines a build prints at its end, from its manifest: what was built, how it measured, how to serve it."""
    options, sanity, trtllm = manifest["options"], manifest.get("sanity") or {}, manifest.get("trtllm")
    rows = [("build", str(output) + ("  (reused: inputs unchanged)" if manifest.get("reused") else "")),
            ("target", f"{manifest['inputs']['target']} ({manifest['inputs']['target_dir']})"),
            ("drafter", manifest["inputs"]["drafter_dir"] or "none"),
            ("runtime", runtime_in_words(options, trtllm)),
            ("quantization", options["quant"] + (f", KV {options['kv_cache']}" if options["quant"] != "none" else ""))]
    if manifest.get("quantization"):
        rows.append(("quality", quality(manifest["quantization"])))
    if trtllm:
        rows.append(("tensorrt-llm", f"{trtllm['options_file']}: {trtllm['validation']}"))
        if trtllm.get("dflash_context_cache_gib") is not None:
            rows.append(("", f"DFlash context cache {trtllm['dflash_context_cache_gib']} GiB per GPU beside the "
                             "KV-cache pool (upstream's estimate; lower --max-batch-size or --max-context if it does "
                             "not fit)"))
    if sanity:
        rows += sanity_rows(sanity, options, trtllm)
    rows += [("repository", str(output / REPOSITORY_DIR)), ("time", f"{manifest['seconds']} s"),
             ("serve", f"dflash-serve {output / REPOSITORY_DIR}" + (
                 "   (in the NGC tritonserver trtllm image: it adds TensorRT-LLM's LLM-API model code)" if trtllm
                 else ""))]
    if trtllm:
        rows.append(("or", f"cd {output} && {shlex.join(trtllm['serve_command'])}   (trtllm-serve's OpenAI API)"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)




def runtime_in_words(options: dict, trtllm: dict | None) -> str:
    batch = f"max batch {options['max_batch_size']}"
    if trtllm:
        from builder.trtllm import resolve_gpu

        speculative = trtllm["options"]["speculative_config"]
        drafts = f"max_draft_len {speculative['max_draft_len']}" + (
            f", draft_len_schedule {speculative['draft_len_schedule']}" if "draft_len_schedule" in speculative else "")
        return f"trtllm: TensorRT-LLM's PyTorch backend on {resolve_gpu(options['gpu'])}, {drafts}, {batch}"
    return (f"torch: our PyTorch runtime, {options['dtype']} on {options['device']}, "
            f"block {options['block_size']}, {batch}, KV cache {options['kv_cache_tokens']} tokens, prefix "
            f"caching {'on' if options['prefix_caching'] else 'off'}, prefill chunk "
            f"{options['prefill_chunk'] or 'off'}")


def sanity_rows(sanity: dict, options: dict, trtllm: dict | None) -> list[tuple[str, str]]:
    """The sanity check's rows: speed and token identity, auto's choices, the CPU weights and CUDA graphs."""
    if "dflash" not in sanity:
        return [("sanity", f"plain decoding (no drafter): {sanity['tokens_per_second']['autoregressive']} tok/s")]
    (block, dflash), = sanity["dflash"].items()
    rates = sanity["tokens_per_second"]
    rows = [("sanity", f"tau {dflash['mean_acceptance_length']}, DFlash {rates[f'dflash {block}']} tok/s vs "
                       f"autoregressive {rates['autoregressive']} tok/s "
                       f"({dflash['speedup_vs_autoregressive']}x; verify lengths {dflash['verify_lengths']}), "
                       f"token-identical {sanity['token_identical_prompts']}"
                       + (f" (our PyTorch runtime here, {options['dtype']} on {options['device']})"
                          if trtllm else ""))]
    if sanity.get("auto"):
        rows.append(("auto", sanity["auto"]))
    if sanity.get("cpu_weights"):
        rows.append(("cpu weights", sanity["cpu_weights"]))
    if sanity.get("cpu_weights_quality"):
        from dflash_tools.weights_quality import in_words

        rows.append(("quality", in_words(sanity["cpu_weights_quality"]) + " (4 prompts; dflash-weights-quality "
                                                                            "measures more)"))
    if sanity.get("cuda_graphs"):
        graphs = sanity["cuda_graphs"]
        rows.append(("cuda graphs", f"{graphs['graphs']} captured at start-up in {graphs['seconds']} s, "
                                    f"{graphs['MiB']} MiB (max batch {options['max_batch_size']})"))
    return rows
