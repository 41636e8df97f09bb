"""No behaviour change: short deterministic runs write the metrics recorded in tests/golden/.

Bit for bit (every key but timings) on a machine with the recorded fingerprint whose GEMMs are not
strict (`ops/gemm.py`); elsewhere (another CPU instruction set, core count, torch or GEMM regime)
float metrics within rtol 1e-3 / atol 1e-6, 2e-2 in bfloat16 runs (another bf16 GEMM rounds
differently: seen 0.8% on an AMX Xeon by step 3), and everything else equal. Regenerate on
purpose only: `python -m tests.golden.runs`.
"""

from __future__ import annotations

import json
import math

import pytest

from parity.ops import gemm
from tests.golden.runs import GOLDEN, RUNS, fingerprint, run

RTOL, ATOL = 1e-3, 1e-6
RTOL_BF16 = 2e-2

_golden = json.loads(GOLDEN.read_text())


def _close(a, b, rtol: float) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=rtol, abs_tol=ATOL)
    return a == b


@pytest.mark.parametrize("name", sorted(RUNS))
def test_deterministic_run_matches_the_golden_metrics(name, tmp_path):
    want = _golden["runs"][name]
    got = run(name, tmp_path)
    assert len(got) == len(want)
    if fingerprint() == _golden["fingerprint"] and not gemm.strict():
        for step, (g, w) in enumerate(zip(got, want)):
            assert g == w, f"{name} step {step}: " + ", ".join(
                f"{k}: {g.get(k)!r} != {w.get(k)!r}" for k in sorted(set(g) | set(w)) if g.get(k) != w.get(k))
        return
    for step, (g, w) in enumerate(zip(got, want)):
        assert sorted(g) == sorted(w), f"{name} step {step}: metric keys differ"
        rtol = RTOL_BF16 if name.startswith("bfloat16") else RTOL
        bad = [k for k in w if not _close(g[k], w[k], rtol)]
        assert not bad, f"{name} step {step} (other machine, rtol {rtol}): " + ", ".join(
            f"{k}: {g[k]!r} vs {w[k]!r}" for k in bad)
