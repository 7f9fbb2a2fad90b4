"""Export a trained checkpoint: a PEFT adapter folder, or the base model with the adapter merged in.

The adapter export is what `PeftModel.from_pretrained` loads; the merged export is a plain Hugging Face
model folder that `AutoModelForCausalLM.from_pretrained` loads, written shard by shard while the base
weights stream past, so host memory stays near one shard however large the model is; the GGUF export is
the same merged weights in one file for llama.cpp, Ollama and LM Studio, with an Ollama Modelfile. Either way the
folder is built under a temporary name and renamed into place at the end: a failed export leaves nothing
half-written behind.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from qlora_cli.config.schema import TrainConfig
from qlora_cli.core.errors import QLoraError, WriteFailed
from qlora_cli.core.files import describe, save_tensors, write_json
from qlora_cli.core.names import ALL_PROJECTIONS
from qlora_cli.export.gguf.ollama import modelfile
from qlora_cli.export.gguf.vocab import check_tokenizer, read_vocabulary
from qlora_cli.export.gguf.writer import DEFAULT_GGUF_TYPE, check_gguf_type, import_gguf, write_gguf
from qlora_cli.export.tokenizer_files import write_tokenizer
from qlora_cli.model.decoder import QLoRAModel
from qlora_cli.model.settings import lora_config
from qlora_cli.rundir.adapter import PREFIX, adapter_config, adapter_state_dict, load_adapter_state
from qlora_cli.rundir.base import checkpoint_base
from qlora_cli.rundir.checkpoint import read_checkpoint_adapter, read_checkpoint_config
from qlora_cli.rundir.folder import is_run_folder, usable_checkpoint
from qlora_cli.rundir.names import ADAPTER_CONFIG, ADAPTER_WEIGHTS, STATE_FILE, names_a_checkpoint_folder
from qlora_cli.rundir.trainer_state import TrainerState, is_checkpoint, read_trainer_state
from qlora_cli.sources.hub import model_reference, resolve_model
from qlora_cli.sources.tokenizer import ChatTokenizer
from qlora_cli.sources.weights import (
    TEXT_LAYOUT,
    VISION_LANGUAGE_LAYOUT,
    ModelSpec,
    canonical_name,
    locate_tensors,
    read_spec,
    stream_checkpoint,
    stream_tensors,
)
from qlora_kernels.nf4 import dequantize_nf4, quantize_nf4

BASES = ("original", "nf4")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DEFAULT_BASE, DEFAULT_DTYPE, DEFAULT_SHARD_SIZE = "original", "bfloat16", "5GB"
SAFETENSORS_METADATA = {"format": "pt"}
# A vision-language base's image and video preprocessing, which its merged model needs beside it.
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")
# The class an adapter's names fit, by the base's layout: PEFT only warns on keys it cannot place, so
# a vision-language base's adapter loaded onto the causal LM class would run without its LoRA.
ADAPTER_BASE_CLASS = {
    TEXT_LAYOUT: "AutoModelForCausalLM",
    VISION_LANGUAGE_LAYOUT: "AutoModelForImageTextToText",
}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


@dataclass
class ExportResult:
    out: Path
    checkpoint: Path
    merged: bool
    base: str | None
    dtype: str | None
    shards: int
    gguf_type: str | None = None
    gguf_file: str | None = None
    notes: list[str] = dataclasses.field(default_factory=list)


def parse_size(text: str) -> int:
    """Bytes from '5GB', '500MB' (powers of 1000) or '2GiB' (powers of 1024), as Hugging Face reads them."""
    match = _SIZE.match(str(text))
    if not match or float(match.group(1)) <= 0:
        raise QLoraError(f"--max-shard-size: expected a size like 5GB, 500MB or 2GiB, got {text!r}")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


def find_checkpoint(path: Path) -> Path:
    """The folder itself when it is a checkpoint, else the newest complete checkpoint of the run that
    owns it (an output_dir may also hold checkpoints of runs it was taken from)."""
    path = Path(path)
    if not path.exists():
        raise QLoraError(f"{path} does not exist; give a checkpoint-<step> folder or a run's output_dir")
    if is_checkpoint(path):
        return path
    found = (
        usable_checkpoint(path, lambda found: f"export it with `qlora export {found} --out …`")
        if path.is_dir()
        else None
    )
    if found is None:
        raise QLoraError(
            f"{path} holds no complete checkpoint (a checkpoint-<step> folder with {STATE_FILE})"
        )
    return found


def training_dtype(state: TrainerState) -> torch.dtype:
    """The compute dtype the run trained in, as the checkpoint's trainer state records it.

    `QLoRAModel.load_base` casts each projection to the compute dtype before quantizing, and dequantizing
    gives that dtype back, so the weights the adapter learned against are
    dequantize_nf4(quantize_nf4(W.to(compute dtype))).
    """
    name = state.compute_dtype
    if name not in DTYPES:
        raise QLoraError(f"{STATE_FILE} does not record the run's compute dtype; --base nf4 needs it")
    return DTYPES[name]


def nf4_round_trip(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The frozen weight as the quantized model computes with it."""
    return dequantize_nf4(quantize_nf4(weight.to(dtype)))


def merge_tensor(
    name: str,
    tensor: torch.Tensor,
    adapter: dict[str, torch.Tensor],
    scaling: float,
    round_trip: torch.dtype | None,
) -> torch.Tensor:
    """One base tensor as the trained model sees it.

    With `round_trip` every projection weight (adapted or not, all are NF4 in training) becomes its NF4
    round trip in that dtype; a projection with an adapter then becomes W + scaling · B @ A computed in
    fp32 (a gated q_proj's B holds the gate rows, interleaved per head as the weight's are, so the
    product lines up row for row); a trained norm becomes its trained value; anything else passes as it
    is. `adapter` is keyed by the names the tensors stream under (`by_tensor_name`).
    """
    module = name.removesuffix(".weight")
    if round_trip is not None and module != name and module.rsplit(".", 1)[-1] in ALL_PROJECTIONS:
        tensor = nf4_round_trip(tensor, round_trip)
    lora_a = adapter.get(f"{module}.lora_A.weight")
    if lora_a is None:
        return adapter.get(name, tensor)
    lora_b = adapter[f"{module}.lora_B.weight"]
    return torch.addmm(tensor.float(), lora_b.float(), lora_a.float(), alpha=scaling)


@dataclass(frozen=True)
class Merge:
    """What a merged export merges: the base's folder and shape, the adapter and its scaling, and the
    dtype of the NF4 round trip the base weights take first (None: the original weights)."""

    base_folder: Path
    spec: ModelSpec
    adapter: dict[str, torch.Tensor]
    scaling: float
    round_trip: torch.dtype | None


def by_tensor_name(adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter keyed as the base's tensors stream (`model.layers.N....`): PEFT's prefix dropped and
    a vision-language decoder's `model.language_model.` made `model.`."""
    return {canonical_name(name.removeprefix(PREFIX)): tensor for name, tensor in adapter.items()}


def merged_tensors(merge: Merge) -> Iterator[tuple[str, torch.Tensor]]:
    """The decoder's tensors merged one at a time as they stream past, under the names stream_tensors
    gives them; a tied lm_head is not among them (stream_tensors yields only the tensors the spec
    names), as transformers and llama.cpp expect."""
    named = by_tensor_name(merge.adapter)
    for name, tensor in stream_tensors(merge.base_folder, merge.spec):
        yield name, merge_tensor(name, tensor, named, merge.scaling, merge.round_trip)


def merged_checkpoint(merge: Merge) -> Iterator[tuple[str, torch.Tensor]]:
    """The base checkpoint in its own layout and names, the decoder merged: a vision-language
    checkpoint's vision tower and any MTP head pass through unchanged, so the result loads as the class
    the base's config.json names."""
    named = by_tensor_name(merge.adapter)
    for stored, name, tensor in stream_checkpoint(merge.base_folder, merge.spec):
        yield (
            stored,
            tensor if name is None else merge_tensor(name, tensor, named, merge.scaling, merge.round_trip),
        )


class ShardWriter:
    """Collects tensors into shards of at most `max_bytes` (a larger tensor gets a shard of its own).

    Shards are written as they fill, under provisional names, and renamed to model-k-of-n once n is known.
    """

    def __init__(self, folder: Path, max_bytes: int):
        self.folder = folder
        self.max_bytes = max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total_size = 0

    def _provisional(self, index: int) -> Path:
        return self.folder / f".model-{index:05d}.safetensors"

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total_size += size

    def _flush(self) -> None:
        save_tensors(self.pending, self._provisional(len(self.shards) + 1), metadata=SAFETENSORS_METADATA)
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> int:
        """Write the last shard, name every shard k-of-n and write the index; returns n."""
        if self.pending:
            self._flush()
        count = len(self.shards)
        weight_map = {}
        for index, names in enumerate(self.shards, start=1):
            final = f"model-{index:05d}-of-{count:05d}.safetensors"
            self._provisional(index).rename(self.folder / final)
            weight_map.update(dict.fromkeys(names, final))
        index_file = {"metadata": {"total_size": self.total_size}, "weight_map": weight_map}
        write_json(self.folder / "model.safetensors.index.json", index_file)
        return count


def _read_adapter(checkpoint: Path, skeleton: QLoRAModel, base_folder: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's adapter tensors, checked against the base: every one present, of the right shape."""
    tensors = read_checkpoint_adapter(checkpoint)
    source = f"{checkpoint / ADAPTER_WEIGHTS} against base {base_folder}"
    load_adapter_state(skeleton, tensors, source)
    adapter = adapter_state_dict(skeleton)
    extra = sorted(set(tensors) - set(adapter))
    if extra:
        raise QLoraError(
            f"{source}: adapter tensor {extra[0]} is not one that the checkpoint's config trains"
        )
    return adapter


def _base_config(folder: Path, dtype: str) -> dict:
    """The base's config.json for a plain (unquantized) model in the export dtype."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    config.pop("quantization_config", None)
    config["dtype"] = dtype
    if "torch_dtype" in config:
        config["torch_dtype"] = dtype
    return config


def _write_merged(folder: Path, merge: Merge, dtype: str, max_bytes: int) -> int:
    """Stream the base, merge each tensor as it passes, write shards."""
    writer = ShardWriter(folder, max_bytes)
    for name, tensor in merged_checkpoint(merge):
        writer.add(name, tensor.to(DTYPES[dtype]))
    shards = writer.finish()
    base_folder = merge.base_folder
    write_json(folder / "config.json", _base_config(base_folder, dtype))
    for name in ("generation_config.json", *PROCESSOR_FILES):
        if (base_folder / name).is_file():
            shutil.copyfile(base_folder / name, folder / name)
    return shards


def _bos_token_id(base_folder: Path) -> int | None:
    value = json.loads((base_folder / "config.json").read_text(encoding="utf-8")).get("bos_token_id")
    return value if isinstance(value, int) else None


def _write_gguf(folder: Path, config: TrainConfig, merge: Merge, gguf_type: str) -> str:
    """The merged weights as one GGUF file, with an Ollama Modelfile beside it; returns the file's name.

    The tokenizer files the other exports carry go to a scratch folder first, so that the GGUF holds the
    run's chat template and special tokens exactly as they would; they are not left in the export.
    """
    base_folder, spec = merge.base_folder, merge.spec
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        write_tokenizer(config, base_folder, Path(scratch))
        tokenizer = ChatTokenizer.from_folder(scratch)
        vocabulary = read_vocabulary(Path(scratch), tokenizer, spec.vocab_size, _bos_token_id(base_folder))
    name = f"model-{gguf_type}.gguf"
    names = locate_tensors(base_folder, spec).names
    model_name = config.base_model.rstrip("/").rsplit("/", 1)[-1] + "-qlora"
    tensors = merged_tensors(merge)
    write_gguf(folder / name, spec, names, tensors, vocabulary, gguf_type, model_name)
    (folder / "Modelfile").write_text(modelfile(name, tokenizer), encoding="utf-8")
    return name


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
    gguf_file: str | None = None,
    layout: str = TEXT_LAYOUT,
) -> str:
    """A short README.md: what was trained, on what, for how long, and how it was exported."""
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
            f"scaling {lora.scaling:g}, targets {', '.join(lora.target_modules)}; "
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


def _contains(folder: Path, path: Path) -> bool:
    return folder == path or folder in path.parents


def _check_out(out: Path, force: bool, keep: list[Path]) -> None:
    """--out must be new or empty, or replaceable with --force without losing what the export reads."""
    if not out.exists():
        return
    if not out.is_dir():
        raise QLoraError(f"--out {out} exists and is a file; give a folder")
    if not force and any(out.iterdir()):
        raise QLoraError(
            f"--out {out} exists and is not empty; choose a new folder or add --force to replace it"
        )
    resolved = out.resolve()
    for path in keep:
        if _contains(resolved, path.resolve()):
            raise QLoraError(
                f"--out {out} holds {path}, which the export reads or runs in; choose another folder"
            )


def _check_place(out: Path) -> None:
    """--out is no folder that a run prunes, replaces or sets aside: not a checkpoint folder of a run, nor
    inside one, nor named like one in a run's output_dir."""
    resolved = out.resolve()
    for folder in (resolved, *resolved.parents):
        if names_a_checkpoint_folder(folder.name) and is_run_folder(folder.parent):
            where = "is named like" if folder == resolved else f"is inside {folder}, one of"
            raise QLoraError(
                f"--out {out} {where} the checkpoint folders of the run in {folder.parent}, which the run "
                "prunes, replaces and sets aside; choose a folder outside them"
            )


def _check_options(
    merged: bool,
    gguf: bool,
    base: str | None,
    dtype: str | None,
    max_shard_size: str | None,
    gguf_type: str | None,
) -> tuple[str | None, str | None, str | None, int | None]:
    """The options of one kind of export, defaults filled in: (base, dtype, gguf_type, shard bytes)."""
    if gguf and merged:
        raise QLoraError("--gguf writes a merged model in GGUF; give either --merged or --gguf")
    if gguf_type is not None and not gguf:
        raise QLoraError("--gguf-type applies to --gguf exports only; add --gguf")
    if gguf and (dtype, max_shard_size) != (None, None):
        raise QLoraError("--dtype and --max-shard-size apply to --merged exports; --gguf takes --gguf-type")
    if not (merged or gguf) and (base, dtype, max_shard_size) != (None, None, None):
        raise QLoraError("--base, --dtype and --max-shard-size apply to merged exports only; add --merged")
    if gguf:
        gguf_type = check_gguf_type(gguf_type or DEFAULT_GGUF_TYPE)
        import_gguf()
    if merged or gguf:
        base = base or DEFAULT_BASE
        if base not in BASES:
            raise QLoraError(f"--base: expected one of {', '.join(BASES)}, got {base!r}")
    if merged:
        dtype = dtype or DEFAULT_DTYPE
        if dtype not in DTYPES:
            raise QLoraError(f"--dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
        return base, dtype, None, parse_size(max_shard_size or DEFAULT_SHARD_SIZE)
    return base, None, gguf_type, None


def export(
    source: Path,
    out: Path,
    *,
    merged: bool = False,
    base: str | None = None,
    dtype: str | None = None,
    max_shard_size: str | None = None,
    gguf: bool = False,
    gguf_type: str | None = None,
    force: bool = False,
    base_model: str | None = None,
) -> ExportResult:
    """Write the adapter of a checkpoint (or of an output_dir's newest checkpoint) to `out`.

    Without `merged`: a PEFT adapter folder. With it: the base model with the adapter merged in, onto the
    original weights (`base="original"`) or onto the NF4 round trip the adapter trained against
    (`base="nf4"`), in `dtype`, cut into shards of at most `max_shard_size`. With `gguf` instead: the
    same merged weights as one GGUF file of `gguf_type`, with an Ollama Modelfile. `base_model`: where
    the local base the checkpoint trained on is now, when it moved.
    """
    base, dtype, gguf_type, max_bytes = _check_options(merged, gguf, base, dtype, max_shard_size, gguf_type)
    checkpoint = find_checkpoint(source)
    config, notes = checkpoint_base(checkpoint, read_checkpoint_config(checkpoint), base_model)
    state = read_trainer_state(checkpoint)
    if (merged or gguf) and base == "nf4" and not config.quantize:
        raise QLoraError(
            f"checkpoint {checkpoint} trained on an unquantized base (load_in_4bit: false); "
            "--base nf4 would merge onto weights it never saw, use --base original"
        )
    out = Path(out)
    _check_place(out)
    _check_out(out, force, [checkpoint, Path.cwd()])
    try:
        base_folder = resolve_model(config.base_model, config.revision)
    except QLoraError as err:
        raise QLoraError(f"cannot find the base model of checkpoint {checkpoint}: {err}") from None
    _check_out(out, force, [base_folder])
    base_model, revision = model_reference(config.base_model, config.revision, base_folder)
    config = dataclasses.replace(config, base_model=base_model, revision=revision)
    spec = read_spec(base_folder)
    skeleton = QLoRAModel(spec, lora_config(config))
    adapter = _read_adapter(checkpoint, skeleton, base_folder)
    if gguf:
        check_tokenizer(base_folder)

    round_trip = training_dtype(state) if base == "nf4" else None
    merge = Merge(base_folder, spec, adapter, skeleton.lora.scaling, round_trip)
    temp = out.parent / f".{out.name}.tmp-export-{os.getpid()}"
    shards, gguf_file = 0, None
    try:
        temp.mkdir(parents=True)
        if gguf:
            gguf_file = _write_gguf(temp, config, merge, gguf_type)
        elif merged:
            shards = _write_merged(temp, merge, dtype, max_bytes)
        else:
            save_tensors(adapter, temp / ADAPTER_WEIGHTS, metadata=SAFETENSORS_METADATA)
            write_json(temp / ADAPTER_CONFIG, adapter_config(skeleton, config))
        if not gguf:
            write_tokenizer(config, base_folder, temp)
        card = model_card(
            config,
            state,
            merged=merged or gguf,
            dtype=gguf_type if gguf else dtype,
            round_trip=round_trip,
            gguf_file=gguf_file,
            layout=spec.layout,
        )
        (temp / "README.md").write_text(card, encoding="utf-8")
        if out.exists():
            shutil.rmtree(out)
        temp.rename(out)
    except OSError as err:
        raise WriteFailed(f"could not write the export to {out}: {describe(err, temp)}") from None
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return ExportResult(out, checkpoint, merged or gguf, base, dtype, shards, gguf_type, gguf_file, notes)
