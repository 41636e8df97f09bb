"""Per-request sampling seeds that every interpreter computes alike.

A rollout's seed is a function of the run's seed, the batch index and the request's place in the
batch, so that any batch can be redone bit for bit (by a resumed run, another worker, a Ray actor, or
a machine with another Python). `hash()` of a tuple gave those numbers until now: it is stable across
processes for integers, but Python promises nothing about it across versions or implementations
(PyPy and 32-bit builds already differ). `mix` is that same function written out — CPython's tuple
hash since 3.8 on a 64-bit build (xxHash-style lanes over each integer's hash) — so every existing
run, checkpoint and golden figure keeps its seeds, and the numbers are now this project's to keep.
"""

from __future__ import annotations

_MASK = (1 << 64) - 1
_PRIME1, _PRIME2, _PRIME5 = 11400714785074694791, 14029467366897019727, 2870177450012600261
_MODULUS = (1 << 61) - 1  # the modulus of CPython's integer hash on 64-bit builds


def _int_hash(n: int) -> int:
    h = abs(n) % _MODULUS
    h = -h if n < 0 else h
    return -2 if h == -1 else h


def mix(*values: int) -> int:
    """A signed 64-bit number from integers: `hash(tuple(values))` of CPython >= 3.8, 64-bit."""
    acc = _PRIME5
    for v in values:
        if not isinstance(v, int):
            raise TypeError(f"seeds.mix takes integers, got {type(v).__name__}")
        acc = (acc + (_int_hash(v) & _MASK) * _PRIME2) & _MASK
        acc = ((acc << 31) | (acc >> 33)) & _MASK
        acc = (acc * _PRIME1) & _MASK
    acc = (acc + (len(values) ^ (_PRIME5 ^ 3527539))) & _MASK
    if acc == _MASK:  # -1 is CPython's error value; it answers this instead
        return 1546275796
    return acc - (1 << 64) if acc >= 1 << 63 else acc


def request_seed(run_seed: int, batch_index: int, i: int) -> int:
    """The sampling seed of request `i` of rollout batch `batch_index` of a run seeded `run_seed`."""
    return mix(run_seed, batch_index, i) % 2**62
