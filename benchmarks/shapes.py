"""The model shapes the benchmarks run at, as transformers' config.json fields: Qwen2.5 0.5B to 7B,
Qwen3 0.6B and 8B, Qwen3.5 9B and 27B, Llama 3.1 8B, Mistral 7B and Mistral Small 24B."""

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


def _qwen3_5(hidden: int, layers: int, intermediate: int, heads: int, value_heads: int) -> dict:
    """Qwen3.5 (= Qwen3.6) text decoder as Qwen3_5ForCausalLM saves it: three Gated DeltaNet layers,
    then one gated attention layer, repeated (notes: Qwen3.5 §1.4)."""
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": 248320,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": value_heads,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "dtype": "bfloat16",
    }


def _qwen3_5_moe(hidden: int, layers: int, experts: int, top_k: int, expert_intermediate: int) -> dict:
    """Qwen3.5 MoE's text decoder as Qwen3_5MoeForCausalLM saves it: Qwen3.5's layer pattern, every MLP
    routed experts beside a gated shared expert of the experts' width; no dense intermediate size."""
    config = _qwen3_5(hidden, layers, 0, heads=16, value_heads=32)
    del config["intermediate_size"]
    return {
        **config,
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
        "num_key_value_heads": 2,
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": expert_intermediate,
        "shared_expert_intermediate_size": expert_intermediate,
    }


def _qwen3(hidden: int, layers: int, intermediate: int, heads: int, tie: bool) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tie,
        "attention_bias": False,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    }


# Every shape the benchmarks run at, as a full config.json: the Qwen2.5 sizes above and the models of
# the other families qlora trains (each shipped recipe's among them).
MODELS = {
    **{name: {} for name in QWEN25},
    "qwen3-0.6b": _qwen3(hidden=1024, layers=28, intermediate=3072, heads=16, tie=True),
    "qwen3-8b": _qwen3(hidden=4096, layers=36, intermediate=12288, heads=32, tie=False),
    "qwen3.5-9b": _qwen3_5(hidden=4096, layers=32, intermediate=12288, heads=16, value_heads=32),
    "qwen3.5-27b": _qwen3_5(hidden=5120, layers=64, intermediate=17408, heads=24, value_heads=48),
    "qwen3.5-35b-a3b": _qwen3_5_moe(hidden=2048, layers=40, experts=256, top_k=8, expert_intermediate=512),
    "qwen3-30b-a3b": {
        **_qwen3(hidden=2048, layers=48, intermediate=6144, heads=32, tie=False),
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_key_value_heads": 4,
        "max_position_embeddings": 40960,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    },
    "mistral-7b": {  # Mistral-7B-v0.3: no sliding window, vocabulary 32768
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "vocab_size": 32768,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-5,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    },
    "mistral-small-24b": {  # Mistral-Small-24B-Base-2501: head_dim 128 with 32 heads, hidden 5120
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "vocab_size": 131072,
        "hidden_size": 5120,
        "intermediate_size": 32768,
        "num_hidden_layers": 40,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "rope_theta": 100000000.0,
        "rms_norm_eps": 1e-5,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    },
}


def model_config(name: str, layers: int | None = None) -> dict:
    """A full config.json for a benchmark shape, with `layers` decoder layers if given (a Qwen3.5 keeps its
    pattern: layer i is full attention when (i + 1) % 4 == 0, so give a multiple of 4 to keep the mix)."""
    if name in QWEN25:
        return qwen25_config(name, **({"num_hidden_layers": layers} if layers else {}))
    config = dict(MODELS[name])
    if layers:
        config["num_hidden_layers"] = layers
    return config
