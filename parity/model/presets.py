"""Named model shapes for `ModelConfig.preset`: the unit-test and demo sizes of every family, and
real sizes with random weights (benchmarks, memory and compile checks)."""

from __future__ import annotations

from typing import Any

_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
_SMALL = dict(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
PRESETS: dict[str, dict[str, Any]] = {
    # unit tests: runs a forward in a few milliseconds
    "tiny": _TINY,
    # demos and benchmarks: ~5M parameters, learns small tasks on 2 cores in minutes
    "small": _SMALL,
    # the other families at the tiny and small sizes (parity check and the bitwise suite per family)
    "tiny-moe": dict(_TINY, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=32, norm_topk_prob=True),
    "small-moe": dict(_SMALL, model_type="qwen3_moe", num_experts=16, num_experts_per_tok=2,
                      moe_intermediate_size=192, norm_topk_prob=True),
    "tiny-qwen2": dict(_TINY, model_type="qwen2", rope_scaling={  # Qwen2.5's long-context YaRN
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
    "tiny-llama": dict(_TINY, model_type="llama", rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "tiny-mistral": dict(_TINY, model_type="mistral", rope_theta=1e6, sliding_window=40),  # < the context
    "tiny-mixtral": dict(_TINY, model_type="mixtral", rope_theta=1e6, num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=32, norm_topk_prob=True),
    "tiny-gemma3": dict(_TINY, model_type="gemma3_text", head_dim=32, query_pre_attn_scalar=24.0,
                        sliding_window=24, layer_types=["sliding_attention", "full_attention"],
                        rope_theta=1e6, rope_local_base_freq=1e4,
                        rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "tiny-gemma2": dict(_TINY, model_type="gemma2", head_dim=32, query_pre_attn_scalar=24.0,
                        sliding_window=24, layer_types=["sliding_attention", "full_attention"],
                        attn_logit_softcapping=1.0, final_logit_softcapping=2.0),  # (bind at test scales)
    "tiny-qwen2-moe": dict(_TINY, model_type="qwen2_moe", num_experts=8, num_experts_per_tok=2,
                           moe_intermediate_size=32, shared_expert_intermediate_size=48),
    # Phi-3's window, Phi-4-mini's partial rotary (12 of 16 dimensions) and longrope (long factors:
    # the context passes the original 4 positions, so transformers takes them too on any test sequence)
    "tiny-phi3": dict(_TINY, model_type="phi3", sliding_window=40, tie_word_embeddings=False,
                      partial_rotary_factor=0.75, rope_scaling={
                          "rope_type": "longrope", "original_max_position_embeddings": 4,
                          "short_factor": [1.0, 1.02, 1.1, 1.3, 1.7, 2.4],
                          "long_factor": [1.0, 1.5, 3.0, 6.0, 12.0, 24.0]}),
    "tiny-smollm3": dict(_TINY, model_type="smollm3", rope_theta=5e6, no_rope_layers=[1, 0]),  # (NoPE: 1)
    "tiny-olmo2": dict(_TINY, model_type="olmo2", rope_theta=500000.0, tie_word_embeddings=False),
    "tiny-olmo3": dict(_TINY, model_type="olmo3", rope_theta=500000.0, rope_local_base_freq=500000.0,
                       sliding_window=24, layer_types=["sliding_attention", "full_attention"],
                       tie_word_embeddings=False, rope_scaling={  # (OLMo 3's long context: YaRN, full layers)
                           "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
    # a real size: Qwen3-0.6B's shape (596M parameters, random weights; benchmarks and memory checks)
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, rope_theta=1000000.0),
    # Qwen3-30B-A3B's layer (the published runs' model: 128 experts of width 768, 8 per token, hidden
    # 2048, 32 query and 4 key-value heads) in 2 of its 48 layers: 1.9B parameters, 622M of them the
    # untied embeddings (random weights; MoE at a real expert count in `bench kernels` and `rollout`)
    "qwen3-30b-a3b-2l": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=2,
                             num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                             max_position_embeddings=40960, rope_theta=1000000.0, model_type="qwen3_moe",
                             num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                             norm_topk_prob=True, tie_word_embeddings=False),
    # Gemma 2 2B's shape (2.6B parameters, 590M of them the embedding; random weights): every other
    # layer slides over 4096 keys, attention scores and logits soft-capped
    "gemma2-2b": dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                      max_position_embeddings=8192, model_type="gemma2", query_pre_attn_scalar=256.0,
                      sliding_window=4096, bos_token_id=2, eos_token_id=[1, 107],
                      attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                      layer_types=["full_attention" if i % 2 else "sliding_attention" for i in range(26)]),
    # Gemma 3 1B's shape (1.0B parameters, 302M of them the embedding; random weights): five
    # sliding layers of 512 keys to one full one, head_dim 256, one key-value head
    "gemma3-1b": dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                      max_position_embeddings=32768,
                      model_type="gemma3_text", rope_theta=1e6, rope_local_base_freq=1e4,
                      query_pre_attn_scalar=256.0, sliding_window=512, bos_token_id=2, eos_token_id=[1, 106],
                      layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                   for i in range(26)]),
}
