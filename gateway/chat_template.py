"""The target's chat template and token counts, without torch: for a front model that takes raw text only.

TensorRT-LLM's LLM-API model (`tensorrt_llm`, a `--runtime trtllm` build) takes text and returns text: no
conversation, no token counts. So the gateway puts a conversation in the target's chat template itself, the way
transformers' `apply_chat_template(messages, tokenize=False, add_generation_prompt=True)` does (the same
sandboxed Jinja environment, filters, globals and special-token variables), and counts the prompt's and the
answer's tokens with the target's tokenizer.json (the `tokenizers` package, which transformers' fast tokenizers
run on). clients.transport calls it through the `Templater` protocol there.

TensorRT-LLM tokenises that text itself with the special tokens recognised, so text is all the gateway can guard: a
message's content or a raw prompt that holds a special token's text (`<|im_end|>`) is refused, naming where and
the token, as it would become the control token there (end its turn, forge a system turn). Escaping it would send
the model other text than the user's without saying so; the torch runtime, which tokenises itself, encodes it as
ordinary text instead (dflash_runtime.text).
"""
from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

from clients.errors import InvalidRequest
from dflash_contract import DFlashError
from dflash_contract.protocol import invalid_request, parse_messages

TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"  # transformers >= 4.43 saves the template here instead
TOKENIZER_FILE = "tokenizer.json"
# the special tokens transformers passes to every template (its special_tokens_map)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplate:
    """A target directory's chat template (None: it has none) and tokenizer."""

    def __init__(self, template: str | None, special_tokens: dict[str, str], tokenizer_file: Path):
        from tokenizers import Tokenizer

        self.source = template
        self._template = _compile(template) if template else None
        self._special_tokens = special_tokens
        self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
        self._special_text = _special_text(self._tokenizer)

    @classmethod
    def from_target_dir(cls, target_dir: str | Path) -> ChatTemplate:
        target_dir = Path(target_dir)
        if not (target_dir / TOKENIZER_FILE).is_file():
            raise FileNotFoundError(f"{target_dir} has no {TOKENIZER_FILE}: the gateway counts tokens with it")
        config_path = target_dir / TOKENIZER_CONFIG
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: transformers uses "default"
            template = {t.get("name"): t.get("template") for t in template}.get("default")
        if template is None and (target_dir / TEMPLATE_FILE).is_file():
            template = (target_dir / TEMPLATE_FILE).read_text()
        special = {name: _token_text(config[name]) for name in SPECIAL_TOKENS if config.get(name) is not None}
        return cls(template, special, target_dir / TOKENIZER_FILE)

    def render(self, messages_json: str) -> str:
        """A conversation (JSON, OpenAI's shape: the front models' `messages` input) as the prompt's text, ending
        with the assistant's generation prompt. InvalidRequest for a conversation the server would refuse."""
        if self._template is None:
            raise InvalidRequest(invalid_request("messages: this model's tokenizer has no chat template; send the "
                                                 "prompt as text"))
        import jinja2

        messages = conversation(messages_json)
        for i, message in enumerate(messages):
            self.refuse_special_tokens(f"messages[{i}].content", message["content"])
        try:
            return self._template.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=True, **self._special_tokens)
        except jinja2.TemplateError as e:  # the template's raise_exception: it refuses this conversation
            raise InvalidRequest(invalid_request(f"messages: the chat template refused the conversation: {e}")) \
                from None

    def refuse_special_tokens(self, field: str, text: str) -> None:
        """InvalidRequest naming `field` when `text` holds a special token's text: TensorRT-LLM would read it as that
        control token."""
        found = self._special_text.search(text)
        if found:
            raise InvalidRequest(invalid_request(
                f"{field} holds {found.group()!r}, a special token of this model: TensorRT-LLM would read it as that "
                "control token, not as text; remove it or write it otherwise"))

    def count(self, text: str, special_tokens: bool) -> int:
        """Tokens of a text, with what the tokenizer adds (a raw prompt) or without (a templated prompt, which holds
        its special tokens already, as transformers encodes an applied template; an answer)."""
        return len(self.token_ids(text, special_tokens))

    def token_ids(self, text: str, special_tokens: bool) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=special_tokens).ids if text else []


def conversation(messages_json: str) -> list[dict[str, str]]:
    """[{"role", "content": str}] from OpenAI's shape, refused with the words the server's own check uses."""
    try:
        return parse_messages(messages_json)
    except DFlashError as e:
        raise InvalidRequest(invalid_request(str(e))) from None


def _special_text(tokenizer) -> re.Pattern:
    """A pattern of the tokenizer's special tokens' text (its added tokens marked special), longest first as the
    tokenizer matches them; one that never matches if none."""
    texts = sorted({t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}, key=len,
                   reverse=True)
    return re.compile("|".join(map(re.escape, texts)) or "(?!)")


def _token_text(token) -> str:
    """A special token as tokenizer_config.json holds it: a string, or an AddedToken's {"content": ...}."""
    return token["content"] if isinstance(token, dict) else str(token)


def _compile(source: str):
    """The template compiled as transformers compiles it (utils/chat_template_utils.py): a sandbox, trimmed blocks,
    loop controls, its tojson, raise_exception and strftime_now, and {% generation %} blocks (rendered as is)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):  # transformers' AssistantTracker without the tracking: the block's text
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[Generation, loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return environment.from_string(source)
