"""Chat templates: a checkpoint's Jinja template rendered the way Hugging Face renders it.

The template (from `tokenizer_config.json`'s `chat_template`, or `chat_template.jinja`) runs in
Jinja's immutable sandbox with `trim_blocks` and `lstrip_blocks`, loop controls, the helpers
templates on the Hub rely on (`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII
text and accepts indent / separators / sort_keys, `namespace` without dunder attributes) and a
`{% generation %}` block that simply renders its body. It is rendered with `messages` (keys whose
value is None dropped), `add_generation_prompt`, `tools`, `documents`, the tokenizer's special
tokens (`bos_token`, `eos_token`, ...) and any extra keyword (e.g. `enable_thinking`). A template
comes with its checkpoint, from anywhere: its loops, products and output are bounded
(`MAX_LOOP_STEPS`, `MAX_RENDER_CHARS`) and any error it raises is one line naming the template.
"""

from __future__ import annotations

import functools
import json
import threading
from datetime import datetime
from typing import Any

from ..errors import InputError

MAX_RENDER_CHARS = 4_000_000
"""The most text a rendering may make (a product or a string repeated past it is refused too)."""
MAX_LOOP_STEPS = 1_000_000
"""The most items all the `range`s of one rendering may hold (nested loops of 10^5 each hung)."""
_budget = threading.local()  # (the rendering under way's `range` items left, per thread)


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

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

    class Bounded(ImmutableSandboxedEnvironment):
        """The sandbox, with `*` and `**` refused where their result would be larger than a
        rendering may be (`"a" * 10**9`, `10**10**6`)."""

        intercepted_binops = frozenset(["*", "**", "%"])

        def call_binop(self, context, operator, left, right):
            if operator == "%" and isinstance(left, str):
                _check_widths(left)
            sized = (str, list, tuple)
            if operator == "*" and isinstance(left, int) and isinstance(right, sized):
                left, right = right, left
            if operator == "*" and isinstance(left, sized) and isinstance(right, int) \
                    and len(left) * right > MAX_RENDER_CHARS:
                raise jinja2.exceptions.SecurityError(f"a product of {len(left) * right:,} items")
            if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 4096 \
                    and abs(left) > 1:
                raise jinja2.exceptions.SecurityError(f"a power of exponent {right:,}")
            return super().call_binop(context, operator, left, right)

    def bounded_range(*args):
        items = safe_range(*args)
        _budget.left = getattr(_budget, "left", MAX_LOOP_STEPS) - len(items)
        if _budget.left < 0:
            raise jinja2.exceptions.SecurityError(f"more than {MAX_LOOP_STEPS:,} loop steps")
        return items

    env = Bounded(trim_blocks=True, lstrip_blocks=True,
                  extensions=[GenerationBlock, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    for name in ("center", "indent", "wordwrap", "truncate", "format"):  # (widths past a rendering's size)
        env.filters[name] = _bounded_filter(env.filters[name], name)
    env.globals.update(raise_exception=raise_exception, namespace=Namespace, range=bounded_range,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt[:1000]))
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise InputError(f"chat template: syntax error on line {exc.lineno}: {exc.message}") from None


def _check_widths(fmt: str) -> None:
    """Refuse a %-format whose field widths or precisions pass a rendering's size ("%1000000000s")."""
    import re

    import jinja2

    for number in re.findall(r"%[-+ #0]*(\d+)|\.(\d+)", fmt):
        if any(n and int(n) > MAX_RENDER_CHARS for n in number):
            raise jinja2.exceptions.SecurityError("a format width past a rendering's size")


def _bounded_filter(fn, name: str):
    """A width-taking filter (`center`, `indent`, ...) that refuses a width past a rendering's size."""
    import jinja2

    @functools.wraps(fn)
    def bounded(*args, **kwargs):
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_RENDER_CHARS:
                raise jinja2.exceptions.SecurityError(f"{name}: a width of {value:,}")
            if name == "format" and isinstance(value, str):
                _check_widths(value)
        return fn(*args, **kwargs)
    return bounded


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
    compiled, out, size = _compile(template), [], 0
    _budget.left = MAX_LOOP_STEPS
    try:  # (piece by piece: a rendering past MAX_RENDER_CHARS stops there)
        for piece in compiled.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                       **context):
            size += len(piece)
            if size > MAX_RENDER_CHARS:
                raise InputError(f"chat template: the rendering passed {MAX_RENDER_CHARS:,} characters")
            out.append(piece)
    except jinja2.exceptions.TemplateError as exc:
        raise InputError(f"chat template: {exc}") from None
    except (ArithmeticError, TypeError, ValueError, LookupError, AttributeError, RecursionError,
            MemoryError) as exc:  # (the template's own mistakes: 1/0, "a" + 1, a macro that recurses)
        if isinstance(exc, InputError):
            raise
        text = str(exc).splitlines()[0][:200] if str(exc) else ""
        raise InputError(f"chat template: {type(exc).__name__}: {text}") from None
    return "".join(out)
