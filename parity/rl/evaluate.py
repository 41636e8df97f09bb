"""Held-out evaluation of a policy on an environment: greedy pass@1 and sampled mean@k, with
95% confidence intervals over problems. The trainer runs it every `eval_every` steps; `parity
eval` and `parity sft` run it on a checkpoint."""

from __future__ import annotations

from ..engine import Engine, SamplingParams
from ..envs.base import Env
from ..errors import InputError
from ..metrics.summary import env_metrics, mean_at_k_interval, wilson
from .rollout_worker import run_episodes


def evaluate(model, env: Env, n: int | None = None, k: int = 0, temperature: float = 1.0,
             max_tokens: int = 96, max_num_seqs: int = 64, seed: int = 0,
             ignore_eos: bool = False, before_step=None) -> dict[str, float]:
    """Held-out evaluation: greedy pass@1 (with its CI), and with k > 0 mean@k — the mean
    success of k samples at `temperature` per problem, CI over problems. `before_step(engine)`
    runs before every engine step (the trainer's: raise there to drop the evaluation)."""
    problems = env.heldout(n)
    if not problems:
        raise InputError(f"{env.name}: empty held-out set")
    engine = Engine(model, max_num_seqs=max_num_seqs, tokenizer=env.tokenizer)
    greedy_params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    greedy = run_episodes(engine, env, problems, [greedy_params] * len(problems), before_step)
    p1 = sum(float(r.episode.passed) for r in greedy) / len(greedy)
    lo, hi = wilson(p1, len(greedy))
    out = {**env_metrics([r.episode for r in greedy], "eval/"),  # (the built-in figures win a name)
           "eval/pass@1": p1, "eval/pass@1_lo95": lo, "eval/pass@1_hi95": hi,
           "eval/problems": float(len(problems)),
           "eval/reward": sum(r.reward for r in greedy) / len(greedy),
           "eval/answered": sum(r.episode.answered for r in greedy) / len(greedy),
           "eval/tool_calls": sum(r.episode.tool_calls for r in greedy) / len(greedy),
           "eval/tool_errors": sum(r.episode.tool_errors for r in greedy) / len(greedy)}
    if k > 0:
        params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=ignore_eos,
                                 seed=(seed * 1_000_003 + i) % 2**62) for i in range(len(problems) * k)]
        sampled = run_episodes(engine, env, [p for p in problems for _ in range(k)], params, before_step)
        per_problem = [sum(r.episode.passed for r in sampled[j * k:(j + 1) * k]) / k
                       for j in range(len(problems))]
        mk, mk_lo, mk_hi = mean_at_k_interval(per_problem, k)
        out.update({f"eval/mean@{k}": mk, f"eval/mean@{k}_lo95": mk_lo, f"eval/mean@{k}_hi95": mk_hi})
    return out
