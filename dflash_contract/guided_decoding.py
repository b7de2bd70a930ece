"""Guided decoding (structured outputs): what a request may ask its output to match, as it travels.

Two of tensorrtllm_backend's inputs carry it, under its names, so Triton LLM clients work unchanged:
`guided_decoding_guide_type` names the kind and `guided_decoding_guide` holds the guide. The OpenAI gateway turns
response_format, tool calls and vLLM's structured_outputs into the same pair; the engine compiles it with xgrammar
(dflash_runtime/grammar.py). Checked here, without xgrammar, for what every door can refuse before the engine.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from . import DFlashError

TYPE_INPUT, GUIDE_INPUT = "guided_decoding_guide_type", "guided_decoding_guide"
# guide type -> what the guide holds (tensorrtllm_backend's types: TensorRT-LLM's GuidedDecodingParams.GuideType)
GUIDE_TYPES = {
    "json": "nothing: any JSON value",
    "json_schema": "a JSON schema, as JSON text",
    "regex": "a regular expression the whole output matches",
    "ebnf_grammar": "an EBNF grammar (xgrammar's GBNF dialect) whose rule `root` the output matches",
}
# A guide's UTF-8 bytes: a tool set's schemas run to tens of KB; the compile time limit bounds the rest
MAX_GUIDE_BYTES = 1 << 18


@dataclass(frozen=True)
class Guide:
    """A request's constraint: `type` one of GUIDE_TYPES, `text` its guide ("" for json)."""

    type: str
    text: str = ""

    def __post_init__(self):
        if self.type not in GUIDE_TYPES:
            raise DFlashError(f"{TYPE_INPUT} must be one of {', '.join(GUIDE_TYPES)}, got {self.type!r}")
        if self.type == "json":
            if self.text:
                raise DFlashError(f"{GUIDE_INPUT} must be empty for {TYPE_INPUT} json (any JSON value)")
            return
        if not self.text:
            raise DFlashError(f"{GUIDE_INPUT} is required for {TYPE_INPUT} {self.type}: "
                              f"{GUIDE_TYPES[self.type]}")
        size = len(self.text.encode("utf-8", "surrogatepass"))
        if size > MAX_GUIDE_BYTES:
            raise DFlashError(f"{GUIDE_INPUT} is {size} bytes (UTF-8), over the limit of {MAX_GUIDE_BYTES}")
        if self.type == "json_schema":
            try:
                schema = json.loads(self.text)
            except json.JSONDecodeError as e:
                raise DFlashError(f"{GUIDE_INPUT}: the JSON schema is not JSON ({e})") from None
            if not isinstance(schema, (dict, bool)):
                raise DFlashError(f"{GUIDE_INPUT}: a JSON schema is an object (or true / false), "
                                  f"got {type(schema).__name__}")


def guide_of(guide_type: str | None, text: str | None) -> Guide | None:
    """The Guide of a request's two inputs (None: unguided); DFlashError naming the input for a bad pair."""
    if guide_type is None or guide_type == "":
        if text:
            raise DFlashError(f"{GUIDE_INPUT} needs {TYPE_INPUT} ({', '.join(GUIDE_TYPES)})")
        return None
    return Guide(guide_type, text or "")


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of `choices` (vLLM's guided choice)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
