"""A local stand-in for the Hugging Face Hub that the real huggingface_hub client talks to over HTTP.

It answers the public endpoints behind `repo_info`, `list_repo_tree`, `hf_hub_download` and
`snapshot_download`, and fails the way the hub does (status code plus `X-Error-Code`), so the client
raises its own exception types. Files are served directly with their ETag and size: no redirect to a
CDN and no xet headers, so the client takes its plain HTTP download path.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from huggingface_hub import _snapshot_download, constants, file_download, hf_api

_REPO = r"(?P<repo>[^/]+(?:/[^/]+)?)"
_TREE_URL = re.compile(rf"/api/(?P<kind>models|datasets)/{_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?")
_INFO_URL = re.compile(rf"/api/(?P<kind>models|datasets)/{_REPO}(?:/revision/(?P<rev>[^/]+))?")
_RESOLVE_URL = re.compile(rf"/(?:(?P<kind>datasets)/)?{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".parquet")


@dataclass
class FakeRepo:
    """A repo's branches and tags, each a full set of files; `tokens` may read a gated or private repo."""

    revisions: dict[str, dict[str, bytes]]
    repo_type: str = "model"
    gated: bool = False
    private: bool = False
    tokens: frozenset[str] = frozenset()


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str
    token: str | None


@dataclass
class _Reply:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


class FakeHub:
    """Serves `repos` (repo id -> FakeRepo) on 127.0.0.1 from a daemon thread while the context is open."""

    def __init__(self, repos: dict[str, FakeRepo]):
        self.repos = repos
        self.requests: list[RecordedRequest] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> FakeHub:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        hub = self

        class Handler(_HubRequestHandler):
            fake_hub = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Close the port: afterwards the client's connections are refused, as with no network."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        self._server = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def commit(self, repo_id: str, revision: str = "main") -> str:
        """The 40-hex commit id the hub reports for `revision`."""
        if _COMMIT.fullmatch(revision):
            return revision  # an earlier commit, kept by push()
        repo = self.repos[repo_id]
        digest = hashlib.sha1(f"{repo.repo_type}/{repo_id}@{revision}".encode())
        for path, data in sorted(repo.revisions[revision].items()):
            digest.update(path.encode() + b"\0" + data)
        return digest.hexdigest()

    def push(self, repo_id: str, files: dict[str, bytes]) -> None:
        """A new commit on main; the one it replaces stays reachable by its id, as on the hub."""
        repo = self.repos[repo_id]
        repo.revisions[self.commit(repo_id)] = repo.revisions["main"]
        repo.revisions["main"] = files

    def fetched_files(self, repo_id: str) -> set[str]:
        """Files of `repo_id` whose metadata or content the client asked for (HEAD or GET on /resolve)."""
        fetched = set()
        for request in self.requests:
            match = _RESOLVE_URL.fullmatch(request.path)
            if match and match["repo"] == repo_id:
                fetched.add(match["path"])
        return fetched

    def clear_requests(self) -> None:
        with self._lock:
            self.requests.clear()

    def record(self, request: RecordedRequest) -> None:
        with self._lock:
            self.requests.append(request)

    def answer(self, method: str, raw_path: str, token: str | None) -> _Reply:
        path, _, query = raw_path.partition("?")
        if match := _TREE_URL.fullmatch(path):
            return self._tree(match, token, recursive=_flag(query, "recursive"))
        if match := _INFO_URL.fullmatch(path):
            return self._info(match, token)
        if match := _RESOLVE_URL.fullmatch(path):
            return self._resolve(match, token, with_body=method == "GET")
        return _error(404, "NotFound", f"no route for {path}")

    def _find(self, match: re.Match, token: str | None) -> tuple[str, FakeRepo, str, str] | _Reply:
        """(repo id, repo, revision name, commit) or the hub's error for a hidden repo or unknown revision."""
        repo_id = unquote(match["repo"])
        repo_type = "dataset" if match["kind"] == "datasets" else "model"
        repo = self.repos.get(repo_id)
        if repo is None or repo.repo_type != repo_type or (repo.private and token not in repo.tokens):
            # The hub hides a repo it will not show as 401 to anonymous callers, 404 to signed-in ones.
            return _error(401 if token is None else 404, "RepoNotFound", "Repository not found")
        wanted = unquote(match["rev"] or "main")
        for name in repo.revisions:
            commit = self.commit(repo_id, name)
            if wanted in (name, commit):
                return repo_id, repo, name, commit
        return _error(404, "RevisionNotFound", f"Invalid rev id: {wanted}")

    def _info(self, match: re.Match, token: str | None) -> _Reply:
        found = self._find(match, token)
        if isinstance(found, _Reply):
            return found
        repo_id, repo, revision, commit = found
        info = {
            "_id": commit[:24],
            "id": repo_id,
            "author": repo_id.split("/")[0],
            "sha": commit,
            "lastModified": "2024-01-01T00:00:00.000Z",
            "private": repo.private,
            "gated": "manual" if repo.gated else False,
            "disabled": False,
            "tags": [],
            "downloads": 0,
            "likes": 0,
            "siblings": [{"rfilename": path} for path in sorted(repo.revisions[revision])],
        }
        if repo.repo_type == "model":
            info["modelId"] = repo_id
        return _json(info)

    def _tree(self, match: re.Match, token: str | None, *, recursive: bool) -> _Reply:
        found = self._find(match, token)
        if isinstance(found, _Reply):
            return found
        _, repo, revision, commit = found
        prefix = unquote(match["path"] or "").strip("/")
        entries: dict[str, dict] = {}
        for path, data in sorted(repo.revisions[revision].items()):
            if prefix and not path.startswith(prefix + "/"):
                continue
            parts = path.split("/")
            first_level = len(prefix.split("/")) + 1 if prefix else 1
            last_level = len(parts) if recursive else first_level
            for level in range(first_level, min(last_level, len(parts) - 1) + 1):
                folder = "/".join(parts[:level])
                entries.setdefault(
                    folder, {"type": "directory", "oid": _git_blob_id(folder.encode()), "path": folder}
                )
            if len(parts) <= last_level:
                entries[path] = _tree_file(path, data)
        if prefix and not entries:
            return _error(404, "EntryNotFound", f"{prefix} does not exist on {revision}", commit)
        return _json(list(entries.values()))

    def _resolve(self, match: re.Match, token: str | None, *, with_body: bool) -> _Reply:
        found = self._find(match, token)
        if isinstance(found, _Reply):
            return found
        repo_id, repo, revision, commit = found
        if repo.gated and token not in repo.tokens:
            if token is None:
                message = f"Access to {repo.repo_type} {repo_id} is restricted. You must have access to it and be authenticated to access it. Please log in."
                return _error(401, "GatedRepo", message)
            message = (
                f"Access to {repo.repo_type} {repo_id} is restricted and you are not in the authorized list."
            )
            return _error(403, "GatedRepo", message)
        path = unquote(match["path"])
        data = repo.revisions[revision].get(path)
        if data is None:
            return _error(404, "EntryNotFound", "Entry not found", commit)
        headers = {
            "Content-Type": "application/octet-stream",
            "Content-Length": str(len(data)),
            "ETag": f'"{_etag(path, data)}"',
            "X-Repo-Commit": commit,
            "Accept-Ranges": "bytes",
        }
        return _Reply(200, headers, data if with_body else b"")


class _HubRequestHandler(BaseHTTPRequestHandler):
    """HTTP/1.0 (one request per connection): once the hub is stopped no open connection can still answer."""

    fake_hub: FakeHub

    def do_GET(self) -> None:
        self._handle("GET")

    def do_HEAD(self) -> None:
        self._handle("HEAD")

    def _handle(self, method: str) -> None:
        authorization = self.headers.get("Authorization", "")
        token = authorization.removeprefix("Bearer ").strip() or None
        self.fake_hub.record(RecordedRequest(method, unquote(urlsplit(self.path).path), token))
        reply = self.fake_hub.answer(method, self.path, token)
        self.send_response(reply.status)
        for name, value in reply.headers.items():
            self.send_header(name, value)
        if "Content-Length" not in reply.headers:
            self.send_header("Content-Length", str(len(reply.body)))
        self.end_headers()
        if method == "GET":
            self.wfile.write(reply.body)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the recorded requests are the log."""


def use_fake_hub(monkeypatch, hub: FakeHub, hf_home: Path) -> None:
    """Point huggingface_hub at `hub` with a clean home: no stored login, no token, online, no telemetry.

    huggingface_hub copies HF_ENDPOINT, the HF_HOME paths and HF_HUB_OFFLINE into `huggingface_hub.constants`
    once, when it is first imported, so by the time a test runs setting the environment alone changes nothing:
    the constants are patched too, and both are restored after the test.
    """
    hf_home.mkdir(parents=True, exist_ok=True)
    for name in (
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HF_HUB_CACHE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    copied_at_import = {
        "ENDPOINT": hub.url,
        "HUGGINGFACE_CO_URL_TEMPLATE": hub.url + "/{repo_id}/resolve/{revision}/{filename}",
        "HF_HOME": str(hf_home),
        "HF_HUB_CACHE": str(hf_home / "hub"),
        "HF_TOKEN_PATH": str(hf_home / "token"),
        "HF_STORED_TOKENS_PATH": str(hf_home / "stored_tokens"),
        "HF_HUB_OFFLINE": False,
        "HF_HUB_DISABLE_TELEMETRY": True,
    }
    # Older releases also import some of these names into other modules; patch every copy there is.
    for module in (constants, file_download, hf_api, _snapshot_download):
        for name, value in copied_at_import.items():
            if hasattr(module, name):
                monkeypatch.setattr(module, name, value)


def _flag(query: str, name: str) -> bool:
    return parse_qs(query).get(name, ["false"])[-1].lower() in ("1", "true")


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _etag(path: str, data: bytes) -> str:
    """Large (LFS) files are known by their sha256, the rest by their git blob id, as on the hub."""
    return hashlib.sha256(data).hexdigest() if path.endswith(_LFS_SUFFIXES) else _git_blob_id(data)


def _tree_file(path: str, data: bytes) -> dict:
    entry = {"type": "file", "oid": _git_blob_id(data), "size": len(data), "path": path}
    if path.endswith(_LFS_SUFFIXES):
        entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
    return entry


def _json(payload: object) -> _Reply:
    return _Reply(200, {"Content-Type": "application/json"}, json.dumps(payload).encode())


def _error(status: int, code: str, message: str, commit: str | None = None) -> _Reply:
    headers = {"Content-Type": "application/json", "X-Error-Code": code, "X-Error-Message": message}
    if commit is not None:
        headers["X-Repo-Commit"] = commit
    return _Reply(status, headers, json.dumps({"error": message}).encode())
