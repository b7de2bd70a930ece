"""What a conversation brings to the chat template besides its messages: tools and template arguments.

`tools` (OpenAI's tool definitions) and `chat_template_kwargs` (vLLM's name) are front-model inputs beside
`messages`; the preprocessing model and the gateway's own templating (trtllm builds) both render with them.

A template that has no tools (SmolLM2's) still gets them: the tool definitions go into the system message and the
tool calls and results into the turns, in the Hermes format that Qwen's templates use and `gateway/tools.py`
parses: `<tools>` JSON lines in the system prompt, `<tool_call>{"name", "arguments"}</tool_call>` in an
assistant turn, `<tool_response>...</tool_response>` in a user turn. A model never trained on it may ignore the
tools, but `tool_choice` "required" or a named function still gets a call that parses (a guided answer).
"""
from __future__ import annotations

import json

from . import DFlashError

# apply_chat_template's own arguments, and what the server sets itself: never taken from chat_template_kwargs
RESERVED_TEMPLATE_ARGS = frozenset(("conversation", "messages", "tools", "documents", "chat_template",
                                    "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                                    "truncation", "max_length", "return_tensors", "return_dict",
                                    "return_assistant_tokens_mask", "tokenizer_kwargs"))
HERMES_SYSTEM = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                 "with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each "
                 "function call, return a json object with function name and arguments within <tool_call></tool_call> "
                 "XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
                 "</tool_call>")


def parse_tools(raw: str) -> list[dict]:
    """OpenAI's tool definitions (the `tools` input, JSON) as [{"type": "function", "function": {"name",
    "description", "parameters"}}]; DFlashError naming the tool and field."""
    tools = _parsed("tools", raw, list, "a JSON list of {\"type\": \"function\", \"function\": {...}}")
    return [_tool(i, tool) for i, tool in enumerate(tools)]


def _tool(i: int, tool) -> dict:
    where = f"tools[{i}]"
    function = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise DFlashError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., ...}}}}")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise DFlashError(f"{where}.function.parameters must be a JSON schema object")
    description = function.get("description", "")
    if not isinstance(description, str):
        raise DFlashError(f"{where}.function.description must be a string")
    return {"type": "function", "function": {"name": function["name"], "description": description,
                                             "parameters": parameters}}


def parse_template_kwargs(raw: str) -> dict:
    """chat_template_kwargs (JSON object) for the template; its own arguments and the server's are refused."""
    kwargs = _parsed("chat_template_kwargs", raw, dict, "a JSON object")
    reserved = sorted(RESERVED_TEMPLATE_ARGS.intersection(kwargs))
    if reserved:
        raise DFlashError(f"chat_template_kwargs.{reserved[0]} is set by the server, not by a request")
    return kwargs


def _parsed(name: str, raw: str, kind: type, shape: str):
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise DFlashError(f"{name}: not JSON ({e})") from None
    if not isinstance(value, kind):
        raise DFlashError(f"{name} must be {shape}")
    return value


def template_has_tools(template: str | None) -> bool:
    """Whether a chat template renders tools itself (it reads the `tools` variable)."""
    return bool(template) and "tools" in template


def hermes_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """A conversation with its tools, calls and results written in, in the Hermes format, for a template without
    tools: the definitions appended to the system message (one made if there is none), each assistant's calls as
    <tool_call> blocks after its text, each tool result as a user turn in <tool_response>."""
    system = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    result = [dict(m) for m in messages]
    if tools:
        if result and result[0]["role"] == "system":
            result[0]["content"] = f"{result[0]['content']}\n\n{system}"
        else:
            result.insert(0, {"role": "system", "content": system})
    for message in result:
        calls = message.pop("tool_calls", None)
        if calls:
            blocks = [f"<tool_call>\n{json.dumps(_call_object(c), ensure_ascii=False)}\n</tool_call>" for c in calls]
            message["content"] = "\n".join(([message["content"]] if message["content"] else []) + blocks)
        if message["role"] == "tool":
            message.pop("tool_call_id", None)
            message.update(role="user", content=f"<tool_response>\n{message['content']}\n</tool_response>")
    return result


def _call_object(call: dict) -> dict:
    """A call as Hermes writes it: {"name", "arguments": an object where they are JSON, else their text}."""
    try:
        arguments = json.loads(call["function"]["arguments"])
    except json.JSONDecodeError:
        arguments = call["function"]["arguments"]
    return {"name": call["function"]["name"], "arguments": arguments}
