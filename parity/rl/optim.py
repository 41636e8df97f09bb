"""The optimizer of `parity`'s learners (RL and SFT): PyTorch's AdamW, without `torch._dynamo`.

`torch.optim`'s methods are wrapped to switch TorchDynamo off inside them, and the wrappers import
`torch._dynamo` on their first call, which imports Triton where it is installed: 2.0-2.3 s on an
AVX2-only AMD EPYC (2026-12-07), as long as importing torch itself, in every process that builds
an optimizer (each `parity train` and `parity sft`, each test that trains). parity never compiles
the optimizer, so `AdamW` is `torch.optim.AdamW` with those methods unwrapped: the same code on the
same tensors (the same bits, `tests/rl/test_optim.py`), state dicts in the same format (checkpoints
of either load in the other), and no TorchDynamo import. A method wrapped in a way this module
does not know (another PyTorch version) is kept as PyTorch's.

It is still built under `signals_held`, and where a method was kept as PyTorch's, `torch._dynamo`
is imported there first (a SIGTERM during Triton's import, which it brings, aborted the process).
"""

from __future__ import annotations

import torch

from ..signals import import_held, signals_held

KNOWN_WRAPPERS = ("_disable_dynamo.<locals>.inner", "_use_grad_for_differentiable.<locals>._use_grad",
                  "Optimizer.profile_hook_step.<locals>.wrapper")
"""The wrappers taken off (their code's qualified names): TorchDynamo's switch, the step's grad mode
(done here as it does outside a compiled graph) and the profiler's hook (PyTorch puts it on this
class's own step as it does on any optimizer's)."""


def _unwrapped(name: str):
    """`torch.optim.AdamW`'s method `name` without its wrappers (None: it has none), and whether every
    wrapper was one of `KNOWN_WRAPPERS` (if not, the method is None: PyTorch's is kept as it is)."""
    method = inner = getattr(torch.optim.AdamW, name)
    while hasattr(inner, "__wrapped__"):
        code = getattr(inner, "__code__", None)
        if code is None or code.co_qualname not in KNOWN_WRAPPERS:
            return None, False
        inner = inner.__wrapped__
    return (None if inner is method else inner), True


class AdamW(torch.optim.AdamW):
    """`torch.optim.AdamW` whose methods run without importing `torch._dynamo` (module docstring)."""


def _step(self, closure=None):
    """One update, with gradients recorded only for a differentiable optimizer (what PyTorch's
    wrapper does outside a compiled graph)."""
    with torch.set_grad_enabled(self.defaults["differentiable"]):
        return _STEP(self, closure)


KEPT: list[str] = []
"""The methods kept as PyTorch's because a wrapper on them is not one of `KNOWN_WRAPPERS`."""
_STEP = None  # Adam's step without its wrappers (None: torch's own step, wrapped once by its profiler hook)
for _name in ("step", "add_param_group", "zero_grad", "state_dict", "load_state_dict"):
    _inner, _known = _unwrapped(_name)
    if not _known:
        KEPT.append(_name)
    elif _inner is not None:
        _STEP = _inner if _name == "step" else _STEP
        setattr(AdamW, _name, _step if _name == "step" else _inner)


def adamw(params, **kwargs) -> torch.optim.AdamW:
    """`AdamW(params, **kwargs)`, built under `signals_held` (and where a method was kept as PyTorch's,
    with `torch._dynamo` imported under them first: such a method may import it at its first call)."""
    with signals_held():
        if KEPT:
            import_held("torch._dynamo")
        return AdamW(params, **kwargs)
