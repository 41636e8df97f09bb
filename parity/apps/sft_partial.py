"""A base-policy build stopped part-way (Ctrl-C, SIGTERM): the steps it trained are kept beside
the output folder, in `<out>.partial/state.pt` (weights, optimizer moments, the demonstrations'
random state, the losses so far), and the next build of the same recipe into the same folder
resumes from them, to the bits an uninterrupted build gives. A signal during a step is held
until the step ends (a second Ctrl-C stops at once, keeping nothing of that step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import ParityError, Terminated

log = logging.getLogger(__name__)

SUFFIX = ".partial"


def partial_path(out_dir: Path) -> Path:
    """Where a stopped build of `out_dir` keeps its steps."""
    return out_dir.with_name(out_dir.name + SUFFIX)


def save(out_dir: Path, recipe: dict, state: dict) -> Path:
    """Write `state` (with the recipe it belongs to) atomically; returns the folder."""
    path = partial_path(out_dir)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save({"recipe": recipe, **state}, tmp / "state.pt")
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path


def load(out_dir: Path, recipe: dict) -> dict | None:
    """The kept steps of a stopped build of this very recipe, or None (none kept; another
    recipe's or a damaged file, which is said and set aside: the build starts from step 0)."""
    path = partial_path(out_dir) / "state.pt"
    if not path.exists():
        return None
    try:
        state = torch.load(path, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file: start over, saying so
        log.warning("%s is unreadable (%s): the build starts from step 0", path, str(exc).splitlines()[0])
        return None
    if not isinstance(state, dict) or state.get("recipe") != recipe:
        log.warning("%s was kept by a build of another recipe: the build starts from step 0", path)
        return None
    return state


def discard(out_dir: Path) -> None:
    shutil.rmtree(partial_path(out_dir), ignore_errors=True)


class HeldSignals:
    """While in force (main thread only), the first SIGINT or SIGTERM is held: `pending` names it
    and `raise_pending()`, called between steps, raises it then (KeyboardInterrupt, or
    `errors.Terminated` for SIGTERM). A second SIGINT raises at once, with `forced` set."""

    def __init__(self) -> None:
        self.pending: str | None = None
        self.forced = False

    def _hold(self, signum, frame) -> None:
        if self.pending and signum == signal.SIGINT:
            self.forced = True
            raise KeyboardInterrupt
        self.pending = signal.Signals(signum).name
        log.warning("%s: finishing this step, then keeping the steps trained (press Ctrl-C again to "
                    "stop at once)", self.pending)

    def raise_pending(self) -> None:
        if self.pending == "SIGTERM":
            raise Terminated()
        if self.pending:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        old = {s: signal.signal(s, self._hold) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)


def train_steps(out_dir: Path, recipe: dict, model, opt, rnd, steps: int, progress,
                step_fn: Callable[[int, list], None]) -> tuple[list[float], float]:
    """Run `step_fn(step, losses)` for steps 0..steps-1, from a stopped build's kept steps when
    there are some (weights, optimizer, `rnd` restored); stopped between steps, keep them and
    raise on. Returns the losses of every step and the training seconds (kept ones included)."""
    kept = load(out_dir, recipe)
    if kept:
        model.load_state_dict(kept["model"])
        opt.load_state_dict(kept["optimizer"])
        rnd.setstate(kept["rnd"])
        torch.set_rng_state(kept["torch_rng"])
        log.warning("resuming the build at step %d of %d (%s)", kept["step"], steps, partial_path(out_dir))
    start, losses = (kept["step"], list(kept["losses"])) if kept else (0, [])
    t0 = time.perf_counter() - (kept["train_s"] if kept else 0.0)
    held = HeldSignals()
    with held.installed():
        try:
            for step in range(start, steps):
                step_fn(step, losses)
                if progress:
                    progress(step, losses[-1], time.perf_counter() - t0)
                held.raise_pending()
        except KeyboardInterrupt:  # (a held signal's or a callback's: between steps, the state whole)
            if len(losses) > start and not held.forced:
                state = {"step": len(losses), "model": model.state_dict(), "optimizer": opt.state_dict(),
                         "rnd": rnd.getstate(), "torch_rng": torch.get_rng_state(), "losses": losses,
                         "train_s": time.perf_counter() - t0}
                try:
                    path = save(out_dir, recipe, state)
                except OSError as exc:  # (a full disk: the interrupt is still what is reported)
                    log.warning("stopped at step %d of %d; the steps trained could not be kept: %s",
                                len(losses), steps, exc.strerror or exc)
                else:
                    log.warning("stopped at step %d of %d: the steps trained are kept in %s; the same "
                                "command resumes from there", len(losses), steps, path)
            raise
    discard(out_dir)
    return losses, time.perf_counter() - t0


def check_kept_build(out_dir: Path, record: dict, cfg, version: int) -> None:
    """A base policy already in `out_dir` (its sft.json `record`) is what `parity sft` was asked
    for (`cfg`, an SFTConfig of recipe `version`): a build of another recipe, steps or seed there,
    or of an older recipe version, is refused in one line naming the first difference (`--out DIR`
    handed back whatever DIR held). A field the record lacks (added since) is its default."""
    asked, defaults = (json.loads(json.dumps(dataclasses.asdict(c))) for c in (cfg, type(cfg)()))  # (lists)
    built = record.get("config")
    if not isinstance(built, dict):
        return  # (a record from before configs were kept: nothing to compare)
    if record.get("recipe") != version:
        raise ParityError(f"{out_dir} holds a base policy of recipe version {record.get('recipe')!r}, not "
                          f"{version}: --force rebuilds it there, or choose another --out")
    diff = [k for k in asked if built.get(k, defaults.get(k)) != asked[k]]
    if diff:
        k = diff[0]
        had = built.get(k, defaults.get(k))
        raise ParityError(f"{out_dir} holds a base policy built with {k} = {had!r}, not the "
                          f"{asked[k]!r} asked for: --force rebuilds it there, or choose another --out")

