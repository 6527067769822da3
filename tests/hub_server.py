"""A mock Hugging Face Hub on 127.0.0.1, for the hf:// tests and benches/hub_bench.py.

Two servers, as the real Hub: `MockHub` answers the API routes `huggingface_hub` calls and
`resolve/`, and redirects LFS files to `Storage`, a second server (another origin) that serves
blobs by sha256, honours Range, and only accepts a signed, unexpired query
(`?Expires=<epoch>&Signature=<hmac>`, as a CDN's signed URL).

Routes (model repos):
- `GET /api/models/{repo}` and `/api/models/{repo}/revision/{rev}`: id, sha, siblings;
- `GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=`: the files with oid, size, lfs;
- `HEAD|GET /{repo}/resolve/{rev}/{path}`: `X-Repo-Commit`, `ETag`; LFS files answer 302 with
  `Location` (signed storage URL), `X-Linked-Size`, `X-Linked-Etag`; other files are served here
  (Range honoured).

Errors as the Hub sends them: private repos without the token get 401 `X-Error-Code:
RepoNotFound`; gated repos 401/403 `GatedRepo`; unknown revisions 404 `RevisionNotFound`, unknown
files 404 `EntryNotFound`; a renamed repo answers 307 with a relative `Location`. Faults can be
injected (`fail(kind, status, count, retry_after)`: kind "api", "resolve" or "storage"), and the
storage server can be rate limited (bytes per second for all its connections together).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from http_server import parse_range

SECRET = b"mock-hub-signing-key"


def git_blob_sha1(data: bytes) -> str:
    return _digests(data)[0]


def lfs_sha256(data: bytes) -> str:
    return _digests(data)[1]


# (git blob sha1, sha256) of each blob served, computed once: the real Hub has them stored, and
# hashing a 1 GB checkpoint on every tree listing and resolve took seconds of the benchmarks'
# time (benches/transformers_bench.py, hub_bench.py). By id(), the bytes kept to check identity.
_DIGESTS: dict[int, tuple[bytes, str, str]] = {}
_DIGESTS_LOCK = threading.Lock()


def _digests(data: bytes) -> tuple[str, str]:
    with _DIGESTS_LOCK:
        hit = _DIGESTS.get(id(data))
    if hit is not None and hit[0] is data:
        return hit[1], hit[2]
    sha1 = hashlib.sha1(b"blob %d\0" % len(data))
    sha1.update(data)
    sha256 = hashlib.sha256(data).hexdigest()
    with _DIGESTS_LOCK:
        _DIGESTS[id(data)] = (data, sha1.hexdigest(), sha256)
    return sha1.hexdigest(), sha256


def is_lfs(path: str, data: bytes) -> bool:
    return path.endswith((".safetensors", ".bin", ".pt")) or len(data) > 10 << 20


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit -> files
    refs: dict[str, str] = field(default_factory=dict)  # branch/tag -> commit
    private: bool = False
    gated: bool = False


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    # listen()'s backlog (socketserver's default is 5): each response closes its connection
    # (HTTP/1.0), so a client with 16 reads in flight connects 16 times at once, and connections
    # beyond the backlog lost their SYN and retried it 1, 3, 7, 15, 31 s later (the 15 and 30 s
    # outliers of benches/transformers_bench.py's 200 MB/s rows).
    request_queue_size = 128

    def __init__(self, handler, port: int = 0):
        super().__init__(("127.0.0.1", port), handler)
        self.log: list[tuple[str, str, dict]] = []  # (method, path, lower-case headers)
        self.faults: list[tuple[str, int, str | None]] = []  # (kind, status, retry_after)
        self.lock = threading.Lock()
        self._thread = threading.Thread(
            target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def fault(self, kind: str) -> tuple[int, str | None] | None:
        with self.lock:
            for i, (k, status, retry_after) in enumerate(self.faults):
                if k == kind:
                    del self.faults[i]
                    return status, retry_after
        return None

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        self._thread.join(timeout=5)


class _Base(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):
        pass

    def _record(self) -> None:
        with self.server.lock:
            self.server.log.append(
                (self.command, self.path, {k.lower(): v for k, v in self.headers.items()})
            )

    def _reply(self, status: int, body: bytes = b"", headers=(), send_body: bool = True) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        if send_body and self.command != "HEAD":
            self.wfile.write(body)

    def _injected(self, kind: str) -> bool:
        got = self.server.fault(kind)
        if got is None:
            return False
        status, retry_after = got
        headers = [("Retry-After", retry_after)] if retry_after is not None else []
        self._reply(status, f"injected {status}\n".encode(), headers)
        return True

    def _send_range(self, data: bytes, headers, rate: int = 0) -> None:
        size = len(data)
        rng = self.headers.get("Range")
        got = parse_range(rng, size) if rng else None
        if got == "unsatisfiable":
            self._reply(416, b"", [("Content-Range", f"bytes */{size}")])
            return
        status, (start, end) = (206, got) if got else (200, (0, size))
        self.send_response(status)
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", "bytes")
        for k, v in headers:
            self.send_header(k, v)
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if self.command == "HEAD":
            return
        view = memoryview(data)
        step = 1 << 20 if not rate else max(1 << 14, rate // 50)
        try:
            for at in range(start, end, step):
                chunk = view[at : min(end, at + step)]
                if rate:
                    self.server.throttle(len(chunk))
                self.wfile.write(chunk)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True


class _StorageHandler(_Base):
    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        self._record()
        if self._injected("storage"):
            return
        parts = urllib.parse.urlsplit(self.path)
        sha = parts.path.strip("/")
        query = dict(urllib.parse.parse_qsl(parts.query))
        self.server.rotate_if_armed()
        if not self.server.signature_ok(sha, query):
            self._reply(403, b"<Error>AccessDenied: bad or expired signature</Error>")
            return
        data = self.server.poison.get(sha, self.server.blobs.get(sha))
        if data is None:
            self._reply(404, b"no such blob")
            return
        self._send_range(data, [("ETag", f'"{sha}"')], rate=self.server.rate)


class Storage(_Server):
    """Blobs by sha256 behind signed, expiring URLs; optionally rate limited."""

    def __init__(self, rate: int = 0):
        self.blobs: dict[str, bytes] = {}
        self.poison: dict[str, bytes] = {}  # sha -> other bytes served in its place
        self.rate = rate  # bytes/s for all connections together, 0: unlimited
        self.ttl = 3600.0  # how long a signed URL is valid
        self.secret_epoch = 0  # bump to refuse every URL signed so far (a key rotation)
        self.rotate_on_next_get = False  # bump secret_epoch when the next request arrives
        self._next_send = time.monotonic()
        self._rate_lock = threading.Lock()
        super().__init__(_StorageHandler)

    def sign(self, sha: str) -> str:
        expires = str(int(time.time() + self.ttl))
        sig = self._sig(sha, expires)
        return f"{self.url}/{sha}?Expires={expires}&Signature={sig}"

    def _sig(self, sha: str, expires: str) -> str:
        key = SECRET + str(self.secret_epoch).encode()
        return hmac.new(key, f"{sha}:{expires}".encode(), hashlib.sha256).hexdigest()

    def rotate_if_armed(self) -> None:
        """A key rotation between handing out URLs and their first use, when armed."""
        with self._rate_lock:
            if self.rotate_on_next_get:
                self.rotate_on_next_get = False
                self.secret_epoch += 1

    def signature_ok(self, sha: str, query: dict) -> bool:
        expires, sig = query.get("Expires", ""), query.get("Signature", "")
        want = self._sig(sha, expires)
        return expires.isdigit() and hmac.compare_digest(sig, want) and time.time() <= int(expires)

    def throttle(self, n: int) -> None:
        """Blocks until `n` more bytes fit the rate (one schedule shared by all connections)."""
        with self._rate_lock:
            now = time.monotonic()
            start = max(now, self._next_send)
            self._next_send = start + n / self.rate
        if start > now:
            time.sleep(start - now)


class _HubHandler(_Base):
    def do_HEAD(self):
        self._route()

    def do_GET(self):
        self._route()

    def _route(self):
        self._record()
        hub: MockHub = self.server
        parts = urllib.parse.urlsplit(self.path)
        path = parts.path
        query = dict(urllib.parse.parse_qsl(parts.query))
        if path.startswith("/api/models/"):
            if self._injected("api"):
                return
            self._api(hub, path[len("/api/models/") :], query)
            return
        segs = path.lstrip("/").split("/", 4)
        if len(segs) >= 5 and segs[2] == "resolve":
            if self._injected("resolve"):
                return
            repo_id = f"{segs[0]}/{segs[1]}"
            rev = urllib.parse.unquote(segs[3])
            self._resolve(hub, repo_id, rev, urllib.parse.unquote(segs[4]))
            return
        self._reply(404, b"not found")

    def _error(self, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self._reply(
            status,
            body,
            [
                ("Content-Type", "application/json"),
                ("X-Error-Code", code),
                ("X-Error-Message", message),
            ],
        )

    def _repo(self, hub: MockHub, repo_id: str, rest: str) -> Repo | None:
        """The repo, or None after answering (renamed: 307; private/gated: 401/403)."""
        if repo_id in hub.renamed:
            target = self.path.replace(f"/{repo_id}/", f"/{hub.renamed[repo_id]}/", 1)
            self._reply(307, b"", [("Location", target)])
            return None
        repo = hub.repos.get(repo_id)
        auth = self.headers.get("Authorization", "")
        token = auth[len("Bearer ") :] if auth.startswith("Bearer ") else None
        if repo is None or (repo.private and token not in hub.tokens):
            self._error(401, "RepoNotFound", "Repository not found")
            return None
        if repo.gated and token not in hub.gated_access.get(repo_id, set()):
            status = 403 if token in hub.tokens else 401
            self._error(
                status,
                "GatedRepo",
                f"Access to model {repo_id} is restricted. You must be authenticated.",
            )
            return None
        return repo

    def _commit(self, repo: Repo, rev: str) -> str | None:
        if rev in repo.commits:
            return rev
        commit = repo.refs.get(rev)
        if commit is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return commit

    def _api(self, hub: MockHub, rest: str, query: dict) -> None:
        # {org}/{name}[/revision/{rev}] or {org}/{name}/tree/{rev}[/{path}]
        segs = rest.split("/")
        repo_id = "/".join(segs[:2])
        repo = self._repo(hub, repo_id, rest)
        if repo is None:
            return
        kind = segs[2] if len(segs) > 2 else "revision"
        rev = urllib.parse.unquote(segs[3]) if len(segs) > 3 else "main"
        commit = self._commit(repo, rev)
        if commit is None:
            return
        files = repo.commits[commit]
        if kind == "revision":
            body = {
                "id": repo_id,
                "modelId": repo_id,
                "sha": commit,
                "private": repo.private,
                "gated": "auto" if repo.gated else False,
                "siblings": [{"rfilename": p} for p in sorted(files)],
            }
        elif kind == "tree":
            prefix = urllib.parse.unquote("/".join(segs[4:])).strip("/")
            recursive = query.get("recursive", "").lower() in ("1", "true")
            body = []
            for p in sorted(files):
                if prefix and not p.startswith(prefix + "/"):
                    continue
                rel = p[len(prefix) + 1 :] if prefix else p
                if "/" in rel and not recursive:
                    continue
                data = files[p]
                entry = {"type": "file", "oid": git_blob_sha1(data), "size": len(data), "path": p}
                if is_lfs(p, data) and p not in hub.plain:
                    sha = lfs_sha256(data)
                    entry["lfs"] = {"oid": sha, "size": len(data), "pointerSize": 134}
                body.append(entry)
        else:
            self._reply(404, b"unknown route")
            return
        self._reply(200, json.dumps(body).encode(), [("Content-Type", "application/json")])

    def _resolve(self, hub: MockHub, repo_id: str, rev: str, path: str) -> None:
        repo = self._repo(hub, repo_id, path)
        if repo is None:
            return
        commit = self._commit(repo, rev)
        if commit is None:
            return
        data = repo.commits[commit].get(path)
        if data is None:
            self._error(404, "EntryNotFound", f"{path} does not exist at {rev}")
            return
        if is_lfs(path, data) and path not in hub.plain:
            sha = lfs_sha256(data)
            hub.storage.blobs[sha] = data
            headers = [
                ("X-Repo-Commit", commit),
                ("ETag", f'"{git_blob_sha1(data)}"'),
                ("X-Linked-Size", str(len(data))),
                ("X-Linked-Etag", f'"{sha}"'),
                ("Location", hub.storage.sign(sha)),
            ]
            self._reply(302, b"", headers)
            return
        etag = (hub.plain_etag or '"{oid}"').format(oid=git_blob_sha1(data))
        self._send_range(data, [("X-Repo-Commit", commit), ("ETag", etag)])


class MockHub(_Server):
    """The Hub's API and `resolve/`, with a `Storage` server for LFS blobs."""

    def __init__(self, rate: int = 0, port: int = 0):
        self.repos: dict[str, Repo] = {}
        self.renamed: dict[str, str] = {}  # old repo id -> new
        self.tokens: set[str] = set()  # valid tokens
        self.gated_access: dict[str, set[str]] = {}  # gated repo -> tokens that accepted
        self.storage = Storage(rate)
        self.plain: set[str] = set()  # paths served outside LFS whatever their name
        # The ETag header of files outside LFS ("{oid}": the git blob id); default '"{oid}"'.
        self.plain_etag: str | None = None
        super().__init__(_HubHandler, port)

    def add(
        self,
        repo_id: str,
        files: dict[str, bytes],
        branch: str = "main",
        tags: tuple[str, ...] = (),
        private: bool = False,
        gated: bool = False,
    ) -> str:
        """Commits `files` (the whole tree) to `branch` of `repo_id`; returns the commit id."""
        repo = self.repos.setdefault(repo_id, Repo())
        repo.private = repo.private or private
        repo.gated = repo.gated or gated
        digest = hashlib.sha1(repo_id.encode() + str(len(repo.commits)).encode())
        for p in sorted(files):
            digest.update(p.encode() + bytes.fromhex(lfs_sha256(files[p])))
        commit = digest.hexdigest()
        repo.commits[commit] = dict(files)
        repo.refs[branch] = commit
        for tag in tags:
            repo.refs[tag] = commit
        return commit

    def requests(self, server: _Server | None = None) -> list[tuple[str, str, dict]]:
        with (server or self).lock:
            return list((server or self).log)

    def close(self) -> None:
        super().close()
        self.storage.close()


def start_hub(rate: int = 0) -> MockHub:
    return MockHub(rate)


def main() -> None:
    """Serves a local directory as one repo until killed (benches/hub_bench.py runs it in its own
    process, so that the client measured does not share an interpreter with the server)."""
    import argparse
    import sys
    from pathlib import Path

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--repo", default="org/bench")
    parser.add_argument("--rate", type=float, default=0, help="storage bytes/s (0: unlimited)")
    args = parser.parse_args()
    hub = MockHub(rate=int(args.rate))
    files = {
        str(p.relative_to(args.dir)): p.read_bytes() for p in args.dir.rglob("*") if p.is_file()
    }
    hub.add(args.repo, files)
    print(hub.url, flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    hub.close()


if __name__ == "__main__":
    main()
