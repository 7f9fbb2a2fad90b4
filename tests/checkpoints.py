"""Tiny random checkpoints of every family qlora trains (Qwen2, Qwen3, Qwen3.5, their MoE, Llama, Mistral), written by
transformers itself, with tokenizers of their kind, for tests to load."""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path

import torch

from qlora_cli.sources.spec import ModelSpec

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_TOKENIZER = REPO_ROOT / "configs" / "demo" / "tiny-qwen3"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
)


# A tiny Llama-shaped spec, for tests of one layer or one seam without a checkpoint.
TINY_SPEC = ModelSpec(
    model_type="llama",
    vocab_size=32,
    hidden_size=64,
    intermediate_size=96,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    attention_bias=False,
    qk_norm=False,
    dtype=torch.float32,
)

# Qwen2.5-7B's shape, for tests that need real sizes without a checkpoint on disk.
QWEN25_7B = ModelSpec(
    model_type="qwen2",
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_layers=28,
    num_heads=28,
    num_kv_heads=4,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    max_position_embeddings=32768,
    tie_word_embeddings=False,
    attention_bias=True,
    qk_norm=False,
    dtype=torch.bfloat16,
)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every weight random (biases and norms too), so no code path hides behind zeros or ones."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            else:
                param.copy_(0.08 * noise)


def write_qwen2(
    folder: Path, *, vocab_size: int = 160, seed: int = 0, dtype=torch.float32, **overrides
) -> Path:
    """Qwen2: q/k/v bias, tied embeddings, GQA (4 query heads on 2 kv heads)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    settings = {
        **TINY,
        "vocab_size": vocab_size,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        **overrides,
    }
    return _save(Qwen2ForCausalLM(Qwen2Config(**settings)), folder, seed, dtype)


def write_qwen3(
    folder: Path, *, vocab_size: int = 160, seed: int = 0, dtype=torch.float32, **overrides
) -> Path:
    """Qwen3: QK-norm, untied lm_head, head_dim (24) unlike hidden / heads (16), no q/k/v bias."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    settings = {**TINY, "vocab_size": vocab_size, "head_dim": 24, "tie_word_embeddings": False, **overrides}
    return _save(Qwen3ForCausalLM(Qwen3Config(**settings)), folder, seed, dtype)


# Qwen3.5's shape in small: 3 linear-attention layers then one full one; twice the value heads of the key
# heads, as the 4B and larger have; rotary over 4 of 16 head dims.
QWEN3_5_TEXT = dict(
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    full_attention_interval=4,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [1, 1, 0],
        "mrope_interleaved": True,
    },
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    eos_token_id=2,
    pad_token_id=0,
)
QWEN3_5_VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    in_channels=3,
    patch_size=16,
    temporal_patch_size=2,
    spatial_merge_size=2,
    out_hidden_size=64,
    num_position_embeddings=64,
)
QWEN3_5_TEMPLATE = REPO_ROOT / "tests" / "templates" / "qwen3_5.jinja"


def write_qwen3_5(
    folder: Path,
    *,
    layout: str = "text",
    tie: bool = False,
    mtp: bool = False,
    seed: int = 0,
    dtype=torch.float32,
    **overrides,
) -> Path:
    """Qwen3.5 as Qwen3_5ForCausalLM saves it (layout "text": model.*) or as Qwen publishes it
    (layout "vl": Qwen3_5ForConditionalGeneration, model.language_model.* beside a vision tower);
    mtp adds an MTP head's tensors as published checkpoints carry them. With the demo tokenizer and a
    Qwen3.5-style thinking chat template."""
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForCausalLM,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5TextConfig,
    )

    text = {**QWEN3_5_TEXT, "tie_word_embeddings": tie, **overrides}
    if layout == "text":
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text))
    else:
        config = Qwen3_5Config(text_config=text, vision_config=QWEN3_5_VISION, tie_word_embeddings=tie)
        model = Qwen3_5ForConditionalGeneration(config)
    folder = _save(model, folder, seed, dtype)
    if mtp:
        _add_mtp_head(folder, text["hidden_size"])
    add_demo_tokenizer(folder)
    shutil.copy(QWEN3_5_TEMPLATE, folder / "chat_template.jinja")
    return folder


# The routed experts in small: 8 experts, 2 a token, each of 32; a shared expert of 48 for Qwen3.5 MoE.
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


def write_qwen3_moe(
    folder: Path, *, vocab_size: int = 160, seed: int = 0, dtype=torch.float32, **overrides
) -> Path:
    """Qwen3 MoE: Qwen3's attention with routed experts in every layer but mlp_only_layers (dense
    SwiGLU of intermediate_size), as Qwen3MoeForCausalLM saves it (each expert's matrices by name)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    settings = {
        **TINY,
        **TINY_MOE,
        "num_hidden_layers": 3,
        "vocab_size": vocab_size,
        "head_dim": 24,
        "norm_topk_prob": True,
        "mlp_only_layers": [1],
        **overrides,
    }
    return _save(Qwen3MoeForCausalLM(Qwen3MoeConfig(**settings)), folder, seed, dtype)


def write_qwen3_5_moe(
    folder: Path, *, layout: str = "text", seed: int = 0, dtype=torch.float32, **overrides
) -> Path:
    """Qwen3.5 MoE: Qwen3.5's hybrid layers, each with routed experts and a gated shared expert, as
    Qwen3_5MoeForCausalLM saves it (layout "text") or under model.language_model. beside a vision tower
    (layout "vl", Qwen3_5MoeForConditionalGeneration)."""
    from transformers import (
        Qwen3_5MoeConfig,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeForConditionalGeneration,
        Qwen3_5MoeTextConfig,
    )

    text = {k: v for k, v in QWEN3_5_TEXT.items() if k != "intermediate_size"}
    text = {**text, **TINY_MOE, "shared_expert_intermediate_size": 48, "tie_word_embeddings": False}
    text = {**text, **overrides}
    if layout == "text":
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**text))
    else:
        config = Qwen3_5MoeConfig(text_config=text, vision_config=QWEN3_5_VISION)
        model = Qwen3_5MoeForConditionalGeneration(config)
    folder = _save(model, folder, seed, dtype)
    add_demo_tokenizer(folder)
    return folder


def _add_mtp_head(folder: Path, hidden: int) -> None:
    """A few `mtp.*` tensors (top level, as published), which transformers neither builds nor saves."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{name}.weight"] = torch.randn(hidden)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def write_llama(
    folder: Path,
    *,
    rope_scaling: dict | None = None,
    tie: bool = False,
    vocab_size: int = 320,
    seed: int = 0,
    dtype=torch.float32,
    **overrides,
) -> Path:
    """Llama 3.x: llama3 RoPE (or `rope_scaling`, a rope_parameters dict), untied unless `tie` (as
    Llama 3.2 1B/3B), with a Llama 3-style byte-level BPE tokenizer and Llama 3's header tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = {
        **TINY,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "tie_word_embeddings": tie,
        "rope_parameters": dict(rope_scaling or LLAMA3_ROPE),
        **overrides,
    }
    del settings["rope_theta"]
    folder = _save(LlamaForCausalLM(LlamaConfig(**settings)), folder, seed, dtype)
    write_llama3_tokenizer(folder, vocab_size)
    return folder


def write_mistral(
    folder: Path,
    *,
    head_dim: int = 32,
    sliding_window: int | None = None,
    vocab_size: int = 320,
    seed: int = 0,
    dtype=torch.float32,
    **overrides,
) -> Path:
    """Mistral: head_dim decoupled from hidden / heads (4 x 32 != 64, as Mistral Small), no biases, a
    sliding window only when asked (MistralConfig's own default is 4096), with a SentencePiece-like
    tokenizer (<unk> <s> </s> [INST] [/INST])."""
    from transformers import MistralConfig, MistralForCausalLM

    settings = {
        **TINY,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "head_dim": head_dim,
        "sliding_window": sliding_window,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        **overrides,
    }
    del settings["rope_theta"]
    folder = _save(MistralForCausalLM(MistralConfig(**settings)), folder, seed, dtype)
    write_mistral_tokenizer(folder, vocab_size)
    return folder


_CORPUS = [
    "Hello world, this is a tiny corpus.",
    "The capital of France is Paris.",
    "12345 apples and 678 pears.",
    "user asks, assistant answers.\n\nNew lines too.",
]
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPECIALS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)
MISTRAL_SPECIALS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]")


def write_llama3_tokenizer(folder: Path, vocab_size: int, eos_token: str = "<|eot_id|>") -> None:
    """Byte-level BPE with Llama 3's split; its special tokens after the BPE vocabulary, as in Llama 3,
    and BOS prepended by the post-processor (rendered chats are tokenized without it). The eos is an
    Instruct model's, <|eot_id|>, unless `eos_token` says otherwise (a base Llama's <|end_of_text|>)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(LLAMA3_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 50, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA3_SPECIALS])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
            ),
        ]
    )
    assert tok.get_vocab_size() <= vocab_size
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token=eos_token,
        pad_token="<|end_of_text|>",
        model_max_length=256,
    ).save_pretrained(folder)


def write_mistral_tokenizer(folder: Path, vocab_size: int) -> None:
    """A tokenizer.json like Mistral v0.3's: BPE with byte fallback over Metaspace, <unk>=0 <s>=1 </s>=2."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1, right=0),
        ]
    )
    specials = [*MISTRAL_SPECIALS, *(f"<0x{i:02X}>" for i in range(256))]
    tok.train_from_iterator(
        _CORPUS * 50, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False)
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in MISTRAL_SPECIALS])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    assert tok.get_vocab_size() <= vocab_size
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(folder)


def _save(model, folder: Path, seed: int, dtype) -> Path:
    _randomize(model, seed)
    model = model.to(dtype)
    folder = Path(folder)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def add_demo_tokenizer(folder: Path) -> Path:
    """The demo's tokenizer, so a tiny checkpoint can train on the demo's data."""
    for name in TOKENIZER_FILES:
        shutil.copy(DEMO_TOKENIZER / name, Path(folder) / name)
    return folder


def load_transformers(folder: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.eval()


DEMO_DATA = REPO_ROOT / "configs" / "demo" / "data" / "train.jsonl"


def subprocess_env(**extra: str) -> dict[str, str]:
    """A child process's environment: reference ops, unbuffered output, and this checkout on the
    path, so that scripts a test writes import it whether or not qlora is installed."""
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "TRITON_INTERPRET": "0", "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **extra}


def write_run(folder: Path, rows: int = 48, model_writer=None, **config) -> Path:
    """A tiny model (a Qwen3 with the demo tokenizer unless `model_writer(folder)` writes another), the
    first `rows` demo examples, and a config for them."""
    import yaml

    folder = Path(folder)
    if model_writer is None:
        model = add_demo_tokenizer(write_qwen3(folder / "model", vocab_size=1024))
    else:
        model = model_writer(folder / "model")
    data = folder / "train.jsonl"
    data.write_text("".join(DEMO_DATA.read_text().splitlines(keepends=True)[:rows]))
    settings = {
        "base_model": str(model),
        "datasets": [{"path": str(data), "type": "chat_template"}],
        "sequence_len": 128,
        "micro_batch_size": 2,
        "max_steps": 6,
        "learning_rate": 1e-3,
        "warmup_steps": 1,
        "lora_r": 4,
        "output_dir": str(folder / "out"),
        "device": "cpu",
        "gradient_checkpointing": False,
        "seed": 3,
    }
    settings.update(config)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(settings, sort_keys=False))
    return path


def draw_lora_b(model, seed: int = 1, std: float = 0.02) -> None:
    """Every LoRA B drawn from N(0, std) instead of PEFT's zeros, so that gradients reach every A."""
    generator = torch.Generator(device=model.norm.device).manual_seed(seed)
    for layer in model.layers:
        for group in layer.projections.values():
            for b in group.lora_B.values():
                with torch.no_grad():
                    b.normal_(0, std, generator=generator)


def suggested(line: str) -> list[str]:
    """The arguments of the `qlora` command a message suggests last, to run it as it is written."""
    words = shlex.split(line.rsplit("`", 2)[-2])
    assert words[0] == "qlora", line
    return words[1:]


def as_written_before_manifests(checkpoint: Path) -> None:
    """Make a checkpoint look as qlora wrote them before manifests: no manifest.json, and a trainer state
    that does not say it was written with one."""
    import json

    state_file = Path(checkpoint) / "trainer_state.json"
    state = json.loads(state_file.read_text())
    del state["manifest_written"]
    state_file.write_text(json.dumps(state))
    (Path(checkpoint) / "manifest.json").unlink()


def captured_graph(run):
    """run() warmed up once on a side stream, as capture asks, then captured in a CUDA graph: (the
    graph, what the captured call returned, which each replay writes again)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = run()
    return graph, outputs
