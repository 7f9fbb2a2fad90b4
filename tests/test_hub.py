"""resolve_model / resolve_dataset through the real huggingface_hub client against a local fake hub."""

import json

import pytest
from fake_hub import FakeHub, FakeRepo, use_fake_hub

from qlora_cli.core.errors import QLoraError
from qlora_cli.sources.hub import resolve_dataset, resolve_model, resolve_tokenizer

GRANTED_TOKEN = "hf_granted_test_token"
OTHER_TOKEN = "hf_other_test_token"

MODEL_FILES = {
    "config.json": json.dumps({"model_type": "qwen2", "hidden_size": 64}).encode(),
    "generation_config.json": b"{}",
    "model-00001-of-00002.safetensors": b"shard one",
    "model-00002-of-00002.safetensors": b"shard two",
    "model.safetensors.index.json": b'{"weight_map": {}}',
    "tokenizer.json": b"{}",
    "tokenizer_config.json": b"{}",
    "special_tokens_map.json": b"{}",
    "vocab.json": b"{}",
    "merges.txt": b"#version: 0.2\n",
    "added_tokens.json": b"{}",
    "chat_template.jinja": b"{{ messages }}",
}
NEVER_FETCHED = {
    "README.md": b"# tiny",
    ".gitattributes": b"*.safetensors filter=lfs",
    "pytorch_model.bin": b"pickle",
    "original/consolidated.pth": b"pickle",
    "onnx/model.onnx": b"onnx",
}
V1_FILES = {"config.json": b'{"revision": "v1"}', "model.safetensors": b"v1 weights", "tokenizer.json": b"{}"}
SMALL_MODEL = {"config.json": b"{}", "model.safetensors": b"weights"}
DATASET_FILES = {
    "data/train.jsonl": b'{"text": "hello"}\n',
    "data/extra.parquet": b"PAR1",
    "data/more.jsonl.gz": b"gzip",
    "data/raw.tsv": b"a\tb",
    "README.md": b"# chats",
    "loader.py": b"print('never run')",
}


@pytest.fixture
def hub(monkeypatch, tmp_path):
    repos = {
        "qwen/tiny": FakeRepo({"main": {**MODEL_FILES, **NEVER_FETCHED}, "v1": V1_FILES}),
        "qwen/bin-only": FakeRepo({"main": {"config.json": b"{}", "pytorch_model.bin": b"pickle"}}),
        "meta/gated": FakeRepo({"main": SMALL_MODEL}, gated=True, tokens=frozenset({GRANTED_TOKEN})),
        "org/private": FakeRepo({"main": SMALL_MODEL}, private=True, tokens=frozenset({GRANTED_TOKEN})),
        "org/chats": FakeRepo({"main": DATASET_FILES}, repo_type="dataset"),
    }
    with FakeHub(repos) as server:
        use_fake_hub(monkeypatch, server, tmp_path / "hf_home")
        yield server


def files_in(folder):
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def test_existing_local_folder_is_returned_as_is(hub, tmp_path, monkeypatch):
    folder = tmp_path / "my-model"
    folder.mkdir()
    monkeypatch.chdir(tmp_path)

    assert resolve_model(str(folder)) == folder.resolve()
    assert resolve_model("./my-model") == folder.resolve()
    assert resolve_model("my-model").is_absolute()
    assert hub.requests == []


def test_local_folder_with_a_revision_is_refused(tmp_path):
    with pytest.raises(QLoraError, match="revision 'v1' cannot apply"):
        resolve_model(str(tmp_path), revision="v1")


@pytest.mark.parametrize(
    "path", ["./missing-model", "/nonexistent/qlora/model", "models/qwen/missing", "~/no-qlora-model"]
)
def test_missing_local_path_is_refused(hub, path):
    with pytest.raises(QLoraError, match=f"model folder '{path}' does not exist"):
        resolve_model(path)
    assert hub.requests == []


def test_invalid_repo_id_is_refused(hub):
    with pytest.raises(QLoraError, match="neither an existing local path nor a valid hub repo id"):
        resolve_model("not a repo!")


def test_download_fetches_only_the_files_qlora_reads(hub, tmp_path):
    cache = tmp_path / "explicit-cache"

    folder = resolve_model("qwen/tiny", cache_dir=cache)

    assert folder.is_relative_to(cache)
    assert files_in(folder) == set(MODEL_FILES)
    assert hub.fetched_files("qwen/tiny") == set(MODEL_FILES)
    assert (folder / "model-00002-of-00002.safetensors").read_bytes() == b"shard two"


def test_tokenizer_download_leaves_the_weights(hub):
    folder = resolve_tokenizer("qwen/tiny")

    tokenizer_files = {name for name in MODEL_FILES if not name.startswith(("model", "generation"))}
    assert files_in(folder) == tokenizer_files
    assert hub.fetched_files("qwen/tiny") == tokenizer_files
    with pytest.raises(QLoraError, match="repo 'qwen/bin-only' .* has no tokenizer.json"):
        resolve_tokenizer("qwen/bin-only")


def test_revision_selects_that_revisions_files(hub):
    v1 = resolve_model("qwen/tiny", revision="v1")
    main = resolve_model("qwen/tiny")
    by_commit = resolve_model("qwen/tiny", revision=hub.commit("qwen/tiny", "v1"))

    assert json.loads((v1 / "config.json").read_text()) == {"revision": "v1"}
    assert json.loads((main / "config.json").read_text())["model_type"] == "qwen2"
    assert files_in(v1) == {"config.json", "model.safetensors", "tokenizer.json"}
    assert by_commit == v1


def test_offline_mode_uses_the_cache_without_any_request(hub, monkeypatch):
    online = resolve_model("qwen/tiny")
    hub.clear_requests()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    assert resolve_model("qwen/tiny") == online
    assert hub.requests == []


def test_unreachable_hub_falls_back_to_the_cache(hub):
    online = resolve_model("qwen/tiny")
    hub.stop()

    assert resolve_model("qwen/tiny") == online
    with pytest.raises(
        QLoraError,
        match=r"repo 'qwen/tiny' \(revision 'v1'\) is not in the local cache and the hub cannot be reached",
    ):
        resolve_model("qwen/tiny", revision="v1")


def test_not_cached_and_offline_is_refused(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        QLoraError, match=r"repo 'qwen/tiny' \(revision 'main'\) is not in the local cache.*HF_HUB_OFFLINE"
    ):
        resolve_model("qwen/tiny")
    assert hub.requests == []


def test_missing_repo_is_reported_with_its_name(hub):
    with pytest.raises(
        QLoraError, match=r"repo 'nobody/nothing' not found on the hub \(check the name.*HF_TOKEN"
    ):
        resolve_model("nobody/nothing")


def test_missing_revision_is_reported_with_repo_and_revision(hub):
    with pytest.raises(QLoraError, match="revision 'no-such-branch' not found in repo 'qwen/tiny'"):
        resolve_model("qwen/tiny", revision="no-such-branch")


@pytest.mark.parametrize("token", [None, OTHER_TOKEN])
def test_gated_repo_without_access_is_explained(hub, token):
    with pytest.raises(
        QLoraError, match=r"repo 'meta/gated' \(revision 'main'\) is gated.*HF_TOKEN"
    ) as caught:
        resolve_model("meta/gated", token=token)
    assert OTHER_TOKEN not in str(caught.value)


def test_gated_repo_downloads_with_a_granted_token(hub, monkeypatch):
    assert files_in(resolve_model("meta/gated", token=GRANTED_TOKEN)) == set(SMALL_MODEL)
    monkeypatch.setenv("HF_TOKEN", GRANTED_TOKEN)
    assert files_in(resolve_model("meta/gated")) == set(SMALL_MODEL)
    assert {r.token for r in hub.requests if "/resolve/" in r.path} == {GRANTED_TOKEN}


def test_private_repo_needs_its_token(hub):
    with pytest.raises(QLoraError, match="repo 'org/private' not found on the hub"):
        resolve_model("org/private")
    assert files_in(resolve_model("org/private", token=GRANTED_TOKEN)) == set(SMALL_MODEL)


def test_repo_with_only_pickled_weights_is_refused_before_any_download(hub):
    with pytest.raises(
        QLoraError, match="repo 'qwen/bin-only' .*has no safetensors weights; qlora reads safetensors only"
    ):
        resolve_model("qwen/bin-only")
    assert hub.fetched_files("qwen/bin-only") == set()


def test_dataset_repo_downloads_only_data_files(hub):
    folder = resolve_dataset("org/chats")

    read = {"data/train.jsonl", "data/extra.parquet", "data/more.jsonl.gz"}
    assert files_in(folder) == read
    assert hub.fetched_files("org/chats") == read
    assert all(r.path.startswith(("/api/datasets/", "/datasets/")) for r in hub.requests)


def test_local_dataset_file_is_returned_as_is(hub, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "hi"}\n')
    assert resolve_dataset(str(data)) == data.resolve()
    assert hub.requests == []


def test_dataset_errors_name_the_path_or_repo(hub):
    with pytest.raises(QLoraError, match="dataset file or folder 'data/train.jsonl' does not exist"):
        resolve_dataset("data/train.jsonl")
    with pytest.raises(QLoraError, match="dataset repo 'org/missing' not found on the hub"):
        resolve_dataset("org/missing")
    with pytest.raises(QLoraError, match="revision 'v9' not found in dataset repo 'org/chats'"):
        resolve_dataset("org/chats", revision="v9")
