"""Conversations as training documents: a chat template renders a record's "messages", only the assistant's turns
are training targets.

`data.chat_template` names the template: a Jinja file, or a Hugging Face `tokenizer_config.json` (its "chat_template",
and its "bos_token" / "eos_token" for templates that use them). A record `{"messages": [{"role": ..., "content":
...}, ...]}` renders into segments: for each assistant turn, what the template renders before it (with the
generation prompt, as at inference) is context, and what its own rendering adds is a target (its content and the
template's end-of-turn text). A template that renders a conversation turn by turn (each rendering a prefix of the
next one's) gives one document a conversation; one that rewrites earlier turns when later ones follow (Qwen3's drops
the reasoning trace of turns before the last user message) gives one document per assistant turn, each with the
conversation before it as the template renders it at that turn (what the model sees at inference), so every target
is trained in the context it will be generated in (at the cost of the repeated prefixes).
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from pathlib import Path
from typing import Any

from services.dataloader.errors import DataError

Segment = tuple[str, bool]  # (text, whether its tokens are training targets)


class ChatTemplate:
    def __init__(self, source: str, template: str, bos_token: str = "", eos_token: str = ""):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt))
        try:
            self._template = env.from_string(template)
        except TemplateError as e:
            raise DataError(f"chat template {source} does not parse: {e}") from None
        self.source, self.text, self.tokens = source, template, {"bos_token": bos_token, "eos_token": eos_token}
        self.sha256 = hashlib.sha256(template.encode()).hexdigest()

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        from jinja2 import TemplateError

        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.tokens)
        except TemplateError as e:
            raise DataError(f"chat template {self.source} failed: {e}") from None

    def documents(self, messages: list[dict[str, Any]], where: str) -> list[list[Segment]]:
        """The conversation as training documents, each its text in order with the pieces marked targets (what an
        assistant turn adds) or context: one document where the template renders the conversation turn by turn
        (each assistant turn's rendering a prefix of the next one's); else one per assistant turn, the conversation
        before it as the template renders it then (as at inference: a template that drops an earlier turn's
        reasoning trace drops it here too) and the turn a target."""
        turns = []  # (rendered before the turn with the generation prompt, rendered through the turn)
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            through = self.render(messages[:i + 1], add_generation_prompt=False)
            if not through.startswith(before):
                raise DataError(f"{where}: chat template {self.source} does not render assistant turn {i + 1} after "
                                "its generation prompt, so the turn cannot be marked; use a template that does, or "
                                "prompt/completion records")
            turns.append((before, through))
        done = [""] + [through for _, through in turns]
        if all(before.startswith(prior) for (before, _), prior in zip(turns, done)):  # turn by turn: one document
            out: list[Segment] = []
            for (before, through), prior in zip(turns, done):
                out += [(before[len(prior):], False), (through[len(before):], True)]
            out.append((self.render(messages, add_generation_prompt=False)[len(done[-1]):], False))
            docs = [[(text, target) for text, target in out if text]]
        else:
            docs = [[(before, False), (through[len(before):], True)] for before, through in turns]
        return [doc for doc in docs if any(target and text.strip() for text, target in doc)]


def _raise(message: str):
    from jinja2 import TemplateError

    raise TemplateError(message)


def hf_chat_template(directory: Path) -> str:
    """Where an HF model directory keeps its chat template: its tokenizer_config.json where that holds one
    ("chat_template"), else its chat_template.jinja (where newer `transformers` save it); "" where it has none."""
    config = directory / "tokenizer_config.json"
    if config.is_file():
        try:
            parsed = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataError(f"{config} cannot be read as JSON ({e})") from None
        if isinstance(parsed, dict) and parsed.get("chat_template"):
            return str(config)
    jinja = directory / "chat_template.jinja"
    return str(jinja) if jinja.is_file() else ""


def load_chat_template(spec: str) -> ChatTemplate:
    """A Jinja file, or an HF tokenizer_config.json whose "chat_template" it is."""
    path = Path(spec)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"`data.chat_template={spec}` cannot be read ({e}); name a Jinja file or a "
                        "tokenizer_config.json") from None
    if path.suffix != ".json":
        return ChatTemplate(spec, text)
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"`data.chat_template={spec}` is not valid JSON ({e})") from None
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if not isinstance(template, str):
        raise DataError(f"`data.chat_template={spec}` has no \"chat_template\" string (a tokenizer_config.json "
                        "holds one where the model has a chat format)")
    return ChatTemplate(spec, template, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))


def _token_text(token: Any) -> str:
    """A tokenizer_config.json special token: a string, or an added-token object with its "content"."""
    return token.get("content", "") if isinstance(token, dict) else token if isinstance(token, str) else ""


def check_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    """A record's "messages": a list of {"role", "content"} objects with string values."""
    ok = isinstance(messages, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages)
    if not ok:
        raise DataError(f"{where}: \"messages\" must be a list of {{\"role\": str, \"content\": str}} objects")
    return messages
