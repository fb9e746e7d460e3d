"""A minimal Hugging Face hub on loopback: just the requests `snapshot_download` makes.

Point HF_ENDPOINT at `FakeHub.url` and the real huggingface_hub download path runs against it:

- GET /api/models/{repo}/revision/{rev}: repo info, {"id", "sha", "siblings"}
- GET /api/models/{repo}/tree/{rev}: the file listing, [{"type", "path", "size", "oid"}]
- HEAD and GET /{repo}/resolve/{rev}/{path}: the bytes, with the headers huggingface_hub checks
  (ETag, X-Repo-Commit, Content-Length)

Errors look like the hub's: a status plus X-Error-Code (RepoNotFound, RevisionNotFound,
EntryNotFound, GatedRepo). A gated repo serves its listing to anyone but its files only with
`Authorization: Bearer <token>` (401 without a token, 403 with another), as the hub does.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LOOPBACK = "127.0.0.1"
_API_RE = re.compile(r"^/api/models/([^/]+/[^/]+)/(revision|tree)/([^/]+)$")
_RESOLVE_RE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


@dataclass
class FakeRepo:
    files: dict[str, bytes]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    gated_token: str | None = None  # files need this bearer token
    branch: str = "main"

    @classmethod
    def from_folder(cls, folder: Path, **kwargs) -> FakeRepo:
        files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
        return cls(files=files, **kwargs)


@dataclass
class FakeHub:
    repos: dict[str, FakeRepo]
    # (method, path) of every request, in order; tests count downloads with it
    requests: list[tuple[str, str]] = field(default_factory=list)
    # set() to hold file GETs open (to observe a download in progress); set by default
    release_downloads: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.release_downloads.set()
        self._server: ThreadingHTTPServer | None = None
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        assert self._server is not None, "start() first"
        return f"http://{LOOPBACK}:{self._server.server_address[1]}"

    def start(self) -> FakeHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:
                hub._handle(self, send_body=False)

            def do_GET(self) -> None:
                hub._handle(self, send_body=True)

            def log_message(self, *args) -> None:  # keep test output clean
                pass

        self._server = ThreadingHTTPServer((LOOPBACK, 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self.release_downloads.set()
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def count(self, method: str, path_part: str) -> int:
        with self._lock:
            return sum(1 for m, p in self.requests if m == method and path_part in p)

    def file_gets(self, filename: str) -> int:
        """How many times a repo file's bytes were downloaded (any repo, any revision)."""
        with self._lock:
            return sum(
                1
                for m, p in self.requests
                if m == "GET" and (r := _RESOLVE_RE.match(p)) and r.group(3) == filename
            )

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- request handling --------------------------------------------------------------------

    def _handle(self, req: BaseHTTPRequestHandler, send_body: bool) -> None:
        path = unquote(urlsplit(req.path).path)
        with self._lock:
            self.requests.append((req.command, path))
        api, resolve = _API_RE.match(path), _RESOLVE_RE.match(path)
        if api:
            repo_id, kind, revision = api.groups()
            repo = self._repo(req, repo_id, revision)
            if repo is None:
                return
            if kind == "revision":
                siblings = [{"rfilename": name} for name in repo.files]
                body = {"id": repo_id, "sha": repo.commit, "siblings": siblings, "private": False}
                self._send_json(req, body, send_body)
            else:
                listing = [
                    {"type": "file", "path": n, "size": len(b), "oid": _sha1(b)}
                    for n, b in repo.files.items()
                ]
                self._send_json(req, listing, send_body)
        elif resolve:
            repo_id, revision, filename = resolve.groups()
            repo = self._repo(req, repo_id, revision)
            if repo is None:
                return
            if repo.gated_token is not None:
                auth = req.headers.get("Authorization")
                if auth != f"Bearer {repo.gated_token}":
                    status = 401 if auth is None else 403
                    self._send_error(req, status, "GatedRepo", "Access to this model is restricted")
                    return
            data = repo.files.get(filename)
            if data is None:
                self._send_error(req, 404, "EntryNotFound", "Entry not found", repo.commit)
                return
            if send_body:
                self.release_downloads.wait()
            req.send_response(200)
            req.send_header("Content-Type", "application/octet-stream")
            req.send_header("Content-Length", str(len(data)))
            req.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            req.send_header("X-Repo-Commit", repo.commit)
            req.end_headers()
            if send_body:
                req.wfile.write(data)
        else:
            self._send_error(req, 404, None, "Not found")

    def _repo(self, req: BaseHTTPRequestHandler, repo_id: str, revision: str) -> FakeRepo | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            self._send_error(req, 404, "RepoNotFound", "Repository not found")
            return None
        if revision not in (repo.branch, repo.commit):
            self._send_error(req, 404, "RevisionNotFound", "Invalid rev id")
            return None
        return repo

    @staticmethod
    def _send_json(req: BaseHTTPRequestHandler, body: object, send_body: bool) -> None:
        data = json.dumps(body).encode()
        req.send_response(200)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        if send_body:
            req.wfile.write(data)

    @staticmethod
    def _send_error(
        req: BaseHTTPRequestHandler,
        status: int,
        error_code: str | None,
        message: str,
        commit: str | None = None,
    ) -> None:
        data = json.dumps({"error": message}).encode()
        req.send_response(status)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(data)))
        if error_code is not None:
            req.send_header("X-Error-Code", error_code)
        req.send_header("X-Error-Message", message)
        if commit is not None:
            req.send_header("X-Repo-Commit", commit)
        req.end_headers()
        if req.command != "HEAD":
            req.wfile.write(data)


def _sha1(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()
