"""Small aligned GEMMs: a row's bits are those of any larger GEMM, whatever M.

Below 12 rows a product is either padded to `gemm_rows(M)` rows (4-row multiples where the
machine's probe confirms they take the large GEMM's path, 16 where it does not) or, in float32
up to 8 rows, computed by the native matrix-vector kernel in the GEMM's own order (where its
probe confirms that order for the K at hand). These tests check the property on shapes the
probes never saw, at 1 and 2 threads, in both dtypes; the controls show that plain unpadded
GEMMs of 1..11 rows, and the matrix-vector kernel with another blocking, do differ.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from parity import hardware
from parity.ops import common, gemm, gemm_strict, native
from tests.conftest import DEVICE

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="the CPU GEMM's property")

SHAPES = [(96, 200), (128, 4000), (2048, 1024), (3072, 1024), (33, 77), (300, 40), (64, 8)]
"""(K, N): not the probe's shapes (the probe must generalise, as the model relies on it)."""


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _data(k: int, n: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(48, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("k,n", SHAPES)
def test_every_small_row_count_gives_the_large_gemms_rows(threads, dtype, k, n):
    x, w = _data(k, n, dtype)
    full = gemm.linear(x, w)
    for m in range(1, 16):
        for off in (0, 5, 48 - m):
            got = gemm.linear(x[off:off + m], w)
            assert torch.equal(got, full[off:off + m]), f"M={m} at row {off} differs"


@pytest.mark.parametrize("k", [64, 300])
def test_one_output_column_gives_every_row_count_the_same_rows(threads, k):
    """A product with one output column (Qwen2-MoE's shared-expert gate): MKL's float32 path for
    it orders a row by M, past 12 rows too (the control: F.linear's rows differ); `linear`
    computes it as one column of four."""
    x, w = _data(k, 1, torch.float32)
    full = gemm.linear(x, w)
    for m in range(1, 48):
        assert torch.equal(gemm.linear(x[:m], w), full[:m]), f"M={m} differs"
    plain = F.linear(x, w)
    if all(torch.equal(F.linear(x[:m], w), plain[:m]) for m in range(1, 48)):  # (seen on AMD EPYC AVX2)
        pytest.skip("the control: this machine's one-column products do not depend on M")


@pytest.mark.parametrize("k,n", [s for s in SHAPES if s[1] >= gemm.FREE_ROWS])
def test_control_unpadded_small_gemms_differ(threads, k, n):
    x, w = _data(k, n, torch.float32)
    full = F.linear(x, w)
    differ = [m for m in range(1, 12) if not torch.equal(F.linear(x[:m], w), full[:m])]
    assert differ, "every unpadded small GEMM matched: the padding would be untested"


def test_padding_is_4_row_multiples_where_the_probe_passes_and_16_where_it_fails(monkeypatch):
    monkeypatch.setattr(gemm, "_quantum", {})
    monkeypatch.setattr(gemm, "strict", lambda: False)  # (strict mode: tested below)
    passes = gemm._probe_quantum() == gemm.ROW_QUANTUM
    if passes:
        assert [gemm.gemm_rows(m) for m in (1, 3, 4, 5, 8, 9, 11, 12, 13, 40)] == \
            [4, 4, 4, 8, 8, 12, 12, 12, 13, 40]

    def uneven(x, w, bias=None):  # a GEMM whose small row counts take another order (any machine)
        y = F.linear(x, w, bias)
        return y + 1e-3 if x.shape[0] < gemm.FREE_ROWS else y

    monkeypatch.setattr(gemm, "gemm_linear", uneven)
    monkeypatch.setattr(gemm, "_quantum", {})
    assert [gemm.gemm_rows(m) for m in (1, 5, 11, 12, 13)] == [16, 16, 16, 12, 13]
    if not passes:
        pytest.skip("this machine's small GEMMs fail the probe: 16 rows everywhere (the fallback checked)")


needs_native = pytest.mark.skipif(native.library() is None, reason="no C compiler: no native kernels")


@pytest.fixture(params=["library", "strict"])
def regime(monkeypatch, request):
    """The GEMM regime, the strict one forced on any machine: the matrix-vector kernel must
    follow the library's GEMM in one and the strict K-blocked product in the other."""
    monkeypatch.setattr(gemm, "_strict", dict.fromkeys((False, True), request.param == "strict"))
    return request.param


def _regime_gemm(regime: str):
    return partial(gemm_strict.forward, chunked=False) if regime == "strict" else F.linear


@needs_native
@pytest.mark.parametrize("k", [64, 193, 300, 1024, 3072])
def test_the_matrix_vector_kernel_is_the_gemms_order_and_is_used(regime, threads, k, monkeypatch):
    if not gemm._gemv_order_holds(k):
        pytest.skip(f"this BLAS orders K={k} otherwise: the padded GEMM serves (also correct)")
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(16, k, generator=gen), torch.randn(1000, k, generator=gen)
    b = torch.randn(1000, generator=gen)
    reference = _regime_gemm(regime)
    for bias in (None, b):
        full = reference(x, w, bias)
        for m in range(1, gemm.GEMV_ROWS + 1):
            assert torch.equal(native.gemv(x[:m], w, bias, gemm._gemv_kblock(k)), full[:m]), m
    calls = []
    real = native.gemv
    monkeypatch.setattr(native, "gemv", lambda *a: calls.append(a) or real(*a))
    assert torch.equal(gemm.linear(x[:3], w, b), reference(x, w, b)[:3])
    assert len(calls) == 1, "a 3-row float32 product did not take the matrix-vector kernel"
    assert gemm.token_rows(3, torch.float32) == 3  # the forward does not pad what the kernel takes


@needs_native
def test_the_strict_k_block_is_one_chain_and_the_kernel_serves_strict_decode(monkeypatch):
    """Strict float32 products run in K blocks whose one-thread GEMM is a single chain here, so
    the matrix-vector kernel serves decode-sized products in strict mode too (on the AMX Xeon a
    quarter of the padded GEMM's time). Control: the kernel with the other candidate's blocks does
    not give the strict product's bits."""
    monkeypatch.setattr(gemm, "_strict", dict.fromkeys((False, True), True))
    kb = gemm_strict.kblock()
    assert kb in gemm_strict.KBLOCKS
    if not gemm_strict._one_chain(kb):
        pytest.skip("no candidate K block is one chain on this BLAS: strict decode keeps the padded GEMM")
    assert f"K blocks of {kb}" in gemm.describe()
    gen = torch.Generator().manual_seed(9)
    x, w = torch.randn(16, 1024, generator=gen), torch.randn(200, 1024, generator=gen)
    blocked = gemm_strict.forward(x, w, chunked=False)
    other = next(b for b in gemm_strict.KBLOCKS if b != kb)
    assert not torch.equal(native.gemv(x[:8], w, None, other), blocked[:8]), "another blocking matched"
    assert gemm._gemv_order_holds(1024)  # probed before counting the product's own calls
    calls = []
    real = native.gemv
    monkeypatch.setattr(native, "gemv", lambda *a: calls.append(a) or real(*a))
    assert torch.equal(gemm.linear(x[:1], w), blocked[:1]) and len(calls) == 1


@pytest.fixture
def bf16_via_float32(monkeypatch):
    """bf16 products as on a CPU without a bf16 GEMM (AVX2 only): in float32 (`gemm_linear`)."""
    monkeypatch.setenv("PARITY_BF16_GEMM", "float32")
    hardware.bf16_gemm_native.cache_clear()
    yield
    monkeypatch.delenv("PARITY_BF16_GEMM")
    hardware.bf16_gemm_native.cache_clear()


@needs_native
@pytest.mark.parametrize("k", [64, 193, 1024])
def test_bf16_weights_widened_in_the_kernel_give_the_padded_products_rows(regime, threads, k,
                                                                          bf16_via_float32, monkeypatch):
    """Where bf16 products run in float32, the matrix-vector kernel reads the bf16 weights and
    widens them as it goes (no float32 copy of the weight, half the bytes): bit for bit the
    float32 kernel on a float32 copy, and so every row of the padded bf16 product; decode-sized
    bf16 products take it and are not padded. N = 1003 covers the 16-wide blocks, an 8-wide one
    and scalar outputs; K = 193 a partial 8-column tile. Control: another K blocking orders the
    sums otherwise, and the bf16 probe (compared before rounding) refuses it."""
    gen = torch.Generator().manual_seed(11)
    x, w = torch.randn(16, k, generator=gen).bfloat16(), torch.randn(1003, k, generator=gen).bfloat16()
    b = torch.randn(1003, generator=gen).bfloat16()
    kb = gemm._gemv_kblock(k)
    exact = _regime_gemm(regime)(x.float(), w.float(), b.float())  # the float32 product of bf16 values
    for bias in (None, b):
        for m in (1, 2, 3, 8):
            float_bias = None if bias is None else bias.float()
            assert torch.equal(native.gemv(x[:m], w, bias, kb),
                               native.gemv(x[:m].float(), w.float(), float_bias, kb)), m
    reference = partial(gemm_strict.forward, chunked=False) if regime == "strict" else common.gemm_linear
    full = reference(x, w, b)
    assert full.dtype == torch.bfloat16 and torch.equal(full, exact.bfloat16())
    if not gemm._gemv_order_holds(k):  # (MKL on AVX-512 orders the library's K=193 and 1024 otherwise)
        assert not gemm._gemv_order_holds(k, torch.bfloat16), "the bf16 probe passed a refused order"
        for m in range(1, gemm.GEMV_ROWS + 1):  # then the padded product serves, and its rows hold
            assert torch.equal(gemm.linear(x[:m], w, b), full[:m]), m
        pytest.skip(f"this BLAS orders K={k} otherwise: the padded GEMM serves (checked)")
    assert all(torch.equal(native.gemv(x[:m], w, b, kb), exact[:m]) for m in (1, 8))
    assert gemm._gemv_order_holds(k, torch.bfloat16), "the float32 route's order held, the bf16 one not"
    for m in range(1, gemm.GEMV_ROWS + 1):
        assert torch.equal(gemm.linear(x[:m], w, b), full[:m]), m
    calls = []
    real = native.gemv
    monkeypatch.setattr(native, "gemv", lambda *a: calls.append(a) or real(*a))
    assert torch.equal(gemm.linear(x[:3], w, b), full[:3]) and len(calls) == 1
    assert gemm.token_rows(3, torch.bfloat16) == 3
    other = min(kb, k) // 2  # two or more blocks where the kernel makes one, or other ones
    assert not torch.equal(real(x[:8], w, b, other), exact[:8]), "another blocking matched"
    monkeypatch.setattr(gemm, "_gemv_ok", {})  # and the bf16 probe finds that order out
    monkeypatch.setattr(gemm, "_gemv_kblock", lambda k: other)
    assert not gemm._gemv_order_holds(k, torch.bfloat16), "the bf16 probe passed another order"
    assert gemm._gemv_order_holds(k, torch.float32) is False
    assert torch.equal(real(x[:2, :0], w[:, :0], b, 8), b.float().expand(2, -1))  # K = 0: the bias


@needs_native
def test_control_another_blocking_differs_and_the_probe_falls_back(regime, monkeypatch):
    k = 1024
    gen = torch.Generator().manual_seed(8)
    x, w = torch.randn(16, k, generator=gen), torch.randn(200, k, generator=gen)
    full = _regime_gemm(regime)(x, w)
    assert not torch.equal(native.gemv(x[:1], w, None, k), full[:1]), "one unblocked chain matched"
    monkeypatch.setattr(gemm, "_gemv_kblock", lambda k: k)
    monkeypatch.setattr(gemm, "_gemv_ok", {})
    assert not gemm._gemv_order_holds(k)
    assert torch.equal(gemm.linear(x[:1], w), full[:1])  # the padded GEMM serves instead


@pytest.fixture(params=["amx", "bf16-chunks", "float32"])
def strict_gemms(monkeypatch, request):
    monkeypatch.setattr(gemm, "_strict", dict.fromkeys((False, True), True))
    if request.param == "amx" and not (hardware.bf16_gemm_native() and native.amx_ready()):
        pytest.skip("no AMX tiles here: strict bf16 runs in 128-row calls or in float32")
    if request.param != "amx":  # the paths a CPU without AMX takes
        monkeypatch.setattr(gemm, "_amx_ok", False)
    if request.param == "float32":  # where the 128-row bf16 GEMMs fail their probe
        monkeypatch.setattr(gemm, "_bf16_chunks_ok", False)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_strict_gemms_give_every_row_count_the_same_rows(strict_gemms, threads, dtype):
    """Strict mode (one MKL thread; float32 padded to 16 rows; bf16 on AMX tiles, in 128-row GEMMs,
    or in float32), forced here on any machine: a row's bits do not depend on M (1-100), its offset
    or the caller's thread count."""
    if dtype == torch.float32 and strict_gemms != "bf16-chunks":
        pytest.skip("(the same float32 path as another parameter)")
    for k, n in ((1024, 1024), (2048, 151), (300, 40)):
        x, w = _data(k, n, dtype)
        x = torch.cat([x, x, x])[:130]
        torch.set_num_threads(1)
        full = gemm.linear(x, w)
        torch.set_num_threads(threads)
        for m in (1, 2, 5, 12, 15, 16, 17, 33, 37, 64, 100):
            for off in (0, 7, 130 - m):
                assert torch.equal(gemm.linear(x[off:off + m], w), full[off:off + m]), (k, n, m, off)
        assert torch.get_num_threads() == threads  # restored after each product


def test_control_a_gemm_whose_large_rows_depend_on_m_makes_gemms_strict(monkeypatch):
    """The probe: rows that change with M between 16 and 100 (as oneDNN's bf16 GEMM did with AMX,
    and MKL's float32 GEMM at 2 threads) make this machine strict; rows that do not, do not."""
    def uneven(x, w, bias=None):
        y = F.linear(x.float(), w.float(), bias).to(x.dtype)
        return y + 1e-3 if 33 <= x.shape[0] < 100 else y

    monkeypatch.setattr(gemm, "gemm_linear", uneven)
    monkeypatch.setattr(gemm, "_strict", {})
    assert gemm.strict()
    assert "strict" in gemm.describe()
    assert gemm._large_rows_hold(gemm._strict_product)  # the strict regime passes it


def test_the_strict_regime_and_the_amx_kernel_can_be_forced_and_a_bad_setting_is_refused(monkeypatch):
    from parity.errors import ConfigError

    for value, want in (("1", True), ("0", False)):
        monkeypatch.setattr(gemm, "_strict", {})
        monkeypatch.setenv("PARITY_GEMM_STRICT", value)
        assert gemm.strict() is want
    monkeypatch.setattr(gemm, "_strict", {})
    monkeypatch.setenv("PARITY_GEMM_STRICT", "yes")
    with pytest.raises(ConfigError, match="PARITY_GEMM_STRICT must be 1 or 0, got 'yes'"):
        gemm.strict()
    monkeypatch.setenv("PARITY_AMX", "0")  # (the AMX kernel: off, and a bad setting refused)
    assert not native.amx_ready()
    monkeypatch.setenv("PARITY_AMX", "on")
    with pytest.raises(ConfigError, match="PARITY_AMX must be 1 or 0, got 'on'"):
        native.amx_ready()


@pytest.fixture
def split_everything(monkeypatch):
    """Strict GEMMs forced on any machine; calling the fixture's value also slices every weight
    (down to 64-column slices), so small shapes exercise the split, and takes float32 products off
    the native GEMM (`native.gemm_f32`, which shares no work out: tests/parity/test_gemm_f32.py)
    onto the library calls the slicing is for."""
    monkeypatch.setattr(gemm, "_strict", dict.fromkeys((False, True), True))

    def split():
        monkeypatch.setattr(gemm_strict, "SPLIT_MIN_WEIGHT", {False: 1, True: 1})
        monkeypatch.setattr(gemm_strict, "SPLIT_MIN_COLUMNS", 64)
        monkeypatch.setattr(native, "gemm_f32", lambda *args: None)
    return split


def test_strict_products_split_by_the_weights_shape_alone(split_everything):
    """A strict product is shared among threads by column slices fixed by its weight's shape and
    path (never by M or the thread count: oneDNN's bf16 GEMM can round a 128-column slice otherwise
    than 256 columns) or, below the slicing size, by row blocks (whole 128-row bf16 calls; float32
    blocks of 16-row multiples): the same bits on 1, 2 and 3 threads, at every M, in the caller's
    grad and inference modes; under autograd the forward is the same product, the gradients right."""
    assert gemm_strict._slices(3072, 1024, False) == [(0, 768), (768, 1536), (1536, 2304), (2304, 3072)]
    assert gemm_strict._slices(1024, 2048, False) == [(0, 512), (512, 1024)]  # N // 512 slices at most
    assert gemm_strict._slices(1024, 1024, False) == [(0, 1024)]  # a small weight: one call
    assert gemm_strict._slices(3072, 1024, True) == [(0, 3072)]  # bf16: sliced from lm-head sizes only
    assert len(gemm_strict._slices(151936, 1024, True)) == gemm_strict.SPLIT_PARTS
    assert gemm_strict._row_blocks(1000, 16, 2) == [(0, 496), (496, 1000)]  # the last block takes the rest
    assert gemm_strict._row_blocks(1024, 128, 3) == [(0, 256), (256, 640), (640, 1024)]
    assert gemm_strict._row_blocks(128, 128, 2) == [(0, 128)]  # below SPLIT_ROWS: one block
    split_everything()
    for dtype in (torch.float32, torch.bfloat16):
        for k, n in ((768, 256), (300, 200), (200, 40)):  # sliced, sliced, rows only
            gen = torch.Generator().manual_seed(k)
            x = torch.randn(400, k, generator=gen).to(dtype)
            w, bias = torch.randn(n, k, generator=gen).to(dtype), torch.randn(n, generator=gen).to(dtype)
            outs = []
            for t in (1, 2, 3):
                torch.set_num_threads(t)
                outs.append(gemm.linear(x, w, bias))
                assert torch.get_num_threads() == t
                for m in (1, 17, 300):
                    assert torch.equal(gemm.linear(x[5:5 + m], w, bias), outs[-1][5:5 + m]), (t, m)
            assert all(torch.equal(o, outs[0]) for o in outs), (dtype, k, n)
            with torch.inference_mode():
                assert torch.equal(gemm.linear(x, w, bias), outs[0])
            xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, bias))
            y = gemm.linear(xg, wg, bg)
            assert y.requires_grad and torch.equal(y.detach(), outs[0])
            g = torch.randn(y.shape, generator=gen).to(dtype)
            y.backward(g)
            xr, wr, br = (t.float().requires_grad_() for t in (x, w, bias))
            F.linear(xr, wr, br).backward(g.float())
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
            for got, want in ((xg.grad, xr.grad), (wg.grad, wr.grad), (bg.grad, br.grad)):
                assert got.dtype == dtype
                assert float((got.float() - want).norm()) <= tol * float(want.norm())


def test_a_split_models_rows_hold_and_its_standard_control_differs(split_everything, monkeypatch):
    """The model on strict, split GEMMs (forced, slices down to the small preset's weights):
    batch, decode, learner-under-autograd and thread-count cases bit for bit in both dtypes; the
    standard kernels, same cases, do not hold."""
    from parity.invariance import run_checks
    from tests.conftest import cached_model

    split_everything()
    monkeypatch.setattr(gemm_strict, "SPLIT_ROWS", 32)
    cases = ("batch", "decode", "autograd", "threads")
    for dtype, preset in (("float32", "tiny"), ("bfloat16", "small")):
        model = cached_model(preset, "aligned", dtype, 31, 0.1)
        for res in run_checks(model, rounds=2, seed=31, cases=cases):
            assert res.comparisons > 0 and res.mismatches == 0, res
    model = cached_model("tiny", "standard", "float32", 31, 0.1)
    assert sum(r.mismatches for r in run_checks(model, rounds=2, seed=31, cases=cases)) > 0


def test_a_forked_child_gets_threads_of_its_own(split_everything):
    """A process forked after a shared product has the pool object but not its threads: its own
    shared products make a pool (they hung on the parent's before) and give the parent's bits."""
    import os
    import time

    split_everything()
    torch.set_num_threads(2)
    x, w = _data(300, 200, torch.float32)
    want = gemm.linear(x, w)
    assert gemm_strict._pool is not None and gemm_strict._pool[0] == os.getpid()
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only with the parent's bits
        try:
            os._exit(0 if torch.equal(gemm.linear(x, w), want) else 1)
        except BaseException:
            os._exit(2)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the child's shared product hung")
    assert os.waitstatus_to_exitcode(done[1]) == 0


def test_the_k_block_is_probed_before_a_product_is_shared_out(split_everything, monkeypatch):
    """The first strict float32 product of a process probes the K block before it shares the work
    out: probed inside a pool thread, the probe waited for the lock its caller held (a hang)."""
    import threading

    split_everything()
    monkeypatch.setattr(gemm_strict, "_kblock", None)
    torch.set_num_threads(2)
    x, w = _data(300, 200, torch.float32)
    out = []
    worker = threading.Thread(target=lambda: out.append(gemm.linear(x, w)), daemon=True)
    worker.start()
    worker.join(60)
    assert out, "the first shared product hung"
    assert torch.equal(out[0], gemm_strict.forward(x, w, chunked=False))


def test_strict_bf16_calls_are_128_rows_with_one_64_row_tail(monkeypatch):
    """Strict bf16 products run as 128-row calls, the rest in one call of 64 rows where it fits
    (a decode step does half the 128-row call's work), and the probe accepts that here. Control:
    a 16-row tail, where oneDNN takes another kernel (AMX), fails the probe."""
    from parity.hardware import bf16_gemm_native

    assert [gemm_strict._chunk_rows(m) for m in (1, 64, 65, 128, 129, 193, 300)] == \
        [64, 64, 128, 128, 192, 256, 320]
    if not bf16_gemm_native():
        pytest.skip("no bf16 GEMM on this CPU: strict bf16 runs in float32")
    monkeypatch.setattr(gemm, "_bf16_chunks_ok", None)
    if not gemm._bf16_chunks_hold():
        pytest.skip("this machine's 128-row bf16 calls fail the probe: strict bf16 runs in float32")
    monkeypatch.setattr(gemm_strict, "STRICT_BF16_TAIL", 16)
    if gemm._large_rows_hold(gemm._bf16_chunks, (torch.bfloat16,)):
        pytest.skip("here a 16-row call has the 128-row call's bits too: the control cannot fail")
