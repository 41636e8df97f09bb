"""The controller: the learner, a rollout backend, checkpoints and metric sinks for one run.

    Controller(cfg).run()     # or Controller(cfg, resume=True) to continue from a checkpoint

Each step it evaluates when due, takes batch `step` from the rollout backend (`rl/local.py`:
RolloutWorkers in child processes, or `rl/ray_backend.py`: RolloutWorker actors on Ray; the
worker enforces the lag bound), runs one learner update on it, publishes the new weight version
to the backend and records the step's metrics, weight-sync figures included (`sync/...`). The learner
consumes batch s at step s, so every sampled token's lag is <= max_policy_lag; `max_policy_lag
= 0` is synchronous on-policy training (strict alternation). Ctrl-C finishes the step and saves
a checkpoint. It writes metrics.jsonl and checkpoints; the run's report (report.md, report.png:
`metrics.report.write_report`) is written by the apps that want one (`parity train`, demo, study),
not by benchmarks and sweeps that only read the metrics.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from ..config import TrainConfig, revalidated, to_toml
from ..errors import CheckpointError, Interrupted, ParityError, WaitInterrupted
from ..metrics.sinks import MetricsSink, read_metrics
from . import checkpoint
from .build import build_env, build_model, tokenizer_path
from .evaluate import evaluate
from .learner import Learner
from .local import LocalRollout
from .trajectory import TrajectoryBatch

log = logging.getLogger(__name__)


def make_rollout(cfg: TrainConfig, model_config, versions):
    """The rollout backend `cfg.rollout.backend` names (Ray is imported only when chosen)."""
    if cfg.rollout.backend == "ray":
        from .ray_backend import RayRollout

        return RayRollout(cfg, model_config, versions)
    return LocalRollout(cfg, model_config, versions)


@dataclass
class _Clock:
    """A run's wall clock and counts, going on from a resumed run's last record (the time
    between an interrupt and the resume is not counted)."""

    t_start: float
    counted_from: int  # the first step the clock covers
    tokens: int
    eval_s: float  # in-loop evaluations so far
    first: dict | None  # step 0's record (start-up included), or this invocation's first

    @staticmethod
    def resumed(metrics: list[dict], start_step: int) -> _Clock:
        if metrics and (metrics[-1].get("step") != start_step - 1 or "time/wall_s" not in metrics[-1]):
            metrics = []  # records missing at the end, or untimed: time from the resume
        prior = metrics[-1] if metrics else {}
        wall0 = float(prior.get("time/wall_s", 0.0))
        return _Clock(time.perf_counter() - wall0, 0 if prior else start_step,
                      round(float(prior.get("throughput/tokens_per_s", 0.0)) * wall0),
                      float(prior.get("time/eval_s", 0.0)), metrics[0] if metrics else None)


class Controller:
    """Runs `cfg.steps` learner updates on batches from a rollout backend; writes the run dir."""

    def __init__(self, cfg: TrainConfig, resume: bool = False, overwrite: bool = False):
        """`resume`: continue from the run dir's latest checkpoint. Otherwise a run dir that holds
        an earlier run's checkpoints is refused, or with `overwrite` cleared of them first."""
        self.cfg = cfg = revalidated(cfg)  # as it stands now, not as it was built
        self.run_dir = Path(cfg.run_dir)
        self.start_step = 0
        self.ready = []  # batches sampled before a checkpoint and not consumed (resume serves them)
        self.metrics: list[dict] = []
        self.interrupted = False
        self._saved: tuple[int, Path] | None = None  # the last checkpoint written: (step, path)
        checkpoint.RunLock(self.run_dir).check()  # another run's dir is neither read nor cleared
        if resume:
            self._resume()
            cfg = self.cfg  # (its tokenizer may come from the checkpoint now)
        else:
            earlier = checkpoint.found(self.run_dir)
            if earlier and not overwrite:
                raise ParityError(f"{self.run_dir} holds {earlier[-1].name} of an earlier run: continue "
                                  f"it with `parity train --resume {self.run_dir}`, start over there "
                                  f"with --overwrite, or choose another run_dir")
            self.model = build_model(cfg)
            self.learner = Learner(self.model, cfg.learner)
        self.env = build_env(cfg, self.model.config.vocab_size,  # a bad task fails here, not in a worker
                             context=self.model.config.max_position_embeddings)
        self.task_description = self.env.describe()
        self.rollout = make_rollout(cfg, self.model.config, lambda: self.learner.history)
        self.rollout.should_stop = lambda: bool(self.interrupted)  # a wait for a batch gives way
        self._clear = overwrite and not resume  # in run(), under the run dir's lock
        if not resume:  # a new run here is no demo's (the demo marks its own after this)
            try:
                (self.run_dir / checkpoint.DEMO_MARK).unlink(missing_ok=True)
            except OSError as exc:  # (the error named the mark file, not the run directory)
                raise ParityError(f"run_dir {self.run_dir} cannot be used: {exc.strerror}") from None

    def _resume(self) -> None:
        path = checkpoint.latest(self.run_dir)
        try:
            self.model, self.learner, self.start_step, self.ready = checkpoint.load(path, self.cfg)
        except CheckpointError as exc:
            older = [p.name for p in checkpoint.found(self.run_dir) if p != path]
            if not older or "does not match this run" in str(exc):  # (an older one would not either)
                raise
            raise CheckpointError(f"{exc}; {older[-1]} is older and may be intact: move {path.name} "
                                  "aside to resume from it") from None
        finished = (self.run_dir / "report.md").exists()  # (a run stopped at its last step has none yet)
        if self.start_step > self.cfg.steps or (self.start_step == self.cfg.steps and finished):
            cosine = " and learner.total_steps=N (its cosine schedule's length)" \
                if self.cfg.learner.schedule == "cosine" else ""
            raise ParityError(f"{path} is already at step {self.start_step}; to train on, raise "
                              f"steps (now {self.cfg.steps}) with --set steps=N{cosine}")
        if self.start_step == self.cfg.steps:
            log.info("%s is the run's last step: finishing the run (its final evaluation)", path.name)
        metrics_path = self.run_dir / "metrics.jsonl"
        if metrics_path.exists():  # keep the records of the steps the checkpoint contains
            self.metrics = [{k: v for k, v in record.items() if not k.endswith("_final")}
                            for record in read_metrics(self.run_dir, before_step=self.start_step)]
            kept = [r.get("step") for r in self.metrics]
            if kept != list(range(self.start_step)):  # (was kept by line count: steps repeated or lost)
                lost = sorted(set(range(self.start_step)) - set(kept))
                log.warning("%s holds %d records for the %d steps %s contains (missing steps: %s); "
                            "they stay as they are", metrics_path, len(kept), self.start_step, path.name,
                            ", ".join(map(str, lost[:10])) + (" ..." if len(lost) > 10 else "") or "none")
        elif self.start_step:  # (went on without a word: the report counted the steps after the resume)
            log.warning("%s is gone: the records of the %d steps %s contains are lost, and the run's "
                        "report covers the steps from %d on", metrics_path, self.start_step, path.name,
                        self.start_step + 1)
        if self.cfg.task.name != "target_tokens" and (path / "tokenizer.json").exists() \
                and not (tokenizer_path(self.cfg) or path / "none").exists():
            log.info("%s has no tokenizer.json now (moved or removed): the task reads %s's copy",
                     self.cfg.model.checkpoint, path.name)  # (the resume failed for want of it)
            self.cfg = replace(self.cfg, task=replace(self.cfg.task, tokenizer=str(path / "tokenizer.json")))
        log.info("resuming %s from %s (step %d, policy version %d)", self.run_dir, path.name,
                 self.start_step, self.learner.version)

    def run(self, progress=None) -> list[dict]:
        """Train to `cfg.steps`; `progress(step, metrics)` is called after every step (a display
        that fails, e.g. stdout piped into `head`, is dropped; training goes on). Any error ends
        the run with a checkpoint at the last whole step boundary (the batch in hand kept)."""
        try:  # (/proc/self/x, /sys/kernel: a raw errno naming a file)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            lock = checkpoint.RunLock(self.run_dir).acquire()
        except OSError as exc:
            raise ParityError(f"run_dir {self.run_dir} cannot be used: {exc.strerror or exc}") from None
        try:
            if self._clear:  # (was in __init__, before the lock: a run that took it meanwhile lost its files)
                checkpoint.clear(self.run_dir)
                self._clear = False
            return self._run(progress)
        finally:
            lock.release()

    def _run(self, progress) -> list[dict]:
        cfg = self.cfg
        for name in checkpoint.sweep(self.run_dir):
            log.info("removed %s (a save that was interrupted)", name)
        try:  # (a read-only run dir: the first write, one line)
            (self.run_dir / "config.toml").write_text(to_toml(cfg))
        except OSError as exc:
            raise ParityError(f"run_dir {self.run_dir} cannot be used: {exc.strerror or exc}") from None
        checkpoint.keep_task_files(cfg, self.run_dir)
        if self.start_step < cfg.steps:  # a report of an earlier end (a run resumed to go on) is stale now
            for name in ("report.md", "report.png"):
                (self.run_dir / name).unlink(missing_ok=True)
        sink = MetricsSink(self.run_dir, self.metrics)
        previous_handler = self._catch_ctrl_c()
        try:
            self.rollout.start(self.start_step, ready=self.ready)
            self._catch_ctrl_c()  # again: ray.init installs a SIGTERM handler of its own over ours
            self.ready = []  # the backend holds them now
            clock = _Clock.resumed(self.metrics, self.start_step)
            for step in range(self.start_step, cfg.steps):  # (messages count steps from 1, as the
                # progress lines do; batches keep their index from 0, as a worker's own lines do)
                rollout, stage = None, f"the evaluation before step {step + 1} failed"
                try:  # until the update the learner is as at this step's start
                    t_eval = time.perf_counter()
                    evaluation = self.evaluate() if cfg.eval_every and step % cfg.eval_every == 0 else {}
                    clock.eval_s += time.perf_counter() - t_eval
                    t0, stage = time.perf_counter(), f"the rollout failed at batch {step}"
                    rollout = self.rollout.next_batch(step)
                    wait_s, stage = time.perf_counter() - t0, f"the learner's step {step + 1} failed"
                    assert rollout.index == step, f"batch {rollout.index} arrived for step {step}"
                    batch = TrajectoryBatch(rollout.trajectories)
                    m = self.learner.step(batch)
                except WaitInterrupted:  # Ctrl-C / SIGTERM while the learner waited for the batch
                    raise Interrupted(self.save_checkpoint(step), self._signal_name()) from None
                except Exception:
                    self._save_after_failure(step, stage, rollout)
                    raise
                try:  # from here the learner is at step + 1
                    record = self._record(step, m, rollout, batch, wait_s, evaluation, clock)
                    sink.write(record)
                except Exception:
                    if self.metrics[-1:] and self.metrics[-1]["step"] == step:
                        self.metrics.pop()  # not written: the learner's own record, if it can be
                    record = {"step": step, **m, "lag/bound": float(cfg.max_policy_lag), **rollout.stats,
                              **evaluation}  # all but the transport figures (publish_s, ...)
                    if self._write_after_failure(sink, record):  # (else resumed records
                        self._save_after_failure(step + 1, f"recording step {step + 1} failed")  # skip one)
                    raise
                progress = self._show(progress, step, m)
                if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
                    self.save_checkpoint(step + 1)
                if self.interrupted:  # Ctrl-C / SIGTERM: stop at this clean step boundary
                    raise Interrupted(self.save_checkpoint(step + 1), self._signal_name())
            if self.start_step < cfg.steps:  # (else resumed to finish: checkpoint-{steps} is there)
                self.save_checkpoint(cfg.steps)  # before the final evaluation: whatever it meets
            if cfg.eval_every and (self.metrics or self.start_step == cfg.steps):  # the final weights,
                try:  # recorded with the last step (on a record of its own where metrics.jsonl was lost)
                    final = self.evaluate()
                except WaitInterrupted:  # (a resume runs it again)
                    raise Interrupted(checkpoint.latest(self.run_dir), self._signal_name()) from None
                if not self.metrics or self.metrics[-1]["step"] != cfg.steps - 1:
                    self.metrics.append({"step": cfg.steps - 1})
                self.metrics[-1].update({k + "_final": v for k, v in final.items()})
                sink.rewrite(self.metrics)
        finally:
            self.rollout.close()
            sink.close()
            for signum, handler in (previous_handler or {}).items():
                signal.signal(signum, handler)
        return self.metrics

    def _record(self, step: int, m: dict, rollout, batch: TrajectoryBatch, wait_s: float,
                evaluation: dict, clock: _Clock) -> dict:
        """Publish the new weights, take in finished batches, and make step's metrics record."""
        cfg = self.cfg
        state, version = self.learner.publish()
        t_pub = time.perf_counter()
        self.rollout.publish(version, state)
        publish_s = time.perf_counter() - t_pub
        kept = self._retain()
        version_bytes = sum(t.numel() * t.element_size() for t in state.values())
        clock.tokens += int(batch.mask.sum())
        shape = self.learner.model.config
        # useful model FLOPs of the step: each sequence's forward on the rollout side and
        # forward + backward (3x) on the learner's, 4 forwards in all
        model_flops = 4 * sum(len(s) * shape.forward_flops_per_token((len(s) - 1) / 2)
                              for s in batch.sequences)
        elapsed = time.perf_counter() - clock.t_start
        done = step + 1 - clock.counted_from
        m.update({"time/generate_s": rollout.generate_s, "time/wait_s": wait_s,
                  "sync/versions_kept": float(kept),
                  "time/rollout_wait_s": rollout.wait_s, "time/wall_s": elapsed,
                  "throughput/tokens_per_s": clock.tokens / elapsed,
                  "throughput/steps_per_hour": 3600 * done / elapsed, "time/eval_s": clock.eval_s,
                  **self._steady(step, elapsed, clock.eval_s, clock.first),
                  "throughput/model_flops": model_flops,
                  "sync/publish_s": publish_s, "sync/rollout_pause_s": rollout.load_s,
                  "sync/version_bytes": float(version_bytes),
                  "sync/bytes_moved": float(version_bytes * cfg.rollout.workers),
                  "lag/bound": float(cfg.max_policy_lag), **rollout.stats, **evaluation})
        record = {"step": step, **m}
        clock.first = clock.first or record
        self.metrics.append(record)
        return record

    def _signal_name(self) -> str:
        return self.interrupted if isinstance(self.interrupted, str) else "SIGINT"

    @staticmethod
    def _show(progress, step: int, m: dict):
        """Call the progress display; a display that fails is dropped (returns None), not the run."""
        if progress is None:
            return None
        try:
            progress(step, m)
            return progress
        except Exception as exc:  # noqa: BLE001 - e.g. BrokenPipeError: stdout piped into `head`
            log.warning("the progress display failed (%s); training goes on without it", exc)
            return None

    def _write_after_failure(self, sink: MetricsSink, record: dict) -> bool:
        """Best effort: the step's record in metrics.jsonl, so a resume finds one per step.
        Whether it is there now."""
        self.metrics.append(record)
        try:
            sink.rewrite(self.metrics)
            return True
        except Exception as exc:  # noqa: BLE001 - the step's own error is the one to report
            log.warning("could not write step %d's metrics either (%s); no checkpoint is saved past "
                        "the last one", record["step"], exc)
            return False

    def _save_after_failure(self, step: int, what: str, in_hand=None) -> None:
        """A checkpoint at this step boundary (the learner's state is whole there, unless its
        update itself failed part-way) when the run fails, if this invocation trained anything:
        the error ends the run, not the steps since the last checkpoint. `in_hand`: the batch for
        `step`, received and not trained on (kept with the checkpoint)."""
        if step <= self.start_step:
            return
        if self.learner.torn is not None:
            log.warning("%s part-way through the learner's update; no checkpoint can be saved from it "
                        "(the last one is %s)", what, self._saved[1] if self._saved else "none")
            return
        try:
            path = self.save_checkpoint(step, in_hand=in_hand)
        except Exception as exc:  # noqa: BLE001 - the run's own error is the one to report
            log.warning("could not save a checkpoint after %s: %s", what, exc)
            return
        log.warning("%s; the %d steps trained are in %s (continue with: parity train --resume %s)",
                    what, step, path, self.run_dir)

    def _catch_ctrl_c(self):
        """Ctrl-C or SIGTERM (a scheduler ending the job): finish the step, save, stop; a second
        Ctrl-C aborts. Returns the old handlers."""
        if threading.current_thread() is not threading.main_thread():
            return None

        def on_signal(signum, frame):
            if self.interrupted and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.interrupted = signal.Signals(signum).name
            log.warning("%s: finishing this step, then saving a checkpoint%s", self.interrupted,
                        " (press Ctrl-C again to abort)" if signum == signal.SIGINT else "")

        return {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}

    def evaluate(self) -> dict[str, float]:
        """Held-out greedy pass@1 (and mean@k with eval_samples = k) of the current weights."""
        cfg = self.cfg
        def stop_check(engine):  # Ctrl-C / SIGTERM: the evaluation is dropped, not finished
            if self.interrupted:
                raise WaitInterrupted

        out = evaluate(self.model, self.env, cfg.eval_prompts, k=cfg.eval_samples,
                       temperature=cfg.rollout.temperature, max_tokens=cfg.rollout.max_tokens,
                       max_num_seqs=cfg.rollout.max_num_seqs, ignore_eos=cfg.task.name == "target_tokens",
                       before_step=stop_check)
        out["eval/policy_version"] = float(self.learner.version)
        return out

    def _retain(self) -> int:
        """Take in the batches the workers have finished; let the learner drop the versions no
        restarted worker could need. Returns how many versions it keeps. MoE models and
        in-flight updates keep the lag window: there the worker does not score every sampled
        token (MoE: the learner also compares expert choices; in-flight: a response's earlier
        tokens came from a version since replaced), so the decomposition still needs the weights."""
        self.rollout.collect()
        scored = not self.model.config.is_moe and self.cfg.rollout.weight_update != "inflight"
        if scored:
            self.learner.retain(self.rollout.needed_versions() or ())
        return len(self.learner.history.keys() | self.learner.kept_back.keys())  # (recheck's one too)

    @staticmethod
    def _steady(step: int, elapsed: float, eval_s: float, first: dict | None) -> dict[str, float]:
        """Training steps/hour after the first step (start-up: processes, the first batch) with
        the in-loop evaluations' time taken out: the training-step throughput to compare runs by.
        At a lag above 0 the workers go on sampling (up to the bound) while the learner evaluates,
        so those batches cost this figure nothing: it favours asynchrony by that much (a review put
        the study's bias at <= 2%; `bench async` evaluates nothing). A resumed run's first span
        includes its own start-up."""
        if first is None or step == first["step"]:
            return {}
        span = elapsed - first["time/wall_s"] - (eval_s - first.get("time/eval_s", 0.0))
        return {"throughput/steady_steps_per_hour": 3600 * (step - first["step"]) / span} if span > 0 else {}

    def save_checkpoint(self, step: int, in_hand=None) -> Path:
        """The model, the learner's state, the versions a restarted worker could need and the
        batches already sampled for later steps (so no older weights need storing); `in_hand`: a
        batch taken from the rollout and not trained on (a failed step's)."""
        if self._saved is not None and self._saved[0] == step:  # checkpoint_every's, then the end's
            return self._saved[1]
        tokenizer = tokenizer_path(self.cfg) if self.cfg.task.name != "target_tokens" else None
        try:
            self._retain()
        except Exception as exc:  # noqa: BLE001 - a failing worker: save what is in hand
            log.warning("could not take in the finished batches before saving: %s", exc)
        ready = ([in_hand] if in_hand is not None else []) + self.rollout.ready_batches()
        path = checkpoint.save(self.run_dir, step, self.model, self.learner, tokenizer, ready=ready,
                               sampled_under=checkpoint.sampling_fields(self.cfg))
        self._saved = (step, path)
        return path
