"""The rollout worker: model + engine + environment; weights in, trajectories out.

Everything the rollout side does lives here, whatever process or actor hosts it:
- **weights**: versions arrive by `receive` (pushed) or `poll` (pulled); between batches the worker
  loads the one admission allows (drain), in-flight it moves running sequences to the newest;
- **admission control**: batch b is sampled only with weights of version >= b - max_policy_lag
  (exactly that version in deterministic mode): no token is trained more than max_policy_lag versions
  (learner steps of mini-batches x epochs updates) after its own; the producer waits, nothing is dropped;
- **episodes**: `run_episodes` keeps every episode of the batch in the engine at once, judges the
  turns one engine step finishes with the environment (concurrently for multi-turn or threaded envs)
  and feeds observations back (`loss_mask` 0, cache kept);
- **trajectories**: the batch leaves as one `RolloutBatch`; in async runs, on the batches the learner
  will decompose, each token also carries the learner path's log-prob under the weights that sampled
  it (`sampled_learner_logprobs`): the kernel/lag split needs no old weights on the learner's side.

A batch's content depends only on (seed, batch index, the version that sampled it).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from ..config import TrainConfig
from ..engine import Engine, RequestOutput, SamplingParams
from ..envs.base import Env, Episode, Turn
from ..errors import InputError
from ..metrics.diagnostics import rollout_stats
from ..model import sequence_logprobs
from ..seeds import request_seed
from .trajectory import RolloutBatch, Trajectory, micro_batches

log = logging.getLogger(__name__)

State = dict[str, torch.Tensor]
Poll = Callable[[bool], list[tuple[int, State]]]
"""`poll(block)` -> newly published (version, weights) pairs; with block=True it may wait a little."""

# --------------------------------------------------------------------------- a batch's requests
def geometric_lengths(rnd: random.Random, n: int, mean: float, cap: int) -> list[int]:
    """n lengths from a geometric distribution on 1, 2, ... with the given mean, capped at `cap`."""
    p = 1.0 / mean
    out = []
    for _ in range(n):
        k = 1
        while rnd.random() > p and k < cap:
            k += 1
        out.append(k)
    return out


def response_limits(cfg: TrainConfig, batch_index: int, n: int) -> list[int]:
    """Per-request max_tokens for batch `batch_index` (seeded, so any batch can be redone)."""
    cap = cfg.rollout.max_tokens
    if cfg.rollout.lengths == "fixed":
        return [cap] * n
    return geometric_lengths(random.Random(cfg.seed * 104_729 + batch_index), n, cap / 4, cap)


def sampling_params(cfg: TrainConfig, batch_index: int, n: int) -> list[SamplingParams]:
    """Per-response SamplingParams of batch `batch_index` (seeded, so any batch can be redone).
    The toy task samples to its length limit; text tasks stop at EOS (limits are per turn)."""
    limits = response_limits(cfg, batch_index, n)
    toy = cfg.task.name == "target_tokens"
    return [SamplingParams(temperature=cfg.rollout.temperature, max_tokens=limits[i],
                           seed=request_seed(cfg.seed, batch_index, i), ignore_eos=toy)
            for i in range(n)]


# --------------------------------------------------------------------------- episodes on the engine
@dataclass
class EpisodeResult:
    output: RequestOutput
    """The engine's output for the whole sequence (loss mask, log-probs, versions)."""
    episode: Episode

    @property
    def reward(self) -> float:
        return self.episode.reward


def run_episodes(engine: Engine, env: Env, problems: list, params: list[SamplingParams],
                 before_step: Callable[[Engine], None] | None = None,
                 tool_threads: int = 4) -> list[EpisodeResult]:
    """Run one episode per problem (params[i] for problem i) to the end; results in order."""
    if len(params) != len(problems):
        raise InputError(f"got {len(params)} SamplingParams for {len(problems)} problems")
    stops, stop_strings = env.stop_token_ids, env.stop_strings
    results: list[EpisodeResult | None] = [None] * len(problems)
    active: dict[int, tuple[int, Episode, int]] = {}  # request id -> (index, episode, turn start)
    for i, (problem, p) in enumerate(zip(problems, params)):
        p = replace(p, stop_token_ids=sorted(set(p.stop_token_ids) | set(stops)),
                    stop_strings=list(dict.fromkeys([*p.stop_strings, *stop_strings])))
        episode = env.start(problem)
        prompt = env.prompt_ids(problem)
        rid = engine.add_request(prompt, p, multi_turn=env.multi_turn)
        active[rid] = (i, episode, len(prompt))
    pool = ThreadPoolExecutor(tool_threads) if (env.multi_turn or env.threaded) and tool_threads > 1 else None
    try:
        while active:
            if not engine.has_unfinished():
                raise RuntimeError("engine idle with episodes unfinished")  # a bug, not bad input
            if before_step is not None:
                before_step(engine)
            outs = [o for o in engine.step() if o.request_id in active]
            if not outs:
                continue

            def judge(out) -> Turn:
                _, episode, start = active[out.request_id]
                if out.finish_reason == "error":
                    episode.info["ended"] = out.error or "engine error"
                    return Turn(None, True, 0.0)
                return env.step(episode, out.full_token_ids[start:])

            turns = list(pool.map(judge, outs)) if pool and len(outs) > 1 else [judge(o) for o in outs]
            for out, turn in zip(outs, turns):
                i, episode, _ = active[out.request_id]
                if not turn.done:
                    try:
                        start = len(out.full_token_ids) + len(turn.observation or [])
                        engine.continue_request(out.request_id, turn.observation or [])
                        active[out.request_id] = (i, episode, start)
                        continue
                    except InputError as exc:  # the observation does not fit the context
                        episode.info["ended"], episode.info["context_full"] = str(exc), True
                        episode.reward, episode.passed = 0.0, False
                episode.reward = turn.reward if turn.done else 0.0
                # a request the engine failed (finish_reason "error") is already gone from it
                final = engine.release(out.request_id) if env.multi_turn and out.finish_reason != "error" \
                    else out
                results[i] = EpisodeResult(final, episode)
                del active[out.request_id]
    finally:
        if pool is not None:
            pool.shutdown()
        for rid in active:  # an exception above: do not leave paused requests holding cache
            if rid in engine.seqs:
                engine.release(rid)
    return results  # type: ignore[return-value]


# --------------------------------------------------------------------------- the worker
def first_batch(worker: int, workers: int, from_batch: int) -> int:
    """Worker `worker`'s first batch at or after `from_batch` (of N workers, worker i samples the
    batches b with b mod N = i)."""
    return from_batch + (worker - from_batch) % workers


def start_version(cfg: TrainConfig, versions: dict, first: int) -> int:
    """The version a worker starts from: the newest one, or in deterministic mode the one its
    first batch must be sampled with (or the newest, when that one is not published yet; or the
    oldest kept, when a run resumed past its planned end no longer keeps it)."""
    if cfg.deterministic:
        return min(max(min(versions), first - cfg.max_policy_lag), max(versions))
    return max(versions)


def resume_floor(cfg: TrainConfig, versions: dict, start_batch: int, ready: list | None = None) -> int:
    """The oldest version batches from `start_batch` on may ask for: 0 in a fresh or exactly
    resumed run (the checkpoint holds the batches sampled by versions it no longer keeps); in a
    deterministic run resumed past its planned end, the oldest version kept (the next batches'
    fixed-lag versions are gone: they are sampled by it)."""
    oldest, lag = min(versions), cfg.max_policy_lag
    have = {b.index for b in ready or [] if b.version == max(0, b.index - lag)}
    short = [b for b in range(start_batch, min(cfg.steps, oldest + lag))
             if max(0, b - lag) < oldest and b not in have]
    if not (cfg.deterministic and short):
        return 0
    log.warning("batches %s are sampled by version %d: their fixed-lag versions were not kept (resumed past "
                "the planned end, or with another max_policy_lag)", ", ".join(map(str, short)), oldest)
    return oldest


class RestartBudget:
    """Worker restarts allowed: at most `limit` within any `window_s` seconds (all workers
    together). A long run meets a transient fault now and then and goes on; a worker that dies
    again and again gives up fast. `total` counts every restart of the run."""

    def __init__(self, limit: int = 3, window_s: float = 3600.0):
        self.limit, self.window_s = limit, window_s
        self.times: list[float] = []
        self.total = 0

    def spend(self, free: bool = False) -> bool:
        """Take one restart; False (and nothing taken) when the window's are used up. `free`:
        counted in `total` only (another actor of a node already counted, say)."""
        if free:
            self.total += 1
            return True
        now = time.monotonic()
        self.times = [t for t in self.times if now - t < self.window_s]
        if len(self.times) >= self.limit:
            return False
        self.times.append(now)
        self.total += 1
        return True


def restored(cfg: TrainConfig, ready: list[RolloutBatch] | None, start_batch: int,
             floor: int) -> dict[int, RolloutBatch]:
    """The checkpoint's sampled-but-unconsumed batches this run may still use: from `start_batch`
    on, sampled by a version its lag admits (deterministic: exactly the one it requires). A run
    resumed with a smaller max_policy_lag (or another staleness mode) samples the others again."""
    kept, dropped = {}, []
    for b in ready or []:
        if b.index < start_batch:
            continue
        need = max(floor, b.index - cfg.max_policy_lag)
        exact = (need, max(0, b.index - cfg.max_policy_lag))  # (past a planned end: either is sound)
        if b.version in exact if cfg.deterministic else b.version >= need:
            kept[b.index] = b
        else:
            dropped.append(b.index)
    if dropped:
        log.warning("batches %s of the checkpoint were sampled by weights this run's max_policy_lag=%d "
                    "does not admit: sampling them again", dropped, cfg.max_policy_lag)
    return kept


class RolloutWorker:
    """Samples batches for a run: holds the model (loaded with `version`'s weights), an engine
    on it and the run's environment."""

    def __init__(self, cfg: TrainConfig, model, env: Env, version: int = 0, poll: Poll | None = None,
                 beat: Callable[[], None] | None = None, state: State | None = None):
        """`poll` fetches newly published weights; `beat`, if given, is called at every engine step
        and every wait for weights (the host's sign of life for a hung-worker detector); `state`:
        the weights `model` was loaded with (kept when a later batch needs them again)."""
        self.cfg = cfg
        self._beat = beat
        self.env = env
        ro = cfg.rollout
        self.engine = Engine(model, max_num_seqs=ro.max_num_seqs, tokenizer=env.tokenizer,
                             kv_cache_memory=ro.kv_cache_memory, prefix_caching=ro.prefix_caching,
                             graphs="auto" if ro.cuda_graphs else "off")
        self.engine.policy_version = version
        self.held: dict[int, State] = {}  # versions received and needed, not loaded now
        self.loaded: State | None = state  # the tensors of the loaded version, when known
        self.floor = 0
        """The oldest version the run keeps: 0, or after resuming past a run's planned end the
        version it resumed at (batches whose fixed-lag version is gone are sampled by it)."""
        self.todo: list[int] | None = None
        """This worker's batches not sampled yet, when its host plans them (then, in deterministic
        mode, only versions one of them needs are held and batches may be sampled out of turn)."""
        self._poll, self._load_s = poll, 0.0  # (_load_s: seconds loading weights for the batch sampled)

    @property
    def version(self) -> int:
        """The version the engine's weights are."""
        return self.engine.policy_version

    # ------------------------------------------------------------------ weights
    def _planned(self) -> bool:
        return self.todo is not None and self.cfg.deterministic

    def needed(self, version: int) -> bool:
        """Whether a batch to sample needs `version` (unplanned: newer; the newest unless deterministic)."""
        if self._planned():
            return any(self.required_version(b) == version for b in self.todo)
        return version > self.version and (self.cfg.deterministic or version >= self._newest())

    def receive(self, version: int, state: State) -> None:
        """A new version, kept until loaded; those it makes useless are let go (lag + 1 were kept)."""
        if version != self.version and self.needed(version):
            self.held[version] = state
            for v in [v for v in self.held if not self.needed(v)]:
                del self.held[v]

    def poll(self, block: bool = False) -> None:
        """Take in what the poll function has (with block=True, wait for it a little)."""
        if self._beat is not None:
            self._beat()
        if self._poll is not None:
            for version, state in self._poll(block):
                self.receive(version, state)

    def _newest(self) -> int:
        return max(self.held, default=self.version)

    def _load(self, version: int, mode: str) -> None:
        if version != self.version:
            t0 = time.perf_counter()
            state = self.held.pop(version)
            if self._planned() and self.loaded is not None and self.needed(self.version):
                self.held[self.version] = self.loaded  # a later batch needs these weights again
            self.engine.update_weights(state, version, mode=mode, copy=False)  # (its own, unchanged)
            self.loaded = state if self._planned() else None  # kept only where a batch may need it again
            self._load_s += time.perf_counter() - t0
        for v in [v for v in self.held if not self.needed(v)]:
            del self.held[v]

    def next_to_sample(self, todo: list[int]) -> int:
        """The batch of `todo` (in order) to sample next: the first, except in deterministic mode
        with more than rollout.max_held_versions versions held: then the batch of the newest held
        version, sampled out of turn so its weights can be dropped (contents do not depend on
        order; the older held versions' batches are the ones the learner needs sooner)."""
        self.poll(block=False)
        limit = self.cfg.rollout.max_held_versions
        if self.cfg.deterministic and limit and len(self.held) > limit:
            newest = max(self.held)
            for b in todo:
                if self.required_version(b) == newest:
                    return b
        return todo[0]

    # ------------------------------------------------------------------ admission
    def required_version(self, batch_index: int) -> int:
        """The oldest version batch `batch_index` may be sampled with (never below `floor`)."""
        return max(self.floor, batch_index - self.cfg.max_policy_lag)

    def admissible(self, batch_index: int) -> bool:
        need = self.required_version(batch_index)
        if self.cfg.deterministic:
            return need == self.version or need in self.held
        return self._newest() >= need

    def wait_for(self, batch_index: int, stopped: Callable[[], bool]) -> float | None:
        """Take in published weights until batch `batch_index` is admissible; the seconds waited,
        or None when `stopped()` became true first."""
        self.poll(block=False)
        t0 = time.perf_counter()
        while not stopped() and not self.admissible(batch_index):
            self.poll(block=True)
        return None if stopped() else time.perf_counter() - t0

    # ------------------------------------------------------------------ sampling
    def sample(self, batch_index: int, wait_s: float = 0.0) -> RolloutBatch:
        """Sample batch `batch_index` (which must be admissible) and return its trajectories."""
        if not self.admissible(batch_index):
            raise RuntimeError(f"batch {batch_index} is not admissible with versions "
                               f"{sorted({self.version, *self.held})}")  # a caller bug
        cfg = self.cfg
        version = self.required_version(batch_index) if cfg.deterministic else self._newest()
        self._load_s = 0.0
        self._load(version, mode="drain")  # between batches nothing is running
        t0 = time.perf_counter()
        group = cfg.rollout.group_size
        problems = self.env.problems(batch_index, cfg.rollout.prompts_per_step)
        params = sampling_params(cfg, batch_index, len(problems) * group)
        inflight = cfg.rollout.weight_update == "inflight"  # (never with deterministic = true)
        results = run_episodes(self.engine, self.env, [p for p in problems for _ in range(group)], params,
                               before_step=self._before_step if (inflight or self._beat) else None)
        trajectories = [Trajectory.from_output(r.output, r.reward, i // group) for i, r in enumerate(results)]
        if self.scores(batch_index) and trajectories[0].rollout_routing is None:
            self.score(trajectories)
        return RolloutBatch(batch_index, trajectories, version, time.perf_counter() - t0, wait_s,
                            rollout_stats(results), self._load_s)

    def scores(self, batch_index: int) -> bool:
        """Whether batch `batch_index` gets `sampled_learner_logprobs`: in async runs (lag > 0),
        on the steps the learner decomposes (batch b is consumed at step b). MoE batches are
        left to the learner, which also compares the experts chosen."""
        every = self.cfg.learner.decompose_every
        return self.cfg.max_policy_lag > 0 and every > 0 and batch_index % every == 0

    def score(self, trajectories: list[Trajectory]) -> None:
        """Set each trajectory's `sampled_learner_logprobs`: the learner's own computation
        (`sequence_logprobs`, the learner's micro-batches, head chunks and temperature) on the
        engine's weights, kept for the tokens those weights sampled (NaN elsewhere: prompt, tool
        output, tokens of an earlier version after an in-flight update)."""
        lc, model, out = self.cfg.learner, self.engine.model, []
        seqs = [t.token_ids for t in trajectories]
        with torch.no_grad():
            for idx in micro_batches([len(x) for x in seqs], lc.micro_batch_size, lc.micro_batch_tokens):
                out += sequence_logprobs(model, [seqs[j] for j in idx], lc.temperature,
                                         head_chunk=lc.head_rows(model.config.vocab_size))
                if self._beat is not None:
                    self._beat()
        nan = float("nan")
        for t, lp in zip(trajectories, out):
            values = [nan] + lp.tolist()
            t.sampled_learner_logprobs = [x if m and v == self.version else nan
                                          for x, m, v in zip(values, t.loss_mask, t.policy_versions)]

    def _before_step(self, engine: Engine) -> None:
        """Before every engine step: a heartbeat, and with in-flight updates the newest weights
        (running sequences continue on them from their next token)."""
        if self.cfg.rollout.weight_update != "inflight":
            self._beat()
            return
        self.poll(block=False)
        if self._newest() > self.version:
            self._load(self._newest(), mode="inflight")
