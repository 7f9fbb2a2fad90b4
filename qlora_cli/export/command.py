"""`qlora export`: checks its options, finds the checkpoint and its base, and has the adapter, merged or
GGUF folder written, built under a temporary name and renamed into place at the end, so a failed export
leaves nothing half-written behind.
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from qlora_cli.core.errors import QLoraError, WriteFailed
from qlora_cli.core.files import describe, save_tensors, write_json
from qlora_cli.export.card import model_card
from qlora_cli.export.gguf.vocab import check_tokenizer
from qlora_cli.export.gguf.writer import DEFAULT_GGUF_TYPE, check_gguf_type, import_gguf
from qlora_cli.export.gguf_folder import write_gguf_folder
from qlora_cli.export.merge import DTYPES, Merge, training_dtype
from qlora_cli.export.out_folder import (
    check_out_path,
    move_into_place,
    out_path,
    remove_stale,
    replace_out,
    temp_folder,
)
from qlora_cli.export.shards import SAFETENSORS_METADATA, parse_size, write_merged
from qlora_cli.export.tokenizer_files import write_generation_config, write_tokenizer
from qlora_cli.model.decoder import QLoRAModel
from qlora_cli.model.from_config import lora_config
from qlora_cli.rundir.adapter import (
    adapted_projections,
    adapter_config,
    adapter_state_dict,
    load_adapter_state,
)
from qlora_cli.rundir.base_model import checkpoint_base
from qlora_cli.rundir.checkpoint import read_checkpoint_adapter, read_checkpoint_config
from qlora_cli.rundir.folder import is_run_folder, usable_checkpoint
from qlora_cli.rundir.names import ADAPTER_CONFIG, ADAPTER_WEIGHTS, STATE_FILE, names_a_checkpoint_folder
from qlora_cli.rundir.trainer_state import is_checkpoint, read_trainer_state
from qlora_cli.sources.hub import model_reference, resolve_model
from qlora_cli.sources.model_config import read_spec

BASES = ("original", "nf4")
DEFAULT_BASE, DEFAULT_DTYPE, DEFAULT_SHARD_SIZE = "original", "bfloat16", "5GB"


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
    if found is None and path.is_file():
        raise QLoraError(
            f"{path} is a file; give a checkpoint-<step> folder or a run's output_dir (a config's output_dir "
            "holds its run)"
        )
    if found is None:
        raise QLoraError(
            f"{path} holds no complete checkpoint (a checkpoint-<step> folder with {STATE_FILE})"
        )
    return found


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
    out: str | Path,
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
    out = out_path(out)
    check_out_path(out)
    checkpoint = find_checkpoint(source)
    config, notes = checkpoint_base(checkpoint, read_checkpoint_config(checkpoint), base_model)
    state = read_trainer_state(checkpoint)
    if (merged or gguf) and base == "nf4" and not config.quantize:
        raise QLoraError(
            f"checkpoint {checkpoint} trained on an unquantized base (load_in_4bit: false); "
            "--base nf4 would merge onto weights it never saw, use --base original"
        )
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
    merge = Merge(base_folder, spec, adapter, skeleton.lora.scaling, round_trip, skeleton.lora.expert_targets)
    notes.extend(remove_stale(out))
    temp = temp_folder(out)
    shards, gguf_file = 0, None
    try:
        temp.mkdir(parents=True)
        if gguf:
            gguf_file = write_gguf_folder(temp, config, merge, gguf_type)
        elif merged:
            shards = write_merged(temp, merge, dtype, max_bytes)
        else:
            save_tensors(adapter, temp / ADAPTER_WEIGHTS, metadata=SAFETENSORS_METADATA)
            write_json(temp / ADAPTER_CONFIG, adapter_config(skeleton, config))
        if not gguf:
            write_tokenizer(config, base_folder, temp)
        if merged:
            write_generation_config(config, base_folder, temp)
        card = model_card(
            config,
            state,
            merged=merged or gguf,
            dtype=gguf_type if gguf else dtype,
            round_trip=round_trip,
            targets=[
                *sorted(adapted_projections(skeleton)),
                *(f"experts.{name}" for name in skeleton.lora.expert_targets),
            ],
            gguf_file=gguf_file,
            layout=spec.layout,
        )
        (temp / "README.md").write_text(card, encoding="utf-8")
        if force:
            notes.extend(replace_out(temp, out))
        else:
            move_into_place(temp, out)
    except OSError as err:
        raise WriteFailed(f"could not write the export to {out}: {describe(err, temp)}") from None
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return ExportResult(out, checkpoint, merged or gguf, base, dtype, shards, gguf_type, gguf_file, notes)
