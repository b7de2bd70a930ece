"""Serving: what the Triton models use to run the engine behind a server.

- engine_loop: one thread owns the engine and steps it while requests come and go (streaming,
  cancellation, a bounded queue, drain); nothing in it knows Triton.
- requests: Triton request tensors -> prompt ids and SamplingParams, validated before the engine.
- detokenize: stateless incremental detokenization (token windows -> text deltas).
- model_args: what a Triton Python model reads from its `args` and config parameters.
- metrics: requests counted by outcome and timed (first token, between tokens, end to end) at the front model
  the client called, through the Python backend's metric families.
"""
