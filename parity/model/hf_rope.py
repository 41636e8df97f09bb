"""RoPE fields of a Hugging Face `config.json`, as transformers 4.x and 5.x read them.

`rope_fields` fills a `ModelConfig`'s `rope_theta`, `rope_scaling` and `partial_rotary_factor`
from either layout (4.x: `rope_theta`, `rope_scaling`, a top-level `partial_rotary_factor`; 5.x:
`rope_parameters`, which may hold the other two), refusing values the two versions would read
differently. Phi-3's code reads every scaling as longrope (`su` and `yarn` renamed to it), its
original context from the top-level `original_max_position_embeddings` (default 4096), and may
rotate part of each head; `phi3_to_hf` writes those back where both versions read them.
YaRN extends the context as vLLM serves it (`original_max_position_embeddings * factor`).
"""

from __future__ import annotations

import logging
from typing import Any

from ..errors import ConfigError

log = logging.getLogger(__name__)
_PHI3_ORIGINAL = 4096  # (transformers' Phi3Config default for original_max_position_embeddings)


def _number(value, what: str, where: str):
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ConfigError(f"{where}: {what} must be a number, got {value!r}")
    return value


def _read(data: dict, where: str, default_theta: float) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) as transformers reads them from either layout: 4.x
    (`rope_theta`, `rope_scaling`) or 5.x (`rope_parameters`). A legacy `rope_scaling` wins over
    `rope_parameters` in both versions; with `rope_parameters` alone 5.x takes its theta over a
    top-level one, which 4.x would read: values the two versions would read differently are
    refused, never guessed."""
    params = data.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per layer type (5.x)
        params = params["full_attention"]
        if not isinstance(params, dict):
            raise ConfigError(f"{where}: rope_parameters.full_attention must be an object, got {params!r}")
    top = data.get("rope_theta")
    scaling = data.get("rope_scaling") or None  # ({} is absent, as transformers reads it)
    if scaling is not None and not isinstance(scaling, dict):
        raise ConfigError(f"{where}: rope_scaling must be an object, got {scaling!r}")
    if scaling is not None:  # 4.x and 5.x: rope_parameters unread
        own = _number(scaling.get("rope_theta"), "rope_scaling.rope_theta", where)
        if own is not None and top is not None and float(own) != float(top):
            raise ConfigError(f"{where}: rope_theta {top} and rope_scaling.rope_theta {own} disagree "
                              "(transformers 4 reads the first, 5 the second): remove one")
        theta = top if top is not None else own
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    elif isinstance(params, dict):
        theta = _number(params.get("rope_theta"), "rope_parameters.rope_theta", where)
        if theta is not None and top is not None and float(theta) != float(top):
            raise ConfigError(f"{where}: rope_theta {top} and rope_parameters.rope_theta {theta} disagree "
                              "(transformers 4 reads the first, 5 the second): remove one")
        theta = top if theta is None else theta
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = top
    theta = default_theta if theta is None else theta
    if isinstance(scaling, dict):  # (5.x keeps the rotated share here too: `_partial` reads it)
        scaling = {k: v for k, v in scaling.items() if k != "partial_rotary_factor"}
        if scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
    context = _number(data.get("original_max_position_embeddings"), "original_max_position_embeddings", where)
    if scaling is not None and context is not None:  # (5.x: the top-level one wins; 4.x reads the inner)
        inner = scaling.get("original_max_position_embeddings")
        if inner is not None and inner != context:
            raise ConfigError(f"{where}: original_max_position_embeddings {context} and the RoPE scaling's "
                              f"{inner} disagree (transformers 5 reads the first, 4 the second): remove one")
        scaling = {**scaling, "original_max_position_embeddings": context}
    return theta, scaling


def _yarn_context(scaling: dict) -> int | None:
    """The context a YaRN scaling extends to, as vLLM serves it: `original_max_position_embeddings
    * factor` (Qwen3's recipe: 131072); None for values `ModelConfig` refuses."""
    factor, context = scaling.get("factor"), scaling.get("original_max_position_embeddings")
    numbers = [v for v in (factor, context) if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if len(numbers) < 2 or not all(0 < v < float("inf") for v in numbers):
        return None
    return min(int(context * factor), 1 << 23)  # (ModelConfig's longest context)


def _partial(data: dict, where: str) -> float:
    """The share of each head RoPE rotates: the top-level `partial_rotary_factor` (4.x) or the
    one inside the RoPE dict (5.x, which prefers it); refused when the two disagree."""
    inner = data.get("rope_scaling") or data.get("rope_parameters")
    if isinstance(inner, dict) and isinstance(inner.get("full_attention"), dict):
        inner = inner["full_attention"]
    top = _number(data.get("partial_rotary_factor"), "partial_rotary_factor", where)
    own = _number(inner.get("partial_rotary_factor") if isinstance(inner, dict) else None,
                  "the RoPE dict's partial_rotary_factor", where)
    if top is not None and own is not None and float(top) != float(own):
        raise ConfigError(f"{where}: partial_rotary_factor {top} and the RoPE dict's {own} disagree "
                          "(transformers 4 reads the first, 5 the second): remove one")
    value = own if own is not None else top
    return 1.0 if value is None else float(value)


def _phi3(data: dict, scaling: dict | None, max_positions: Any, where: str) -> dict | None:
    """Phi-3's scaling as its transformers code reads it: `su` and `yarn` are longrope, other
    types are refused; the original context is the top-level one (default 4096)."""
    if scaling is None:
        return None
    key = "rope_scaling" if data.get("rope_scaling") else "rope_parameters"
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ("longrope", "su", "yarn"):
        raise ConfigError(f"{where}: {key} of type {kind!r} on Phi-3 is not supported: transformers' "
                          "Phi-3 reads every scaling as longrope (su and yarn renamed to it)")
    scaling = {k: v for k, v in scaling.items() if k != "type"}
    scaling["rope_type"] = "longrope"
    inner = scaling.get("original_max_position_embeddings")
    if data.get("original_max_position_embeddings") is None:
        if inner is not None and inner != _PHI3_ORIGINAL:
            raise ConfigError(f"{where}: {key}.original_max_position_embeddings {inner} is not what "
                              f"transformers' Phi-3 reads (the top-level one, default {_PHI3_ORIGINAL}): "
                              "move it there")
        scaling["original_max_position_embeddings"] = _PHI3_ORIGINAL
    factor, original = scaling.get("factor"), scaling["original_max_position_embeddings"]
    if (factor is not None and scaling.get("attention_factor") is None and isinstance(max_positions, int)
            and isinstance(original, (int, float)) and original > 0 and factor != max_positions / original):
        raise ConfigError(f"{where}: {key}.factor {factor} is not max_position_embeddings / "
                          f"original_max_position_embeddings = {max_positions / original:g} (transformers 4 "
                          "derives the attention factor from the second, 5 from the first): "
                          "set attention_factor")
    return scaling


def rope_fields(data: dict, fields: dict[str, Any], where: str, default_theta: float) -> None:
    """`fields` (a ModelConfig's, `model_type` and `max_position_embeddings` set) given the RoPE
    fields of `data` as transformers reads them."""
    theta, scaling = _read(data, where, default_theta)
    if fields["model_type"] == "phi3":
        scaling = _phi3(data, scaling, fields["max_position_embeddings"], where)
    fields.update(rope_theta=float(theta), rope_scaling=scaling, partial_rotary_factor=_partial(data, where))
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "yarn":
        # (transformers fills the original context in so: before it is extended below)
        scaling.setdefault("original_max_position_embeddings", fields["max_position_embeddings"])
        context, file_context = _yarn_context(scaling), fields["max_position_embeddings"]
        if context is not None and isinstance(file_context, int) and context > file_context:
            log.info("%s: YaRN factor %s over original_max_position_embeddings %s: a context of %d "
                     "tokens (max_position_embeddings %s in the file)", where, scaling["factor"],
                     scaling["original_max_position_embeddings"], context, file_context)
            fields["max_position_embeddings"] = context


def phi3_to_hf(cfg) -> dict[str, Any]:
    """A Phi-3 config's fields transformers 4.x and 5.x read outside `rope_scaling`: the rotated
    share and longrope's original context (top-level, as Phi-3's files hold them)."""
    out: dict[str, Any] = {}
    if cfg.partial_rotary_factor != 1:
        out["partial_rotary_factor"] = cfg.partial_rotary_factor
    if cfg.rope_scaling is not None:
        out["original_max_position_embeddings"] = cfg.rope_scaling["original_max_position_embeddings"]
    return out
