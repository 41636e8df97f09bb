"""Rolling an environment out on the engine, and evaluating a policy on its held-out set.

`run_episodes` keeps every episode in the engine at once (continuous batching): when a
request finishes a turn, the environment judges it; tool calls of requests that paused in the
same engine step run concurrently; observation tokens go back with `continue_request` (loss
mask 0) and the request resumes with its KV cache kept. `evaluate` reports greedy pass@1 and
sampled mean@k with a 95% confidence interval over problems.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from ..engine import Engine, SamplingParams
from ..errors import InputError
from .base import Env, Episode, Turn


@dataclass
class EpisodeResult:
    output: object  # the engine's RequestOutput (whole sequence, loss mask, log-probs, versions)
    episode: Episode

    @property
    def reward(self) -> float:
        return self.episode.reward


def run_episodes(engine: Engine, env: Env, problems: list, params: list[SamplingParams],
                 before_step=None, tool_threads: int = 4) -> list[EpisodeResult]:
    """Run one episode per problem (params[i] for problem i) to the end; results in order."""
    if len(params) != len(problems):
        raise InputError(f"got {len(params)} SamplingParams for {len(problems)} problems")
    stops = env.stop_token_ids
    results: list[EpisodeResult | None] = [None] * len(problems)
    active: dict[int, tuple[int, Episode, int]] = {}  # request id -> (index, episode, turn start)
    for i, (problem, p) in enumerate(zip(problems, params)):
        p = replace(p, stop_token_ids=sorted(set(p.stop_token_ids) | set(stops)))
        episode = env.start(problem)
        prompt = env.prompt_ids(problem)
        rid = engine.add_request(prompt, p, multi_turn=env.multi_turn)
        active[rid] = (i, episode, len(prompt))
    pool = ThreadPoolExecutor(tool_threads) if env.multi_turn and tool_threads > 1 else None
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

            turns = list(pool.map(judge, outs)) if pool is not None and len(outs) > 1 else \
                [judge(o) for o in outs]
            for out, turn in zip(outs, turns):
                i, episode, _ = active[out.request_id]
                if not turn.done:
                    try:
                        start = len(out.full_token_ids) + len(turn.observation or [])
                        engine.continue_request(out.request_id, turn.observation or [])
                        active[out.request_id] = (i, episode, start)
                        continue
                    except InputError as exc:  # the observation does not fit the context
                        episode.info["ended"] = str(exc)
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


def _mean_ci(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its normal-approximation 95% confidence interval."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, 1.96 * math.sqrt(var / n)


def evaluate(model, env: Env, n: int | None = None, k: int = 0, temperature: float = 1.0,
             max_tokens: int = 96, max_num_seqs: int = 64, seed: int = 0,
             ignore_eos: bool = False) -> dict[str, float]:
    """Held-out evaluation: greedy pass@1 (with its CI), and with k > 0 mean@k — the mean
    success of k samples at `temperature` per problem, CI over problems."""
    problems = env.heldout(n)
    if not problems:
        raise InputError(f"{env.name}: empty held-out set")
    engine = Engine(model, max_num_seqs=max_num_seqs)
    greedy_params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    greedy = run_episodes(engine, env, problems, [greedy_params] * len(problems))
    passed = [float(r.episode.passed) for r in greedy]
    p1, p1_ci = _mean_ci(passed)
    calls = sum(r.episode.tool_calls for r in greedy)
    out = {"eval/pass@1": p1, "eval/pass@1_ci95": p1_ci, "eval/problems": float(len(problems)),
           "eval/reward": sum(r.reward for r in greedy) / len(greedy),
           "eval/answered": sum(r.episode.answered for r in greedy) / len(greedy),
           "eval/tool_calls": calls / len(greedy),
           "eval/tool_errors": sum(r.episode.tool_errors for r in greedy) / len(greedy)}
    if k > 0:
        params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=ignore_eos,
                                 seed=(seed * 1_000_003 + i) % 2**62) for i in range(len(problems) * k)]
        sampled = run_episodes(engine, env, [p for p in problems for _ in range(k)], params)
        per_problem = [sum(r.episode.passed for r in sampled[j * k:(j + 1) * k]) / k
                       for j in range(len(problems))]
        mk, mk_ci = _mean_ci(per_problem)
        out.update({f"eval/mean@{k}": mk, f"eval/mean@{k}_ci95": mk_ci})
    return out
