"""Counter-based sampling uniforms (`parity/engine/draws.py`): the same bits on every device.

The uniforms are integer arithmetic, so they are compared with `torch.equal` against a plain
Python SplitMix64 (unsigned 64-bit, masked) and, on a GPU (`PARITY_TEST_DEVICE=cuda`), against
the CPU's. The control: the same hash with torch's arithmetic right shift (what `>>` on int64
does) differs from the reference, so the comparison can fail.
"""

from __future__ import annotations

import pytest
import torch

from parity.engine import draws
from tests.conftest import DEVICE

MASK = (1 << 64) - 1


def _mix_ref(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def _uniform_ref(seed: int, counter: int, j: int, vocab: int) -> float:
    base = _mix_ref(seed % (1 << 64))
    z = _mix_ref((base + (counter * vocab + j + 1) * 0x9E3779B97F4A7C15) & MASK)
    return ((z >> 11) + 0.5) * 2.0 ** -53


SEEDS = [0, 1, 12345, -7, 2**63 - 1, 2**64 + 5, 999_999_937 * 1_000_003 + 17]


def _draw(seeds, counters, vocab, device=DEVICE) -> torch.Tensor:
    keys = torch.tensor([draws.request_key(s) for s in seeds], dtype=torch.long, device=device)
    return draws.uniforms(keys, torch.tensor(counters, dtype=torch.long, device=device), vocab)


def test_uniforms_are_splitmix64_bit_for_bit():
    vocab = 37
    counters = [0, 1, 5, 0, 3, 1_000_000, 2]
    got = _draw(SEEDS, counters, vocab).cpu()
    want = torch.tensor([[_uniform_ref(s, c, j, vocab) for j in range(vocab)]
                         for s, c in zip(SEEDS, counters)], dtype=torch.float64)
    assert torch.equal(got, want)
    assert float(got.min()) > 0 and float(got.max()) < 1


def test_control_an_arithmetic_shift_breaks_the_match(monkeypatch):
    monkeypatch.setattr(draws, "_shr", lambda z, k: z >> k)
    got = _draw(SEEDS, [0] * len(SEEDS), 37).cpu()
    want = torch.tensor([[_uniform_ref(s, 0, j, 37) for j in range(37)] for s in SEEDS], dtype=torch.float64)
    assert not torch.equal(got, want)


def test_the_same_bits_on_this_device_as_on_the_cpu_in_any_chunking(monkeypatch):
    seeds, counters, vocab = list(range(40)), [c * 3 for c in range(40)], 5003
    here = _draw(seeds, counters, vocab)
    assert torch.equal(here.cpu(), _draw(seeds, counters, vocab, "cpu"))
    monkeypatch.setattr(draws, "CHUNK", 3 * vocab + 1)  # 3 rows at a time
    assert torch.equal(_draw(seeds, counters, vocab), here)
    # a row depends on its request and draw index alone, not on the other rows
    assert torch.equal(_draw(seeds[7:8], counters[7:8], vocab), here[7:8])


@pytest.mark.parametrize("vocab", [2, 10])
def test_uniforms_are_uniform(vocab):
    u = _draw(list(range(2000)), [0] * 2000, vocab).cpu().flatten()
    hist = torch.histc(u.float(), bins=10, min=0, max=1)
    expected = u.numel() / 10
    chi2 = float(((hist - expected) ** 2 / expected).sum())
    assert chi2 < 27.9  # 9 degrees of freedom, p = 0.001


def _draws_triton():
    """The fused Triton draw (`engine/draws_triton.py`): the GPU's sampler, the interpreter here."""
    from parity.errors import ConfigError
    try:
        from parity.engine import draws_triton
    except (ImportError, ConfigError) as err:
        pytest.skip(f"Triton: {err}")
    return draws_triton


def _torch_gumbel_argmax(logp, keys, counts):
    u = draws.uniforms(keys, counts, logp.shape[1])
    return torch.argmax(logp.double() - torch.log(-torch.log(u)), -1)


@pytest.mark.parametrize("vocab", [5, 1000, 2500, 4096])
def test_the_fused_draw_picks_the_pytorch_paths_token(vocab):
    """One Triton pass (hash, Gumbel noise, first maximum, per vocabulary chunk, chunks combined
    in order) gives the token of the PyTorch ops it replaces on a GPU, including rows with -inf
    entries and a row of nothing but -inf (index 0, as `torch.argmax`); a row's token does not
    depend on the other rows. The control: the next draw number picks other tokens."""
    fused = _draws_triton()
    gen = torch.Generator().manual_seed(vocab)
    n = len(SEEDS)
    logp = torch.log_softmax(3 * torch.randn(n, vocab, generator=gen), -1)
    logp[1, : vocab // 2] = float("-inf")
    logp[2] = float("-inf")
    logp, keys = logp.to(DEVICE), torch.tensor([draws.request_key(s) for s in SEEDS], device=DEVICE)
    counts = torch.tensor([0, 1, 5, 2**40, 3, 7, 1_000_000], device=DEVICE)
    got = fused.gumbel_argmax(logp, keys, counts)
    assert torch.equal(got, _torch_gumbel_argmax(logp, keys, counts)) and int(got[2]) == 0
    assert torch.equal(fused.gumbel_argmax(logp[3:5], keys[3:5], counts[3:5]), got[3:5])
    if vocab > 5:
        assert not torch.equal(fused.gumbel_argmax(logp, keys, counts + 1), got)


def test_the_sampler_with_the_fused_draw_gives_the_same_tokens(monkeypatch):
    """The sampler's fused path (a GPU's; forced on CPU tensors here) returns the tokens, log-probs
    and draw counts of its PyTorch counter path, for greedy, plain and truncated (top-k: still the
    PyTorch path) rows at two temperatures in one batch."""
    _draws_triton()
    import parity
    from parity.engine.sampler import Sampler
    from parity.engine.sequence import SamplingParams, Sequence

    class _Model:
        kernels = parity.get_kernels("aligned", torch.device(DEVICE))

    mixed = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=3),
             SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=4, seed=8)]
    plain = [SamplingParams(temperature=0.9, seed=5), SamplingParams(temperature=0.9)]
    logits = torch.randn(12, 3000, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    for kinds, draws_made in ((mixed, [0, 3, 3, 3] * 3), (plain, [3, 3] * 6)):
        runs = {}
        for fused in (False, True):
            monkeypatch.setattr(Sampler, "_fused_draws", lambda self, logp, on=fused: on)
            sampler = Sampler(_Model(), seed=4, draws="counter")
            seqs = [Sequence(i, [0], kinds[i % len(kinds)], prompt_len=1) for i in range(12)]
            runs[fused] = [sampler.sample(seqs, logits) for _ in range(3)], [s.draws for s in seqs]
        assert runs[True] == runs[False]
        assert runs[True][1] == draws_made


def test_the_python_int_mix_is_the_tensor_mix():
    """`draws.mix_int` (the sampler's unseeded-request seeds) is `draws.mix` bit for bit."""
    for seed in SEEDS:
        key = draws.request_key(seed)
        assert draws.mix_int(seed) == int(draws.mix(torch.tensor([key]))[0]) % (1 << 64), seed
