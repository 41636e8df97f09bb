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
from pathlib import Path

from ..config import TrainConfig, revalidated, to_toml
from ..errors import CheckpointError, Interrupted, ParityError
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
        if resume:
            self._resume()
        else:
            earlier = checkpoint.found(self.run_dir)
            if earlier and not overwrite:
                raise ParityError(f"{self.run_dir} holds {earlier[-1].name} of an earlier run: continue "
                                  f"it with `parity train --resume {self.run_dir}`, start over there "
                                  f"with --overwrite, or choose another run_dir")
            self.model = build_model(cfg)
            self.learner = Learner(self.model, cfg.learner)
        self.env = build_env(cfg, self.model.config.vocab_size)  # a bad task fails here, not in a worker
        self.task_description = self.env.describe()
        self.rollout = make_rollout(cfg, self.model.config, lambda: self.learner.history)
        if overwrite and not resume:  # only once the run is known to start
            checkpoint.clear(self.run_dir)
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
        if self.start_step >= self.cfg.steps:
            raise ParityError(f"{path} is already at step {self.start_step}; to train on, raise "
                              f"steps (now {self.cfg.steps}) with --set steps=N")
        metrics_path = self.run_dir / "metrics.jsonl"
        if metrics_path.exists():  # keep the records of the steps the checkpoint contains
            self.metrics = [{k: v for k, v in record.items() if not k.endswith("_final")}
                            for record in read_metrics(self.run_dir, limit=self.start_step)]
        log.info("resuming %s from %s (step %d, policy version %d)", self.run_dir, path.name,
                 self.start_step, self.learner.version)

    def run(self, progress=None) -> list[dict]:
        """Train to `cfg.steps`; `progress(step, metrics)` is called after every step."""
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.toml").write_text(to_toml(cfg))
        sink = MetricsSink(self.run_dir, self.metrics)
        previous_handler = self._catch_ctrl_c()
        try:
            self.rollout.start(self.start_step, ready=self.ready)
            self._catch_ctrl_c()  # again: ray.init installs a SIGTERM handler of its own over ours
            self.ready = []  # the backend holds them now
            # a resumed run's clock and counts go on from its last record (wall time of training:
            # the time between the interrupt and the resume is not counted)
            prior = self.metrics[-1] if self.metrics else {}
            counted_from = 0 if prior else self.start_step  # steps the clock below covers
            wall0 = float(prior.get("time/wall_s", 0.0))
            t_start = time.perf_counter() - wall0
            tokens = round(float(prior.get("throughput/tokens_per_s", 0.0)) * wall0)
            eval_s = float(prior.get("time/eval_s", 0.0))  # in-loop evaluations so far
            first = self.metrics[0] if self.metrics else None  # step 0's record: start-up included
            for step in range(self.start_step, cfg.steps):
                t_eval = time.perf_counter()
                evaluation = self.evaluate() if cfg.eval_every and step % cfg.eval_every == 0 else {}
                eval_s += time.perf_counter() - t_eval
                t0 = time.perf_counter()
                try:
                    rollout = self.rollout.next_batch(step)
                except Exception:  # the rollout gave up: keep what the learner has trained
                    self._save_after_failure(step)
                    raise
                wait_s = time.perf_counter() - t0
                assert rollout.index == step, f"batch {rollout.index} arrived for step {step}"
                batch = TrajectoryBatch(rollout.trajectories)
                m = self.learner.step(batch)
                state, version = self.learner.publish()
                t_pub = time.perf_counter()
                self.rollout.publish(version, state)
                publish_s = time.perf_counter() - t_pub
                kept = self._retain()
                version_bytes = sum(t.numel() * t.element_size() for t in state.values())
                tokens += int(batch.mask.sum())
                shape = self.learner.model.config
                # useful model FLOPs of the step: each sequence's forward on the rollout side and
                # forward + backward (3x) on the learner's, 4 forwards in all
                model_flops = 4 * sum(len(s) * shape.forward_flops_per_token((len(s) - 1) / 2)
                                      for s in batch.sequences)
                elapsed = time.perf_counter() - t_start
                done = step + 1 - counted_from
                m.update({"time/generate_s": rollout.generate_s, "time/wait_s": wait_s,
                          "sync/versions_kept": float(kept),
                          "time/rollout_wait_s": rollout.wait_s, "time/wall_s": elapsed,
                          "throughput/tokens_per_s": tokens / elapsed,
                          "throughput/steps_per_hour": 3600 * done / elapsed, "time/eval_s": eval_s,
                          **self._steady(step, elapsed, eval_s, first),
                          "throughput/model_flops": model_flops,
                          "sync/publish_s": publish_s, "sync/rollout_pause_s": rollout.load_s,
                          "sync/version_bytes": float(version_bytes),
                          "sync/bytes_moved": float(version_bytes * cfg.rollout.workers),
                          "lag/bound": float(cfg.max_policy_lag), **rollout.stats, **evaluation})
                record = {"step": step, **m}
                first = first or record
                self.metrics.append(record)
                sink.write(record)
                if progress:
                    progress(step, m)
                if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
                    self.save_checkpoint(step + 1)
                if self.interrupted:  # Ctrl-C / SIGTERM: stop at this clean step boundary
                    raise Interrupted(self.save_checkpoint(step + 1),
                                      self.interrupted if isinstance(self.interrupted, str) else "SIGINT")
            if cfg.eval_every and self.metrics:  # the final weights, recorded with the last step
                final = self.evaluate()
                self.metrics[-1].update({k + "_final": v for k, v in final.items()})
                sink.rewrite(self.metrics)
            self.save_checkpoint(cfg.steps)  # the report (plots) is the apps' to write: write_report
        finally:
            self.rollout.close()
            sink.close()
            for signum, handler in (previous_handler or {}).items():
                signal.signal(signum, handler)
        return self.metrics

    def _save_after_failure(self, step: int) -> None:
        """A checkpoint at this step boundary (the learner's state is whole there) when the
        rollout fails for good, if this invocation trained anything: the error ends the run, not
        the steps since the last checkpoint."""
        if step <= self.start_step:
            return
        try:
            path = self.save_checkpoint(step)
        except Exception as exc:  # noqa: BLE001 - the rollout's error is the one to report
            log.warning("could not save a checkpoint after the rollout failed: %s", exc)
            return
        log.warning("the rollout failed at batch %d; the %d steps trained are in %s (continue with: "
                    "parity train --resume %s)", step, step, path, self.run_dir)

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
        out = evaluate(self.model, self.env, cfg.eval_prompts, k=cfg.eval_samples,
                       temperature=cfg.rollout.temperature, max_tokens=cfg.rollout.max_tokens,
                       max_num_seqs=cfg.rollout.max_num_seqs, ignore_eos=cfg.task.name == "target_tokens")
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
        return len(self.learner.history)

    @staticmethod
    def _steady(step: int, elapsed: float, eval_s: float, first: dict | None) -> dict[str, float]:
        """Training steps/hour after the first step (start-up: processes, the first batch) with
        the in-loop evaluations' time taken out: the training-step throughput to compare runs by."""
        if first is None or step == first["step"]:
            return {}
        span = elapsed - first["time/wall_s"] - (eval_s - first.get("time/eval_s", 0.0))
        return {"throughput/steady_steps_per_hour": 3600 * (step - first["step"]) / span} if span > 0 else {}

    def save_checkpoint(self, step: int) -> Path:
        """The model, the learner's state, the versions a restarted worker could need and the
        batches already sampled for later steps (so no older weights need storing)."""
        if self._saved is not None and self._saved[0] == step:  # checkpoint_every's, then the end's
            return self._saved[1]
        tokenizer = tokenizer_path(self.cfg) if self.cfg.task.name != "target_tokens" else None
        self._retain()
        path = checkpoint.save(self.run_dir, step, self.model, self.learner, tokenizer,
                               ready=self.rollout.ready_batches())
        self._saved = (step, path)
        return path
