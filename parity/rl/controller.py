"""The controller: a rollout worker process and the learner, with the policy lag bounded.

Seams (small, replaceable by a distributed backend later):
- `RolloutWorker` (its own process): model + engine + task; for batch b it waits until it holds
  weights of version >= b - max_policy_lag (exactly that version in deterministic mode), samples
  `prompts_per_step x group_size` responses and sends the trajectories. Admission control: the
  producer waits, nothing is dropped.
- weights flow learner -> worker through a queue, one message per published version;
  trajectories flow worker -> learner through another, tagged with their batch index.
- the learner consumes batch s at step s, so every sampled token's lag is <= max_policy_lag;
  `max_policy_lag = 0` is synchronous on-policy training (strict alternation).
"""

from __future__ import annotations

import json
import pickle
import queue as queue_mod
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.multiprocessing as mp

from ..config import TrainConfig, to_toml
from ..errors import ParityError
from .learner import Learner
from .trajectory import Trajectory, TrajectoryBatch


def checkpoint_path(cfg: TrainConfig) -> str | None:
    """The model checkpoint directory ("base" resolves to the cached base policy)."""
    if cfg.model.checkpoint == "base":
        from ..sft import get_base_policy

        return str(get_base_policy())
    return cfg.model.checkpoint


def build_model(cfg: TrainConfig):
    from ..model import Model, ModelConfig, load_model

    dtype = getattr(torch, cfg.model.dtype)
    path = checkpoint_path(cfg)
    if path:
        return load_model(path, kernels=cfg.model.kernels, dtype=dtype)
    return Model(ModelConfig.preset(cfg.model.preset), kernels=cfg.model.kernels, dtype=dtype,
                 seed=cfg.model.seed)


def build_task(cfg: TrainConfig, vocab_size: int, sandbox=None):
    """The run's environment (text tasks read the checkpoint's tokenizer.json)."""
    t = cfg.task
    if t.name == "target_tokens":
        from ..envs import TargetTokensTask

        return TargetTokensTask(vocab_size, t.targets, t.prompt_len, cfg.seed)
    from ..model.tokenizer import HFTokenizer

    path = checkpoint_path(cfg)
    if not path or not (Path(path) / "tokenizer.json").exists():
        raise ParityError(f"task {t.name!r} needs a tokenizer.json in the checkpoint directory "
                          f"({path}); use model.checkpoint = \"base\" or a parity sft output")
    tokenizer = HFTokenizer(Path(path) / "tokenizer.json")
    if t.name == "math":
        from ..envs.math import MathEnv

        return MathEnv(tokenizer, t.math_task, t.level, cfg.seed, t.heldout_size)
    from ..envs.tool import ToolEnv

    return ToolEnv(tokenizer, tuple(t.kinds), t.level, cfg.seed, t.heldout_size, t.max_tool_calls,
                   sandbox=sandbox)


def sampling_params(cfg: TrainConfig, batch_index: int, n: int) -> list:
    """Per-response SamplingParams of batch `batch_index` (seeded, so any batch can be redone).
    The toy task samples to its length limit; text tasks stop at EOS (limits are per turn)."""
    from ..engine import SamplingParams

    limits = response_limits(cfg, batch_index, n)
    toy = cfg.task.name == "target_tokens"
    return [SamplingParams(temperature=cfg.rollout.temperature, max_tokens=limits[i],
                           seed=hash((cfg.seed, batch_index, i)) % 2**62, ignore_eos=toy)
            for i in range(n)]


def rollout_stats(episodes) -> dict[str, float]:
    """Per-batch episode statistics (tool use, answers, pass rate)."""
    n = len(episodes)
    return {"rollout/pass_rate": sum(e.passed for e in episodes) / n,
            "rollout/answered": sum(e.answered for e in episodes) / n,
            "rollout/tool_calls": sum(e.tool_calls for e in episodes) / n,
            "rollout/tool_errors": sum(e.tool_errors for e in episodes) / n,
            "rollout/turns": sum(e.turns for e in episodes) / n}


_CORES = max(1, torch.get_num_threads())  # read once, before any split changes it


def split_threads(cfg: TrainConfig) -> tuple[int, int]:
    """(rollout threads, learner threads): both get every core when they alternate (lag 0),
    the cores are shared out when they run at once."""
    cores = _CORES
    if cfg.max_policy_lag == 0 or cores == 1:
        return cores, cores
    return max(1, cores // 2), max(1, cores - cores // 2)


def response_limits(cfg: TrainConfig, batch_index: int, n: int) -> list[int]:
    """Per-request max_tokens for batch `batch_index` (seeded, so any batch can be redone)."""
    cap = cfg.rollout.max_tokens
    if cfg.rollout.lengths == "fixed":
        return [cap] * n
    import random

    from ..envs.lengths import geometric_lengths

    return geometric_lengths(random.Random(cfg.seed * 104_729 + batch_index), n, cap / 4, cap)


def _send_batch(traj_q, spool: str, b: int, payload: tuple) -> None:
    """A batch goes through a file, the queue carries only its path: a worker that dies while
    sending leaves a partial file nobody reads, never a torn queue message the learner would
    block on."""
    path = Path(spool) / f"batch-{b}.pkl"
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL))
    tmp.rename(path)
    traj_q.put(("batch", str(path)))


def _worker_main(cfg_dict: dict, init_state: dict, init_version: int, start_batch: int,
                 weights_q, traj_q, stop, threads: int, spool: str) -> None:
    """Rollout worker process body."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the controller's to handle
    traj_q.cancel_join_thread()  # never block this process's exit on unread batches
    try:
        _worker_loop(cfg_dict, init_state, init_version, start_batch, weights_q, traj_q, stop, threads, spool)
    except ParityError as exc:  # a problem that a restart would only repeat
        traj_q.put(("error", str(exc)))
        traj_q.close()
        traj_q.join_thread()  # deliver it: cancel_join_thread above would drop it at exit


def _worker_loop(cfg_dict: dict, init_state: dict, init_version: int, start_batch: int,
                 weights_q, traj_q, stop, threads: int, spool: str) -> None:
    from ..config import config_from_dict
    from ..engine import Engine
    from ..envs.rollout import run_episodes

    torch.set_num_threads(threads)
    parent = mp.parent_process()
    cfg = config_from_dict(cfg_dict)
    model = build_model(cfg)
    model.load_state_dict(init_state)
    task = build_task(cfg, model.config.vocab_size)
    engine = Engine(model, max_num_seqs=cfg.rollout.max_num_seqs)
    engine.policy_version = init_version
    held = {init_version: init_state}  # versions received but not yet loaded
    lag = cfg.max_policy_lag

    def receive(block: bool) -> None:
        if parent is not None and not parent.is_alive():
            stop.set()  # orphaned: the controller is gone
            return
        try:
            while True:
                version, state = weights_q.get(block=block, timeout=0.5 if block else None)
                held[version] = state
                block = False
        except queue_mod.Empty:
            pass

    b = start_batch
    while not stop.is_set() and b < cfg.steps:
        need = max(0, b - lag)
        receive(block=False)
        t_wait = time.perf_counter()
        while not stop.is_set() and (need not in held if cfg.deterministic else max(held) < need):
            receive(block=True)  # admission control: wait for fresh enough weights
        wait_s = time.perf_counter() - t_wait
        if stop.is_set():
            break
        version = need if cfg.deterministic else max(held)
        if version != engine.policy_version:  # between batches nothing is running
            engine.update_weights(held[version], version, mode="drain")
        for v in [v for v in held if v < version]:
            del held[v]
        t0 = time.perf_counter()
        problems = task.problems(b, cfg.rollout.prompts_per_step)
        group = cfg.rollout.group_size
        params = sampling_params(cfg, b, len(problems) * group)
        inflight = cfg.rollout.weight_update == "inflight"  # (never with deterministic = true)

        def load_newer(eng) -> None:  # in-flight: switch running sequences to newer weights
            receive(block=False)
            newest = max(held)
            if newest > eng.policy_version:
                eng.update_weights(held[newest], newest, mode="inflight")
                for v in [v for v in held if v < newest]:
                    del held[v]

        results = run_episodes(engine, task, [p for p in problems for _ in range(group)], params,
                               before_step=load_newer if inflight else None)
        trajectories = [asdict(Trajectory.from_output(r.output, r.reward, i // group))
                        for i, r in enumerate(results)]
        stats = rollout_stats([r.episode for r in results])
        _send_batch(traj_q, spool, b, (b, trajectories, time.perf_counter() - t0, version, wait_s, stats))
        b += 1


class Controller:
    """Runs `cfg.steps` learner updates with a rollout worker process; writes the run dir."""

    def __init__(self, cfg: TrainConfig, resume: bool = False):
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.start_step = 0
        self.metrics: list[dict] = []
        if resume:
            self._resume()
        else:
            self.model = build_model(cfg)
            self.learner = Learner(self.model, cfg.learner)
        task = build_task(cfg, self.model.config.vocab_size)  # a bad task fails here, not in the worker
        self.task_description = task.describe()
        self.ctx = mp.get_context("spawn")

    def _resume(self) -> None:
        from . import checkpoint

        path = checkpoint.latest(self.run_dir)
        self.model, self.learner, self.start_step = checkpoint.load(path, self.cfg)
        if self.start_step >= self.cfg.steps:
            raise ParityError(f"{path} is already at step {self.start_step}; to train on, raise "
                              f"steps (now {self.cfg.steps}) with --set steps=N")
        metrics_path = self.run_dir / "metrics.jsonl"
        if metrics_path.exists():  # keep the records of the steps the checkpoint contains
            lines = [x for x in metrics_path.read_text().splitlines() if x.strip()][:self.start_step]
            self.metrics = [{k: v for k, v in json.loads(x).items() if not k.endswith("_final")}
                            for x in lines]
        print(f"parity: resuming {self.run_dir} from {path.name} (step {self.start_step}, "
              f"policy version {self.learner.version})", flush=True)

    def _close_queues(self) -> None:
        for q in (getattr(self, "weights_q", None), getattr(self, "traj_q", None)):
            if q is not None:
                q.cancel_join_thread()  # unread weight messages must not block our exit
                q.close()

    def _start_worker(self, start_batch: int):
        self._close_queues()
        self.weights_q = self.ctx.Queue()
        self.traj_q = self.ctx.Queue()
        self.stop = self.ctx.Event()
        state, version = self.learner.publish()
        if self.cfg.deterministic:  # the worker may need older versions than the newest
            version = max(0, start_batch - self.cfg.max_policy_lag)
            state = self.learner.history[version]
        rollout_threads, learner_threads = split_threads(self.cfg)
        torch.set_num_threads(learner_threads)
        worker = self.ctx.Process(target=_worker_main, daemon=True, args=(
            _config_dict(self.cfg), state, version, start_batch, self.weights_q, self.traj_q, self.stop,
            rollout_threads, self.spool))
        worker.start()
        for v in sorted(self.learner.history):
            if v > version:
                self.weights_q.put((v, self.learner.history[v]))
        return worker

    max_restarts = 3

    def _next_batch(self, step: int) -> tuple:
        """Batch `step`; a dead worker is restarted from that batch (what it held is sampled
        again: nothing consumed is repeated, nothing pending is lost)."""
        while True:
            try:
                kind, value = self.traj_q.get(timeout=1.0)
                if kind == "error":
                    raise ParityError(f"rollout worker: {value}")
                path = Path(value)
                item = pickle.loads(path.read_bytes())
                path.unlink()
                return item
            except queue_mod.Empty:
                if self.worker.is_alive():
                    continue
                if self.restarts >= self.max_restarts:
                    raise ParityError(f"the rollout worker died (exit code {self.worker.exitcode}) "
                                      f"{self.restarts + 1} times; giving up at batch {step}") from None
                self.restarts += 1
                print(f"parity: rollout worker died (exit code {self.worker.exitcode}); "
                      f"restarting it from batch {step}", flush=True)
                self.worker = self._start_worker(step)

    def run(self, progress=None) -> list[dict]:
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.toml").write_text(to_toml(cfg))
        metrics_path = self.run_dir / "metrics.jsonl"
        metrics_path.write_text("".join(json.dumps(m) + "\n" for m in self.metrics))
        self.restarts = 0
        shm = Path("/dev/shm")
        self.spool = tempfile.mkdtemp(prefix="parity-batches-", dir=shm if shm.is_dir() else None)
        tb = tensorboard_writer(self.run_dir)
        self.worker = self._start_worker(self.start_step)
        t_start = time.perf_counter()
        tokens = 0
        self.interrupted = False
        previous_handler = None
        if threading.current_thread() is threading.main_thread():
            def on_sigint(signum, frame):
                if self.interrupted:  # a second Ctrl-C: stop now
                    raise KeyboardInterrupt
                self.interrupted = True
                print("\nparity: Ctrl-C: finishing this step, then saving a checkpoint "
                      "(press again to abort)", flush=True)
            previous_handler = signal.signal(signal.SIGINT, on_sigint)
        try:
            with metrics_path.open("a") as sink:
                for step in range(self.start_step, cfg.steps):
                    evaluation = self.evaluate() if cfg.eval_every and step % cfg.eval_every == 0 else {}
                    t0 = time.perf_counter()
                    b, trajectories, gen_s, version, rollout_wait_s, stats = self._next_batch(step)
                    wait_s = time.perf_counter() - t0
                    assert b == step, f"batch {b} arrived for step {step}"
                    batch = TrajectoryBatch([Trajectory(**t) for t in trajectories])
                    m = self.learner.step(batch)
                    state, v = self.learner.publish()
                    self.weights_q.put((v, state))
                    tokens += int(batch.mask.sum())
                    elapsed = time.perf_counter() - t_start
                    done = step + 1 - self.start_step
                    m.update({"time/generate_s": gen_s, "time/wait_s": wait_s,
                              "time/rollout_wait_s": rollout_wait_s, "time/wall_s": elapsed,
                              "throughput/tokens_per_s": tokens / elapsed,
                              "throughput/steps_per_hour": 3600 * done / elapsed,
                              "lag/bound": float(cfg.max_policy_lag), **stats, **evaluation})
                    record = {"step": step, **m}
                    self.metrics.append(record)
                    sink.write(json.dumps(record) + "\n")
                    sink.flush()
                    if tb is not None:
                        for key, value in m.items():
                            tb.add_scalar(key, value, step)
                    if progress:
                        progress(step, m)
                    if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
                        self.save_checkpoint(step + 1)
                    if self.interrupted:  # Ctrl-C: stop at this clean step boundary
                        raise Interrupted(self.save_checkpoint(step + 1))
            if cfg.eval_every and self.metrics:  # the final weights, recorded with the last step
                final = self.evaluate()
                self.metrics[-1].update({k + "_final": v for k, v in final.items()})
                metrics_path.write_text("".join(json.dumps(m) + "\n" for m in self.metrics))
            self.save_checkpoint(cfg.steps)
            from ..metrics.report import write_report

            write_report(self.run_dir)
        finally:
            self._close_queues()
            if tb is not None:
                tb.close()
            if previous_handler is not None:
                signal.signal(signal.SIGINT, previous_handler)
            self.stop.set()
            self.worker.join(timeout=10)
            if self.worker.is_alive():
                self.worker.terminate()
            shutil.rmtree(self.spool, ignore_errors=True)
        return self.metrics

    def evaluate(self) -> dict[str, float]:
        """Held-out greedy pass@1 (and mean@k with eval_samples = k) of the current weights."""
        from ..envs.rollout import evaluate

        cfg = self.cfg
        if not hasattr(self, "_eval_task"):
            self._eval_task = build_task(cfg, self.model.config.vocab_size)
        out = evaluate(self.model, self._eval_task, cfg.eval_prompts, k=cfg.eval_samples,
                       temperature=cfg.rollout.temperature, max_tokens=cfg.rollout.max_tokens,
                       max_num_seqs=cfg.rollout.max_num_seqs,
                       ignore_eos=cfg.task.name == "target_tokens")
        out["eval/policy_version"] = float(self.learner.version)
        return out

    def save_checkpoint(self, step: int) -> Path:
        from . import checkpoint

        source = checkpoint_path(self.cfg) if self.cfg.task.name != "target_tokens" else None
        tokenizer = Path(source) / "tokenizer.json" if source else None
        return checkpoint.save(self.run_dir, step, self.model, self.learner, tokenizer)


class Interrupted(Exception):
    """Ctrl-C during training: a checkpoint was saved at `path`."""

    def __init__(self, path: Path):
        super().__init__(str(path))
        self.path = path


def tensorboard_writer(run_dir: Path):
    """A TensorBoard SummaryWriter under run_dir/tensorboard when tensorboard is installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(log_dir=str(run_dir / "tensorboard"))


def _config_dict(cfg: TrainConfig) -> dict:
    return asdict(cfg)
