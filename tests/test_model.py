"""Model config validation, HF-compatible checkpoints, and one-line errors for bad input."""

from __future__ import annotations

import functools
import json

import pytest
import torch

import parity
from parity import CheckpointError, ConfigError, InputError
from tests.conftest import cached_model


@pytest.mark.parametrize("fields, culprit", [
    (dict(hidden_size=60, num_attention_heads=7), "num_attention_heads"),
    (dict(num_attention_heads=4, num_key_value_heads=3), "num_key_value_heads"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(head_dim=7), "head_dim"),
    (dict(rms_norm_eps=-1.0), "rms_norm_eps"),
    (dict(eos_token_id=10_000), "eos_token_id"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor 0.5 is not supported for qwen3"),
    (dict(model_type="phi3", partial_rotary_factor=0.1), "rotates 1 of head_dim=16 dimensions"),
    (dict(model_type="phi3", partial_rotary_factor=1.5), r"partial_rotary_factor must be in \(0, 1\]"),
    (dict(model_type="phi3", rope_scaling={"rope_type": "longrope", "original_max_position_embeddings": 64,
                                           "short_factor": [1.0] * 8, "long_factor": "x"}),
     "long_factor must list 8 positive finite numbers"),
    (dict(model_type="phi3", rope_scaling={"rope_type": "longrope", "original_max_position_embeddings": 1,
                                           "short_factor": [1.0] * 8, "long_factor": [1.0] * 8}),
     "original_max_position_embeddings must be at least 2"),
])
def test_inconsistent_config_names_the_field(fields, culprit):
    with pytest.raises(ConfigError, match=culprit):
        parity.ModelConfig(**fields)


def test_unknown_config_field_is_an_error():
    with pytest.raises(ConfigError, match="hidden_sise"):
        parity.ModelConfig.from_dict({"hidden_sise": 64})
    with pytest.raises(ConfigError, match="unknown model preset"):
        parity.ModelConfig.preset("huge")


def test_state_dict_uses_hugging_face_qwen3_names():
    model = parity.Model(parity.ModelConfig.preset("tiny", tie_word_embeddings=False))
    names = set(model.state_dict())
    for n in ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
              "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_norm.weight",
              "model.layers.1.mlp.down_proj.weight", "model.layers.1.post_attention_layernorm.weight"]:
        assert n in names
    assert model.config.num_parameters == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checkpoint_round_trip_is_bitwise(tmp_path, dtype):
    model = parity.Model(parity.ModelConfig.preset("tiny"), dtype=dtype, seed=4)
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["Qwen3ForCausalLM"]
    loaded = parity.load_model(tmp_path)
    assert loaded.dtype == dtype
    seqs = [torch.arange(30) % 128]
    with torch.no_grad():
        assert torch.equal(parity.sequence_logprobs(model, seqs)[0],
                           parity.sequence_logprobs(loaded, seqs)[0])


def test_bad_checkpoints_are_refused_with_the_file_named(tmp_path):
    model = parity.Model(parity.ModelConfig.preset("tiny"))
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    # shape mismatch: config says a wider model than the weights hold
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 256}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*gate_proj.*shape"):
        parity.load_model(tmp_path)
    # more layers than stored, before a model of that size is built (10^8 layers hung the build)
    for layers in (3, 100_000_000):
        (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": layers}))
        with pytest.raises(CheckpointError, match="num_hidden_layers"):
            parity.load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(CheckpointError, match="hold layers 0..1, config.json says num_hidden_layers = 3"):
        parity.load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 10**12}))
    with pytest.raises(CheckpointError, match="max_position_embeddings must be at most 8,388,608"):
        parity.load_model(tmp_path)  # (asked for 8 TB of RoPE tables, naming no field)
    # a size torch's int64 shapes overflow (a TypeError from inside torch), one no memory holds
    # ('out of memory, 238 GiB': lower the batch sizes), a scalar architectures (a TypeError)
    for edit, message in (({"intermediate_size": 10**30}, "cannot be built here .*Overflow"),
                          ({"num_attention_heads": 10**30}, "cannot be built here .*Overflow"),
                          ({"intermediate_size": 10**7}, r"gate_proj.*has shape \(128, 64\), config.json "
                                                         r"implies \(10000000, 64\)"),
                          ({"architectures": 5}, "architectures must be a list, got 5")):
        (tmp_path / "config.json").write_text(json.dumps({**cfg, **edit}))
        with pytest.raises(CheckpointError, match=message):
            parity.load_model(tmp_path)
    # truncated weights file
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt"):
        parity.load_model(tmp_path)
    for field in ("rms_norm_eps", "rope_theta"):  # (NaN made every log-prob NaN, silently)
        (tmp_path / "config.json").write_text(json.dumps({**cfg, field: float("nan")}))
        with pytest.raises(CheckpointError, match=f"{field} must be a positive finite number"):
            parity.load_model(tmp_path)
    for where, message in (("", "path must name a directory"), (tmp_path / "config.json", "cannot be made")):
        with pytest.raises(CheckpointError, match=message):  # (a raw OSError; "" wrote into the cwd)
            model.save_pretrained(where)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json"):
        parity.load_model(tmp_path)


def test_bad_tokens_and_lengths(tiny):
    with pytest.raises(InputError, match="token id 128 is outside the vocabulary"):
        parity.sequence_logprobs(tiny, [[1, 2, 128]])
    with pytest.raises(InputError, match="exceeds max_position_embeddings"):
        parity.sequence_logprobs(tiny, [list(range(10)) * 60])
    with pytest.raises(InputError, match="empty"):
        parity.sequence_logprobs(tiny, [[]])
    with pytest.raises(InputError, match="temperature"):
        parity.sequence_logprobs(tiny, [[1, 2]], temperature=0.0)
    dec = parity.Decoder(tiny, max_tokens=64)
    with pytest.raises(InputError, match="sequence 7: token id -1"):
        dec.extend({7: [1, -1]})


def test_logprobs_are_float32_and_normalised(tiny):
    """The learner's log-probs are float32, and the engine's full row (a decoder's prefill, then
    log-softmax) agrees bit for bit with the learner's gathered token; the control, the standard
    kernels, does not (prefills of 2-11 tokens and the learner's 12 take other GEMM shapes)."""
    seq = torch.arange(12)
    agree = []
    for model in (tiny, cached_model("tiny", "standard", "float32", 0, 0.02)):
        lp = parity.sequence_logprobs(model, [seq], temperature=0.8)[0]
        assert lp.dtype == torch.float32 and lp.shape == (11,)
        same = []
        with torch.no_grad():
            for k in range(2, 12):
                logits = parity.Decoder(model).extend({0: seq[:k]})[0]
                full = model.kernels.log_softmax(logits.unsqueeze(0), 0.8)[0]
                assert abs(float(full.exp().sum()) - 1.0) < 1e-5
                same.append(torch.equal(full[seq[k]], lp[k - 1]))
        agree.append(same)
    assert all(agree[0]) and not all(agree[1]), agree


def _decode_vs_recompute(model, steps: int = 20) -> list[bool]:
    """Greedy token-by-token decoding over the KV cache: per step, whether its logits equal a full
    recompute of the sequence's last position bit for bit."""
    prompt = [3, 14, 15, 92, 65]
    dec = parity.Decoder(model)
    seq, same = list(prompt), []
    with torch.no_grad():
        logits = dec.extend({0: prompt})[0]
        for _ in range(steps):
            nxt = int(logits.argmax())
            batch = parity.ForwardBatch.build([torch.tensor(seq)], [0], model.block_size)
            same.append(torch.equal(model.logits(model(batch)[-1:])[0], logits))
            seq.append(nxt)
            logits = dec.extend({0: [nxt]})[0]
    return same


def test_greedy_decoder_matches_full_recompute(tiny):
    """Token-by-token greedy decoding over the KV cache computes what a full recompute does, bit
    for bit; the control, the standard kernels (one query row over the cache against the whole
    sequence's attention and GEMMs), does not."""
    assert all(_decode_vs_recompute(tiny))
    assert not all(_decode_vs_recompute(cached_model("tiny", "standard", "float32", 0, 0.02)))


def test_both_backends_in_one_process_agree_closely():
    a = parity.Model(parity.ModelConfig.preset("tiny"), kernels="aligned", seed=1)
    s = parity.Model(parity.ModelConfig.preset("tiny"), kernels="standard", seed=1)
    seqs = [torch.arange(40) % 128, torch.arange(7)]
    with torch.no_grad():
        for x, y in zip(parity.sequence_logprobs(a, seqs), parity.sequence_logprobs(s, seqs)):
            assert torch.allclose(x, y, atol=1e-5)


def test_forward_batch_layout():
    """Lists and tensors give the same batch; the cache layout by hand for a decode + a prefill."""
    toks, starts, tables = [[7], [1, 2, 3]], [33, 0], [[4, 9], [5, 6, 8]]
    a = parity.ForwardBatch.build(toks, starts, 32, tables)
    b = parity.ForwardBatch.build([torch.tensor(t) for t in toks], starts, 32,
                                  [torch.tensor(t) for t in tables])
    for name, value in vars(a).items():
        other = getattr(b, name)
        assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, name
    assert a.input_ids.tolist() == [7, 1, 2, 3] and a.positions.tolist() == [33, 0, 1, 2]
    assert a.block_tables.tolist() == [[4, 9], [5, 0]]  # key_len 64: two blocks, the prefill needs one
    assert a.slots.tolist() == [9 * 32 + 1, 5 * 32, 5 * 32 + 1, 5 * 32 + 2]
    assert a.q_index.tolist() == [[0, 4, 4], [1, 2, 3]] and a.q_pos.tolist() == [[33, -1, -1], [0, 1, 2]]
    with pytest.raises(ValueError, match="sequence 0 needs 2 cache blocks, has 1"):
        parity.ForwardBatch.build(toks, starts, 32, [[4], [5]])


def test_block_size_must_be_a_multiple_of_16():
    with pytest.raises(ConfigError, match="block_size"):
        parity.Model(parity.ModelConfig.preset("tiny"), block_size=8)


def test_a_dtype_the_kernels_do_not_compute_in_is_refused():
    """float16 was accepted (and ran kernels never tested in it); bfloat16 is the control."""
    assert parity.Model(parity.ModelConfig.preset("tiny"), dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ConfigError, match=r"bfloat16 \(or float64 for references\), got torch.float16"):
        parity.Model(parity.ModelConfig.preset("tiny"), dtype=torch.float16)


def test_empty_inputs_are_no_ops(tiny):
    assert parity.sequence_logprobs(tiny, []) == []
    assert parity.Decoder(tiny).extend({}) == {}


def test_pointwise_padding_stays_small_with_many_threads():
    from parity.ops.aligned import _padded_length

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(20)
        for n in (1, 1000, 70_001, 1_000_003):
            assert n <= _padded_length(n) <= n + 64 * 20
    finally:
        torch.set_num_threads(before)


def test_pointwise_gives_an_element_its_bits_wherever_it_sits():
    """Element-wise ops on a CPU take a vector path for full vectors and a scalar one for the
    tail, which round differently: an element's bits followed its position (an odd-length slice
    at an offset). `pointwise` pads so that every element takes the vector path: a slice's values
    are the same bits as in the whole row, at every offset; the control, `fn` alone, differs."""
    from parity.ops.aligned import pointwise

    x = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 4
    gelu = functools.partial(torch.nn.functional.gelu, approximate="tanh")
    plain_differs = False
    for fn in (torch.sigmoid, torch.nn.functional.silu, gelu):
        whole, plain = pointwise(fn, x), fn(x)
        for o in range(1, 40):
            assert torch.equal(pointwise(fn, x[o:o + 13].clone()), whole[o:o + 13]), (fn, o)
            plain_differs |= not torch.equal(fn(x[o:o + 13].clone()), plain[o:o + 13])
    if not plain_differs:  # (the control: without the padding a slice's bits follow its position)
        pytest.skip("this CPU's element-wise ops gave every position the same bits (checked above)")


def test_char_tokenizer_round_trip_with_special_tokens(tmp_path):
    from parity.model.tokenizer import SPECIAL_TOKENS, build_char_tokenizer, load_tokenizer

    tok = build_char_tokenizer()
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path, vocab_size=tok.get_vocab_size())
    text = "<|user|>12+34=<|assistant|><python>print(12 * 34)</python><result>408\n</result>answer: 46<|eos|>"
    ids = loaded.encode(text)
    assert loaded.decode(ids) == text
    assert ids[0] == SPECIAL_TOKENS.index("<|user|>") and ids[-1] == SPECIAL_TOKENS.index("<|eos|>")
    assert len(ids) == len(text) - sum(len(s) - 1 for s in SPECIAL_TOKENS for _ in range(text.count(s)))
    assert tok.get_vocab_size() < 128  # fits the tiny preset


def test_projection_weights_share_one_buffer_and_keep_their_values(tmp_path, monkeypatch):
    """q/k/v and gate/up are row blocks of one buffer per layer (`model/fused.py`): the fused GEMM
    weight is that buffer (no copy, none cached), also after `.to(dtype)`; a model whose weights
    do not share one (the concatenating path) gives the same log-probs and gradients bit for bit;
    checkpoints save and load the blocks as separate tensors."""
    from parity.model import decoder
    from parity.model.fused import adjacent

    cfg = parity.ModelConfig.preset("tiny")
    model = parity.Model(cfg, seed=1).to(torch.float64).to(torch.float32)  # lossless round trip
    att, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    qkv = adjacent([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight])
    assert qkv is not None and qkv.data_ptr() == att.q_proj.weight.data_ptr()
    assert model._fused(1, "qkv", [att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]).data_ptr() \
        == qkv.data_ptr()
    assert adjacent([mlp.gate_proj.weight, mlp.up_proj.weight]) is not None and not model._fused_cache
    seqs = [torch.arange(17) % 128, torch.arange(5, 40) % 128]

    def run(m):
        lps = parity.sequence_logprobs(m, seqs)
        sum(lp.sum() for lp in lps).backward()
        return [lp.detach() for lp in lps], {n: p.grad for n, p in m.named_parameters()}

    lp_shared, g_shared = run(model)
    monkeypatch.setattr(decoder, "adjacent", lambda parts: None)  # the concatenating path
    other = parity.Model(cfg, seed=1)
    lp_cat, g_cat = run(other)
    monkeypatch.undo()
    assert all(torch.equal(a, b) for a, b in zip(lp_shared, lp_cat))
    assert all(torch.equal(g_shared[n], g_cat[n]) for n in g_shared)
    model.save_pretrained(tmp_path)
    loaded = parity.load_model(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))


def test_moe_combine_sums_the_experts_in_rank_order():
    """The aligned MoE combine adds a token's k weighted expert outputs one after another in rank
    order (what the learner and the engine both run, whatever the token count); at k = 8 in bf16
    (Qwen3-MoE's k) the standard `sum(1)` rounds in another order: the control. Every MoE preset
    routes to k = 2, where the two agree, so only this test can tell them apart."""
    from parity.ops import aligned, standard

    parts = torch.randn(64, 8, 256, generator=torch.Generator().manual_seed(0)).bfloat16()
    in_order = parts[:, 0]
    for j in range(1, 8):
        in_order = in_order + parts[:, j]
    assert torch.equal(aligned.moe_combine(parts), in_order)
    assert all(torch.equal(aligned.moe_combine(parts[:t]), in_order[:t]) for t in (1, 3, 17))
    assert not torch.equal(standard.moe_combine(parts), in_order)


def test_rope_tables_are_built_in_blocks_and_refused_past_the_memory_there(monkeypatch):
    """The tables were built in float64 through several whole copies: max_position_embeddings of
    1M took 4 GB for a 100 KB model, 8M asked for ~60 GB (the host's OOM killer). They are built
    in blocks of positions now, the same bits, and a context whose tables alone would take more
    than half the memory available is a one-line error naming the field and the way out."""
    import torch

    from parity.errors import ConfigError
    from parity.model import rope

    positions, head_dim, theta = 70_000, 8, 1e6  # (past one block of 65,536 positions)
    cos, sin = rope.rope_tables(head_dim, theta, positions, None)
    inv = rope.inverse_frequencies(head_dim, theta, None, positions)
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * inv  # (the whole-table way)
    angles = torch.cat([angles, angles], dim=-1)
    assert torch.equal(cos, angles.cos().float()) and torch.equal(sin, angles.sin().float())
    monkeypatch.setattr(rope, "available_memory", lambda device=None: 2**30)
    with pytest.raises(ConfigError, match=r"max_position_embeddings = 8,388,608: its RoPE tables take "
                                          r"16.0 GiB, more than half the 1.0 GiB available; serve a shorter"):
        rope.rope_tables(256, theta, 8_388_608, None)
