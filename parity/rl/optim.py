"""The optimizer of `parity`'s learners (RL and SFT): PyTorch's AdamW, without `torch._dynamo`.

`torch.optim`'s methods are wrapped to switch TorchDynamo off inside them, and the wrappers import
`torch._dynamo` on their first call, which imports Triton where it is installed: 2.0-2.3 s on an
AVX2-only AMD EPYC (2026-12-07), as long as importing torch itself, in every process that builds
an optimizer (each `parity train` and `parity sft`, each test that trains). parity never compiles
the optimizer, so `AdamW` is `torch.optim.AdamW` with those methods unwrapped: the same code on the
same tensors (the same bits, `tests/rl/test_optim.py`), state dicts in the same format (checkpoints
of either load in the other), and no TorchDynamo import. A method wrapped in a way this module
does not know (another PyTorch version) is kept as PyTorch's.

It is still built under `signals_held` (a PyTorch whose optimizer does import Triton there stays
safe from a SIGTERM during that import).
"""

from __future__ import annotations

import torch

from ..signals import signals_held

KNOWN_WRAPPERS = ("_disable_dynamo.<locals>.inner", "_use_grad_for_differentiable.<locals>._use_grad",
                  "Optimizer.profile_hook_step.<locals>.wrapper")
"""The wrappers taken off (their code's qualified names): TorchDynamo's switch, the step's grad mode
(done here as it does outside a compiled graph) and the profiler's hook (PyTorch puts it on this
class's own step as it does on any optimizer's)."""


def _unwrapped(name: str):
    """`torch.optim.AdamW`'s method `name` without its wrappers; None where it has none, or one this
    module does not know (a PyTorch version that wraps it otherwise keeps its method as it is)."""
    method = inner = getattr(torch.optim.AdamW, name)
    while hasattr(inner, "__wrapped__"):
        code = getattr(inner, "__code__", None)
        if code is None or code.co_qualname not in KNOWN_WRAPPERS:
            return None
        inner = inner.__wrapped__
    return None if inner is method else inner


class AdamW(torch.optim.AdamW):
    """`torch.optim.AdamW` whose methods run without importing `torch._dynamo` (module docstring)."""

    _step = _unwrapped("step")

    def step(self, closure=None):
        """One update, with gradients recorded only for a differentiable optimizer (what PyTorch's
        wrapper does outside a compiled graph)."""
        if self._step is None:
            return super().step(closure)
        with torch.set_grad_enabled(self.defaults["differentiable"]):
            return self._step(closure)


for _name in ("add_param_group", "zero_grad", "state_dict", "load_state_dict"):
    if (_inner := _unwrapped(_name)) is not None:
        setattr(AdamW, _name, _inner)


def adamw(params, **kwargs) -> torch.optim.AdamW:
    """`AdamW(params, **kwargs)`, built under `signals_held`."""
    with signals_held():
        return AdamW(params, **kwargs)
