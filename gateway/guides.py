"""A request's structured-output fields -> the guide the engine decodes under (dflash_contract.guided_decoding).

OpenAI's `response_format` (json_object, json_schema strict or not: both are guided, as vLLM and SGLang do) and
vLLM's extra-body `structured_outputs` ({json | regex | choice | grammar | json_object: one of them}). A request
that names two constraints is refused: which one wins would be a guess.
"""
from __future__ import annotations

import json

from dflash_contract import DFlashError
from dflash_contract.guided_decoding import Guide, choice_grammar

# structured_outputs' constraint keys (vLLM's StructuredOutputsParams), and the options that change nothing here
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
STRUCTURED_OPTIONS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties")
ANY_OBJECT = '{"type": "object"}'


class GuideError(ValueError):
    """A structured-output field the engine cannot take: `param` names it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def request_guide(body: dict) -> Guide | None:
    """The guide of a chat or completion body, None for free text; GuideError naming the field."""
    guides = [(name, guide) for name, guide in (("response_format", response_format(body.get("response_format"))),
                                                ("structured_outputs",
                                                 structured_outputs(body.get("structured_outputs"))))
              if guide is not None]
    if len(guides) > 1:
        raise GuideError("send one of response_format and structured_outputs", "structured_outputs")
    return guides[0][1] if guides else None


def response_format(value) -> Guide | None:
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise GuideError("response_format must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}",
                         "response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return _guide("json_schema", ANY_OBJECT, "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise GuideError("response_format.json_schema must be an object with a name and a schema",
                         "response_format")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise GuideError("response_format.json_schema.schema must be a JSON schema object", "response_format")
    return _guide("json_schema", json.dumps(schema), "response_format")


def structured_outputs(value) -> Guide | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise GuideError("structured_outputs must be an object", "structured_outputs")
    unknown = sorted(set(value) - set(STRUCTURED_KEYS) - set(STRUCTURED_OPTIONS))
    if unknown:
        raise GuideError(f"structured_outputs.{unknown[0]} is not supported (supported: "
                         f"{', '.join(STRUCTURED_KEYS)})", "structured_outputs")
    given = [key for key in STRUCTURED_KEYS if value.get(key) not in (None, False)]
    if len(given) != 1:
        raise GuideError(f"structured_outputs takes exactly one of {', '.join(STRUCTURED_KEYS)}",
                         "structured_outputs")
    key, spec = given[0], value[given[0]]
    where = f"structured_outputs.{key}"
    if key == "json_object":
        return _guide("json_schema", ANY_OBJECT, "structured_outputs")
    if key == "json":
        if isinstance(spec, str):
            return _guide("json_schema", spec, "structured_outputs")
        if not isinstance(spec, dict):
            raise GuideError(f"{where} must be a JSON schema (an object, or its JSON text)", "structured_outputs")
        return _guide("json_schema", json.dumps(spec), "structured_outputs")
    if key == "choice":
        if not isinstance(spec, list) or not spec or not all(isinstance(c, str) and c for c in spec):
            raise GuideError(f"{where} must be a non-empty list of non-empty strings", "structured_outputs")
        return _guide("ebnf_grammar", choice_grammar(spec), "structured_outputs")
    if not isinstance(spec, str) or not spec:
        raise GuideError(f"{where} must be a non-empty string", "structured_outputs")
    return _guide("regex" if key == "regex" else "ebnf_grammar", spec, "structured_outputs")


def _guide(kind: str, text: str, param: str) -> Guide:
    try:
        return Guide(kind, text)
    except DFlashError as e:
        raise GuideError(f"{param}: {e}", param) from None
