"""Reading checkpoints: config.json variants, sharded safetensors, and every way a checkpoint is broken."""

import json

import pytest
import torch
from checkpoints import write_llama, write_mistral, write_qwen2, write_qwen3, write_qwen3_5
from safetensors.torch import load_file, save_file

from qlora_cli.core.errors import QLoraError
from qlora_cli.sources.model_config import read_spec, spec_from_config
from qlora_cli.sources.weights import locate_tensors, stream_tensors

QWEN2_CONFIG = {
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "rope_theta": 1000000.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": True,
}


def test_qwen2_spec_derives_head_dim_and_bias():
    spec = spec_from_config(QWEN2_CONFIG)
    assert (spec.head_dim, spec.attention_bias, spec.qk_norm, spec.dtype) == (64, True, False, torch.bfloat16)


def test_qwen3_spec_with_dtype_and_rope_parameters():
    cfg = {k: v for k, v in QWEN2_CONFIG.items() if k not in ("rope_theta", "torch_dtype")}
    cfg.update(
        model_type="qwen3",
        head_dim=128,
        dtype="float32",
        rope_parameters={"rope_type": "default", "rope_theta": 5e5},
    )
    spec = spec_from_config(cfg)
    assert (spec.head_dim, spec.attention_bias, spec.qk_norm, spec.rope_theta) == (128, False, True, 5e5)
    assert spec.dtype == torch.float32


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gemma2"}, "model_type 'gemma2' is not supported"),
        ({"rope_scaling": {"type": "longrope", "factor": 4.0}}, "rope scaling 'longrope' is not supported"),
        ({"torch_dtype": "int8"}, "dtype 'int8' is not one of"),
        ({"hidden_size": None}, "hidden_size"),
    ],
)
def test_unsupported_configs_are_refused_by_name(change, message):
    cfg = {**QWEN2_CONFIG, **change}
    if change.get("hidden_size", 0) is None:
        del cfg["hidden_size"]
    with pytest.raises(QLoraError, match=message):
        spec_from_config(cfg)


def test_folder_without_config(tmp_path):
    with pytest.raises(QLoraError, match="has no config.json"):
        read_spec(tmp_path)


def test_streams_every_expected_tensor_once(tmp_path):
    folder = write_qwen3(tmp_path)
    spec = read_spec(folder)
    names = [name for name, _ in stream_tensors(folder, spec)]
    assert sorted(names) == sorted(spec.expected_tensors())


def test_sharded_checkpoint_with_index(tmp_path):
    folder = write_qwen2(tmp_path / "one")
    tensors = load_file(folder / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((folder / "config.json").read_text())
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, sharded / shard)
    weight_map = {n: shard for shard, shard_names in shards.items() for n in shard_names}
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    spec = read_spec(sharded)
    streamed = dict(stream_tensors(sharded, spec))
    assert all(torch.equal(streamed[n], tensors[n]) for n in spec.expected_tensors())


def test_missing_tensor_is_named(tmp_path):
    folder = write_qwen2(tmp_path)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(QLoraError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        list(stream_tensors(folder, read_spec(folder)))


def test_wrong_shape_is_named(tmp_path):
    folder = write_qwen2(tmp_path)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(QLoraError, match=r"k_proj\.weight has shape \[8, 64\], expected \[32, 64\]"):
        list(stream_tensors(folder, read_spec(folder)))


def test_truncated_file_is_refused(tmp_path):
    folder = write_qwen2(tmp_path)
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(QLoraError, match="truncated or corrupt"):
        list(stream_tensors(folder, read_spec(folder)))


def test_garbage_file_is_refused(tmp_path):
    folder = write_qwen2(tmp_path)
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(QLoraError, match="not a valid safetensors file"):
        list(stream_tensors(folder, read_spec(folder)))


SUPPORTED_LINE = (
    "(qlora trains qwen2, qwen3, qwen3_5, qwen3_5_text, qwen3_moe, qwen3_5_moe, qwen3_5_moe_text, llama, "
    "mistral: Qwen2, Qwen2.5, Qwen3, Qwen3.5/3.6, Qwen3 MoE, Qwen3.5/3.6 MoE, Llama 3.x and Mistral)"
)


@pytest.mark.parametrize("model_type", ["gemma2", "phi3", "gpt_oss", "qwen2_moe", "mixtral"])
def test_other_architectures_are_one_line_naming_the_supported(model_type):
    with pytest.raises(QLoraError) as error:
        spec_from_config({**QWEN2_CONFIG, "model_type": model_type})
    message = str(error.value)
    assert "\n" not in message and f"model_type '{model_type}' is not supported" in message
    assert message.endswith(SUPPORTED_LINE)


def test_a_vision_language_config_whose_text_decoder_is_another_family_is_refused():
    cfg = {"model_type": "qwen3_5", "text_config": {**QWEN2_CONFIG, "model_type": "qwen3_5_moe_text"}}
    with pytest.raises(QLoraError, match=r"text_config: model_type 'qwen3_5_moe_text' is not supported"):
        spec_from_config(cfg)


LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "bfloat16",
}


def test_llama_31_legacy_rope_scaling_is_read():
    spec = spec_from_config(LLAMA_31_8B)
    assert (spec.head_dim, spec.rope_theta, spec.rope_scaling.rope_type) == (128, 500000.0, "llama3")
    assert (spec.rope_scaling.factor, spec.rope_scaling.original_max_position_embeddings) == (8.0, 8192)
    assert not (spec.attention_bias or spec.o_proj_bias or spec.mlp_bias or spec.qk_norm)
    assert set(spec.layer_types) == {"full_attention"} and spec.layout == "text"


def test_llama_attention_bias_also_biases_o_proj_and_mlp_bias_the_mlp():
    spec = spec_from_config({**LLAMA_31_8B, "attention_bias": True, "mlp_bias": True})
    layer = spec.layer_tensors(0)
    biased = sorted(name.split(".")[1] for name in layer if name.endswith(".bias"))
    assert biased == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert layer["self_attn.o_proj.bias"] == (4096,) and layer["mlp.down_proj.bias"] == (4096,)
    qwen2 = spec_from_config(QWEN2_CONFIG).layer_tensors(0)
    assert sorted(n.split(".")[1] for n in qwen2 if n.endswith(".bias")) == ["k_proj", "q_proj", "v_proj"]


MISTRAL_SMALL = {
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
    "sliding_window": None,
    "torch_dtype": "bfloat16",
}


def test_mistral_small_head_dim_is_decoupled_from_hidden():
    spec = spec_from_config(MISTRAL_SMALL)
    shapes = spec.projection_shapes()
    assert (shapes["q_proj"], shapes["o_proj"], shapes["k_proj"]) == (
        (4096, 5120),
        (5120, 4096),
        (1024, 5120),
    )
    assert spec.sliding_window is None and spec.rope_theta == 1e8
    assert spec_from_config({**MISTRAL_SMALL, "sliding_window": 4096}).sliding_window == 4096


QWEN3_5_27B_TEXT = {
    "model_type": "qwen3_5_text",
    "vocab_size": 248320,
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 64,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "partial_rotary_factor": 0.25,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
    "max_position_embeddings": 262144,
    "tie_word_embeddings": True,
    "dtype": "bfloat16",
}


def test_qwen3_5_27b_shapes_per_layer_kind_match_the_published_tensors():
    """The shapes Qwen3.6-27B's published tensor listing has (the research notes' table)."""
    cfg = {"model_type": "qwen3_5", "tie_word_embeddings": False, "text_config": QWEN3_5_27B_TEXT}
    spec = spec_from_config(cfg)
    assert spec.layout == "vl" and spec.decoder_prefix == "model.language_model."
    assert not spec.tie_word_embeddings  # the top-level flag decides for the vision-language class
    assert spec.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)
    assert spec.layer_types.count("full_attention") == 16 and spec.layer_types[-1] == "full_attention"
    assert (spec.rotary_dim, spec.rope_theta, spec.mrope_section) == (64, 1e7, (11, 11, 10))
    full, linear = spec.layer_tensors(3), spec.layer_tensors(0)
    assert full["self_attn.q_proj.weight"] == (12288, 5120)
    assert full["self_attn.o_proj.weight"] == (5120, 6144)
    assert full["self_attn.k_proj.weight"] == (1024, 5120) and full["self_attn.q_norm.weight"] == (256,)
    assert linear["linear_attn.in_proj_qkv.weight"] == (10240, 5120)
    assert linear["linear_attn.in_proj_z.weight"] == (6144, 5120)
    assert linear["linear_attn.in_proj_b.weight"] == linear["linear_attn.in_proj_a.weight"] == (48, 5120)
    assert linear["linear_attn.conv1d.weight"] == (10240, 1, 4)
    assert linear["linear_attn.A_log"] == linear["linear_attn.dt_bias"] == (48,)
    assert linear["linear_attn.norm.weight"] == (128,)
    assert linear["linear_attn.out_proj.weight"] == (5120, 6144)
    assert not any(name.startswith("self_attn.") for name in linear)
    assert not any(name.startswith("linear_attn.") for name in full)


def test_qwen3_5_layer_types_win_over_the_interval_and_are_checked():
    types = ["full_attention", "linear_attention"] * 32
    spec = spec_from_config({**QWEN3_5_27B_TEXT, "layer_types": types})
    assert spec.layer_types == tuple(types) and spec.layout == "text" and spec.tie_word_embeddings
    with pytest.raises(QLoraError, match="layer_types must list 64 entries"):
        spec_from_config({**QWEN3_5_27B_TEXT, "layer_types": types[:-1]})
    with pytest.raises(QLoraError, match="layer_types must list"):
        spec_from_config({**QWEN3_5_27B_TEXT, "layer_types": ["sliding_attention"] * 64})
    with pytest.raises(QLoraError, match="layer_types must list 1 entry "):
        spec_from_config({**QWEN3_5_27B_TEXT, "num_hidden_layers": 1, "layer_types": types[:2]})


def test_qwen3_5_partial_rotary_factor_defaults_and_mrope_section_is_checked():
    params = {"rope_type": "default", "rope_theta": 1e7}
    assert (
        spec_from_config(
            {**QWEN3_5_27B_TEXT, "partial_rotary_factor": None, "rope_parameters": params}
        ).rotary_dim
        == 64
    )
    spec = spec_from_config({**QWEN3_5_27B_TEXT, "rope_parameters": {**params, "partial_rotary_factor": 0.5}})
    assert spec.rotary_dim == 128
    bad = {**params, "mrope_section": [11, 11, 11]}
    with pytest.raises(QLoraError, match=r"mrope_section \[11, 11, 11\] must sum to 32"):
        spec_from_config({**QWEN3_5_27B_TEXT, "rope_parameters": bad})


@pytest.fixture(scope="module")
def qwen3_5_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_5")
    return {
        "text": write_qwen3_5(root / "text"),
        "vl": write_qwen3_5(root / "vl", layout="vl", mtp=True, tie=True),
    }


def test_tiny_qwen3_5_specs_of_both_layouts(qwen3_5_folders):
    text, vl = (read_spec(qwen3_5_folders[layout]) for layout in ("text", "vl"))
    assert (text.model_type, text.layout, text.decoder_prefix) == ("qwen3_5_text", "text", "model.")
    assert (vl.model_type, vl.layout, vl.decoder_prefix) == ("qwen3_5", "vl", "model.language_model.")
    assert text.layer_types == vl.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (text.rotary_dim, text.head_dim, text.qk_norm, text.zero_centred_norms) == (4, 16, True, True)
    assert text.attention_output_gate and text.projection_shapes()["q_proj"] == (128, 64)
    assert (text.linear_attention.conv_dim, text.linear_attention.num_value_heads) == (128, 4)
    assert not text.tie_word_embeddings and vl.tie_word_embeddings


def test_qwen3_5_text_layout_streams_the_canonical_names(qwen3_5_folders):
    folder = qwen3_5_folders["text"]
    spec = read_spec(folder)
    streamed = dict(stream_tensors(folder, spec))
    assert sorted(streamed) == sorted(spec.expected_tensors()) and len(streamed) == 56
    assert streamed["model.layers.0.linear_attn.conv1d.weight"].shape == (128, 1, 4)
    assert locate_tensors(folder, spec).note() is None


def test_qwen3_5_vl_layout_streams_the_text_decoder_as_a_causal_lm_names_it(qwen3_5_folders):
    folder = qwen3_5_folders["vl"]
    spec = read_spec(folder)
    stored = load_file(folder / "model.safetensors")
    streamed = dict(stream_tensors(folder, spec))
    assert sorted(streamed) == sorted(spec.expected_tensors()) and "lm_head.weight" not in streamed
    assert all(name.startswith("model.layers.") or "layers" not in name for name in streamed)
    assert torch.equal(
        streamed["model.layers.3.self_attn.q_proj.weight"],
        stored["model.language_model.layers.3.self_attn.q_proj.weight"],
    )
    locations = locate_tensors(folder, spec)
    assert locations.skipped == {"vision-tower": 33, "MTP": 4}
    assert locations.note() == (
        "skipped 33 vision-tower tensors and 4 MTP tensors of the checkpoint (not trained; qlora trains the "
        "text decoder)"
    )


def test_vision_and_mtp_tensors_are_never_read(qwen3_5_folders, monkeypatch):
    """Their data is never asked for: only the decoder's tensors are read from the file."""
    import qlora_cli.sources.weights as weights

    folder = qwen3_5_folders["vl"]
    spec = read_spec(folder)
    real_open, read = weights._open, []

    class Recording:
        def __init__(self, file):
            self.inner = real_open(file)

        def __enter__(self):
            handle = self.inner.__enter__()
            outer = self

            class Handle:
                def keys(self):
                    return handle.keys()

                def get_slice(self, name):
                    return handle.get_slice(name)

                def get_tensor(self, name):
                    read.append(name)
                    return handle.get_tensor(name)

            outer.handle = Handle()
            return outer.handle

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

    monkeypatch.setattr(weights, "_open", Recording)
    list(stream_tensors(folder, spec))
    assert len(read) == len(spec.expected_tensors())
    assert not [name for name in read if name.startswith(("model.visual.", "mtp."))]


def test_qwen3_5_wrong_shape_of_a_linear_attention_tensor_is_one_line(tmp_path):
    folder = write_qwen3_5(tmp_path, layout="vl")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.language_model.layers.1.linear_attn.A_log"] = torch.zeros(2)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(QLoraError) as error:
        list(stream_tensors(folder, read_spec(folder)))
    assert str(error.value) == (
        "model.safetensors: tensor model.language_model.layers.1.linear_attn.A_log has shape [2], "
        "expected [4] from config.json"
    )


def test_qwen3_5_missing_linear_attention_tensor_is_named(tmp_path):
    folder = write_qwen3_5(tmp_path)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.2.linear_attn.norm.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(QLoraError, match=r"missing tensor model\.layers\.2\.linear_attn\.norm\.weight$"):
        list(stream_tensors(folder, read_spec(folder)))


def test_a_tensor_stored_under_both_layouts_is_refused(tmp_path):
    folder = write_qwen3_5(tmp_path)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.language_model.norm.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(QLoraError, match=r"holds model\.norm\.weight twice"):
        list(stream_tensors(folder, read_spec(folder)))


@pytest.mark.parametrize(
    ("write", "expected"),
    [
        (lambda f: write_llama(f), {"rope_type": "llama3", "tie": False, "head_dim": 16, "window": None}),
        (
            lambda f: write_llama(f, tie=True),
            {"rope_type": "llama3", "tie": True, "head_dim": 16, "window": None},
        ),
        (
            lambda f: write_mistral(f, sliding_window=8),
            {"rope_type": "default", "tie": False, "head_dim": 32, "window": 8},
        ),
    ],
    ids=["llama", "llama-tied", "mistral-window"],
)
def test_tiny_llama_and_mistral_read_and_stream(tmp_path, write, expected):
    folder = write(tmp_path)
    spec = read_spec(folder)
    got = {
        "rope_type": spec.rope_scaling.rope_type,
        "tie": spec.tie_word_embeddings,
        "head_dim": spec.head_dim,
        "window": spec.sliding_window,
    }
    assert got == expected
    names = [name for name, _ in stream_tensors(folder, spec)]
    assert sorted(names) == sorted(spec.expected_tensors())
    assert ("lm_head.weight" in names) != spec.tie_word_embeddings


def test_mistral_wrong_shape_is_one_line(tmp_path):
    folder = write_mistral(tmp_path)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.self_attn.o_proj.weight"] = torch.zeros(64, 64)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(
        QLoraError,
        match=r"^model\.safetensors: tensor model\.layers\.1\.self_attn\.o_proj\.weight has shape \[64, 64\], expected \[64, 128\] from config\.json$",
    ):
        list(stream_tensors(folder, read_spec(folder)))
