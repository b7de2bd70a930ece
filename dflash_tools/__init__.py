"""Command-line tools and benchmarks around the core runtime, and the prompt sets they read.

- cli: `dflash-generate`.
- benchmark: `dflash-bench` (transformers generate vs autoregressive vs DFlash, side by side).
- prompts: prompt sets from installed packages (ShareGPT V3, HumanEval, JSONL files); no torch.
"""
