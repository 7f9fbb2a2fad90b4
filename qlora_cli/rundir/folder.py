"""The output_dir a run owns: whose it is, who writes it now, and whether it can hold the run.

A new run writes its id to `qlora_run.json` and into every checkpoint. `qlora train` into a folder that
holds another run's checkpoints or adapter refuses, or with `--overwrite` removes that run's files
first; `qlora resume` and `qlora export` read only the owner's checkpoints. While a run trains it holds
a lock on the folder, so no second process writes into it at the same time. All of this is checked
before any weights load, along with the folder being writable and having room for the run's files.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from qlora_cli.config.schema import TrainConfig
from qlora_cli.core.errors import QLoraError, WriteFailed
from qlora_cli.core.files import describe, replace_file
from qlora_cli.core.wording import byte_size
from qlora_cli.model.from_config import lora_config
from qlora_cli.rundir.checkpoint import (
    checkpoint_problem,
    checkpoint_run,
    checkpoints_and_stateless,
    foreign_files,
    list_checkpoints,
    readable_checkpoints,
    remove_checkpoint,
    run_checkpoints,
)
from qlora_cli.rundir.names import (
    ADAPTER_WEIGHTS,
    CHECKPOINT_NAME,
    DISCARD_PREFIX,
    LOCK_FILE,
    RUN_FILE,
    RUN_FILES,
    STATE_FILE,
    SUPERSEDED_PREFIX,
    TEMP_PREFIX,
    WRITE_PROBE_PREFIX,
)
from qlora_cli.rundir.trainer_state import is_checkpoint, read_trainer_state
from qlora_cli.sources.spec import ModelSpec

# A checkpoint holds the adapter, two AdamW moments of the same size, and small JSON/YAML files.
CHECKPOINT_ADAPTER_COPIES = 3
CHECKPOINT_OVERHEAD = 1 << 20


def owner_run(output_dir: Path) -> str | None:
    """The run that owns output_dir: the one qlora_run.json names, else the newest checkpoint's."""
    try:
        return json.loads((Path(output_dir) / RUN_FILE).read_text(encoding="utf-8"))["run_id"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    found = list(readable_checkpoints(output_dir))
    return found[-1][2] if found else None


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The newest checkpoint of the run that owns output_dir."""
    found = run_checkpoints(output_dir, owner_run(output_dir))
    return found[-1][1] if found else None


def usable_checkpoint(output_dir: Path, use_instead: Callable[[Path], str]) -> Path | None:
    """The owner's newest checkpoint, checked readable; None when it has none.

    A damaged newest checkpoint is an error naming it and the newest complete one, with
    `use_instead(that checkpoint)` saying how to continue from that one.
    """
    output_dir = Path(output_dir)
    run_id = owner_run(output_dir)
    damaged = None
    for _, folder in reversed(checkpoints_and_stateless(output_dir)):
        if not is_checkpoint(folder):
            damaged = damaged or f"checkpoint {folder} is incomplete: {STATE_FILE} is missing"
            continue
        try:
            if checkpoint_run(folder) != run_id:
                continue
        except QLoraError:
            pass
        problem = checkpoint_problem(folder)
        if problem is None and damaged is None:
            return folder
        if problem is None:
            raise QLoraError(f"{damaged}; the newest complete checkpoint is {folder}: " + use_instead(folder))
        damaged = damaged or problem
    if damaged is not None:
        raise QLoraError(f"{damaged}; no complete checkpoint is left in {output_dir}")
    return None


def earlier_run_files(output_dir: Path) -> list[Path]:
    """What a new run must not mix with: the checkpoints and final adapter of any run before it."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    return [
        entry
        for entry in sorted(output_dir.iterdir())
        if (
            entry.is_dir() and (CHECKPOINT_NAME.match(entry.name) or entry.name.startswith(SUPERSEDED_PREFIX))
        )
        or entry.name == ADAPTER_WEIGHTS
    ]


def foreign_checkpoints(output_dir: Path, run_id: str | None) -> list[Path]:
    """Readable checkpoints in output_dir that belong to a run other than `run_id`."""
    return [folder for _, folder, owner in readable_checkpoints(output_dir) if owner != run_id]


def check_new_run(output_dir: Path, overwrite: bool) -> None:
    """A new run may start in output_dir: it holds no earlier run's files, or `overwrite` removes them."""
    found = earlier_run_files(output_dir)
    if found and not overwrite and not _holds_a_run(output_dir, found):
        raise QLoraError(
            f"output_dir {output_dir} holds an adapter but no run (no {RUN_FILE}, no checkpoints), as "
            "`qlora export` writes one; choose another output_dir for the new run"
        )
    if found and not overwrite:
        names = ", ".join(entry.name for entry in found[:3]) + (", …" if len(found) > 3 else "")
        raise QLoraError(
            f"output_dir {output_dir} holds another run's files ({names}); continue that run with "
            f"`qlora resume {output_dir}`, choose a new output_dir, or add --overwrite "
            "(overwrite_output_dir: true) to delete them first"
        )
    for entry in found if overwrite else ():
        if entry.is_dir() and (why := _not_a_run_folder(entry)):
            raise QLoraError(
                f"output_dir {output_dir}: --overwrite deletes only what a run wrote, and {entry.name} {why}; "
                "move it out of output_dir first, or choose another output_dir"
            )


def _not_a_run_folder(folder: Path) -> str | None:
    """Why a folder named like a checkpoint holds what no run wrote, or None when it holds a checkpoint only."""
    if not is_checkpoint(folder):
        return f"is no checkpoint (it has no {STATE_FILE})"
    if foreign := foreign_files(folder):
        return f"holds {', '.join(foreign)}, which no checkpoint writes"
    return None


def is_run_folder(folder: Path) -> bool:
    """Whether a folder is a run's output_dir: it holds the run's file or checkpoints."""
    return (Path(folder) / RUN_FILE).is_file() or bool(list_checkpoints(folder))


def _holds_a_run(output_dir: Path, found: list[Path]) -> bool:
    """A run's folder has its run file or checkpoints; an adapter alone is an export (or a copy of one)."""
    return (Path(output_dir) / RUN_FILE).is_file() or any(entry.name != ADAPTER_WEIGHTS for entry in found)


def remove_run_files(output_dir: Path) -> None:
    """Every file and folder a run writes in output_dir; anything else there is left alone, in its
    checkpoint folders too (remove_checkpoint)."""
    for entry in Path(output_dir).iterdir():
        if entry.is_dir() and entry.name.startswith((TEMP_PREFIX, DISCARD_PREFIX)):
            shutil.rmtree(entry)
        elif entry.is_dir() and (
            CHECKPOINT_NAME.match(entry.name) or entry.name.startswith(SUPERSEDED_PREFIX)
        ):
            remove_checkpoint(entry)
        elif entry.name in RUN_FILES:
            entry.unlink()


def claim(output_dir: Path, run_id: str, *, overwrite: bool = False) -> None:
    """Make output_dir the run `run_id`'s: for a new run, after check_new_run; for a resume, its own."""
    output_dir = Path(output_dir)
    try:
        if overwrite:
            remove_run_files(output_dir)
        replace_file(output_dir / RUN_FILE, (json.dumps({"run_id": run_id}) + "\n").encode())
    except OSError as err:
        raise WriteFailed(f"could not prepare output_dir {output_dir}: {describe(err, output_dir)}") from None


def new_run_id() -> str:
    return uuid.uuid4().hex


def set_aside_newer(output_dir: Path, run_id: str | None, step: int) -> list[Path]:
    """Rename the run's checkpoints past `step` out of the way: a run resumed from an earlier
    checkpoint continues from there, and must never later resume from the abandoned continuation."""
    moved = []
    for later_step, folder in run_checkpoints(output_dir, run_id):
        if later_step > step:
            target = folder.with_name(SUPERSEDED_PREFIX + str(later_step))
            if target.exists():
                shutil.rmtree(target)
            folder.rename(target)
            moved.append(target)
    return moved


@contextmanager
def run_lock(output_dir: Path) -> Iterator[None]:
    """Hold output_dir for this process; another qlora process training into it is refused."""
    path = Path(output_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as err:
        raise QLoraError(f"output_dir {output_dir} is not writable: {describe(err, path)}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            raise QLoraError(
                f"output_dir {output_dir} is in use by another qlora process (pid {holder}); "
                "wait for it to finish or choose another output_dir"
            ) from None
        except OSError:
            pass  # a filesystem without locks: train unguarded, as before
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)


def preflight(output_dir: Path) -> None:
    """output_dir can be created and written into: checked before anything is loaded."""
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise QLoraError(f"output_dir {output_dir} exists and is not a folder")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise QLoraError(f"output_dir {output_dir} cannot be created: {describe(err, output_dir)}") from None
    probe = output_dir / f"{WRITE_PROBE_PREFIX}{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"qlora")
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        raise QLoraError(f"output_dir {output_dir} is not writable: {describe(err, probe)}") from None
    finally:
        with suppress(OSError):
            probe.unlink(missing_ok=True)


def adapter_bytes(spec: ModelSpec, config: TrainConfig) -> int:
    """Size of the saved adapter: every trained weight in fp32."""
    return 4 * lora_config(config).trained_weights(spec)


def space_needed(spec: ModelSpec, config: TrainConfig) -> int:
    """Two checkpoints (the one being written while the previous stays) and the final adapter."""
    adapter = adapter_bytes(spec, config)
    return 2 * (CHECKPOINT_ADAPTER_COPIES * adapter + CHECKPOINT_OVERHEAD) + adapter


def check_free_space(output_dir: Path, needed: int) -> None:
    free = shutil.disk_usage(output_dir).free
    if free < needed:
        raise QLoraError(
            f"output_dir {output_dir} has {byte_size(free)} free and this run needs about {byte_size(needed)} "
            "(two checkpoints and the final adapter); free some space or choose another output_dir"
        )


@dataclass
class Ownership:
    """The run a process trains under, and what claiming output_dir for it moved out of the way."""

    run_id: str | None
    set_aside: list[Path] = field(default_factory=list)


def _check_owner(output_dir: Path, resume_from: Path | None, overwrite: bool) -> Ownership:
    """A new run's fresh id once output_dir may take it; a resumed run keeps its checkpoint's."""
    if resume_from is None:
        check_new_run(output_dir, overwrite)
        return Ownership(new_run_id())
    ownership = Ownership(checkpoint_run(resume_from))
    others = foreign_checkpoints(output_dir, ownership.run_id)
    if others:
        raise QLoraError(
            f"cannot resume {resume_from} into {output_dir}: it holds checkpoints of another run "
            f"({others[-1].name}); resume into that run's own output_dir or a new one"
        )
    return ownership


@contextmanager
def owned_output_dir(
    output_dir: Path, *, resume_from: Path | None, overwrite: bool, writer: bool
) -> Iterator[Ownership]:
    """output_dir checked, claimed and locked for one run for as long as it trains, before anything loads.

    Only the writer (rank 0 under torchrun) creates, locks and changes the folder; the other processes
    check it the same way and go on.
    """
    output_dir = Path(output_dir)
    if not writer:
        yield _check_owner(output_dir, resume_from, overwrite)
        return
    preflight(output_dir)
    with run_lock(output_dir):
        ownership = _check_owner(output_dir, resume_from, overwrite)
        claim(output_dir, ownership.run_id, overwrite=resume_from is None and overwrite)
        if resume_from is not None:
            step = read_trainer_state(resume_from).step
            ownership.set_aside = set_aside_newer(output_dir, ownership.run_id, step)
        yield ownership
