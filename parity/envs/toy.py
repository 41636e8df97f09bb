"""A toy task for exercising the trainer: reward = fraction of response tokens in a target set.

It is learnable from a random model within a few dozen updates, so it shows the plumbing and
the numerics (lag, importance weights, mismatch) without a pretrained policy. Prompts are
seeded by (seed, batch index), so any batch can be regenerated exactly.
"""

from __future__ import annotations

import random

from .base import Env, Episode, Turn
from .math import HELDOUT_SEED, _stable_seed


class TargetTokensTask(Env):
    """Single-turn; a problem is a list of random prompt token ids."""

    name = "target_tokens"

    def __init__(self, vocab_size: int, targets: list[int], prompt_len: int = 8, seed: int = 0):
        bad = [t for t in targets if not 0 <= t < vocab_size]
        if bad:
            from ..errors import ConfigError

            raise ConfigError(f"task.targets: token id {bad[0]} is outside the vocabulary ({vocab_size})")
        self.vocab_size = vocab_size
        self.targets = set(targets)
        self.prompt_len = prompt_len
        self.seed = seed

    def prompts(self, batch_index: int, n: int, rnd: random.Random | None = None) -> list[list[int]]:
        rnd = rnd or random.Random(self.seed * 1_000_003 + batch_index)
        return [[rnd.randrange(self.vocab_size) for _ in range(self.prompt_len)] for _ in range(n)]

    def heldout(self, n: int | None = None) -> list[list[int]]:
        """A fixed evaluation set, the same for every run seed, from a generator no training batch
        uses (it was batch 1's at seed 0: `Random(-1)` seeds like `Random(1)`)."""
        rnd = random.Random(_stable_seed("target_tokens", HELDOUT_SEED, "heldout"))
        return self.prompts(-1, 32 if n is None else n, rnd)

    def problems(self, batch_index: int, n: int) -> list[list[int]]:
        return self.prompts(batch_index, n)

    def prompt_ids(self, problem: list[int]) -> list[int]:
        return list(problem)

    def step(self, episode: Episode, turn_ids: list[int]) -> Turn:
        episode.turns += 1
        episode.reward = self.reward(episode.problem, turn_ids)
        episode.passed = episode.reward >= 0.5
        episode.answered = True
        return Turn(None, True, episode.reward)

    def passed(self, prompt: list[int], completion: list[int]) -> bool:
        """pass@1 criterion: at least half of the response is target tokens."""
        return self.reward(prompt, completion) >= 0.5

    def reward(self, prompt: list[int], completion: list[int]) -> float:
        if not completion:
            return 0.0
        return sum(t in self.targets for t in completion) / len(completion)
