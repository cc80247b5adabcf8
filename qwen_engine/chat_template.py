"""Chat messages -> prompt text, in Qwen's ChatML (`<|im_start|>role\\n...<|im_end|>\\n`).

The built-in renderer follows the Qwen3 family's template (thinking models):

* an optional leading system message, then every turn as `<|im_start|>{role}\\n{content}<|im_end|>\\n`;
* assistant turns after the last user message keep their reasoning as `<think>\\n{reasoning}\\n</think>\\n\\n`
  before the answer (from `reasoning_content`, or split off the content at `</think>`); earlier assistant turns
  keep only the answer, so old reasoning does not fill the context;
* the generation prompt `<|im_start|>assistant\\n`, then `<think>\\n` (thinking on, the Qwen3.5/3.6 default: the
  model continues inside the think block) or `<think>\\n\\n</think>\\n\\n` (`enable_thinking: false`: an empty
  think block, the model answers at once).

A checkpoint ships its own template (`chat_template.jinja`, or `chat_template` in `tokenizer_config.json`); when
one is found it is rendered instead, with Jinja2's sandbox as transformers' `apply_chat_template` does
(`trim_blocks`, `lstrip_blocks`, `raise_exception`, `tojson`), and `chat_template_kwargs` passed as variables.
Tool calling is not supported here: `tool` messages and `tools` are refused by the API layer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatMessage:
    role: str  # system | user | assistant
    content: str
    reasoning_content: str | None = None  # an assistant turn's earlier thinking, if the client sends it back


class TemplateError(ValueError):
    """The conversation cannot be rendered (the template raised, or the messages break its rules)."""


def _split_reasoning(msg: ChatMessage) -> tuple[str, str]:
    """(reasoning, answer) of an assistant turn."""
    content = msg.content
    if msg.reasoning_content is not None:
        return msg.reasoning_content.strip(), content.strip()
    if "</think>" in content:
        reasoning, _, answer = content.partition("</think>")
        return reasoning.split("<think>")[-1].strip(), answer.strip()
    return "", content.strip()


def render_builtin(messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
                   enable_thinking: bool = True) -> str:
    """The built-in Qwen3.x ChatML rendering (module docstring)."""
    if not messages:
        raise TemplateError("messages is empty")
    out = []
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
    for i, msg in enumerate(messages):
        if msg.role not in ROLES:
            raise TemplateError(f"messages[{i}].role {msg.role!r} is not one of {list(ROLES)}")
        if msg.role == "system" and i > 0:
            raise TemplateError(f"messages[{i}]: a system message must come first")
        if msg.role != "assistant":
            out.append(f"<|im_start|>{msg.role}\n{msg.content}<|im_end|>\n")
            continue
        reasoning, answer = _split_reasoning(msg)
        if i > last_user:  # the turn being continued (e.g. a multi-step answer): keep its thinking
            out.append(f"<|im_start|>assistant\n<think>\n{reasoning}\n</think>\n\n{answer}<|im_end|>\n")
        else:
            out.append(f"<|im_start|>assistant\n{answer}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n" + ("<think>\n" if enable_thinking else "<think>\n\n</think>\n\n"))
    return "".join(out)


class ChatTemplate:
    """Renders chat messages to prompt text: the checkpoint's Jinja template if it has one, else `render_builtin`."""

    def __init__(self, jinja_source: str | None = None, origin: str = "builtin"):
        self.origin = origin  # "builtin" or the file the template came from
        self._template = None
        if jinja_source is not None:
            from jinja2.exceptions import TemplateError as JinjaError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise TemplateError(message)

            def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
                return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                  sort_keys=sort_keys)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            try:
                self._template = env.from_string(jinja_source)
            except JinjaError as exc:
                raise TemplateError(f"chat template from {origin} does not compile: {exc}") from exc

    @classmethod
    def from_checkpoint(cls, directory: str | os.PathLike | None) -> "ChatTemplate":
        """The template a checkpoint directory ships (chat_template.jinja, then tokenizer_config.json), else the
        built-in one."""
        if directory is None or not Path(directory).is_dir():
            return cls()
        d = Path(directory)
        if (d / "chat_template.jinja").is_file():
            return cls((d / "chat_template.jinja").read_text(encoding="utf-8"), str(d / "chat_template.jinja"))
        cfg = d / "tokenizer_config.json"
        if cfg.is_file():
            template = json.loads(cfg.read_text(encoding="utf-8")).get("chat_template")
            if isinstance(template, str):
                return cls(template, str(cfg))
        return cls()

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
               kwargs: Mapping[str, object] | None = None) -> str:
        kwargs = dict(kwargs or {})
        if self._template is None:
            enable_thinking = kwargs.pop("enable_thinking", True)
            if not isinstance(enable_thinking, bool):
                raise TemplateError("chat_template_kwargs.enable_thinking must be true or false")
            if kwargs:
                raise TemplateError(f"chat_template_kwargs {sorted(kwargs)} are not used by the built-in template; "
                                    "it knows only enable_thinking")
            return render_builtin(messages, add_generation_prompt, enable_thinking)
        from jinja2.exceptions import TemplateError as JinjaError

        dicts = []
        for m in messages:
            d = {"role": m.role, "content": m.content}
            if m.reasoning_content is not None:
                d["reasoning_content"] = m.reasoning_content
            dicts.append(d)
        reserved = sorted({"messages", "add_generation_prompt"} & set(kwargs))
        if reserved:
            raise TemplateError(f"chat_template_kwargs may not set {reserved}")
        try:
            return self._template.render(messages=dicts, add_generation_prompt=add_generation_prompt, **kwargs)
        except TemplateError:
            raise
        except JinjaError as exc:
            raise TemplateError(f"the chat template failed: {exc}") from exc
