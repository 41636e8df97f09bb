"""Invariance checks: the same weights and tokens must give the same log-prob bits, however run.

Each case compares a reference (the sequence scored alone by `sequence_logprobs`, no grad) with
the same sequence's log-probs computed another way: inside random batches, behind padding, at
another offset, by prefill + decode steps or random prefill chunks over the engine's paged KV
cache (`Decoder`), by decode steps padded to a graph's batch bucket (`graphs`), by the rollout
engine itself (continuous batching, chunked prefill, sampling; and requests sharing cached
prompt blocks: `prefix`),
under autograd, on another thread count, or in a separate process. A comparison is one
sequence's whole float32 log-prob vector under `torch.equal`. `parity check` and `tests/parity/`
both run these functions; with `standard` kernels some of them must fail (the control).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .engine import Decoder, Engine, SamplingParams
from .errors import ParityError
from .model import sequence_logprobs

Pairs = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class CaseResult:
    case: str
    kernels: str
    comparisons: int
    mismatches: int
    max_abs_diff: float
    error: str = ""
    """Why the case stopped (a ParityError's message: a decode graph that failed to capture, an
    engine request that failed); empty when every round ran. Its comparisons up to then count."""

    def as_dict(self) -> dict:
        return asdict(self)


def compare(pairs: Pairs) -> tuple[int, int, float]:
    """(comparisons, mismatches, max |Δ|) over (reference, candidate) pairs."""
    mismatches, worst = 0, 0.0
    for ref, got in pairs:
        ref, got = ref.cpu(), got.cpu()  # the engine reports Python floats, the model's device may be a GPU
        if not torch.equal(ref, got):
            mismatches += 1
            worst = max(worst, float((ref - got).abs().max()) if ref.shape == got.shape else float("inf"))
    return len(pairs), mismatches, worst


def reference(model, seqs: Sequence[torch.Tensor], temperature: float = 1.0) -> list[torch.Tensor]:
    """Each sequence scored alone (the reference every case compares against)."""
    with torch.no_grad():
        return [sequence_logprobs(model, [s], temperature)[0] for s in seqs]


# ----------------------------------------------------------------------------- cases
def case_batch(model, seqs, refs, order: Sequence[int], temperature: float = 1.0) -> Pairs:
    """Score the sequences together, in `order` (batch composition and position)."""
    with torch.no_grad():
        out = sequence_logprobs(model, [seqs[i] for i in order], temperature)
    return [(refs[i], out[j]) for j, i in enumerate(order)]


def case_padding(model, seqs, refs, filler: Sequence[torch.Tensor], temperature=1.0) -> Pairs:
    """Score each sequence next to fillers of other lengths (changes padded M and key length)."""
    pairs = []
    with torch.no_grad():
        for s, r in zip(seqs, refs):
            out = sequence_logprobs(model, [s, *filler], temperature)
            pairs.append((r, out[0]))
    return pairs


def case_offset(model, seqs, refs, shift: int, temperature=1.0) -> Pairs:
    """Place each sequence after `shift` copies of a 3-token filler (another row offset)."""
    filler = [torch.arange(3) % model.config.vocab_size] * shift
    pairs = []
    with torch.no_grad():
        for s, r in zip(seqs, refs):
            out = sequence_logprobs(model, [*filler, s], temperature)
            pairs.append((r, out[-1]))
    return pairs


def schedule_decoder(model, seqs, graphs: str = "auto") -> Decoder:
    """A `Decoder` with room for all of `seqs` (`graphs`: its decode-graph mode)."""
    return Decoder(model, max_tokens=sum(s.numel() for s in seqs) + model.block_size * len(seqs),
                   graphs=graphs)


def run_schedule(model, seqs, chunks: Sequence[Sequence[int]], temperature=1.0,
                 dec: Decoder | None = None) -> list[torch.Tensor]:
    """Run all sequences through a `Decoder` (`dec`, or a new one), sequence i fed in chunks
    `chunks[i]` (summing to its length), all sequences' next chunks in one forward per step.
    Returns each sequence's log-probs.
    """
    dec = dec or schedule_decoder(model, seqs)
    fed = [0] * len(seqs)
    step = [0] * len(seqs)
    got: list[list[torch.Tensor]] = [[] for _ in seqs]
    while True:
        feed = {i: seqs[i][fed[i]:fed[i] + chunks[i][step[i]]]
                for i in range(len(seqs)) if step[i] < len(chunks[i])}
        if not feed:
            break
        logits = dec.extend(feed, all_logits=True)
        for i, toks in feed.items():
            start, n = fed[i], toks.numel()
            targets = seqs[i][start + 1:start + n + 1].to(logits[i].device)
            rows = logits[i][:targets.numel()]
            if targets.numel():
                got[i].append(model.kernels.token_logprobs(rows, targets, temperature))
            fed[i] += n
            step[i] += 1
    return [torch.cat(g) for g in got]


def case_decode(model, seqs, refs, chunks, temperature=1.0) -> Pairs:
    """Prefill / chunked prefill / token-by-token decode over the paged KV cache."""
    return list(zip(refs, run_schedule(model, seqs, chunks, temperature)))


def case_graphs(model, seqs, refs, rng: random.Random, temperature=1.0) -> Pairs:
    """A prefill of random length per sequence, then decode steps of every sequence at once, as
    the engine replays them from graphs (CUDA graphs on a GPU; on a CPU their static step run
    eagerly): each step padded up to its batch bucket, sequences dropping out as they end."""
    dec = schedule_decoder(model, seqs, "auto" if model.device.type == "cuda" else "emulate")
    firsts = [rng.randint(1, s.numel()) for s in seqs]
    chunks = [[f] + [1] * (s.numel() - f) for f, s in zip(firsts, seqs)]
    pairs = list(zip(refs, run_schedule(model, seqs, chunks, temperature, dec)))
    graphs = dec.runner.graphs
    if graphs is not None and graphs.failed:  # the steps ran eagerly: say so, do not pass quietly
        raise ParityError(f"check 'graphs': decode graph capture failed: {graphs.failed}")
    return pairs


def case_engine(model, prompts: Sequence[torch.Tensor], rng: random.Random, temperature=1.0,
                case: str = "engine", most_tokens: int = 16) -> Pairs:
    """The rollout engine samples continuations of `prompts` under continuous batching with a
    random token budget (chunked prefill), batch limit and response lengths; each request's
    recorded log-probs against its whole sequence scored alone."""
    fewest = 1 if case == "engine" else 2  # (one at a time, a group's members would share nothing)
    engine = Engine(model, max_num_seqs=rng.randint(fewest, len(prompts)),
                    max_num_batched_tokens=rng.choice([5, 16, 37, 2048]), seed=rng.randrange(2**31))
    room = model.config.max_position_embeddings - max(p.numel() for p in prompts)
    most = max(1, min(most_tokens, room))
    params = [SamplingParams(temperature=temperature, max_tokens=rng.randint(1, most),
                             seed=rng.randrange(2**31), ignore_eos=True) for _ in prompts]
    outs = engine.generate([p.tolist() for p in prompts], params)
    pairs = []
    for prompt, out in zip(prompts, outs):
        if out.error:
            raise ParityError(f"check '{case}': {out.error}")
        full = torch.tensor(out.full_token_ids)
        ref = reference(model, [full], temperature)[0][prompt.numel() - 1:]
        pairs.append((ref, torch.tensor(out.logprobs, dtype=torch.float32)))
    return pairs


def case_prefix(model, prompts: Sequence[torch.Tensor], rng: random.Random, max_len: int,
                temperature=1.0) -> Pairs:
    """The engine's prefix caching: each prompt asked 2-3 times (a GRPO group) and once more
    behind another prompt's full blocks, in a random order, so requests start on blocks other
    requests computed and prefill only the rest; up to 6 tokens each (`case_engine` scores them)."""
    bs, asked = model.block_size, []
    for p in prompts:
        asked += [p] * rng.randint(2, 3)
        other = prompts[rng.randrange(len(prompts))]
        k = min((other.numel() - 1) // bs, (max_len - 17) // bs) * bs  # (its full blocks, room left)
        if k:
            asked.append(torch.cat([other[:k], p[:max_len - 16 - k]]))
    rng.shuffle(asked)
    return case_engine(model, asked, rng, temperature, case="prefix", most_tokens=6)


def case_autograd(model, seqs, refs, temperature=1.0) -> Pairs:
    """The learner's forward with autograd recording (and a backward) vs inference: as it is, and
    with its memory options (the LM head 7 positions at a time, activation checkpointing)."""
    pairs = []
    for options in ({}, {"head_chunk": 7, "recompute": True}):
        with torch.enable_grad():
            out = sequence_logprobs(model, list(seqs), temperature, **options)
            torch.stack([o.sum() for o in out]).sum().backward()
        model.zero_grad(set_to_none=True)
        pairs += [(r, o.detach()) for r, o in zip(refs, out)]
    return pairs


def case_threads(model, seqs, refs, temperature=1.0) -> Pairs:
    """The same batch on 1 thread and on 2 threads, each against the reference (CPU threads:
    nothing to compare for a model on a GPU)."""
    if model.device.type != "cpu":
        return []
    before = torch.get_num_threads()
    pairs: Pairs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            with torch.no_grad():
                out = sequence_logprobs(model, list(seqs), temperature)
            pairs += list(zip(refs, out))
    finally:
        torch.set_num_threads(before)
    return pairs


_CHILD = """
import sys, json, torch, parity
spec = json.load(open(sys.argv[1]))
torch.set_num_threads(spec["threads"])
model = parity.load_model(spec["path"], kernels=spec["kernels"], block_size=spec["block_size"],
                          device=spec["device"])
seqs = [torch.tensor(s) for s in spec["seqs"]]
with torch.no_grad():
    out = parity.sequence_logprobs(model, seqs, spec["temperature"])
torch.save([o.cpu() for o in out], spec["out"])
"""


def case_process(model, seqs, refs, temperature=1.0) -> Pairs:
    """A separate Python process, at another CPU thread count (1 where this one runs more, else 2),
    loads the saved checkpoint and scores the batch."""
    with tempfile.TemporaryDirectory(prefix="parity-check-") as tmp:
        model.save_pretrained(Path(tmp) / "ckpt")
        spec = {"path": str(Path(tmp) / "ckpt"), "kernels": model.kernels.name,
                "block_size": model.block_size, "device": str(model.device),
                "seqs": [s.tolist() for s in seqs], "threads": 1 if torch.get_num_threads() > 1 else 2,
                "temperature": temperature, "out": str(Path(tmp) / "out.pt")}
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(Path(tmp) / "spec.json")],
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise ParityError(f"check 'process': the child process failed: {last}")
        out = torch.load(spec["out"])
    return list(zip(refs, out))


# ----------------------------------------------------------------------------- random runner
def random_sequences(rng: random.Random, vocab: int, n: int, max_len: int) -> list[torch.Tensor]:
    return [torch.tensor([rng.randrange(vocab) for _ in range(rng.randint(2, max_len))])
            for _ in range(n)]


def random_chunks(rng: random.Random, length: int) -> list[int]:
    """A random split of `length` tokens: whole prefill, one by one, or random chunk sizes."""
    mode = rng.choice(["prefill", "decode", "chunked", "chunked"])
    if mode == "prefill":
        return [length]
    if mode == "decode":
        first = rng.randint(1, length)
        return [first] + [1] * (length - first)
    out, left = [], length
    while left:
        out.append(min(left, rng.randint(1, max(1, length // 2))))
        left -= out[-1]
    return out


CASES = ("batch", "padding", "offset", "decode", "graphs", "engine", "prefix", "autograd", "threads",
         "process")


def _run_case(c: str, model, seqs, refs, rng: random.Random, temperature: float, max_len: int) -> Pairs:
    """One round of case `c` on these sequences (extra inputs drawn from `rng`)."""
    vocab = model.config.vocab_size
    if c == "batch":
        order = list(range(len(seqs)))
        rng.shuffle(order)
        return case_batch(model, seqs, refs, order, temperature)
    if c == "padding":
        return case_padding(model, seqs, refs, random_sequences(rng, vocab, rng.randint(1, 3), max_len),
                            temperature)
    if c == "offset":
        return case_offset(model, seqs, refs, rng.randint(1, 9), temperature)
    if c == "decode":
        return case_decode(model, seqs, refs, [random_chunks(rng, s.numel()) for s in seqs], temperature)
    if c == "graphs":
        return case_graphs(model, seqs, refs, rng, temperature)
    if c in ("engine", "prefix"):
        prompts = [s[:max(1, min(s.numel() - 1, max_len - 16))] for s in seqs]
        if c == "prefix":
            return case_prefix(model, prompts, rng, max_len, temperature)
        return case_engine(model, prompts, rng, temperature)
    if c == "autograd":
        return case_autograd(model, seqs, refs, temperature)
    if c == "threads":
        return case_threads(model, seqs, refs, temperature)
    if c == "process":
        return case_process(model, seqs, refs, temperature)
    raise ValueError(f"unknown check case {c!r}: expected one of {', '.join(CASES)}")


def run_checks(model, rounds: int = 4, seed: int = 0, max_len: int = 96,
               cases: Sequence[str] = CASES, temperature: float = 1.0,
               progress: Callable[[str], None] | None = None,
               stopped: list[str] | None = None, record_errors: bool = False) -> list[CaseResult]:
    """Run `rounds` random rounds of every case; return one aggregated result per case.
    A case that cannot run raises ParityError, or with `record_errors` is reported in its
    result's `error` and not run again while the other cases go on. Interrupted (Ctrl-C, or
    SIGTERM under `term_as_interrupt`) with a `stopped` list, it returns the comparisons made so
    far and says so there."""
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    max_len = min(max_len, model.config.max_position_embeddings)
    totals = {c: [0, 0, 0.0] for c in cases}
    errors: dict[str, str] = {}  # a case that raised is recorded and not run again; the others go on
    r = 0
    try:
        for r in range(rounds):
            seqs = random_sequences(rng, vocab, rng.randint(2, 8), max_len)
            refs = reference(model, seqs, temperature)
            for c in cases:
                if c in errors or (c == "process" and r > 0):  # one child process per run is enough
                    continue
                if progress:
                    progress(f"round {r + 1}/{rounds}: {c}")
                try:
                    pairs = _run_case(c, model, seqs, refs, rng, temperature, max_len)
                except ParityError as err:
                    if not record_errors:
                        raise
                    errors[c] = str(err)
                    continue
                n, bad, worst = compare(pairs)
                totals[c][0] += n
                totals[c][1] += bad
                totals[c][2] = max(totals[c][2], worst)
    except KeyboardInterrupt:
        if stopped is None:
            raise
        stopped.append(f"interrupted in round {r + 1} of {rounds} ({model.kernels.name} kernels)")
    return [CaseResult(c, model.kernels.name, *totals[c], errors.get(c, "")) for c in cases]
