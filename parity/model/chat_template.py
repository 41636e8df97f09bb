"""Chat templates: a checkpoint's Jinja template rendered the way Hugging Face renders it.

The template (from `tokenizer_config.json`'s `chat_template`, or `chat_template.jinja`) runs in
Jinja's immutable sandbox with `trim_blocks` and `lstrip_blocks`, loop controls, the helpers
templates on the Hub rely on (`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII
text and accepts indent / separators / sort_keys, `namespace` without dunder attributes) and a
`{% generation %}` block that simply renders its body. It is rendered with `messages` (keys whose
value is None dropped), `add_generation_prompt`, `tools`, `documents`, the tokenizer's special
tokens (`bos_token`, `eos_token`, ...) and any extra keyword (e.g. `enable_thinking`).
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

from ..errors import InputError


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}` (assistant-mask markers): renders the body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        def __setitem__(self, name, value):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")
            super().__setitem__(name, value)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, namespace=Namespace,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise InputError(f"chat template: syntax error on line {exc.lineno}: {exc.message}") from None


CALLER_VARIABLES = ("messages", "add_generation_prompt")
"""Template variables the caller sets itself: never keyword arguments (`task.chat_template_kwargs`,
`parity generate --chat-kwarg`)."""


def render_chat(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                special_tokens: dict[str, str] | None = None, /, **kwargs: Any) -> str:
    """The conversation as the text the model sees; `kwargs` are the template's other variables
    (any name but `messages` and `add_generation_prompt`: a `template` variable is the template's)."""
    fixed = sorted(set(kwargs) & set(CALLER_VARIABLES))
    if fixed:
        raise InputError(f"chat template variable {fixed[0]!r} is set by the caller, not a keyword")
    import jinja2

    if not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise InputError("chat: expected a non-empty list of messages with a 'role'")
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    context = {**(special_tokens or {}), **kwargs}
    context.setdefault("tools", None)
    context.setdefault("documents", None)
    try:
        return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **context)
    except jinja2.exceptions.TemplateError as exc:
        raise InputError(f"chat template: {exc}") from None
