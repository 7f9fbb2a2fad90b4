"""Turn a `base_model` or dataset setting into a local folder: a path as is, a hub repo through its cache.

Only the files qlora reads are fetched (safetensors, JSON, tokenizer files), never pickles. The hub's own
cache is the offline store: with HF_HUB_OFFLINE=1, or when the hub cannot be reached, a snapshot that was
downloaded before is used as is.
"""

from __future__ import annotations

import fnmatch
import glob
import importlib
import os
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import HfApi, constants, snapshot_download
from huggingface_hub.utils import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from qlora_cli.core.errors import QLoraError
from qlora_cli.sources.dataset_files import DATA_SUFFIXES
from qlora_cli.sources.hf_files import (
    GENERATION_CONFIG,
    MODEL_CONFIG,
    SAFETENSORS_INDEX,
    TOKENIZER_FILE,
    TOKENIZER_FILES,
)

MODEL_FILE_PATTERNS = (
    MODEL_CONFIG,
    GENERATION_CONFIG,
    "*.safetensors",
    SAFETENSORS_INDEX,
    *TOKENIZER_FILES,
)
# Every format qlora reads: else a snapshot another tool had downloaded whole would train on files that
# a fresh download leaves out.
DATASET_FILE_PATTERNS = tuple(f"*{suffix}" for suffix in DATA_SUFFIXES)

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_TRUE_VALUES = {"1", "ON", "YES", "TRUE"}


@dataclass(frozen=True)
class _HubRepo:
    """One repo at one revision, with what we need from it."""

    repo_id: str
    revision: str | None
    repo_type: str
    patterns: tuple[str, ...]
    required_suffixes: tuple[str, ...]
    missing_files_message: str
    choose: Callable[[list[str]], list[str]] | None = None

    @property
    def name(self) -> str:
        kind = "dataset repo" if self.repo_type == "dataset" else "repo"
        return f"{kind} '{self.repo_id}'"

    @property
    def revision_name(self) -> str:
        return self.revision or constants.DEFAULT_REVISION

    @property
    def label(self) -> str:
        return f"{self.name} (revision '{self.revision_name}')"


def resolve_model(
    base_model: str,
    revision: str | None = None,
    *,
    token: str | None = None,
    cache_dir: str | Path | None = None,
) -> Path:
    """Local folder holding the model's config, safetensors weights and tokenizer files."""
    return _model_folder(
        base_model,
        revision,
        token,
        cache_dir,
        holds="config.json and the weights",
        patterns=MODEL_FILE_PATTERNS,
        required_suffixes=(".safetensors",),
        missing_files_message="has no safetensors weights; qlora reads safetensors only, never pickled .bin files",
    )


def resolve_tokenizer(
    base_model: str,
    revision: str | None = None,
    *,
    token: str | None = None,
    cache_dir: str | Path | None = None,
) -> Path:
    """Local folder holding the model's config.json and tokenizer files, without fetching the weights."""
    return _model_folder(
        base_model,
        revision,
        token,
        cache_dir,
        holds=TOKENIZER_FILE,
        patterns=(MODEL_CONFIG, *TOKENIZER_FILES),
        required_suffixes=(TOKENIZER_FILE,),
        missing_files_message="has no tokenizer.json; qlora reads fast tokenizers only",
    )


def _model_folder(
    base_model: str,
    revision: str | None,
    token: str | None,
    cache_dir: str | Path | None,
    *,
    holds: str,
    patterns: tuple[str, ...],
    required_suffixes: tuple[str, ...],
    missing_files_message: str,
) -> Path:
    """A local model folder as it is, or a hub model repo's snapshot of `patterns`."""
    local = _existing_local_path(base_model, revision, noun="model folder")
    if local is not None:
        if not local.is_dir():
            raise QLoraError(f"base_model '{base_model}' is a file; give the folder that holds {holds}")
        return local
    repo = _HubRepo(
        repo_id=base_model,
        revision=revision,
        repo_type="model",
        patterns=patterns,
        required_suffixes=required_suffixes,
        missing_files_message=missing_files_message,
    )
    return _download(repo, token=token, cache_dir=cache_dir)


def model_reference(base_model: str, revision: str | None, folder: Path) -> tuple[str, str | None]:
    """How a saved config names the model that `resolve_model` found in `folder`, so that it is found
    again from any directory: a local folder by its absolute path, a hub repo by its id and the commit
    its snapshot was downloaded at (later pushes to the repo do not change a run's weights)."""
    if Path(base_model).expanduser().exists():
        return str(folder), revision
    return base_model, snapshot_commit(folder) or revision


def snapshot_commit(folder: Path) -> str | None:
    """The commit a hub snapshot was downloaded at (huggingface_hub's cache names the folder so), or
    None for any other folder."""
    if folder.parent.name == "snapshots" and _COMMIT.fullmatch(folder.name):
        return folder.name
    return None


def resolve_dataset(
    path_or_repo: str,
    revision: str | None = None,
    *,
    token: str | None = None,
    cache_dir: str | Path | None = None,
    choose: Callable[[list[str]], list[str]] | None = None,
) -> Path:
    """Local data file or folder, or the folder of a hub dataset repo's data files (qlora_cli/data/files.py).

    choose: given the repo's data files, the ones to download (e.g. one split's); offline, the cache
    holds what it holds.
    """
    local = _existing_local_path(
        path_or_repo, revision, noun="dataset file or folder", file_suffixes=DATA_SUFFIXES
    )
    if local is not None:
        return local
    repo = _HubRepo(
        repo_id=path_or_repo,
        revision=revision,
        repo_type="dataset",
        patterns=DATASET_FILE_PATTERNS,
        required_suffixes=DATA_SUFFIXES,
        missing_files_message=f"has no {', '.join(DATA_SUFFIXES)} files; qlora reads only those formats",
        choose=choose,
    )
    return _download(repo, token=token, cache_dir=cache_dir)


def _existing_local_path(
    value: str, revision: str | None, *, noun: str, file_suffixes: tuple[str, ...] = ()
) -> Path | None:
    """The absolute path when `value` exists on disk; an error when it looks like a path but does not exist.

    A name ending in one of `file_suffixes` counts as a path: 'data/train.jsonl' is a missing file, not a repo.
    """
    path = Path(value).expanduser()
    if path.exists():
        if revision is not None:
            raise QLoraError(
                f"'{value}' is a local {noun}, so revision '{revision}' cannot apply; "
                "remove the revision or give a hub repo id"
            )
        return path.resolve()
    looks_local = (
        value.startswith((".", "/", "~"))
        or (os.sep in value and not _REPO_ID.fullmatch(value))
        or value.endswith(file_suffixes)
    )
    if looks_local:
        raise QLoraError(
            f"{noun} '{value}' does not exist; check the path, or give a hub repo id like 'org/name'"
        )
    return None


def _download(repo: _HubRepo, *, token: str | None, cache_dir: str | Path | None) -> Path:
    """Snapshot of the wanted files; checks the file list first so nothing is fetched from an unusable repo."""
    offline = _offline_mode_requested()
    with _as_qlora_errors(repo, offline_mode=offline):
        patterns = list(repo.patterns)
        if not offline:
            try:
                remote = _remote_files(repo, token)
                _require_files(repo, remote)
                if repo.choose is not None:
                    wanted = [n for n in remote if any(fnmatch.fnmatch(n, p) for p in repo.patterns)]
                    patterns = [glob.escape(name) for name in repo.choose(wanted)] or patterns
            except _unreachable_errors():
                offline = True
            except HfHubHTTPError as error:
                if not _is_server_failure(error):
                    raise
                offline = True
        folder = Path(
            snapshot_download(
                repo.repo_id,
                repo_type=repo.repo_type,
                revision=repo.revision,
                allow_patterns=patterns,
                token=token,
                cache_dir=cache_dir,
                local_files_only=offline,
            )
        )
    if offline:
        _require_files(repo, (p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()))
    return folder


def _remote_files(repo: _HubRepo, token: str | None) -> list[str]:
    """The file list from repo_info: one request that fails at once offline (the tree listing retries for ~20 s)."""
    info = HfApi().repo_info(repo.repo_id, repo_type=repo.repo_type, revision=repo.revision, token=token)
    return [sibling.rfilename for sibling in info.siblings or []]


def _require_files(repo: _HubRepo, files: Iterable[str]) -> None:
    if not any(name.endswith(repo.required_suffixes) for name in files):
        raise QLoraError(f"{repo.label} {repo.missing_files_message}")


def _offline_mode_requested() -> bool:
    """HF_HUB_OFFLINE, read per call: huggingface_hub reads it once at import, which misses later changes."""
    return constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE_VALUES


def _unreachable_errors() -> tuple[type[BaseException], ...]:
    """Connection failures of the HTTP library under this huggingface_hub (requests, httpx or httpx2)."""
    errors: list[type[BaseException]] = [OfflineModeIsEnabled]
    for module_name, names in (
        ("httpx2", ("ConnectError", "TimeoutException")),
        ("httpx", ("ConnectError", "TimeoutException")),
        ("requests", ("ConnectionError", "Timeout")),
    ):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        errors.extend(getattr(module, name) for name in names)
    return tuple(errors)


def _is_server_failure(error: HfHubHTTPError) -> bool:
    response = getattr(error, "response", None)
    return response is not None and response.status_code >= 500


@contextmanager
def _as_qlora_errors(repo: _HubRepo, *, offline_mode: bool) -> Iterator[None]:
    """One clear line per hub failure; the messages never include the token."""
    try:
        yield
    except GatedRepoError as error:
        raise QLoraError(
            f"{repo.label} is gated: accept its terms on the hub page with your account, "
            "then set HF_TOKEN (or run `hf auth login`) with a token of that account"
        ) from error
    except RepositoryNotFoundError as error:
        raise QLoraError(
            f"{repo.name} not found on the hub (check the name, or log in / set HF_TOKEN if it is private)"
        ) from error
    except RevisionNotFoundError as error:
        raise QLoraError(
            f"revision '{repo.revision_name}' not found in {repo.name}; "
            "give an existing branch, tag or commit hash"
        ) from error
    except HFValidationError as error:
        raise QLoraError(
            f"'{repo.repo_id}' is neither an existing local path nor a valid hub repo id like 'org/name'"
        ) from error
    except LocalEntryNotFoundError as error:
        reason = (
            "HF_HUB_OFFLINE is set, so it cannot be downloaded; unset HF_HUB_OFFLINE"
            if offline_mode
            else "the hub cannot be reached; check the network connection"
        )
        raise QLoraError(f"{repo.label} is not in the local cache and {reason}") from error
    except HfHubHTTPError as error:
        status = getattr(getattr(error, "response", None), "status_code", None)
        if status in (401, 403):
            raise QLoraError(
                f"the hub refused the token for {repo.label} (HTTP {status}); "
                "check HF_TOKEN or log in again with `hf auth login`"
            ) from error
        raise QLoraError(f"the hub answered HTTP {status} for {repo.label}; try again later") from error
    except _unreachable_errors() as error:
        raise QLoraError(
            f"the connection to the hub broke while downloading {repo.label}; check the network and run again"
        ) from error
