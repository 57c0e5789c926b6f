"""A local stand-in for the Hugging Face Hub's HTTP routes, enough for the real huggingface_hub client
(2.x): repository info at a revision, the recursive tree listing, and file HEAD/GET with Range. Point the
client at it with HF_ENDPOINT.

Repositories may be gated (403, X-Error-Code: GatedRepo) or private (401 RepoNotFound) unless the request
carries the hub's token; every request is recorded, and a fault can cut one file's download short."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


@dataclass
class FakeRepo:
    commits: dict[str, dict[str, bytes]]       # commit sha -> {path: content}
    refs: dict[str, str]                       # branch -> commit sha ("main" is the default branch)
    access: str = "public"                     # public | gated | private


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    range: str | None
    authorization: str | None


@dataclass
class Fault:
    """The first GET of `file` sends `cut` bytes and drops the connection; later GETs are answered (by Range)
    unless `then_503`, when they answer 503 until the fault is cleared."""
    file: str
    cut: int
    then_503: bool = False
    dropped: bool = False


def commit_sha(label: str) -> str:
    return hashlib.sha1(label.encode()).hexdigest()


@dataclass
class FakeHub:
    repos: dict[str, FakeRepo]
    token: str = "hf_fake_token"
    requests: list[Request] = field(default_factory=list)
    fault: Fault | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> "FakeHub":
        hub = self

        class Handler(_Handler):
            owner = hub

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def take_requests(self) -> list[Request]:
        with self.lock:
            out, self.requests = self.requests, []
        return out


_API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+)|/tree/(?P<tree>[^/]+))?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    owner: FakeHub

    def log_message(self, *args) -> None:   # quiet
        pass

    def do_HEAD(self) -> None:
        self._route(head=True)

    def do_GET(self) -> None:
        self._route(head=False)

    def _route(self, head: bool) -> None:
        hub = self.owner
        path = urlsplit(self.path).path
        with hub.lock:
            hub.requests.append(Request(self.command, path, self.headers.get("Range"), self.headers.get("Authorization")))
        api, resolve = _API.match(path), _RESOLVE.match(path)
        m = api or resolve
        if m is None:
            return self._error(404, "RepoNotFound")
        repo = hub.repos.get(m["repo"])
        if repo is None:
            return self._error(404, "RepoNotFound")
        authorized = self.headers.get("Authorization") == f"Bearer {hub.token}"
        if repo.access == "gated" and not authorized:
            return self._error(403, "GatedRepo", "Access to model is restricted and you are not in the authorized list")
        if repo.access == "private" and not authorized:
            return self._error(401, "RepoNotFound", "Invalid username or password.")
        revision = unquote(m["rev"] or (api and api["tree"]) or "main")
        commit = repo.refs.get(revision, revision if revision in repo.commits else None)
        if commit is None:
            return self._error(404, "RevisionNotFound", "Invalid rev id")
        files = repo.commits[commit]
        if api is not None and api["tree"] is not None:
            return self._json([{"type": "file", "path": p, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                               for p, b in sorted(files.items())])
        if api is not None:
            return self._json({"id": m["repo"], "sha": commit, "private": repo.access == "private",
                               "gated": "auto" if repo.access == "gated" else False,
                               "siblings": [{"rfilename": p} for p in sorted(files)]})
        name = unquote(resolve["file"])
        if name not in files:
            return self._error(404, "EntryNotFound", f"{name} does not exist on \"{revision}\"")
        self._file(files[name], name, commit, head)

    def _file(self, content: bytes, name: str, commit: str, head: bool) -> None:
        hub = self.owner
        start, status = 0, 200
        rng = self.headers.get("Range")
        if rng and not head:
            start = int(re.fullmatch(r"bytes=(\d+)-", rng)[1])
            status = 206
        fault = hub.fault
        if fault is not None and fault.file == name and not head and (fault.then_503 or not fault.dropped):
            if fault.dropped:
                return self._error(503, None, "try later")
            fault.dropped = True
            self._headers(200, content, commit, 0)
            self.wfile.write(content[:fault.cut])
            self.wfile.flush()
            self.close_connection = True
            return
        self._headers(status, content, commit, start)
        if not head:
            self.wfile.write(content[start:])

    def _headers(self, status: int, content: bytes, commit: str, start: int) -> None:
        self.send_response(status)
        self.send_header("X-Repo-Commit", commit)
        self.send_header("ETag", f'"{hashlib.sha256(content).hexdigest()}"')
        self.send_header("Content-Length", str(len(content) - start))
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{len(content) - 1}/{len(content)}")
        self.end_headers()

    def _json(self, value) -> None:
        body = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str | None, message: str = "") -> None:
        body = json.dumps({"error": message or code}).encode()
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        if message:
            self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
