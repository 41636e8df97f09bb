"""The aligned Triton backend (the CUDA path) run on CPU tensors through Triton's interpreter.

This proves the invariance *design* of `parity/ops/triton_kernels.py` in CI, where there is no
GPU: fixed GEMM tiles without split-K, fixed key blocks visited in order with an online softmax,
fixed-chunk log-sum-exp. Every comparison is a whole float32 log-prob vector under `torch.equal`:
batch composition, padding, offsets, prefill vs chunked prefill vs decode over the paged KV cache,
the rollout engine, and the learner's forward under autograd. The same cases on the standard
kernels fail (the control). GPU bits and speed are checked by `scripts/gpu_check.sh` on a GPU.

The interpreter costs tens of milliseconds per kernel launch, so the model here has one layer
and sequences are short. On a machine with CUDA these tests are skipped: there the whole bitwise
suite runs on the GPU instead (`PARITY_TEST_DEVICE=cuda`).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import parity
from parity.errors import ConfigError
from parity.invariance import reference, run_checks
from tests.parity import mutants
from tests.parity.schedules import assert_kernel_schedules_agree, assert_model_schedules_agree

try:  # imports triton with its interpreter turned on (no GPU here)
    import parity.ops.triton_kernels  # noqa: F401
except ConfigError as err:  # triton missing: `make test` installs it
    pytest.skip(str(err), allow_module_level=True)
import triton  # noqa: E402  (after parity turned the interpreter on)
import triton.language as tl  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="CUDA present: the bitwise suite runs on the GPU instead")


@pytest.fixture
def triton_impl(monkeypatch):
    monkeypatch.setenv("PARITY_ALIGNED_IMPL", "triton")


def _model(kernels: str, dtype: torch.dtype, preset: str = "tiny", seed: int = 3, **over):
    model = parity.Model(parity.ModelConfig.preset(preset, **{"num_hidden_layers": 1, **over}),
                         kernels=kernels, dtype=dtype, seed=seed)
    model.reset_parameters(seed, 0.1)
    return model.to(dtype)


def test_the_switch_selects_triton(triton_impl):
    from parity.ops import triton_kernels
    assert parity.get_kernels("aligned").impl == "triton"
    assert parity.get_kernels("standard").impl == "cpu"
    assert triton_kernels.INTERPRET
    assert _model("aligned", torch.float32).kernels.impl == "triton"


class _FakeKernel:
    """Stands in for a jitted kernel: `kernel[grid](out, n)` raises `error` or writes `value`."""

    def __init__(self, error=None, value=2.0):
        self.error, self.value = error, value

    def __getitem__(self, grid):
        def launch(out, n):
            if self.error is not None:
                raise self.error
            out.fill_(self.value)
        return launch


def test_an_interpreter_that_cannot_run_kernels_is_a_one_line_error():
    """Triton 3.6's interpreter under numpy >= 2.4 fails every launch deep inside itself (seen in
    a venv with both); the import-time probe turns that into one ConfigError naming the versions.
    The real probe kernel passes on this stack; stand-ins play the broken interpreters."""
    from parity.ops import triton_kernels
    triton_kernels._probe_interpreter()
    bad = TypeError("only 0-dimensional arrays can be converted to Python scalars")
    with pytest.raises(ConfigError, match=r"interpreter .*cannot run a kernel under numpy .*numpy<2.4"):
        triton_kernels._probe_interpreter(_FakeKernel(error=bad))
    with pytest.raises(ConfigError, match="cannot be trusted"):
        triton_kernels._probe_interpreter(_FakeKernel(value=3.0))
    triton_kernels._probe_interpreter(_FakeKernel())  # the control: a stand-in that works passes


@triton.jit
def _doubled(x):
    return x * 2.0


@triton.jit
def _helper_loop_kernel(out_ptr, n):
    acc = tl.zeros((4,), tl.float32)  # (Triton's own helper, which sees `tl.core` alone)
    for _ in range(0, n):
        acc = _doubled(acc + 1.0)
    tl.store(out_ptr + tl.arange(0, 4), acc)


def test_the_interpreter_patches_the_language_once_a_launch(monkeypatch):
    """`triton_kernels` has a launch patch `triton.language` once, and each module set its helpers
    see once more, not at every helper call (the scans were a quarter of this file's time); the language is
    put back after the launch. The control: the interpreter's own helper call patches at each."""
    from triton.runtime import interpreter as ti
    real, patched = ti._patch_lang, []
    monkeypatch.setattr(ti, "_patch_lang", lambda fn: patched.append(fn.__name__) or real(fn))
    arange, out = tl.arange, torch.zeros(4)
    _helper_loop_kernel[(1,)](out, 5)
    assert torch.equal(out, torch.full((4,), 62.0))  # x -> 2 (x + 1) five times from 0
    assert patched == ["_helper_loop_kernel", "zeros"] and tl.arange is arange
    patched.clear()
    monkeypatch.setattr(ti.InterpretedFunction, "__call__", ti.InterpretedFunction.__call__.__wrapped__)
    _helper_loop_kernel[(1,)](out.zero_(), 5)
    assert torch.equal(out, torch.full((4,), 62.0))
    assert patched == ["_helper_loop_kernel", "zeros"] + ["_doubled"] * 5  # the control


def test_a_helper_that_sees_no_triton_language_is_still_refused(tmp_path, monkeypatch):
    """A helper whose module imports neither `triton.language` nor its core is refused by the
    interpreter ("must be visible"); skipping its patch inside a launch must not let it run."""
    from triton.runtime.interpreter import InterpreterError
    (tmp_path / "bare_helper.py").write_text("import triton\n\n\n@triton.jit\ndef helper(x):\n"
                                             "    return x * 2.0\n")
    (tmp_path / "bare_kernel.py").write_text(
        "import triton\nimport triton.language as tl\n\nfrom bare_helper import helper\n\n\n"
        "@triton.jit\ndef kernel(out_ptr):\n    tl.store(out_ptr + tl.arange(0, 1), helper(tl.zeros((1,), "
        "tl.float32) + 1.0))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import bare_kernel
    with pytest.raises(InterpreterError, match="must be visible"):
        bare_kernel.kernel[(1,)](torch.zeros(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_rows_do_not_depend_on_the_batch(triton_impl, dtype):
    from parity.ops import triton_gemm as tk
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(70, 96, generator=gen).to(dtype)
    w = torch.randn(200, 96, generator=gen).to(dtype)
    b = torch.randn(200, generator=gen).to(dtype)
    full = tk.matmul(x, w, b)
    perm = torch.randperm(70, generator=gen)
    assert torch.equal(tk.matmul(x[perm], w, b), full[perm])  # every row in another tile slot
    for rows in (1, 3, 13, 64):
        assert torch.equal(tk.matmul(x[-rows:], w, b), full[-rows:])
    # and it is a GEMM: close to float64 math
    ref = (x.double() @ w.double().T + b.double()).to(dtype)
    assert torch.allclose(full.float(), ref.float(), rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                          atol=1e-2 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_tiles_by_row_count_only_where_the_probe_finds_the_same_bits(triton_impl, monkeypatch, dtype):
    """A ladder of tiles (small for few rows, large for many) serves by M only when the device's
    probe finds its rungs' products equal; the control: a rung with another BLOCK_K gives other
    bits (so row bits would depend on M), the probe says so, and the last rung serves every M."""
    from parity.ops import triton_gemm as tk
    gen = torch.Generator().manual_seed(1)
    spread = torch.exp2(torch.randint(-8, 9, (70, 96), generator=gen).float())  # orders show
    x = (torch.randn(70, 96, generator=gen) * spread).to(dtype)
    w = torch.randn(200, 96, generator=gen).to(dtype)
    b = torch.randn(200, generator=gen).to(dtype)
    small, large, other_k = (32, 32, 64, 4, 1), (64, 128, 64, 4, 1), (32, 32, 32, 4, 1)
    key = (str(dtype).removeprefix("torch."), 200, 96)
    monkeypatch.setattr(tk, "_LADDERS", {})

    monkeypatch.setattr(tk, "GEMM_TILES", {key: ((16, small), (None, large))})
    full = tk.matmul(x, w, b)
    assert tk.gemm_tiles(dtype, 200, 96, 13) == small and tk.gemm_tiles(dtype, 200, 96, 70) == large
    for rows in (1, 3, 13, 16, 17):
        assert torch.equal(tk.matmul(x[-rows:], w, b), full[-rows:]), rows
    assert "same bits" in tk.describe_tiles()

    monkeypatch.setattr(tk, "GEMM_TILES", {key: ((16, other_k), (None, large))})
    sums = {t: tk.matmul(x, w, b, tiles=t, out_dtype=torch.float32) for t in (other_k, large)}
    assert not torch.equal(sums[other_k], sums[large])  # what the probe guards against
    assert tk.gemm_tiles(dtype, 200, 96, 3) == large  # the probe found the rungs differ
    assert "64x128x64x4x1 differs from 32x32x32x4x1" in tk.describe_tiles()
    for rows in (1, 3, 13):
        assert torch.equal(tk.matmul(x[-rows:], w, b), full[-rows:]), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tma_gemm_sums_as_the_pointer_kernel(triton_impl, monkeypatch, dtype):
    """The persistent TMA kernel (3 programs walking 12 tiles here, K and rows past the ends read
    as zeros): rows independent of M and of the other rows, float32 sums equal to the pointer
    kernel's at the same BLOCK_K, so the two share a ladder (the probe agrees). The control: at
    another BLOCK_K the sums differ and the probe refuses the ladder. Bad tiles: one-line errors."""
    from parity.ops import triton_gemm as tg
    gen = torch.Generator().manual_seed(4)
    spread = torch.exp2(torch.randint(-8, 9, (70, 96), generator=gen).float())
    x = (torch.randn(70, 96, generator=gen) * spread).to(dtype)
    w, b = torch.randn(200, 96, generator=gen).to(dtype), torch.randn(200, generator=gen).to(dtype)
    tma, ptr, other = (32, 64, 64, 4, 1, "tma"), (64, 128, 64, 4, 1), (32, 64, 32, 4, 1, "tma")
    full = tg.matmul(x, w, b, tiles=tma)
    perm = torch.randperm(70, generator=gen)
    assert torch.equal(tg.matmul(x[perm], w, b, tiles=tma), full[perm])
    for rows in (1, 3, 33):
        assert torch.equal(tg.matmul(x[-rows:], w, b, tiles=tma), full[-rows:]), rows
    sums = {t: tg.matmul(x, w, b, tiles=t, out_dtype=torch.float32) for t in (tma, ptr, other)}
    assert torch.equal(sums[tma], sums[ptr]) and torch.equal(full, tg.matmul(x, w, b, tiles=ptr))
    assert not torch.equal(sums[other], sums[ptr])  # the control
    key = (str(dtype).removeprefix("torch."), 200, 96)
    monkeypatch.setattr(tg, "_LADDERS", {})
    monkeypatch.setattr(tg, "GEMM_TILES", {key: ((16, ptr), (None, tma))})
    assert tg.gemm_tiles(dtype, 200, 96, 70) == tma and tg.gemm_tiles(dtype, 200, 96, 9) == ptr
    monkeypatch.setattr(tg, "GEMM_TILES", {key: ((16, ptr), (None, other))})
    assert tg.gemm_tiles(dtype, 200, 96, 9) == other
    assert "32x64x32x4x1+tma differs from 64x128x64x4x1" in tg.describe_tiles()
    with pytest.raises(ConfigError, match="rows of a multiple of 16 bytes; K = 90"):
        tg.matmul(x[:, :90], w[:, :90], tiles=tma)
    with pytest.raises(ConfigError, match="unknown GEMM kernel in tiles 32x64x64x4x1\\+wgmma"):
        tg.matmul(x, w, tiles=(*tma[:5], "wgmma"))
    # layouts TMA cannot read as they are (one row out of a column, which PyTorch calls
    # contiguous; rows expanded with stride 0) are copied; empty sides go to the pointer kernel
    one, rows = x[7].reshape(96, 1).T, x[:1].expand(5, 96)
    assert one.stride() == (1, 1) and one.is_contiguous()
    assert torch.equal(tg.matmul(one, w, b, tiles=tma), full[7:8])
    assert torch.equal(tg.matmul(rows, w, b, tiles=tma), full[:1].expand(5, 200))
    assert tg.matmul(x, w[:0], tiles=tma).shape == (70, 0)
    assert torch.equal(tg.matmul(x[:, :0], w[:, :0], b, tiles=tma), b.expand(70, 200))
    with pytest.raises(ConfigError, match="out must be a dense, 16-byte aligned \\[70, 200\\]"):
        tg.matmul(x, w, tiles=tma, out=torch.empty(200, 70, dtype=dtype).T)


def test_attention_paged_equals_dense_equals_one_query(triton_impl):
    from parity.ops import triton_attention as tk
    from parity.ops.functions import reference_attention
    gen = torch.Generator().manual_seed(1)
    bsz, m, hq, hkv, d, bs = 2, 40, 4, 2, 16, 32
    q = torch.randn(bsz, m, hq, d, generator=gen)
    k = torch.randn(bsz, 2 * bs, hkv, d, generator=gen)
    v = torch.randn(bsz, 2 * bs, hkv, d, generator=gen)
    pos = torch.arange(m).repeat(bsz, 1) + torch.tensor([[0], [20]])
    dense = tk.attention(q, k, v, pos, bs)
    assert torch.allclose(dense, reference_attention(q, k, v, pos), atol=1e-5)
    # the same keys as cache pages, blocks scattered and tables shuffled
    k_cache = torch.zeros(7, hkv, d, bs)
    v_cache = torch.zeros(7, hkv, bs, d)
    tables = torch.tensor([[5, 1], [2, 6]])
    for b in range(bsz):
        for j in range(2):
            k_cache[tables[b, j]] = k[b, j * bs:(j + 1) * bs].permute(1, 2, 0)
            v_cache[tables[b, j]] = v[b, j * bs:(j + 1) * bs].permute(1, 0, 2)
    assert torch.equal(tk.paged_attention(q, k_cache, v_cache, tables, pos), dense)
    for i in (0, 17, 39):  # one query alone (decode) against the same query in a prefill
        one = tk.paged_attention(q[:, i:i + 1], k_cache, v_cache, tables, pos[:, i:i + 1])
        assert torch.equal(one[:, 0], dense[:, i])


def test_attention_refuses_head_sizes_the_gpu_cannot_compile(triton_impl):
    """Head sizes must be powers of two from 16 (tl.arange, tensor-core tl.dot): the interpreter
    runs 8 but a GPU would not compile it, so both are refused in one line (16 runs: the control)."""
    from parity.errors import ConfigError
    from parity.ops import triton_attention as tk
    for d in (8, 24, 96):
        q, k = torch.randn(1, 2, 2, d), torch.randn(1, 32, 2, d)
        with pytest.raises(ConfigError, match=f"powers of two from 16 up, not {d}: run this model with"):
            tk.attention(q, k, k, torch.arange(2).view(1, 2), 32)
    q, k = torch.randn(1, 2, 2, 16), torch.randn(1, 32, 2, 16)
    assert tk.attention(q, k, k, torch.arange(2).view(1, 2), 32).shape == (1, 2, 2, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_split_schedule_equals_the_walk(triton_impl, dtype, monkeypatch):
    """Keys over several fixed splits (`KV_SPLIT_PAGES`): the split schedule (a program per split,
    then a merge kernel) gives every query the walk's bits (`schedules.py`; the CUDA suite runs
    the same checks on the GPU's machine code)."""
    assert_kernel_schedules_agree(dtype, "cpu", 16, monkeypatch)


def test_attention_schedule_is_chosen_by_shapes():
    """The split schedule where the walk would leave a GPU idle (few sequences x heads, more than
    one split) and its partials fit the workspace; the walk otherwise."""
    from parity.ops import triton_attention as ta
    cpu = torch.device("cpu")
    splits = 4 * ta.KV_SPLIT_PAGES
    assert ta._schedule(1, 8, 2, 64, splits, 128, cpu) == "split"  # decode, batch 1, long context
    assert ta._schedule(256, 8, 2, 64, splits, 128, cpu) == "walk"  # decode, batch 256
    assert ta._schedule(1, 8, 2, 64, ta.KV_SPLIT_PAGES, 128, cpu) == "walk"  # one split: nothing to split
    assert ta._schedule(1, 8, 2048, 64, 10_000, 128, cpu) == "walk"  # partials over the workspace


def test_row_lse_and_norm_rows_are_independent(triton_impl, tmp_path):
    """A row's log-sum-exp and RMSNorm bits do not depend on the rows launched with it. The plain
    ops cannot be the control: torch's logsumexp and log_softmax and the standard RMSNorm kept every
    row's bits on this CPU (800 shapes of 1-300 rows by 1-6,000 columns, sliced, reshaped and
    misaligned, at 1 and 2 threads: none moved). So the controls are the kernels on a schedule the
    launch chooses, as a batch-dependent kernel's is: a lone row's log-sum-exp in another schedule
    (a program per row, 2048-column chunks) moves some rows (2 of 90 here); a norm that sums each
    row's squares in two halves when launched on a few rows moves some rows of the 4-row slices
    against the whole launch (12 of 88 here)."""
    from parity.ops import triton_kernels as tk
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(90, 3000, generator=gen)
    lse = tk.row_lse(logits, 1 / 0.7)
    assert torch.allclose(lse, torch.logsumexp(logits / 0.7, -1), atol=1e-5)
    assert torch.equal(tk.row_lse(logits[37:38], 1 / 0.7), lse[37:38])
    x, w = torch.randn(90, 64, generator=gen), torch.randn(64, generator=gen)
    assert torch.equal(tk.rms_norm(x[5:9], w, 1e-6), tk.rms_norm(x, w, 1e-6)[5:9])

    def lone_row_lse(row):  # the controls
        out = torch.empty(1)
        tk._row_lse_kernel[(1,)](row, out, 1, row.shape[1], row.stride(0), 1 / 0.7, ROWS=1, BLOCK_V=2048)
        return out
    assert not torch.equal(torch.cat([lone_row_lse(logits[r:r + 1]) for r in range(90)]), lse)
    halves = mutants.triton_kernel(
        tk._rms_norm_kernel, tmp_path, "mean_sq = tl.sum(x * x, axis=1) / H",
        "half = cols[None, :] < BLOCK // 2\n    mean_sq = (tl.sum(tl.where(half, x * x, 0.0), "
        "axis=1) + tl.sum(tl.where(half, 0.0, x * x), axis=1)) / H")

    def norm_in_halves(rows):
        out = torch.empty_like(rows)
        halves[(1,)](rows, w, out, rows.shape[0], 64, rows.stride(0), out.stride(0), 1e-6, ROWS=64, BLOCK=64)
        return out
    assert not torch.equal(torch.cat([norm_in_halves(x[i:i + 4]) for i in range(0, 88, 4)]),
                           tk.rms_norm(x, w, 1e-6)[:88])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norm_rope_is_the_norm_then_rope(triton_impl, dtype):
    """One kernel for the q/k head norm and RoPE (strided head rows of a fused projection): each
    head row's bits independent of the others, the values those of the two steps apart (bit for
    bit in float32 here; in bf16 the interpreter rounds the last cast its own way, one ulp), and
    its backward autograd's through the two steps."""
    from parity.ops import triton_kernels as tk
    from parity.ops.common import rope
    from parity.ops.triton_bundle import rms_norm_rope
    from parity.ops.triton_norm_rope import rms_norm_rope as fused_kernel
    gen = torch.Generator().manual_seed(6)
    qkv = torch.randn(9, 3 * 4 * 16, generator=gen).to(dtype)
    x = qkv[:, :64].reshape(9, 4, 16)  # head rows inside the fused projection's output
    w = (torch.rand(16, generator=gen) + 0.5).to(dtype)
    cos, sin = torch.rand(9, 16, generator=gen), torch.rand(9, 16, generator=gen)
    fused = fused_kernel(x, w, 1e-6, cos, sin)
    assert torch.equal(fused_kernel(x[3:4], w, 1e-6, cos[3:4], sin[3:4]), fused[3:4])
    two = rope(tk.rms_norm(x, w, 1e-6), cos, sin)
    if dtype == torch.float32:
        assert torch.equal(fused, two)
    else:
        assert torch.allclose(fused.float(), two.float(), rtol=2 ** -7, atol=0)
    xf, wf = x.float().requires_grad_(), w.float().requires_grad_()
    rms = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * wf
    rope(rms, cos, sin).pow(2).sum().backward()
    xg, wg = x.float().requires_grad_(), w.float().requires_grad_()
    rms_norm_rope(xg, wg, 1e-6, cos, sin).pow(2).sum().backward()
    assert torch.allclose(xg.grad, xf.grad, rtol=1e-4, atol=1e-5)
    assert torch.allclose(wg.grad, wf.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype,cases", [
    (torch.float32, ("batch", "padding", "offset", "decode", "engine", "autograd")),
    (torch.bfloat16, ("batch", "decode", "graphs", "engine", "autograd")),
])
def test_model_log_probs_are_invariant(triton_impl, dtype, cases):
    """Engine (paged KV cache, chunked prefill, continuous batching, decode steps padded to a
    graph's bucket) and learner (autograd) give the same bits as each sequence scored alone, in
    both dtypes."""
    model = _model("aligned", dtype)
    assert model.kernels.impl == "triton"
    results = run_checks(model, rounds=2, seed=4, max_len=24, cases=cases)
    assert all(r.comparisons > 0 and r.mismatches == 0 for r in results), results


def test_model_log_probs_are_invariant_with_gemm_tiles_by_row_count(triton_impl, monkeypatch):
    """A ladder on every weight (one tile up to 4 rows: decode; another above: prefill, learner)
    keeps the engine's and the learner's bits, both tiles in use. The control: a rung with
    another BLOCK_K forced past the probe makes the same checks find mismatches (float32: the
    sums' differences reach the log-probs, where bf16 rounding would hide most of them)."""
    from parity.apps.bench_gemm import weight_shapes
    from parity.ops import triton_gemm as tk
    model = _model("aligned", torch.float32)
    used = set()
    real = tk.gemm_tiles
    monkeypatch.setattr(tk, "gemm_tiles", lambda *a: used.add(real(*a)) or real(*a))

    def ladder(small):
        return {("float32", n, k): ((4, small), (None, (64, 128, 64, 4, 1)))
                for n, k in weight_shapes(model.config).values()}
    monkeypatch.setattr(tk, "GEMM_TILES", ladder((32, 32, 64, 4, 1)))
    results = run_checks(model, rounds=1, seed=5, max_len=20, cases=("batch", "decode"))
    assert all(r.comparisons > 0 and r.mismatches == 0 for r in results), results
    assert {(32, 32, 64, 4, 1), (64, 128, 64, 4, 1)} <= used

    monkeypatch.setattr(tk, "GEMM_TILES", ladder((32, 32, 32, 4, 1)))
    monkeypatch.setattr(tk, "ladder_holds", lambda *a: True)
    results = run_checks(model, rounds=1, seed=5, max_len=20, cases=("batch", "decode"))
    assert sum(r.mismatches for r in results) > 0


def test_model_log_probs_are_invariant_across_kv_splits(triton_impl):
    """Sequences whose last queries reduce over three key splits: every attention call on the
    walk against every call on the split schedule, learner and engine (`schedules.py`)."""
    from parity.ops import triton_attention as ta
    model = _model("aligned", torch.bfloat16)
    long = 2 * ta.KV_SPLIT_PAGES * model.block_size + 6
    assert_model_schedules_agree(model, (long, long - 9))


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-mixtral", "tiny-qwen2-moe", "tiny-llama", "tiny-qwen2",
                                    "tiny-mistral", "tiny-gemma2", "tiny-gemma3", "tiny-olmo3", "tiny-phi3"])
def test_moe_routing_and_the_other_families_are_invariant(triton_impl, preset):
    """Routing (Qwen3-MoE; Mixtral: renormalised, no q/k norm; Qwen2-MoE's shared expert) and the
    families without q/k norm, whose RoPE is the plain op beside the Triton kernels (Llama's
    llama3 tables, Qwen2's YaRN, Phi-3's longrope over partly rotated heads); Mistral's, Gemma's,
    OLMo 3's and Phi-3's sliding windows (9 keys here, so they bind); Gemma 2's soft-capped scores
    and logits."""
    sliding = ("tiny-mistral", "tiny-gemma2", "tiny-gemma3", "tiny-olmo3", "tiny-phi3")
    over = {"sliding_window": 9} if preset in sliding else {}
    if preset in sliding[1:]:  # (both layers: a sliding one, its own RoPE, a full one)
        over.update(num_hidden_layers=2)
    model = _model("aligned", torch.float32, preset=preset, **over)
    results = run_checks(model, rounds=1, seed=5, max_len=24, cases=("batch", "decode"))
    assert all(r.comparisons > 0 and r.mismatches == 0 for r in results), results


def test_learner_gradients_are_right(triton_impl):
    """Backward is ordinary math; it must agree with the CPU aligned backend's gradients."""
    seqs = [torch.arange(n) % 128 for n in (9, 21)]
    grads = {}
    for impl in ("triton", "cpu"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("PARITY_ALIGNED_IMPL", impl)
            model = _model("aligned", torch.float32)
            out = parity.sequence_logprobs(model, seqs)
            torch.stack([o.sum() for o in out]).sum().backward()
            grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for name, g in grads["triton"].items():
        ref = grads["cpu"][name]
        assert float((g - ref).norm()) <= 1e-4 * float(ref.norm()) + 1e-7, name


def test_learner_memory_options_keep_the_bits(triton_impl):
    """The LM head in chunks keeps the log-probs' bits; activation checkpointing the gradients'
    too (its control, on the CPU backends: tests/parity/test_learner_memory.py)."""
    seqs = [torch.arange(n) * 7 % 128 for n in (9, 21)]
    model = _model("aligned", torch.float32)
    runs = []
    for options in ({}, {"head_chunk": 4}, {"head_chunk": 4, "recompute": True}):
        model.zero_grad(set_to_none=True)
        out = torch.cat(parity.sequence_logprobs(model, seqs, **options))
        (out * torch.linspace(-1, 1, len(out))).sum().backward()
        runs.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert torch.equal(runs[1][0], runs[0][0]) and torch.equal(runs[2][0], runs[0][0])
    assert all(torch.equal(runs[2][1][n], g) for n, g in runs[1][1].items())
    for name, g in runs[0][1].items():
        assert float((runs[1][1][name] - g).norm()) <= 1e-5 * float(g.norm()) + 1e-7, name


def test_control_standard_kernels_differ():
    """The same cases on the standard kernels find mismatches, so these checks can fail."""
    model = _model("standard", torch.float32)
    refs_differ = run_checks(model, rounds=3, seed=4, max_len=24, cases=("batch", "decode"))
    assert sum(r.mismatches for r in refs_differ) > 0
    assert reference(model, [torch.arange(5)])[0].numel() == 4


def test_bench_gemm_checks_each_candidate_tiles_rows(triton_impl, monkeypatch):
    """`parity bench gemm` keeps a candidate tile only if its rows are the same bits at every M;
    the control: a GEMM that switches path by M is caught."""
    from parity.apps.bench_gemm import bench_gemm, best, parse_tiles
    from parity.errors import ParityError
    from parity.ops import triton_gemm as tk
    candidates = ["64x128x64x4x3", "64x32x64x4x4", "64x64x32x4x3"]
    rows = bench_gemm("tiny", "float32", (4, 16), candidates, reps=1)
    assert len(rows) == 4 * 3 and all(r.rows_invariant for r in rows)
    assert set(best(rows)) == {"qkv", "o_proj", "gate_up", "down_proj"}
    assert [r.bits for r in rows[:3]] == ["A", "A", "B"]  # another BLOCK_K sums in another order

    def cut(msg):  # a time limit arriving while the second shape is under way
        if msg.startswith("o_proj"):
            raise KeyboardInterrupt
    stopped = []
    done = bench_gemm("tiny", "float32", (4, 16), candidates, reps=1, progress=cut, stopped=stopped)
    assert {r.shape for r in done} == {"qkv"} and all(len(r.ratios) == 2 for r in done)
    assert stopped == ["interrupted: 1 of 4 shapes done"]
    real = tk.matmul
    monkeypatch.setattr(tk, "matmul", lambda x, w, b=None, tiles=None, out_dtype=None, out=None:
                        real(x, w, b, tiles, out_dtype, out) if x.shape[0] > 8 else F.linear(x, w))
    assert not any(r.rows_invariant for r in bench_gemm("tiny", "float32", (4, 16), candidates[:1], reps=1))

    def skewed(x, w, b=None, tiles=None, out_dtype=None, out=None):  # deterministic, row-invariant, wrong
        y = real(x, w, b, tiles, out_dtype, out)
        return y.mul_(1.01) if tiles == (64, 32, 64, 4, 4) else y

    def skipping(x, w, b=None, tiles=None, out_dtype=None, out=None):  # never writes the last columns
        if tiles != (64, 32, 64, 4, 4) or out is None:
            return real(x, w, b, tiles, out_dtype, out)
        keep = out.shape[1] - 8
        out[:, :keep] = real(x, w[:keep], None if b is None else b[:keep], tiles, out_dtype)
        return out
    for wrong_kernel in (skewed, skipping):
        monkeypatch.setattr(tk, "matmul", wrong_kernel)
        wrong = bench_gemm("tiny", "float32", (4, 16), candidates[:2], reps=1)
        assert [r.correct for r in wrong[:2]] == [True, False] and not wrong[1].ratios, wrong_kernel
        assert wrong[1].error.startswith("wrong sums: row ") and best(wrong)["qkv"].tiles == candidates[0]
    monkeypatch.setattr(tk, "matmul", real)
    import parity.apps.bench_gemm as bg
    timed = bg.seconds_per_call

    broken = []

    def failing(fn, device):  # a tile whose timing fails (a CUDA graph capture, say): marked, the
        if fn.func is F.linear and broken:  # others go on; cuBLAS failing (the device in error)
            raise RuntimeError("CUDA error: an illegal memory access")  # ends the run with the
        if getattr(fn, "keywords", {}).get("tiles") == (64, 32, 64, 4, 4):  # shapes done (it
            raise RuntimeError("capture failed")  # killed the bench: no JSON at all)
        return timed(fn, "cpu", 0.001)
    monkeypatch.setattr(bg, "seconds_per_call", failing)
    marked = bench_gemm("tiny", "float32", (4, 16), candidates[:2], reps=1, stopped=[])
    assert [r.error for r in marked[:2]] == ["", "RuntimeError: capture failed"] and len(marked) == 8
    assert best(marked)["qkv"].tiles == candidates[0]
    broken.append(1)
    stopped = []
    assert bench_gemm("tiny", "float32", (4, 16), candidates[:1], reps=1, stopped=stopped) == []
    assert stopped == ["cuBLAS failed at qkv M=4 (RuntimeError: CUDA error: an illegal memory access): "
                       "0 shapes done"]
    assert parse_tiles("128x256x64x8x3+TMA") == (128, 256, 64, 8, 3, "tma")
    for bad in ("64x100x64x4x3", "64x128x64x4x3+wgmma", "64x128x64x4x3+tma+tma"):
        with pytest.raises(ParityError, match="is not BLOCK_MxBLOCK_N"):
            parse_tiles(bad)
    for bad in ("64x512x64x4x3+tma", "64x128x8x4x3+tma"):
        with pytest.raises(ParityError, match="blocks must be 16 to 256"):
            parse_tiles(bad)


def test_bench_gemm_ladders_stay_in_one_bits_class_and_load_as_the_table(monkeypatch, tmp_path):
    """The best ladder per shape takes the fastest tile per row count within one bits class (never
    mixing classes, whose rows would differ by M), and `--gemm-tiles` loads it as `GEMM_TILES`;
    a malformed file is a one-line error."""
    from parity.apps.bench_gemm import TileRow, apply_tiles, ladders, table_entries
    from parity.errors import ParityError
    from parity.ops import triton_gemm as tk

    def row(tiles, r4, r16, bits):
        return TileRow("o_proj", 64, 128, "bfloat16", tiles, {4: r4, 16: r16}, True, 0.0, bits=bits)
    rows = [row("64x128x64x4x3", 1.0, 2.0, "A"), row("64x32x64x4x4", 1.5, 1.2, "A"),
            row("64x64x32x4x3", 1.6, 1.6, "B"), row("128x128x64x8x3", 9.0, 9.0, "A")]
    rows[3].rows_invariant = False  # a tile whose rows change with M is never chosen
    lad = ladders(rows)["o_proj"]
    assert lad.bits == "A" and lad.rungs == [[4, "64x32x64x4x4"], [None, "64x128x64x4x3"]]
    assert lad.ratios == {4: 1.5, 16: 2.0} and abs(lad.geomean - 3 ** 0.5) < 1e-12
    assert lad.entry() == "('bfloat16', 64, 128): ((4, (64, 32, 64, 4, 4)), (None, (64, 128, 64, 4, 3)),),"
    rows[2].ratios = {4: 3.0, 16: 3.0}  # class B faster at every count: one rung of B
    assert ladders(rows)["o_proj"].rungs == [[None, "64x64x32x4x3"]]

    path = tmp_path / "gemm.json"
    path.write_text(json.dumps({"gemm_tiles": table_entries({"o_proj": lad})}))
    monkeypatch.setattr(tk, "GEMM_TILES", {})
    assert apply_tiles(str(path)) == 1
    assert tk.GEMM_TILES == {("bfloat16", 64, 128): ((4, (64, 32, 64, 4, 4)), (None, (64, 128, 64, 4, 3)))}
    rows.append(row("128x128x64x8x4+tma", 0.5, 9.0, "A"))  # the TMA kernel: a tile like the others
    tma = ladders(rows)["o_proj"]
    assert tma.entry().endswith("(None, (128, 128, 64, 8, 4, 'tma')),),")
    path.write_text(json.dumps({"gemm_tiles": table_entries({"o_proj": tma})}))
    assert apply_tiles(str(path)) == 1 and tk.GEMM_TILES[("bfloat16", 64, 128)][-1][1][5:] == ("tma",)
    path.write_text("a warning a library printed\n" + path.read_text() + "\nand a line after it\n")
    assert apply_tiles(str(path)) == 1  # (a log with stray lines around its JSON, as a device call's may)
    unordered = [[None, [64, 32, 64, 4, 4]], [4, [1, 1, 1, 1, 1]]]
    boolean = [[True, [64, 32, 64, 4, 4]], [None, [64, 32, 64, 4, 4]]]
    for bad in ({"rows": []}, {"gemm_tiles": [["bfloat16", 64, 128, unordered]]},
                {"gemm_tiles": [["bfloat16", 64, 128, [[None, [64, 30, 64, 4, 4]]]]]},
                {"gemm_tiles": [["bfloat16", 64.5, 128, [[None, [64, 32, 64, 4, 4]]]]]},
                {"gemm_tiles": [["bfloat16", 64, 128, boolean]]},
                {"gemm_tiles": [["bfloat16", 64, 128, [[None, [64, 32, 64, 4, 4, "wgmma"]]]]]},
                {"gemm_tiles": [["bfloat16", 64, 128, [[None, [64, 32, 64, 4, 4, 7]]]]]},
                {"gemm_tiles": [["int8", 64, 128, [[None, [64, 32, 64, 4, 4]]]]]}):
        path.write_text(json.dumps(bad))
        with pytest.raises(ParityError, match="gemm-tiles") as err:
            apply_tiles(str(path))
        assert "\n" not in str(err.value)
    with pytest.raises(ParityError, match="cannot read"):
        apply_tiles(str(tmp_path / "missing.json"))
