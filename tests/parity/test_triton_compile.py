"""The aligned Triton kernels compiled for real GPUs here, without one (`parity compile`).

Every launch of a model's learner, prefill and decode passes is compiled by Triton's own binder,
passes and bundled ptxas for sm_90 (H100/H200) and launched nowhere; the cubins are read back.
This catches what the interpreter suite cannot: a kernel that does not compile for the GPU,
register spills, 16-bit products off the tensor cores, a kernel over the shared-memory limit,
and batch-dependent specialisation (a second binary for another batch size). Each check has a
control that the detector is known to flag. Runs in subprocesses: the compile-only driver must
be in place before the kernels are imported, and this process imports them for the interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

triton = pytest.importorskip("triton")


def _run(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    """`parity ARGS` or `python -c CODE` in a fresh process, without the interpreter switch that
    the Triton interpreter suite sets in this one."""
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "parity.cli", *args]
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PARITY_ALIGNED_IMPL")}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


@pytest.fixture(scope="module")
def hopper_report() -> dict:
    proc = _run("compile", "--arch", "sm_90", "--presets", "tiny", "--dtype", "bfloat16,float32",
                "--batch", "8", "--length", "32", "--json")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_every_kernel_compiles_for_hopper_without_problems(hopper_report):
    assert hopper_report["arch"] == "sm_90" and hopper_report["problems"] == []
    kernels = {(b["kernel"], run["dtype"]) for run in hopper_report["runs"] for b in run["binaries"]}
    for dtype in ("bfloat16", "float32"):
        for name in ("_matmul_kernel", "_attention_kernel", "_rms_norm_kernel", "_silu_mul_kernel",
                     "_row_lse_kernel"):
            assert (name, dtype) in kernels
    compiled = {b["kernel"] for run in hopper_report["runs"] for b in run["binaries"]}
    assert {"_gumbel_argmax_kernel", "_split_partial_kernel", "_combine_kernel"} <= compiled
    for run in hopper_report["runs"]:
        for b in run["binaries"]:
            assert b["stack_bytes"] == 0 and 0 < b["registers"] <= 255
            assert b["shared_bytes"] <= hopper_report["shared_limit"]


def test_matrix_products_use_the_intended_instructions(hopper_report):
    """bf16 GEMM and attention on Hopper's warpgroup tensor cores (HGMMA); float32 in plain FMA
    (IEEE float32 like the standard backend's cuBLAS without TF32: TF32 would change the math)."""
    for run in hopper_report["runs"]:
        for b in run["binaries"]:
            if b["kernel"] in ("_matmul_kernel", "_attention_kernel"):
                want = "HGMMA" if run["dtype"] == "bfloat16" else "none"
                assert b["tensor_cores"] == want, (run["dtype"], b)


def test_one_binary_serves_every_batch_size(hopper_report):
    """The learner at batch 2 compiles the kernels; batch 3, the engine's decode steps and batch 8
    compile nothing new: one binary per kernel and layout, whatever the batch (the batch-dependent
    arguments are not specialised), so the learner and the engine run the same machine code."""
    for run in hopper_report["runs"]:
        compiled = run["compiled_by_phase"]
        assert compiled["learner batch 2"] > 0
        assert compiled["learner batch 3"] == compiled["decode batch 1"] == 0
        assert compiled["prefill batch 8"] == compiled["decode batch 8"] == 0
        assert run["one_binary_per_kernel"]
        assert run["decode"]["1"]["launches"] == run["decode"]["8"]["launches"] > 0


def test_decode_steps_never_wait_for_the_gpu(hopper_report):
    """No host sync in the model forward of a decode step, on either backend (the standard one
    grouped sequences by a count read back from the device once per layer, until decode skipped
    it): a sync stalls the host until the GPU drains, on every layer, and blocks CUDA graphs."""
    for run in hopper_report["runs"]:
        step = run["decode"]["8"]
        assert step["syncs"] == 0 and step["torch_kernels"] > 0
        assert 1 <= step["gemm_programs"][0] <= step["gemm_programs"][1]
        assert step["standard"]["syncs"] == 0 and step["standard"]["torch_kernels"] > 0


def test_control_specialising_on_the_row_count_is_caught():
    """The same RMSNorm kernel without `do_not_specialize`: one row and eight rows compile two
    binaries (Triton makes R == 1 a constant), which the phase count would flag."""
    code = textwrap.dedent("""
        import torch
        from parity.ops import triton_target
        drv = triton_target.enable("sm_90")
        import triton
        from parity.ops import triton_kernels as tk
        w = torch.ones(64, dtype=torch.bfloat16)
        for rows in (1, 8):
            tk.rms_norm(torch.zeros(rows, 64, dtype=torch.bfloat16), w, 1e-6)
        kept = len(drv.binaries)
        tk._rms_norm_kernel = triton.jit(tk._rms_norm_kernel.fn)
        for rows in (1, 8):
            tk.rms_norm(torch.zeros(rows, 64, dtype=torch.bfloat16), w, 1e-6)
        print(kept, len(drv.binaries) - kept)
    """)
    proc = _run(code=code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-2:] == ["1", "2"]


@pytest.mark.parametrize("guard", [True, False])
def test_rows_off_16_byte_alignment_share_the_binary(guard):
    """Log-sum-exp over rows that start mid-buffer (a slice of a 1001-column float32 logits
    tensor: 4,004 bytes a row) reuses the aligned rows' binary, because such rows are copied first;
    without that copy (the control) Triton compiles a second, unaligned binary."""
    code = textwrap.dedent(f"""
        import torch
        from parity.ops import triton_target
        drv = triton_target.enable("sm_90")
        from parity.ops import triton_kernels as tk
        if not {guard}:
            tk._aligned = lambda t: t
        logits = torch.zeros(6, 1001)
        tk.row_lse(logits, 1.0)
        tk.row_lse(logits[1:], 1.0)
        print(len(drv.binaries))
    """)
    proc = _run(code=code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == ("1" if guard else "2")


def test_control_a_spilling_tile_is_reported():
    """Attention at head size 128 in 64 rows on 4 warps (the tiles before `parity compile`
    existed) spills registers on sm_90; the detector names it."""
    code = textwrap.dedent("""
        import torch
        from parity.ops import triton_target
        drv = triton_target.enable("sm_90")
        from parity.ops import triton_kernels as tk
        from parity.apps.compile import problems
        from parity.ops import triton_attention as ta
        ta._attention_tiles = lambda d, dtype: (64, 4, 2)
        q = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)
        kv = torch.zeros(1, 32, 1, 128, dtype=torch.bfloat16)
        ta.attention(q, kv, kv, torch.arange(8).view(1, 8), 32)
        print(problems(drv.binaries))
    """)
    proc = _run(code=code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "register spills" in proc.stdout and "_attention_kernel" in proc.stdout


def test_a_cubins_reading_is_kept_and_read_back(tmp_path, monkeypatch):
    """cuobjdump's half second a binary is paid once per cubin: the answer is kept in parity's cache
    under the cubin's hash; another cubin, or a kept file that cannot be read, is read again."""
    from parity.ops import triton_target

    monkeypatch.setenv("PARITY_CACHE", str(tmp_path))
    answer, reads = (40, 0, {"HGMMA.64x64x16": 2}, "TMA"), []
    monkeypatch.setattr(triton_target, "_read_cubin", lambda cubin: reads.append(cubin) or answer)
    for _ in range(2):
        assert triton_target._inspect(b"cubin a") == answer
    assert reads == [b"cubin a"]
    assert triton_target._inspect(b"cubin b") == answer and reads == [b"cubin a", b"cubin b"]
    kept = sorted((tmp_path / "cubins").iterdir())
    assert len(kept) == 2
    for path in kept:
        path.write_text("{half written")
    assert triton_target._inspect(b"cubin a") == answer
    assert reads == [b"cubin a", b"cubin b", b"cubin a"]  # the control: an unreadable entry is read again


def test_control_a_kernel_over_the_shared_memory_limit_is_refused():
    """A GEMM tile whose pipeline needs more shared memory than an sm_86 block may take fails to
    load as it would on that GPU; the default tiles fit."""
    code = textwrap.dedent("""
        import torch
        from parity.ops import triton_target
        drv = triton_target.enable("sm_86")
        from triton.runtime.errors import OutOfResources
        from parity.ops import triton_gemm as tk
        x, w = torch.zeros(4, 256, dtype=torch.bfloat16), torch.zeros(256, 256, dtype=torch.bfloat16)
        tk.matmul(x, w)
        tk.gemm_tiles = lambda *shape: (128, 256, 64, 8, 4)
        try:
            tk.matmul(x, w)
            print("fitted")
        except OutOfResources as err:
            print("refused", drv.binaries[0].shared_bytes <= drv.max_shared)
    """)
    proc = _run(code=code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-2:] == ["refused", "True"]


@pytest.fixture(scope="module")
def ampere() -> dict:
    """One compile-only process for sm_80: `parity compile`, then a +tma tile asked for by name and
    one in `GEMM_TILES`."""
    code = textwrap.dedent("""
        import contextlib, io, json
        import torch
        from parity.cli import main
        from parity.errors import ConfigError
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = main(["compile", "--arch", "sm_80", "--presets", "tiny", "--dtype", "bfloat16",
                       "--batch", "2", "--length", "16", "--json"])
        from parity.ops import triton_gemm as tg
        x, w = torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(64, 64, dtype=torch.bfloat16)
        try:
            tg.matmul(x, w, tiles=(64, 64, 64, 4, 3, "tma"))
            refused = None
        except ConfigError as err:
            refused = str(err)
        tg.GEMM_TILES[("bfloat16", 64, 64)] = ((None, (64, 64, 64, 4, 3, "tma")),)
        print(json.dumps({"rc": rc, "report": json.loads(out.getvalue()), "refused": refused,
                          "table": list(tg.gemm_tiles(torch.bfloat16, 64, 64, 4, x.device))}))
    """)
    proc = _run(code=code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_ampere_gets_warp_level_tensor_cores(ampere):
    assert ampere["rc"] == 0, ampere["report"]["problems"]
    gemm = [b for b in ampere["report"]["runs"][0]["binaries"] if b["kernel"] == "_matmul_kernel"]
    assert gemm and all(b["tensor_cores"] == "HMMA" for b in gemm)


def test_tma_tiles_are_refused_in_one_line_before_hopper(ampere):
    """A +tma tile asked for by name on sm_80 is a one-line error; one in `GEMM_TILES` (measured
    on another GPU kind) gives way to the default tile there."""
    assert ampere["refused"] == ("GEMM tiles marked +tma need the Tensor Memory Accelerator (sm_90 or "
                                 "later); this GPU is sm_80")
    assert ampere["table"] == [64, 128, 64, 4, 3]  # a table's TMA tile: the default here


@pytest.mark.parametrize("arch", ["sm_42", "hopper"])
def test_unknown_architecture_is_one_line(arch):
    proc = _run("compile", "--arch", arch)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "unknown GPU architecture" in proc.stderr


def test_an_interpreting_triton_is_refused_in_one_line():
    code = textwrap.dedent("""
        import os
        os.environ["TRITON_INTERPRET"] = "1"
        import triton
        from parity.errors import ConfigError
        from parity.ops import triton_target
        try:
            triton_target.enable("sm_90")
        except ConfigError as err:
            print("refused:", err)
    """)
    proc = _run(code=code)
    assert proc.returncode == 0 and "refused: Triton was imported with its interpreter on" in proc.stdout


@pytest.fixture(scope="module")
def gemm_runs(tmp_path_factory) -> dict:
    """One compile-only process: `parity compile` with a GEMM ladder (then `_rung` on copies of its
    binaries), then with `--gemm-candidates` (good tiles and bad)."""
    small, large = [64, 32, 64, 4, 4], [128, 128, 64, 8, 4, "tma"]
    ladders = [["bfloat16", n, k, [[4, small], [None, large]]] for n, k in ((64, 64), (256, 64), (64, 128))]
    ladders.append(["bfloat16", 128, 64, [[None, large]]])  # q/k/v and the LM head (tiny's shapes)
    path = tmp_path_factory.mktemp("tiles") / "tiles.json"
    path.write_text(json.dumps({"gemm_tiles": ladders}))
    code = textwrap.dedent(f"""
        import contextlib, io, json
        from dataclasses import replace
        from parity.cli import main
        from parity.ops import triton_target

        def compile_(*args):
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = main(["compile", "--arch", "sm_90", "--presets", "tiny", "--dtype", "bfloat16", *args])
            return {{"rc": rc, "report": json.loads(out.getvalue() or "null"), "stderr": err.getvalue()}}

        ladder = compile_("--batch", "8", "--length", "32", "--json", "--gemm-tiles", {str(path)!r})
        from parity.apps.compile import _rung
        binaries = triton_target.active().binaries
        ptr = next(b for b in binaries if b.kernel == "_matmul_kernel")
        before = [b for b in binaries[:binaries.index(ptr)] if "matmul" in b.kernel]
        tma = before[0]
        other = replace(ptr, constants={{**ptr.constants, "BLOCK_N": 128}})  # another pointer tile
        unspec = replace(ptr, specialised=ptr.specialised.replace("sxm%16,", ""))
        ladder["rungs"] = [
            _rung(ptr, before),  # the pointer rung, compiled first in decode, the TMA one's twin
            _rung(ptr, [tma, other]),  # the pointer kernel's own arguments as in its other tile
            _rung(ptr, [tma, ptr]),  # the same tile again
            _rung(replace(tma, specialised=tma.specialised + ",PROGRAMS%16"), [ptr]),  # program count
            _rung(ptr, [replace(tma, constants={{**tma.constants, "HAS_BIAS": True}})]),  # a bias
            _rung(unspec, [tma, other]),  # x's row stride specialised otherwise than the other tile
            _rung(ptr, []),  # no twin: nothing to be the rung of
            _rung(replace(ptr, kernel="_rms_norm_kernel"), before)]
        from parity.ops import triton_gemm as tg
        tg.GEMM_TILES[("bfloat16", 512, 64)] = ((4, {tuple(large)}), (None, (128, 256, 64, 8, 4, "tma")))
        wide = replace(tma, constants={{**tma.constants, "BLOCK_N": 256}},  # W's descriptor block too
                       signature=tma.signature.replace("[128x64]>,*", "[256x64]>,*", 1))
        biased = replace(ptr, constants={{**ptr.constants, "HAS_BIAS": True}})
        tma_biased = replace(tma, constants={{**tma.constants, "HAS_BIAS": True}})
        one_row = replace(ptr, constants={{**ptr.constants, "sxm": 1}},
                          signature=ptr.signature.rsplit(",", 1)[0],
                          specialised=ptr.specialised.replace("sxm%16,", ""))
        ladder["rungs"] += [
            _rung(wide, [tma]),  # a ladder of two TMA tiles: by design
            _rung(biased, [tma_biased, ptr]),  # the rung tile again for a layer with a bias
            _rung(one_row, [tma]),  # the pointer kernel's first binary with x's row stride a constant 1
            _rung(replace(ptr, specialised=ptr.specialised.replace("x_ptr%16,", "")), [tma])]  # x unaligned
        ladder["before"] = [b.kernel for b in before]
        tiles = "64x16x64x4x6,128x256x64x8x4+tma"
        print(json.dumps({{"ladder": ladder, "candidates": compile_("--json", "--gemm-candidates", tiles),
                          "bad": compile_("--gemm-candidates", "64x100x64x4x3")}}))
    """)
    proc = _run(code=code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_a_ladders_tiles_compile_without_counting_as_specialisation(gemm_runs):
    """A `GEMM_TILES` ladder (`--gemm-tiles`, as `bench gemm` writes it) gives decode another GEMM
    tile than prefill and the learner: here the pointer kernel up to 4 rows, the persistent TMA
    kernel above (the LM head's shape: TMA only), so decode at batch 1 compiles the pointer
    kernel's first binary. That binary is by design, not a batch-dependent argument specialised:
    the phase count lets it pass, and both kernels are compiled and checked (TMA: descriptors,
    HGMMA, no spills). The controls, on copies of the real binaries: the same tile again, a TMA
    binary with its program count specialised, a bias the twin lacks, one of x's strides
    specialised otherwise than in an earlier binary of the same kernel, no twin at all, and, for
    the pointer kernel's first binary, x's row stride made a constant or x unaligned. By design
    too: a ladder of two TMA tiles (their descriptors' blocks differ), and a rung tile compiled
    again for a layer with a bias."""
    result = gemm_runs["ladder"]
    report = result["report"]
    run = report["runs"][0]
    assert result["rc"] == 0 and report["problems"] == [] and run["one_binary_per_kernel"], report["problems"]
    assert run["compiled_by_phase"]["decode batch 1"] == 0 and result["before"] == ["_matmul_tma_kernel"]
    assert result["rungs"] == [True, True, False, False, False, False, False, False, True, True, False, False]
    gemms = {(b["kernel"], b["constants"]["BLOCK_N"]): b for b in run["binaries"] if "matmul" in b["kernel"]}
    assert set(gemms) == {("_matmul_kernel", 32), ("_matmul_tma_kernel", 128)}
    tma = gemms[("_matmul_tma_kernel", 128)]
    assert tma["signature"].startswith("tensordesc<bf16[128x64]>,tensordesc<bf16[128x64]>,*bf16")
    assert tma["tensor_cores"] == "HGMMA" and tma["stack_bytes"] == 0 and tma["loads"] == "TMA"
    assert gemms[("_matmul_kernel", 32)]["loads"] == "cp.async"


def test_bench_gemms_candidates_compile_and_a_refused_one_is_named(gemm_runs):
    """`parity compile --gemm-candidates` compiles `bench gemm`'s tiles at a preset's weight shapes
    with both outputs its checks use (`gpu_check.sh` warms Triton's cache with it), one binary per
    tile and output whatever the shape, and names a tile the GPU would refuse: the control,
    128x256 at 4 stages with a float32 output (256 KiB of shared memory, over sm_90's 227). A
    malformed tile is a one-line error."""
    result = gemm_runs["candidates"]
    report = result["report"]
    run = report["runs"][0]
    assert result["rc"] == 1 and run["candidates"] == ["64x16x64x4x6", "128x256x64x8x4+tma"]
    built = sorted((b["kernel"], b["constants"]["BLOCK_N"], b["signature"].split(",")[3])
                   for b in run["binaries"])
    assert built == [("_matmul_kernel", 16, "*bf16"), ("_matmul_kernel", 16, "*fp32"),
                     ("_matmul_tma_kernel", 256, "*bf16")]
    assert len(report["problems"]) == 1
    assert report["problems"][0].startswith("tiny torch.bfloat16: 128x256x64x8x4+tma (float32 out): "
                                            "OutOfResources: out of resource: shared memory")
    bad = gemm_runs["bad"]
    assert bad["rc"] == 2 and bad["stderr"].strip().splitlines() == [
        "parity: error: --gemm-candidates: '64x100x64x4x3' is not BLOCK_MxBLOCK_NxBLOCK_Kxwarpsxstages with "
        "power-of-two blocks, optionally +tma (e.g. 64x128x64x4x3)"]
