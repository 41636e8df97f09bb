"""Aligned attention in Triton: one reduction order over keys, whatever the queries or sequences.

A query's keys are read page by page (the KV cache's block size) in fixed *splits* of
`KV_SPLIT_PAGES` pages counted from key 0. Within a split an online softmax runs over its pages in
order from an empty state; the splits' states (max, sum, weighted values) are then merged in split
order 0, 1, 2, ... into the query's result. Which splits and pages a query reduces depends on its
position alone, so prefill, chunked prefill and decode, dense keys (the learner) and paged ones
(the engine) give the same bits. Two schedules run that one order:

- the *walk* (`_attention_kernel`): one program per (sequence, KV head, tile of query rows) runs
  the splits one after another and merges each as it ends — prefill, the learner, big batches;
- the *split* schedule: one program per (sequence, KV head, tile, split) writes its split's state
  (`_split_partial_kernel`), and a second kernel merges them in the same order with the same
  arithmetic (`_combine_kernel`) — decode at small batch over long contexts, where one program
  per sequence and head would leave most of a GPU idle.

Both call the same `_split_state` and `_merge`, launched without fused multiply-add contraction
(`triton_kernels.LAUNCH`), so a query gets the same bits from either; which one runs is chosen by
shapes alone (never by values: no host sync, fixed per CUDA graph). Pages, or splits, wholly
beyond a query's position are exact no-ops for it: their state is (max -inf, sum 0, values 0),
and merging it multiplies by exactly 1 and adds exactly 0.

A sliding window (`window` > 0: a query sees its last `window` keys) masks the keys before it the
same way (a compile-time switch, SLIDING: full-attention binaries are unchanged). Splits wholly
before every live row's window are skipped; for a row whose window starts later than its tile's,
the splits before it are empty states, and merging empties into the empty start state keeps it
(-inf, 0, 0) exactly (`_merge` takes exponents against 0 there), so a row's bits depend on its own
position and window alone.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from ..errors import ConfigError
from .common import score_scale
from .triton_kernels import INTERPRET, LAUNCH, _cdiv, _dot, _on, tl, triton

KV_SPLIT_PAGES = 2 if INTERPRET else 8
"""Pages per split of a query's keys (8 x 32 = 256 keys on a GPU; 2 in the interpreter, so the
CI suite's short sequences cross splits). A constant: the learner and the engine share it."""

_COMBINE_ROWS = 64 if INTERPRET else 16
"""Query rows per program of the merge kernel (any tile works: a row merges its own splits, and
the tile's later ones are exact no-ops for it; 16 rows of D = 128 keep two fp32 states in registers)."""

_WORKSPACE_BYTES = 1 << 26
"""The split schedule's partial states may take at most this much memory; beyond, the walk runs."""


@triton.jit
def _tanh(x):
    """tanh(x) = 1 - 2 / (e^2x + 1), by exp2 (libdevice's tanh has no interpreter form): exactly
    +-1 where e^2x overflows or vanishes, within ~2e-7 of tanh elsewhere; x itself below 2^-12
    (where tanh(x) = x to float32's precision, and the formula's cancellation would lose it)."""
    t = 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)
    return tl.where(tl.abs(x) < 0.000244140625, x, t)


@triton.jit
def _split_state(q, k_ptr, v_ptr, tab_ptr, b, h, pos, lo, j0, j1, scale, softcap,
                 skb, skh, skd, skp, svb, svh, svp, svd, stb,
                 D: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr,
                 INTERP: tl.constexpr, IEEE: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr):
    """Online softmax of the query rows over pages j0..j1-1 of sequence b, in order, from an empty
    state: (row max, row sum, weighted values), in log2 units. A row with no visible key yet keeps
    (-inf, 0, 0) exactly (its exponents are taken against 0, not against -inf). Key j is visible
    to a row iff j <= pos, and with a sliding window (SLIDING) lo < j too. Soft-capped scores
    (SOFTCAP) arrive in natural units (`scale` without log2 e), are capped, then turned into log2
    units."""
    d = tl.arange(0, D)
    keys = tl.arange(0, BS)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    for j in range(j0, j1):
        blk = tl.load(tab_ptr + b * stb + j).to(tl.int64)
        kt = tl.load(k_ptr + blk * skb + h * skh + d[:, None] * skd + keys[None, :] * skp)  # [D, BS]
        s = _dot(q, kt, tl.zeros((BLOCK_M, BS), dtype=tl.float32), INTERP, IEEE) * scale
        if SOFTCAP:
            s = _tanh(s / softcap) * softcap * 1.4426950408889634
        key = (j * BS + keys)[None, :]
        if SLIDING:
            s = tl.where((key <= pos[:, None]) & (key > lo[:, None]), s, float("-inf"))
        else:
            s = tl.where(key <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + blk * svb + h * svh + keys[:, None] * svp + d[None, :] * svd)  # [BS, D]
        acc = acc * alpha[:, None]
        if IEEE or INTERP:
            acc = _dot(p, v, acc, INTERP, IEEE)
        else:
            acc = _dot(p.to(v.dtype), v, acc, INTERP, IEEE)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _merge(m_t, l_t, a_t, m_i, l_i, acc, SLIDING: tl.constexpr):
    """The running result (m_t, l_t, a_t) with one more split's state merged in. Under a sliding
    window a row's leading splits are empty, and two empty states (max -inf) merge into an empty
    one exactly: exponents taken against 0 (without a window a row's first split holds key 0)."""
    m_new = tl.maximum(m_t, m_i)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new) if SLIDING else m_new
    old = tl.exp2(m_t - m_use)
    new = tl.exp2(m_i - m_use)
    return m_new, l_t * old + l_i * new, a_t * old[:, None] + acc * new[:, None]


@triton.jit
def _rows(pos_ptr, b, h, tile, M, REP, spb, window, BLOCK_M: tl.constexpr):
    """A tile's query rows (row r: token r // REP, query head h * REP + r % REP), their liveness,
    positions (padding rows attend to key 0: finite, then dropped) and the last key before each
    row's window (-1 without one)."""
    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    live = r < M * REP
    tok = r // REP
    pos = tl.maximum(tl.load(pos_ptr + b * spb + tok, mask=live, other=0), 0)
    lo = tl.where(window > 0, tl.maximum(pos - window, -1), -1)
    return r, live, tok, h * REP + r % REP, pos, lo


@triton.jit
def _first_page(lo, live, n_tab, BS: tl.constexpr):
    """The first page holding a key visible to some live row of the tile (rows past the tile's
    end do not count: every key is before them)."""
    return (tl.min(tl.where(live, lo, n_tab * BS), axis=0) + 1) // BS


@triton.jit(do_not_specialize=["M", "n_tab", "window", "sqb", "sob", "stb", "spb"])
def _attention_kernel(q_ptr, k_ptr, v_ptr, tab_ptr, pos_ptr, out_ptr, M, REP, n_tab, window, scale, softcap,
                      sqb, sqm, sqh, sob, som, soh,
                      skb, skh, skd, skp, svb, svh, svp, svd, stb, spb,
                      D: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT: tl.constexpr,
                      INTERP: tl.constexpr, IEEE: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr):
    """The walk: sequence b, KV head h, BLOCK_M query rows; splits in order, each merged as it ends
    (under a sliding window from the tile's first split with a visible key)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    r, live, tok, head, pos, lo = _rows(pos_ptr, b, h, tl.program_id(2), M, REP, spb, window, BLOCK_M)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * sqb + tok[:, None] * sqm + head[:, None] * sqh + d[None, :],
                mask=live[:, None], other=0.0)
    last = tl.minimum(tl.max(pos, axis=0) // BS + 1, n_tab)
    m_t = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_t = tl.zeros((BLOCK_M,), dtype=tl.float32)
    a_t = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    if SLIDING:
        first = _first_page(lo, live, n_tab, BS) // SPLIT * SPLIT
        for j0 in range(0, last, SPLIT):
            if j0 >= first:  # (a loop from `first` spilled registers on sm_90)
                m_i, l_i, acc = _split_state(q, k_ptr, v_ptr, tab_ptr, b, h, pos, lo, j0,
                                             tl.minimum(j0 + SPLIT, last),
                                             scale, softcap, skb, skh, skd, skp, svb, svh, svp, svd, stb,
                                             D, BS, BLOCK_M, INTERP, IEEE, True, SOFTCAP)
                m_t, l_t, a_t = _merge(m_t, l_t, a_t, m_i, l_i, acc, True)
    else:
        for j0 in range(0, last, SPLIT):
            m_i, l_i, acc = _split_state(q, k_ptr, v_ptr, tab_ptr, b, h, pos, lo, j0,
                                         tl.minimum(j0 + SPLIT, last),
                                         scale, softcap, skb, skh, skd, skp, svb, svh, svp, svd, stb,
                                         D, BS, BLOCK_M, INTERP, IEEE, False, SOFTCAP)
            m_t, l_t, a_t = _merge(m_t, l_t, a_t, m_i, l_i, acc, False)
    tl.store(out_ptr + b * sob + tok[:, None] * som + head[:, None] * soh + d[None, :],
             (a_t / l_t[:, None]).to(out_ptr.dtype.element_ty), mask=live[:, None])


@triton.jit(do_not_specialize=["M", "n_tab", "n_split", "window", "sqb", "stb", "spb"])
def _split_partial_kernel(q_ptr, k_ptr, v_ptr, tab_ptr, pos_ptr, pm_ptr, pl_ptr, pa_ptr,
                          M, REP, n_tab, n_split, window, scale, softcap, sqb, sqm, sqh,
                          skb, skh, skd, skp, svb, svh, svp, svd, stb, spb,
                          D: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT: tl.constexpr,
                          INTERP: tl.constexpr, IEEE: tl.constexpr, SLIDING: tl.constexpr,
                          SOFTCAP: tl.constexpr):
    """One split of one tile: its state written to the partials [B, Hkv, M*REP, n_split](, D)
    (not where it lies wholly before every row's sliding window: no row reads it)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    tile = tl.program_id(2) // n_split
    sp = tl.program_id(2) % n_split
    r, live, tok, head, pos, lo = _rows(pos_ptr, b, h, tile, M, REP, spb, window, BLOCK_M)
    last = tl.minimum(tl.max(pos, axis=0) // BS + 1, n_tab)
    j0 = sp * SPLIT
    first = _first_page(lo, live, n_tab, BS) if SLIDING else 0
    if (j0 < last) & (j0 + SPLIT > first):
        d = tl.arange(0, D)
        q = tl.load(q_ptr + b * sqb + tok[:, None] * sqm + head[:, None] * sqh + d[None, :],
                    mask=live[:, None], other=0.0)
        m_i, l_i, acc = _split_state(q, k_ptr, v_ptr, tab_ptr, b, h, pos, lo, j0,
                                     tl.minimum(j0 + SPLIT, last),
                                     scale, softcap, skb, skh, skd, skp, svb, svh, svp, svd, stb,
                                     D, BS, BLOCK_M, INTERP, IEEE, SLIDING, SOFTCAP)
        at = ((b * tl.num_programs(1) + h) * M * REP + r) * n_split + sp
        tl.store(pm_ptr + at, m_i, mask=live)
        tl.store(pl_ptr + at, l_i, mask=live)
        tl.store(pa_ptr + at[:, None] * D + d[None, :], acc, mask=live[:, None])


@triton.jit(do_not_specialize=["M", "n_tab", "n_split", "window", "sob", "spb"])
def _combine_kernel(pm_ptr, pl_ptr, pa_ptr, pos_ptr, out_ptr, M, REP, n_tab, n_split, window,
                    sob, som, soh, spb,
                    D: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT: tl.constexpr,
                    SLIDING: tl.constexpr):
    """The splits' states of a tile merged in split order, as the walk merges them. A row reads
    its own splits; the others count as empty (-inf, 0, 0), which the walk computes for it."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    r, live, tok, head, pos, lo = _rows(pos_ptr, b, h, tl.program_id(2), M, REP, spb, window, BLOCK_M)
    d = tl.arange(0, D)
    last = tl.minimum(tl.max(pos, axis=0) // BS + 1, n_tab)
    mine = pos // BS // SPLIT
    own = (lo + 1) // BS // SPLIT if SLIDING else mine * 0  # a row's first split
    first = _first_page(lo, live, n_tab, BS) // SPLIT if SLIDING else 0
    m_t = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_t = tl.zeros((BLOCK_M,), dtype=tl.float32)
    a_t = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    for sp in range(first, tl.cdiv(last, SPLIT)):
        ok = live & (sp <= mine) & (sp >= own)
        at = ((b * tl.num_programs(1) + h) * M * REP + r) * n_split + sp
        # rows past the tile's end (never stored) are kept finite: max 0, sum 1
        m_i = tl.where(live, tl.load(pm_ptr + at, mask=ok, other=float("-inf")), 0.0)
        l_i = tl.where(live, tl.load(pl_ptr + at, mask=ok, other=0.0), 1.0)
        acc = tl.load(pa_ptr + at[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        m_t, l_t, a_t = _merge(m_t, l_t, a_t, m_i, l_i, acc, SLIDING)
    tl.store(out_ptr + b * sob + tok[:, None] * som + head[:, None] * soh + d[None, :],
             (a_t / l_t[:, None]).to(out_ptr.dtype.element_ty), mask=live[:, None])


@contextlib.contextmanager
def forced(schedule: str):
    """Every attention call in the block on `schedule` ('walk' or 'split'), whatever the shapes:
    the same bits (tests; `parity compile` builds both schedules' binaries)."""
    global _schedule
    chosen, _schedule = _schedule, lambda *args: schedule
    try:
        yield
    finally:
        _schedule = chosen


def _attention_tiles(d: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M query rows, num_warps, num_stages) of the walk's and the split kernel's programs
    (the same for both: one instruction sequence per row): a function of the head size and dtype
    only, never of the query or sequence count. Chosen so that no binary, paged (engine) or dense
    (learner), spills registers on sm_90 (`parity compile`, Triton 3.9); the walk holds two
    [BLOCK_M, D] float32 states (the running result and the current split's). 16-bit heads up to
    64 in 64 rows on 8 warps (Hopper's warpgroup MMA); at 128, 64 rows spilled 48-80 bytes a
    thread on 8 warps (752 on 4, 248 on 16), so 32 rows on 8 warps (warp-level MMA, 128
    registers). Float32 (FMA): 32 rows on 4 warps up to D = 32, on 8 warps up to 128, then 16
    rows, all with one stage (two spilled 8-32 bytes; at D = 16 since the sliding window's
    bookkeeping joined the walk, 2026-12-06)."""
    if INTERPRET:
        return 64, 4, 1
    if dtype != torch.float32:
        return (64, 8, 2) if d <= 64 else (32, 8, 2) if d <= 128 else (16, 8, 2)
    return (32, 4, 2) if d <= 32 else (32, 8, 1) if d <= 128 else (16, 8, 1)


@functools.cache
def _busy_programs(device: torch.device) -> int:
    """How many programs keep a GPU busy: twice its SM count (264 where it is not known)."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 264


def _schedule(bsz: int, hkv: int, rows: int, bm: int, n_tab: int, d: int, device) -> str:
    """'split' when the walk would run too few programs for the GPU and splitting helps (more than
    one split) within the workspace budget; else 'walk'. Shapes only: the bits are the same."""
    n_split = _cdiv(n_tab, KV_SPLIT_PAGES)
    if n_split < 2 or bsz * hkv * _cdiv(rows, bm) >= _busy_programs(device):
        return "walk"
    return "split" if bsz * hkv * rows * n_split * (d + 2) * 4 <= _WORKSPACE_BYTES else "walk"


def _launch(q, k_blocks, v_blocks, k_strides, v_strides, tables, q_pos, block_size, schedule="auto",
            window=0, softcap=0.0, scale=None):
    bsz, m, hq, d = q.shape
    if d < 16 or d & (d - 1):  # (tl.arange needs a power of two, a tensor-core tl.dot at least 16)
        raise ConfigError(f"the aligned CUDA attention takes head sizes that are powers of two from 16 up, "
                          f"not {d}: run this model with kernels 'standard' on CUDA, or on the CPU")
    hkv = k_strides[4]
    rep = hq // hkv
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if bsz == 0 or m == 0:
        return out
    q_pos = q_pos.to(torch.int32).contiguous()
    tables = tables.to(torch.int32).contiguous()
    n_tab = tables.shape[1]
    bm, warps, stages = _attention_tiles(d, q.dtype)
    tiles = _cdiv(m * rep, bm)
    if schedule == "auto":
        schedule = _schedule(bsz, hkv, m * rep, bm, n_tab, d, q.device)
    log2e = 1.4426950408889634  # scores in log2 units (soft-capped ones: after the cap)
    scale = score_scale(d, scale) if softcap else log2e / d ** 0.5 if scale is None else log2e * scale
    common = dict(D=d, BS=block_size, BLOCK_M=bm, SPLIT=KV_SPLIT_PAGES, SLIDING=window > 0,
                  SOFTCAP=softcap > 0)
    softcap = float(softcap)
    opts = dict(num_warps=warps, num_stages=stages, **LAUNCH)
    with _on(q, k_blocks, v_blocks):
        if schedule == "walk":
            _attention_kernel[(bsz, hkv, tiles)](
                q, k_blocks, v_blocks, tables, q_pos, out, m, rep, n_tab, window, scale, softcap,
                q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2),
                *k_strides[:4], *v_strides, tables.stride(0), q_pos.stride(0),
                INTERP=INTERPRET, IEEE=q.dtype == torch.float32, **common, **opts)
            return out
        n_split = _cdiv(n_tab, KV_SPLIT_PAGES)
        pm = torch.empty(bsz, hkv, m * rep, n_split, dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
        pa = torch.empty(bsz, hkv, m * rep, n_split, d, dtype=torch.float32, device=q.device)
        _split_partial_kernel[(bsz, hkv, tiles * n_split)](
            q, k_blocks, v_blocks, tables, q_pos, pm, pl, pa, m, rep, n_tab, n_split, window, scale, softcap,
            q.stride(0), q.stride(1), q.stride(2), *k_strides[:4], *v_strides,
            tables.stride(0), q_pos.stride(0),
            INTERP=INTERPRET, IEEE=q.dtype == torch.float32, **common, **opts)
        _combine_kernel[(bsz, hkv, _cdiv(m * rep, _COMBINE_ROWS))](
            pm, pl, pa, q_pos, out, m, rep, n_tab, n_split, window,
            out.stride(0), out.stride(1), out.stride(2), q_pos.stride(0),
            D=d, BS=block_size, BLOCK_M=_COMBINE_ROWS, SPLIT=KV_SPLIT_PAGES, SLIDING=common["SLIDING"],
            num_warps=4, **LAUNCH)
    return out


def paged_attention(q, k_cache, v_cache, tables, q_pos, window: int = 0, softcap: float = 0.0,
                    scale: float | None = None, *, schedule: str = "auto") -> torch.Tensor:
    """Attention through block tables: q [B, M, Hq, D] (last dim contiguous), key blocks
    [NB, Hkv, D, bs], value blocks [NB, Hkv, bs, D], tables [B, nblk], q_pos [B, M]; a sliding
    `window` > 0 limits each query to its last `window` keys; scores are q.k times `scale` (None:
    1/sqrt(D)), soft-capped when `softcap` > 0.
    `schedule`: 'auto' (by shapes), 'walk' or 'split' (tests): the same bits."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    k_str = (*k_cache.stride(), k_cache.shape[1])  # block, head, d, pos, Hkv
    v_str = v_cache.stride()  # block, head, pos, d
    return _launch(q, k_cache, v_cache, k_str, v_str, tables, q_pos, k_cache.shape[-1], schedule, window,
                   softcap, scale)


def attention(q, k, v, q_pos, block_size: int, window: int = 0, softcap: float = 0.0,
              scale: float | None = None, *, schedule: str = "auto") -> torch.Tensor:
    """Dense attention (the learner's): k, v [B, L, Hkv, D] with L a multiple of `block_size`,
    read as pages of `block_size` keys in order, by the same kernels as `paged_attention`."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    k, v = k.contiguous(), v.contiguous()
    bsz, length, hkv, d = k.shape
    nblk = length // block_size
    tables = torch.arange(bsz * nblk, device=q.device, dtype=torch.int32).view(bsz, nblk)
    # page (b, j) starts at row b * L + j * bs of the [B * L, Hkv, D] key matrix
    k_str = (block_size * hkv * d, d, 1, hkv * d, hkv)
    v_str = (block_size * hkv * d, d, hkv * d, 1)
    return _launch(q, k, v, k_str, v_str, tables, q_pos, block_size, schedule, window, softcap, scale)
