"""How the benches time: order, amortised calls, rotation over copies, the GEMM rate's second
measurement, the shared-machine note, and the FLOPs the rollout bench credits the engine with."""

import os
import time

import pytest

from parity.apps import timing


def test_interleaved_reverses_the_order_every_other_round(monkeypatch):
    monkeypatch.setattr(timing, "SAMPLE_S", 0.0)  # (one call a sample)
    calls = []
    fns = {k: (lambda k=k: calls.append(k)) for k in "AB"}
    med = timing.interleaved(fns, reps=4)
    assert calls == ["A", "B", "A", "B", "B", "A", "A", "B", "B", "A"]  # (a warm-up round first)
    assert set(med) == {"A", "B"} and all(v >= 0 for v in med.values())


def test_interleaved_samples_last_long_enough_to_time():
    calls = {"fast": 0, "slow": 0}

    def fast():
        calls["fast"] += 1

    def slow():
        calls["slow"] += 1
        time.sleep(0.03)  # (longer than a sample: one call each)

    med = timing.interleaved({"fast": fast, "slow": slow}, reps=3)
    assert calls["slow"] == 4 and calls["fast"] > 3 * 10  # (a warm-up call, then whole samples)
    assert med["fast"] < 1e-4 < 0.03 <= med["slow"]
    inner = timing.interleaved({"x": lambda: 0.5}, reps=2, timed_inside=True)  # (its own seconds)
    assert inner == {"x": 0.5}


def test_seconds_per_call_amortises_short_calls():
    calls = []
    sec = timing.seconds_per_call(lambda: calls.append(1), "cpu", target=0.002)
    assert len(calls) > 10 and 0 < sec < 1e-3  # (a timing of one sub-microsecond call would be the clock's)


def test_rotating_cycles_through_its_copies_and_a_cpu_gets_one():
    seen = []
    rot = timing.Rotating([lambda i=i: seen.append(i) for i in range(3)])
    for _ in range(7):
        rot()
    assert seen == [0, 1, 2, 0, 1, 2, 0]
    assert timing.l2_copies(8 << 20, "cpu") == 1


class Row:
    def __init__(self, dtype, gemm):
        self.dtype, self.gemm_gflops = dtype, gemm


def test_a_gemm_rate_measured_while_busy_is_replaced_by_the_second_one(monkeypatch):
    measured = []
    monkeypatch.setattr(timing.hardware, "gemm_rate",
                        lambda dtype, device=None: measured.append(dtype) or 300.0)
    rows = [Row("float32", 150.0), Row("float32", 150.0), Row("bfloat16", 900.0)]
    timing.gemm_rate_again(rows, "cpu")
    assert [r.gemm_gflops for r in rows] == [300.0, 300.0, 900.0] and len(measured) == 2  # once per dtype


def test_a_shared_machine_is_named_under_the_table(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (5.8, 3.0, 2.0))
    assert "load average was 5.8 on 2 cores" in timing.busy_note(threads=2)
    monkeypatch.setattr(os, "getloadavg", lambda: (2.4, 2.0, 2.0))  # (the bench's own two threads)
    assert timing.busy_note(threads=2) == ""


def test_the_rollout_bench_credits_the_forwards_the_engine_runs():
    from parity.apps.bench_rollout import RolloutWorkload
    from parity.model import ModelConfig

    cfg = ModelConfig.preset("qwen3-0.6b")
    work = RolloutWorkload([[1, 2, 3]], [2])  # 3 prompt tokens, 2 sampled: 4 positions, 2 LM heads
    head = 2 * cfg.vocab_size * cfg.hidden_size
    body = sum(cfg.forward_flops_per_token(c) - head for c in range(4))
    assert work.forward_flops(cfg) == pytest.approx(body + 2 * head, rel=1e-12)
    assert cfg.head_flops_per_token == head
