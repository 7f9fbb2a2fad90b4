"""The README.md every export carries: what was trained, on what, for how long, how it was exported
and how to load or run it, so the folder explains itself wherever it is copied."""

from __future__ import annotations

import torch

from qlora_cli.config.schema import TrainConfig
from qlora_cli.model.from_config import lora_config
from qlora_cli.rundir.trainer_state import TrainerState
from qlora_cli.sources.spec import TEXT_LAYOUT, VISION_LANGUAGE_LAYOUT

# The class an adapter's names fit, by the base's layout: PEFT only warns on keys it cannot place, so
# a vision-language base's adapter loaded onto the causal LM class would run without its LoRA.
ADAPTER_BASE_CLASS = {
    TEXT_LAYOUT: "AutoModelForCausalLM",
    VISION_LANGUAGE_LAYOUT: "AutoModelForImageTextToText",
}


def _run_section(gguf_file: str) -> str:
    return (
        "\n## Run it\n\n"
        f"llama.cpp: `llama-cli -m {gguf_file} -cnv` (chat with the template the GGUF carries), or "
        f"`llama-server -m {gguf_file}` for an OpenAI-compatible server.\n\n"
        "Ollama: `ollama create my-model -f Modelfile`, then `ollama run my-model`.\n\n"
        f"LM Studio: put {gguf_file} under its models folder (or `lms import {gguf_file}`).\n"
    )


def _last(metrics: list[dict], key: str) -> dict | None:
    return next((record for record in reversed(metrics) if key in record), None)


def model_card(
    config: TrainConfig,
    state: TrainerState,
    *,
    merged: bool,
    dtype: str | None,
    round_trip: torch.dtype | None,
    targets: list[str],
    gguf_file: str | None = None,
    layout: str = TEXT_LAYOUT,
) -> str:
    """A short README.md: what was trained, on what, for how long, and how it was exported. `targets`:
    what carries LoRA in this model (the config's list may name projections it lacks)."""
    revision = f" at revision `{config.revision}`" if config.revision else ""
    lora = lora_config(config)
    data = ", ".join(f"`{d.path}` ({d.type})" for d in config.datasets)
    metrics = state.metrics or []
    rows = [
        ("base model", f"`{config.base_model}`{revision}"),
        ("data", data),
        ("steps", f"{state.step} of {state.step if state.total_steps is None else state.total_steps}"),
    ]
    train_record, eval_record = _last(metrics, "loss"), _last(metrics, "eval_loss")
    if train_record:
        rows.append(("final training loss", f"{train_record['loss']:.4f} (step {train_record['step']})"))
    if eval_record:
        rows.append(("final eval loss", f"{eval_record['eval_loss']:.4f} (step {eval_record['step']})"))
    rows.append(
        (
            "LoRA",
            f"r={lora.r}, alpha={lora.alpha:g}, dropout={lora.dropout:g}, rsLoRA {'on' if lora.use_rslora else 'off'}, "
            f"scaling {lora.scaling:g}, targets {', '.join(targets)}; "
            f"norms {'trained' if lora.train_norms else 'frozen'}",
        )
    )
    rows.append(("trained on", "NF4-quantized base (QLoRA)" if config.quantize else "unquantized base"))
    if merged:
        onto = (
            f"the NF4 round trip of the base weights in {str(round_trip).removeprefix('torch.')}, "
            "the weights training computed with"
            if round_trip is not None
            else "the original base weights"
        )
        rows.append(("merged onto", f"{onto}, W + scaling · B·A in fp32, saved in {dtype}"))
        kind, library = "the base model with the LoRA adapter merged in", "transformers"
        usage = "AutoModelForCausalLM.from_pretrained(this_folder)"
        if gguf_file is not None:
            kind = f"{kind}, as one GGUF file ({gguf_file}) for llama.cpp, Ollama and LM Studio"
            library = "gguf"
            usage = f"llama-cli -m {gguf_file} -cnv"
    else:
        kind, library = "a LoRA adapter (PEFT format)", "peft"
        usage = f"PeftModel.from_pretrained({ADAPTER_BASE_CLASS[layout]}.from_pretrained(base_model), this_folder)"
    table = "\n".join(f"| {key} | {value} |" for key, value in rows)
    return (
        f"---\nlibrary_name: {library}\ntags: [qlora, lora]\n---\n\n"
        f"# {config.base_model} fine-tuned with qlora\n\n"
        f"This folder holds {kind}. Load it with `{usage}`.\n\n"
        f"| | |\n|---|---|\n{table}\n" + (_run_section(gguf_file) if gguf_file else "")
    )
