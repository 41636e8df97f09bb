"""Response-length distributions for workloads with a long tail."""

from __future__ import annotations

import random


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
