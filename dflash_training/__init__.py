"""Training a DFlash drafter for a target.

- drafter_data: the target's own greedy answers to ShareGPT prompts, as training data (resumable).
- train_drafter: the trainer (frozen target, self-distillation, block loss, resumable).
"""
