"""OpenAI tool calls: `tools` and `tool_choice` -> what the server templates and guides, its text -> `tool_calls`.

The tools go to the target's chat template (the front models' `tools` input; dflash_contract.chat). Then, as vLLM
and SGLang do:
- "none": the answer is text;
- "auto" (the default with tools): the answer is parsed for Hermes-style `<tool_call>{"name", "arguments"}
  </tool_call>` blocks (Qwen3's format, and the one dflash_contract.chat writes for templates without tools); the
  text before the first block is the content;
- "required": the answer is guided to a JSON list of {"name", "arguments"} objects, one of the tools each (one
  element only with parallel_tool_calls false), and read as the calls;
- a named function: the answer is guided to that function's parameters schema, and read as its arguments.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from dflash_contract import DFlashError
from dflash_contract.chat import parse_tools
from dflash_contract.guided_decoding import Guide

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
TOOL_CALL_OPEN = "<tool_call>"


class ToolError(ValueError):
    """A tools field the server cannot take: `param` names it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict]  # checked definitions, as the template gets them
    choice: str  # "none", "auto", "required" or "function" (the named one)
    name: str | None = None  # the named function
    parallel: bool = True

    def guide(self) -> Guide | None:
        """The guide of "required" and a named function; None where the answer is free."""
        if self.choice == "required":
            calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                       "arguments": t["function"]["parameters"]},
                      "required": ["name", "arguments"], "additionalProperties": False} for t in self.tools]
            schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1, **({} if self.parallel else
                                                                                      {"maxItems": 1})}
            return Guide("json_schema", json.dumps(schema))
        if self.choice == "function":
            return Guide("json_schema", json.dumps(self._function(self.name)["parameters"]))
        return None

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    def calls(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool calls in OpenAI's shape) of an answer; no calls where none parses."""
        if self.choice == "function":
            arguments = _json(text)
            return None, [] if arguments is None else [_call(self.name, arguments)]
        if self.choice == "required":
            found = _json(text)
            return None, [_call(c["name"], c["arguments"]) for c in found] if isinstance(found, list) else []
        start = text.find(TOOL_CALL_OPEN)
        if self.choice == "none" or start < 0:
            return text, []
        calls = []
        for block in TOOL_CALL.findall(text[start:]):
            found = _json(block)
            if isinstance(found, dict) and isinstance(found.get("name"), str):
                calls.append(_call(found["name"], found.get("arguments", {})))
        if not calls:
            return text, []
        content = text[:start].rstrip()
        return content or None, calls if self.parallel else calls[:1]

    def _function(self, name: str) -> dict:
        return next(t["function"] for t in self.tools if t["function"]["name"] == name)


def tool_plan(body: dict) -> ToolPlan | None:
    """The plan of a chat body's tools fields, None without tools; ToolError naming the field."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls must be true or false", "parallel_tool_calls")
    if not tools:
        if choice not in (None, "none"):
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None
    try:
        checked = parse_tools(json.dumps(tools))
    except DFlashError as e:
        raise ToolError(str(e), "tools") from None
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) != len(names):
        raise ToolError("tools: two tools have the same name", "tools")
    for tool in checked:
        try:
            Guide("json_schema", json.dumps(tool["function"]["parameters"]))
        except DFlashError as e:
            raise ToolError(f"tools: {tool['function']['name']}: {e}", "tools") from None
    if choice is None or choice in ("none", "auto", "required"):
        return ToolPlan(checked, choice or "auto", parallel=parallel)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise ToolError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                        '{"name": ...}}', "tool_choice")
    if name not in names:
        raise ToolError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return ToolPlan(checked, "function", name, parallel)


def _json(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _call(name: str, arguments) -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": text}}
