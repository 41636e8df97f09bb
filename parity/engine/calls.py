"""How callers may use an `Engine`: the checks of what they hand it, and the one-thread guard.

An engine is single-threaded. Its public methods take its (re-entrant) lock without waiting: a
call from another thread while one runs is a one-line error, never a forward on half-copied
weights or a request list changed under `generate` (both were reproduced: tokens tagged with a
version that could not reproduce them; IndexErrors and lost outputs). Inside `generate`, its
`before_step` callback may call `update_weights` (what it is for); stepping the engine or adding
requests there is refused (their outputs had nowhere to go: `generate` returned None for them, or
dropped them).
"""

from __future__ import annotations

import copy
import functools

import torch

from ..errors import InputError
from .sequence import SamplingParams, Sequence


def one_thread(in_before_step: bool = False):
    """Decorate an `Engine` method: run it holding the engine's lock, refused (not queued) while
    another thread holds it; with `in_before_step` False, also refused from `before_step`."""
    def wrap(method):
        @functools.wraps(method)
        def guarded(self, *args, **kwargs):
            name = f"Engine.{method.__name__}"
            if not self._lock.acquire(blocking=False):
                raise InputError(f"{name}: the engine is in use on another thread; an engine is single-"
                                 "threaded (call it from one thread, or from generate's before_step)")
            try:
                if self._in_before_step and not in_before_step:
                    raise InputError(f"{name}: not from generate's before_step, which may call "
                                     "update_weights (generate adds and steps its own requests)")
                return method(self, *args, **kwargs)
            finally:
                self._lock.release()
        return guarded
    return wrap


def decode_failed(seq: Sequence, err: Exception) -> str:
    """The one-line error of a request whose text the engine's tokenizer could not decode."""
    return f"request {seq.request_id}: tokenizer.decode failed on its tokens: {type(err).__name__}: {err}"


def sampling_params(params, tokenizer, vocab_size: int) -> SamplingParams:
    """The request's own checked copy of `params` (None: the defaults)."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise InputError(f"params must be a SamplingParams, got {type(params).__name__}")
    params = copy.deepcopy(params)  # the request's own: the caller may change or reuse theirs
    params.validate()  # (fields changed since construction were sampled with unchecked)
    if params.stop_strings and tokenizer is None:  # (they were silently never matched)
        raise InputError("SamplingParams.stop_strings need an engine with a tokenizer (Engine(..., "
                         "tokenizer=...)); stop_token_ids work without one")
    outside = [t for t in params.stop_token_ids or () if not 0 <= t < vocab_size]
    if outside:  # (accepted, and never matched)
        raise InputError(f"SamplingParams.stop_token_ids: {outside[0]} is outside the vocabulary "
                         f"(0..{vocab_size - 1})")
    return params


def repeats(prompts: list) -> bool:
    """Whether a prompt occurs twice (prompts that cannot be compared count as different)."""
    try:
        keys = {tuple(p.tolist() if isinstance(p, torch.Tensor) else p) for p in prompts}
    except TypeError:  # (a bad prompt: generate reports it as that request's error)
        return False
    return len(keys) < len(prompts)
