"""parity's AdamW (`parity/rl/optim.py`): torch's AdamW with its methods unwrapped, so that building and
stepping it never imports torch._dynamo (and with it Triton): the same bits and the same state dicts
as torch's, in both directions, and no TorchDynamo import in a fresh process."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from parity.rl.optim import AdamW, adamw


def _train(make, steps: int = 6, state: dict | None = None, eps: float = 1e-8):
    """A small model trained `steps` steps under a warm-up schedule; its weights and optimizer state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = make(model.parameters(), lr=1e-2, betas=(0.9, 0.98), weight_decay=0.01, eps=eps, fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    if state is not None:
        state = copy.deepcopy(state)  # (a loaded optimizer state shares the tensors it was given)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
    data = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(8, 16, generator=data)).pow(2).sum().backward()
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
    return {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optimizer": opt.state_dict(),
            "schedule": schedule.state_dict()}


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]) and all(
        torch.equal(x, b["optimizer"]["state"][i][name]) for i, s in a["optimizer"]["state"].items()
        for name, x in s.items())


def test_the_same_bits_and_state_dicts_as_torchs_adamw():
    ours, theirs = _train(adamw), _train(torch.optim.AdamW)
    assert _same(ours, theirs)
    assert ours["optimizer"]["param_groups"] == theirs["optimizer"]["param_groups"]
    # a state saved by either resumes in the other to the same bits
    assert _same(_train(adamw, 3, state=theirs), _train(torch.optim.AdamW, 3, state=theirs))
    assert _same(_train(torch.optim.AdamW, 3, state=ours), _train(adamw, 3, state=ours))
    # the control: another eps gives other bits, so the comparison can fail
    assert not _same(_train(adamw, eps=1e-6), theirs)


def test_an_optimizer_in_a_fresh_process_imports_no_torch_dynamo():
    """The control: torch's own AdamW imports it on its first call."""
    script = """
import sys, torch
from parity.rl.optim import AdamW
w = torch.nn.Parameter(torch.ones(4))
opt = {"parity": AdamW, "torch": torch.optim.AdamW}[sys.argv[1]]([w], lr=0.1, fused=True)
w.sum().backward(); opt.step(); opt.zero_grad(); opt.load_state_dict(opt.state_dict())
print("torch._dynamo" in sys.modules, "triton" in sys.modules)
"""
    seen = {}
    for which in ("parity", "torch"):
        proc = subprocess.run([sys.executable, "-c", script, which], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        seen[which] = proc.stdout.split()
    assert seen["parity"] == ["False", "False"]
    assert seen["torch"][0] == "True"


@pytest.mark.parametrize("closure", [False, True])
def test_step_takes_a_closure_and_records_no_graph(closure):
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = AdamW([w], lr=0.1)

    def loss():
        opt.zero_grad()
        out = (w * w).sum()
        out.backward()
        return out

    if closure:
        assert opt.step(loss).item() == 5.0
    else:
        loss()
        assert opt.step() is None
    # (grad mode on inside the step would have failed the in-place update of a leaf; and it is on again)
    assert torch.is_grad_enabled() and not torch.equal(w.detach(), torch.tensor([1.0, -2.0]))


def test_a_wrapper_of_another_kind_is_left_on(monkeypatch):
    """Only the wrappers `KNOWN_WRAPPERS` names come off: a PyTorch that wraps a method otherwise
    keeps its own (the control: today's wrappers do come off)."""
    import functools

    from parity.rl import optim

    assert optim._unwrapped("zero_grad") == (torch.optim.Optimizer.zero_grad.__wrapped__, True)
    assert optim.KEPT == []
    original = torch.optim.AdamW.zero_grad

    @functools.wraps(original)
    def another_kind(*args, **kwargs):
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "zero_grad", another_kind)
    assert optim._unwrapped("zero_grad") == (None, False)


KEPT_STEP = """
import functools, sys, torch
original = torch.optim.Adam.step
@functools.wraps(original)
def another_kind(*args, **kwargs):  # a PyTorch whose step has a wrapper parity does not know
    return original(*args, **kwargs)
torch.optim.Adam.step = another_kind
from parity.rl.optim import KEPT, adamw
print("kept", KEPT, "dynamo", "torch._dynamo" in sys.modules)
counts = []
for make in (adamw, torch.optim.AdamW):
    w = torch.nn.Parameter(torch.ones(4))
    opt = make([w], lr=0.1)
    if make is adamw:  # imported at its build, under the signals held, not at its first step
        print("built", "torch._dynamo" in sys.modules)
    calls = []
    opt.register_step_post_hook(lambda *a: calls.append(1))
    w.sum().backward()
    opt.step()
    counts.append(len(calls))
print("hooks", counts)
"""


def test_a_step_kept_as_torchs_runs_its_hooks_once_and_imports_dynamo_under_the_signals_held():
    """A review's finding: with torch's step kept, parity's own step wrapper called it through
    `super()`, and both carried the profiler's hook: step hooks ran twice."""
    proc = subprocess.run([sys.executable, "-c", KEPT_STEP], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "kept ['step'] dynamo False\nbuilt True\nhooks [1, 1]" in proc.stdout
