"""Qwen2.5 shapes the benchmarks run at, as transformers' config.json fields."""

QWEN25 = {
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
}


def qwen25_config(name: str, **overrides) -> dict:
    """A full config.json for a Qwen2.5 shape (random weights are written separately)."""
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
        "use_sliding_window": False,
        **QWEN25[name],
    }
    config.update(overrides)
    return config
