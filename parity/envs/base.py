"""The environment API: what a task must provide for the engine to roll it out.

An `Env` hands out problems (a seeded training stream and a fixed held-out set), renders each as
prompt token ids, and judges the model's turns:

    episode = env.start(problem)
    prompt  = env.prompt_ids(problem)
    turn    = env.step(episode, sampled_turn_ids)   # -> Turn(observation, done, reward)

Single-turn tasks finish on the first turn with a verifier's reward. Multi-turn tasks (the tool
environment) may answer a turn with observation tokens that the engine appends with
`loss_mask = 0` before the model's next turn; the last turn carries the reward. `step` never
raises for anything the model wrote: a malformed tool call, an answer that does not parse or a
tool that fails becomes a tool error or zero reward, and the episode goes on or ends.

Your own task subclasses `Env` and is named in the config (`task.name = "custom"`, `task.env`;
`parity/envs/custom.py`). Problems must follow from (seed, batch index) alone and the held-out set
must be the same for every run; a multi-turn env's `step` may be called from several threads at
once (one per episode); set `episode.passed` for pass@1, and per-episode figures of your own in
`episode.info["metrics"]` (averaged per batch as rollout/<name>, per evaluation as eval/<name>).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Turn:
    """The environment's reply to one model turn."""

    observation: list[int] | None = None
    """Tokens to append before the model's next turn (None when the episode is done)."""
    done: bool = True
    """The episode is over; `reward` is final."""
    reward: float = 0.0
    """Reward of the whole episode (meaningful when done)."""


@dataclass
class Episode:
    """Per-rollout state an environment keeps between turns."""

    problem: Any
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    reward: float = 0.0
    passed: bool = False
    answered: bool = False
    """The final turn gave a parseable answer."""
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_passed_set", False)

    def __setattr__(self, name: str, value) -> None:
        if name == "passed":  # an env of the user's that never sets it is judged by its reward
            object.__setattr__(self, "_passed_set", True)  # (parity.envs.custom.CheckedEnv)
        object.__setattr__(self, name, value)


class Env(ABC):
    """A task the trainer, the evaluator and `parity sft` can use."""

    name: str = "env"
    multi_turn: bool = False
    """True when `step` may return observations (the engine then keeps the request's cache)."""
    threaded: bool = False
    """Judge the turns an engine step finishes on several threads (multi-turn envs always are):
    for a `step` that waits (a sandbox, a judge over the network), not one that computes."""

    tokenizer = None
    """The text tasks' tokenizer (the engine decodes with it to find stop strings)."""

    @property
    def stop_token_ids(self) -> list[int]:
        """Tokens that end a model turn, besides the model's EOS (e.g. `</python>`)."""
        return []

    @property
    def stop_strings(self) -> list[str]:
        """Texts that end a model turn when they are not single tokens (e.g. `</python>` in a
        tokenizer that spells it out)."""
        return []

    @abstractmethod
    def problems(self, batch_index: int, n: int) -> list:
        """Training problems of one batch (seeded: the same index gives the same problems)."""

    @abstractmethod
    def heldout(self, n: int | None = None) -> list:
        """The fixed evaluation set (disjoint from every training batch), or its first n."""

    @abstractmethod
    def prompt_ids(self, problem) -> list[int]:
        """The problem as prompt tokens."""

    def start(self, problem) -> Episode:
        return Episode(problem)

    @abstractmethod
    def step(self, episode: Episode, turn_ids: list[int]) -> Turn:
        """Judge one model turn (its sampled tokens); must not raise for anything the model wrote."""

    def describe(self) -> str:
        """One line for the start-up banner."""
        return f"task: {self.name}"
