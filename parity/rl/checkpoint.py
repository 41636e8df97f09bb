"""Training checkpoints: written atomically, verified before anything is loaded.

`checkpoint-<step>/` holds the model (HF layout, compute dtype), `trainer_state.pt` (optimizer,
schedule, policy version, float32 master weights, the weight versions a restarted rollout worker
could still need, the batches already sampled for later steps, RNG state, the KL penalty's
reference weights) and `manifest.json` with a SHA-256 per file, written last.
A directory without a valid manifest, or whose files do not match it, is refused whole.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import pickle
import re
import shutil
import time
from pathlib import Path

import torch

from ..config import TaskSection
from ..dtypes import dtype_from_name
from ..errors import CheckpointError, ParityError
from ..fields import is_file_spec
from ..model import files as model_files
from ..model.tokenizer import copy_tokenizer
from .faults import checkpoint_fault
from .learner import Learner
from .reference import restore_reference
from .trajectory import RolloutBatch

log = logging.getLogger(__name__)


class _Writes(io.RawIOBase):
    """A binary file whose failed writes are remembered (torch.save rewraps them)."""

    def __init__(self, raw) -> None:
        self.raw, self.error = raw, None

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        try:
            return self.raw.write(data)
        except OSError as exc:
            self.error = exc
            raise


def sampling_fields(cfg) -> dict:
    """What a batch sampled ahead was sampled and scored under, besides its weights: a resume
    whose config changes any of it samples those batches again (they were trained on as they
    were: another temperature's log-probs in the importance weights, the old task's rewards)."""
    r = cfg.rollout
    task = {k: v for k, v in dataclasses.asdict(cfg.task).items() if k != "tokenizer"}
    for key in ("data", "heldout_data", "env", "reward"):  # your own task's files: their contents
        value = task.get(key)
        paths = _code_files(value) if key in ("env", "reward") else [value] if value else []
        if paths:
            digests = [_digest(path) for path in paths]
            task[f"{key}_sha256"] = digests if isinstance(value, list) else digests[0]
    return {"rollout": {k: getattr(r, k) for k in ("prompts_per_step", "group_size", "max_tokens",
                                                   "temperature", "lengths")},
            "task": task, "model": {"kernels": cfg.model.kernels}, "run": {"seed": cfg.seed}}  # (prompts)


def _code_files(specs) -> list[str]:
    """The files among import specs ('file.py:name' or 'module:name'; one, a list, or None)."""
    specs = specs if isinstance(specs, list) else [specs]
    return [where for spec in specs if spec and is_file_spec(where := spec.rpartition(":")[0])]


def keep_task_files(cfg, run_dir: Path) -> None:
    """Copies of the Python files your task names (task.env, task.reward) in `run_dir/task-files`,
    one per content (`name-<sha256 prefix>.py`: a resume after an edit adds the new one, two files
    of one name both stay): what the run's rewards came from, beside its config (the data files
    are too large to copy; the checkpoints keep their hashes)."""
    for source in sorted(set(_code_files(cfg.task.env) + _code_files(cfg.task.reward))):
        try:
            (run_dir / "task-files").mkdir(exist_ok=True)
            path = Path(source)
            shutil.copyfile(source, run_dir / "task-files" / f"{path.stem}-{_digest(source)}{path.suffix}")
        except (OSError, TypeError) as exc:
            log.warning("could not keep a copy of %s in %s: %s", source, run_dir / "task-files", exc)


_DIGESTS: dict[tuple, str] = {}


def _digest(path: str) -> str | None:
    """The first 16 hex digits of a file's SHA-256 (kept per size and modification time, as every
    checkpoint asks, unless modified in the last 2 s: a rewrite within the clock's granularity
    keeps both), or None when it cannot be read."""
    try:
        stat = os.stat(path)
        key = (path, stat.st_size, stat.st_mtime_ns)
        if key in _DIGESTS:
            return _DIGESTS[key]
        digest = model_files.sha256(path)[:16]
        if time.time_ns() - stat.st_mtime_ns > 2_000_000_000:
            _DIGESTS[key] = digest
        return digest
    except OSError:
        return None


def _changed(saved: dict, now: dict) -> list[str]:
    """The fields that differ; one a checkpoint of an earlier version did not record counts as
    unchanged while it holds its default (or is a file hash: there was no file then)."""
    defaults = {"task": {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                         for f in dataclasses.fields(TaskSection)}}
    out = []
    for section in sorted(set(saved) | set(now)):
        was, now_ = saved.get(section, {}), now.get(section, {})
        for k in sorted(set(was) | set(now_)):
            if k not in was and (k.endswith("_sha256") or now_.get(k) == defaults.get(section, {}).get(k, k)):
                continue
            if was.get(k) != now_.get(k):
                out.append(f"{section}.{k}")
    return out


def _trainer_state(step: int, learner: Learner, separate: bool, ready: list | None,
                   sampled_under: dict | None) -> dict:
    return {"sampled_under": sampled_under, "step": step, "version": learner.version, "steps": learner.steps,
        "optimizer": learner.optimizer.state_dict(), "scheduler": learner.scheduler.state_dict(),
        "master": [m.detach() for m in learner.master] if separate else None,
        "history": learner.history, "torch_rng": torch.get_rng_state(),
        "reference": learner.reference.state_dict() if learner.reference is not None else None,  # kl_coef
        "ready": [b.to_dict() for b in ready or []],  # plain data: loads with weights_only
    }


def save(run_dir: Path, step: int, model, learner: Learner, tokenizer: Path | None = None,
         ready: list | None = None, sampled_under: dict | None = None) -> Path:
    """Write checkpoint-<step>; `tokenizer` (a tokenizer.json, with the files beside it that
    `HFTokenizer` reads) is copied in so the checkpoint can be evaluated or trained from on its
    own; `ready`: RolloutBatches sampled for later steps (a resume consumes them)."""
    learner.check_whole()  # (a torn update saved would be resumed as if whole)
    final = Path(run_dir) / f"checkpoint-{step}"
    tmp = Path(run_dir) / f".checkpoint-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        if tokenizer is not None and Path(tokenizer).exists():  # (with its chat template: was left out)
            copy_tokenizer(tokenizer, tmp)
        checkpoint_fault(step)
        separate = learner.compute_dtype != torch.float32
        # streamed to the file through Python writes (not serialised in memory first: at a real
        # size the optimizer state alone is several GB), which keep an OS error (a full disk) as
        # it is instead of torch's own writer's "[enforce fail ...]"
        with (tmp / "trainer_state.pt").open("wb") as raw:
            out = _Writes(raw)
            try:
                torch.save(_trainer_state(step, learner, separate, ready, sampled_under), out)
            except RuntimeError:
                if out.error is not None:
                    raise out.error from None
                raise
        files = {p.name: model_files.sha256(p) for p in sorted(tmp.iterdir())}
        (tmp / "manifest.json").write_text(json.dumps({"step": step, "files": files}, indent=1))
        _sync(*sorted(tmp.iterdir()), tmp)  # on disk before the rename makes it the newest
    except (OSError, RuntimeError, CheckpointError) as exc:  # a full disk, say
        shutil.rmtree(tmp, ignore_errors=True)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
        raise CheckpointError(f"{final}: could not be written ({reason}); earlier checkpoints are "
                              "untouched") from None
    except BaseException:  # anything else (out of memory, an interrupt): no model-sized leftover
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():  # the step saved again: swapped by renames, never left half-removed
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    try:
        _sync(Path(run_dir))  # the rename itself
    except OSError:
        pass
    return final


def _sync(*paths: Path) -> None:
    """fsync files and directories: after a power loss the newest checkpoint is whole (its
    files were in the page cache only, and its manifest check would fail on resume)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


LOCK = ".parity-lock"
"""The file a run holds an exclusive lock on while it trains in its run dir (its pid inside)."""


class RunLock:
    """One run at a time in a run dir: a second one (or a resume of a run still going) is
    refused in one line (two wrote into one metrics.jsonl and one set of checkpoints). The lock
    is the OS's (flock): it goes with the process, however that ends."""

    def __init__(self, run_dir: Path):
        self.path, self.fd = Path(run_dir) / LOCK, None

    def acquire(self) -> RunLock:
        import fcntl

        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:  # (a read-only run dir fails on its own writes, with its own message)
            return self
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ParityError(f"{self.path.parent} is in use by another run (pid {holder}): wait for it "
                              "to end, or choose another run_dir") from None
        except OSError:  # a file system without locks: runs there are not guarded
            os.close(fd)
            return self
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def check(self) -> None:
        """Refuse now if another run holds the run dir (before anything in it is read or cleared)."""
        if self.path.parent.is_dir():
            self.acquire().release()


DEMO_MARK = ".parity-demo"
"""The file `parity demo` leaves in its run dir: a later demo may replace that run without
asking. Any other run started there removes it."""


def found(run_dir: Path) -> list[Path]:
    """The checkpoint directories in `run_dir` by step (none when it does not exist)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    steps = sorted((int(m.group(1)), p) for p in run_dir.iterdir()
                   if (m := re.fullmatch(r"checkpoint-(\d+)", p.name)) and p.is_dir())
    return [p for _, p in steps]


def latest(run_dir: Path) -> Path:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"{run_dir}: no such run directory")
    paths = found(run_dir)
    if not paths:
        raise CheckpointError(f"{run_dir}: no checkpoint to resume from")
    return paths[-1]


def sweep(run_dir: Path) -> list[str]:
    """Remove what an interrupted save left (`.checkpoint-N.tmp`, `.checkpoint-N.old`: a kill
    mid-write keeps a model-sized directory nothing reads); returns their names."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    left = sorted(run_dir.glob(".checkpoint-*.tmp")) + sorted(run_dir.glob(".checkpoint-*.old"))
    for path in left:
        shutil.rmtree(path, ignore_errors=True)
    return [p.name for p in left]


def clear(run_dir: Path) -> None:
    """Remove an earlier run's checkpoints (unfinished ones too), metrics, TensorBoard events and
    report from `run_dir`, so a run started over there cannot be mixed with them (a resume would
    take the newest checkpoint; a study takes a report.md for a finished run; TensorBoard would
    draw both runs' curves as one)."""
    run_dir = Path(run_dir)
    sweep(run_dir)
    for path in found(run_dir):
        shutil.rmtree(path)
    for name in ("tensorboard", "task-files"):
        if (run_dir / name).is_dir():
            shutil.rmtree(run_dir / name)
    for name in ("metrics.jsonl", "report.md", "report.png"):
        (run_dir / name).unlink(missing_ok=True)


def verify(path: Path) -> dict:
    """`path`'s manifest, every file it lists intact (`model.files.verify_manifest`)."""
    return model_files.verify_manifest(path)


_ARCHITECTURE = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts",
                 "moe_intermediate_size", "tie_word_embeddings")


def _check_belongs(path: Path, cfg, model) -> None:
    """Refuse a checkpoint that is not this run's: of another model or dtype than the run's
    config.toml describes (a copied-in one trained on under the wrong config), or misnamed."""
    from ..model import ModelConfig
    from ..model.families import config_from_hf, read_json

    try:
        src = cfg.model.checkpoint and Path(cfg.model.checkpoint) / "config.json"
        want = config_from_hf(read_json(src), src) if src else ModelConfig.preset(cfg.model.preset)
    except ParityError:  # the run's starting checkpoint is gone: nothing to compare with
        want = None
    diff = [k for k in _ARCHITECTURE if want is not None and getattr(want, k) != getattr(model.config, k)]
    if diff:
        raise CheckpointError(f"{path} holds a model with {diff[0]} = {getattr(model.config, diff[0])}; this "
                              f"run's config describes {getattr(want, diff[0])}: not this run's checkpoint")
    saved = json.loads((path / "config.json").read_text()).get("torch_dtype")
    if cfg.learner.compute_dtype != "auto" and saved not in (None, cfg.learner.compute_dtype):
        raise CheckpointError(f"{path}/config.json: torch_dtype {saved!r}; this run's model.dtype is "
                              f"{cfg.learner.compute_dtype} (the checkpoint fixes it)")


def load(path: Path, cfg):
    """(model, learner, step, ready batches) restored from a verified checkpoint directory."""
    from ..model import load_model

    if not (path / model_files.MANIFEST).exists():
        verify(path)  # (refused: a checkpoint without one is incomplete)
    # load_model checks every file against the manifest first (here once: the optimizer state is
    # several times the weights' size, and was hashed twice)
    model = load_model(path, kernels=cfg.model.kernels, dtype=dtype_from_name(cfg.learner.compute_dtype),
                       device=cfg.model.device, context=cfg.model.context)
    _check_belongs(path, cfg, model)
    where = path / "trainer_state.pt"
    try:
        state = torch.load(where, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a bad file
        # (not torch's own advice, to load it with weights_only=False: never for a damaged file)
        why = "not plain tensors and numbers" if isinstance(exc, pickle.UnpicklingError) else \
            (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise CheckpointError(f"{where}: unreadable ({why}): damaged, or not written by parity") from None
    learner = Learner(model, cfg.learner)
    try:
        learner.optimizer.load_state_dict(state["optimizer"])
        learner.scheduler.load_state_dict(state["scheduler"])
        for change in learner.adopt_config():
            log.info("resuming with %s (this run's config)", change)
        if state["master"] is not None:
            with torch.no_grad():
                for m, saved in zip(learner.master, state["master"], strict=True):
                    m.copy_(saved)
        learner.version, learner.steps = int(state["version"]), int(state["steps"])
        learner.history = dict(state["history"])
        restore_reference(learner.reference, state.get("reference"), path)  # the run's own π_ref
        torch.set_rng_state(state["torch_rng"])
        step = int(state["step"])
        if (named := re.fullmatch(r"checkpoint-(\d+)", path.name)) and int(named.group(1)) != step:
            raise CheckpointError(f"{path} holds step {step}: not this run's {path.name} (copied in?)")
        ready = [RolloutBatch.from_dict(b) for b in state.get("ready", [])]
        changed = _changed(state.get("sampled_under") or {}, sampling_fields(cfg)) \
            if state.get("sampled_under") is not None else []
        edited = [c.removesuffix("_sha256") for c in changed if c.endswith("_sha256")]
        if edited:
            log.warning("%s changed since %s was saved: the problems, held-out set or rewards from here "
                        "on follow the files as they are now", ", ".join(edited), path.name)
        if changed and ready:
            log.warning("the %d batches %s sampled ahead were sampled under another %s: sampling them "
                        "again", len(ready), path.name, ", ".join(changed))
            ready = []
    except (KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise CheckpointError(f"{where}: does not match this run's model or optimizer ({exc})") from None
    return model, learner, step, ready
