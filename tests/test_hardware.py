"""The machine beside every figure: CPU features read from /proc/cpuinfo, and the one-line
warning (with a cost measured on the spot) when bfloat16 is chosen on a CPU without bf16
instructions."""

from __future__ import annotations

import pytest

from parity import hardware
from parity.cli import main


def test_describe_names_the_features_that_matter():
    info = hardware.describe()
    assert set(info) >= {"cpu", "cores", "features", "bf16", "torch", "threads"}
    assert set(info["features"]) <= {name for _, name in hardware.FEATURES}
    assert info["bf16"] in ("native", "slow")
    line = hardware.line(info)
    assert info["torch"] in line and f"{info['cores']} cores" in line
    flags = open("/proc/cpuinfo").read()
    assert ("avx2" in flags) == ("AVX2" in info["features"])


def test_measured_bf16_cost_is_a_positive_ratio():
    assert 0 < hardware.bf16_cost(size=64, reps=1) < 1000


@pytest.fixture
def slow_bf16(monkeypatch):
    info = {**hardware.describe(), "bf16": "slow", "features": ["AVX2"], "gpu": None}
    monkeypatch.setattr(hardware, "describe", lambda: info)
    monkeypatch.setattr(hardware, "bf16_cost", lambda *a, **k: 9.5)
    return info


def test_bf16_on_a_cpu_without_bf16_instructions_warns_with_the_cost(slow_bf16, monkeypatch):
    text = hardware.bf16_warning("bfloat16")
    assert text.startswith("this CPU has no bf16 instructions (AVX2)") and "9.5x slower" in text
    assert "\n" not in text and hardware.bf16_warning("float32") is None
    monkeypatch.setattr(hardware, "bf16_cost", lambda *a, **k: 1.0)  # measured: not slower
    assert hardware.bf16_warning("bfloat16") is None
    assert hardware.bf16_warning("bfloat16", info={**slow_bf16, "bf16": "native"}) is None


def test_commands_print_the_warning_on_stderr(slow_bf16, capsys):
    assert main(["generate", "--preset", "tiny", "--dtype", "bfloat16", "--prompt-ids", "1,2",
                 "--max-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "parity: warning: this CPU has no bf16 instructions" in err and "float32 (--dtype) is" in err
    assert main(["generate", "--preset", "tiny", "--prompt-ids", "1,2", "--max-tokens", "2"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_auto_dtype_is_resolved_and_recorded(tmp_path):
    from parity.config import load_config, to_toml

    assert hardware.preferred_dtype({"bf16": "slow", "gpu": None}) == "float32"
    assert hardware.preferred_dtype({"bf16": "native", "gpu": None}) == "bfloat16"
    cfg = load_config(None, ['model.dtype="auto"'])
    assert cfg.model.dtype == hardware.preferred_dtype() == cfg.learner.compute_dtype
    assert f'dtype = "{cfg.model.dtype}"' in to_toml(cfg)  # the run's config.toml names the real dtype


def test_bf16_gemms_through_float32_keep_parity_and_are_bf16_gemms(monkeypatch):
    """The path for CPUs without a bf16 GEMM (PARITY_BF16_GEMM=float32 forces it here): aligned
    log-probs stay bitwise batch-invariant (the standard control still differs), and a layer's
    output is a bf16 GEMM's result (float32 accumulation of exact bf16 products, rounded)."""
    import json
    import os
    import subprocess
    import sys

    import torch
    import torch.nn.functional as F

    from parity.ops import common

    env = {**os.environ, "PARITY_BF16_GEMM": "float32"}
    cmd = [sys.executable, "-m", "parity.cli", "check", "--dtype", "bfloat16", "--rounds", "2",
           "--cases", "batch,decode,engine", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout)["results"]
    assert all(r["mismatches"] == 0 for r in results if r["kernels"] == "aligned")
    assert sum(r["mismatches"] for r in results if r["kernels"] == "standard") > 0

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(16, 256, generator=gen).bfloat16(), torch.randn(32, 256, generator=gen).bfloat16()
    monkeypatch.setenv("PARITY_BF16_GEMM", "float32")
    hardware.bf16_gemm_native.cache_clear()
    try:
        via_float32 = common.gemm_linear(x, w)
    finally:
        hardware.bf16_gemm_native.cache_clear()
    assert via_float32.dtype == torch.bfloat16
    exact = x.double() @ w.double().t()  # every product and sum exact in float64 at this size
    ulp = exact.abs().float() * 2**-7  # one bf16 step
    assert ((via_float32.float() - exact.float()).abs() <= ulp).all()
    assert ((F.linear(x, w).float() - exact.float()).abs() <= ulp).all()  # as the native bf16 GEMM


def test_parity_sets_its_process_settings_before_torch_and_keeps_the_users():
    """`parity/_startup.py`: huge pages for large tensors and a short OpenMP spin (so a strict
    GEMM's own thread gets a core), set when parity is imported first; a value the user set wins."""
    import os
    import subprocess
    import sys

    code = "import parity, os; print(os.environ['THP_MEM_ALLOC_ENABLE'], os.environ['GOMP_SPINCOUNT'])"
    env = {k: v for k, v in os.environ.items() if k not in ("THP_MEM_ALLOC_ENABLE", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "20000"]
    out = subprocess.run([sys.executable, "-c", code], env={**env, "GOMP_SPINCOUNT": "7"},
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "7"]
