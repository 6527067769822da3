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

Repos added with `xet=True` are served as Xet-backed repos are in 2026: their LFS files' 302 also
carries `X-Xet-Hash` and a `Link` with rel="xet-auth", and points at `Bridge`, a third server (the
CloudFront bridge: signed URLs by Xet hash, 206 for ranges, 400 for a plain GET of a file above
`plain_get_limit`, the whole file with 200 to a ranged GET that accepts gzip). The Xet protocol
itself (the CAS reconstruction API) is not served: clients read through the bridge, as
huggingface_hub does with `HF_HUB_DISABLE_XET`.

Errors as the Hub sends them: private repos without the token get 401 `X-Error-Code:
RepoNotFound`; gated repos 401/403 `GatedRepo`; unknown revisions 404 `RevisionNotFound`, unknown
files 404 `EntryNotFound`; a renamed repo answers 307 with a relative `Location`. Faults can be
injected (`fail(kind, status, count, retry_after)`: kind "api", "resolve" or "storage"), and the
storage server can be rate limited (bytes per second for all its connections together).

Both servers send an `ETag` with their bytes (the storage host its own, an MD5 of the bytes, as
S3 does; the Hub the git blob id) and honour `If-Match` (412 when it does not match). `swap(key,
data, after)` has the bytes behind a key (a blob's sha256 on the storage host, a file's path on
the Hub) overwritten after `after` GETs of it: a file that changes under the same URL mid-load.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

from .base import Handler, Server
from .ranges import serve, write

SECRET = b"mock-hub-signing-key"


def git_blob_sha1(data: bytes) -> str:
    return _digests(data)[0]


def lfs_sha256(data: bytes) -> str:
    return _digests(data)[1]


# (git blob sha1, sha256, md5) of each blob served, computed once: the real Hub and its storage
# have them stored, and hashing a 1 GB checkpoint on every tree listing, resolve and ranged GET
# (the storage host's ETag) took seconds of the benchmarks' time (benches/transformers_bench.py,
# hub_bench.py). By id(), the bytes kept to check identity.
_DIGESTS: dict[int, tuple[bytes, str, str, str]] = {}
_DIGESTS_LOCK = threading.Lock()


def _all_digests(data: bytes) -> tuple[str, str, str]:
    with _DIGESTS_LOCK:
        hit = _DIGESTS.get(id(data))
    if hit is not None and hit[0] is data:
        return hit[1], hit[2], hit[3]
    sha1 = hashlib.sha1(b"blob %d\0" % len(data))
    sha1.update(data)
    sha256 = hashlib.sha256(data).hexdigest()
    md5 = hashlib.md5(data).hexdigest()
    with _DIGESTS_LOCK:
        _DIGESTS[id(data)] = (data, sha1.hexdigest(), sha256, md5)
    return sha1.hexdigest(), sha256, md5


def _digests(data: bytes) -> tuple[str, str]:
    sha1, sha256, _ = _all_digests(data)
    return sha1, sha256


def storage_etag(data: bytes) -> str:
    """The storage host's own ETag of a blob: an MD5 of the bytes, as S3's for a plain upload."""
    return f'"{_all_digests(data)[2]}"'


def is_lfs(path: str, data: bytes) -> bool:
    return path.endswith((".safetensors", ".bin", ".pt")) or len(data) > 10 << 20


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit -> files
    refs: dict[str, str] = field(default_factory=dict)  # branch/tag -> commit
    private: bool = False
    gated: bool = False
    xet: bool = False  # LFS files are Xet-backed: served through the bridge


class _Server(Server):
    def __init__(self, handler, port: int = 0):
        self.log: list[tuple[str, str, dict]] = []  # (method, path, lower-case headers)
        self.faults: list[tuple[str, int, str | None]] = []  # (kind, status, retry_after)
        self.swaps: dict[str, list] = {}  # key -> [GETs left before the swap, new bytes]
        self.refused_if_match = 0
        self.lock = threading.Lock()
        super().__init__(handler, port)

    def fault(self, kind: str) -> tuple[int, str | None] | None:
        with self.lock:
            for i, (k, status, retry_after) in enumerate(self.faults):
                if k == kind:
                    del self.faults[i]
                    return status, retry_after
        return None

    def swap(self, key: str, data: bytes, after: int) -> None:
        """The bytes behind `key` are `data` from the GET after the `after`th on."""
        with self.lock:
            self.swaps[key] = [after, data]

    def current(self, key: str, data: bytes, get: bool) -> bytes:
        """`data`, or what replaced it (`get`: this request is one of the GETs counted)."""
        with self.lock:
            swap = self.swaps.get(key)
            if swap is None:
                return data
            if swap[0] > 0:
                swap[0] -= int(get)
                return data
            return swap[1]


class _Base(Handler):
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

    def _send_range(self, data: bytes, headers, rate: int = 0, honour_range=True) -> None:
        etag = dict(headers).get("ETag")
        rest = [(k, v) for k, v in headers if k != "ETag"]

        def noted(status: int) -> None:
            if status == 412:
                with self.server.lock:
                    self.server.refused_if_match += 1

        reply = serve(self, data, rest, etag=etag, honour_range=honour_range, on_status=noted)
        step = 1 << 20 if not rate else max(1 << 14, rate // 50)
        write(self, reply.body, step, self.server.throttle if rate else None)


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
        data = self.server.current(sha, data, self.command == "GET")
        etag = storage_etag(data)
        ranged = self.headers.get("Range") is not None
        limit = self.server.plain_get_limit
        if self.command == "GET" and not ranged and limit is not None and len(data) > limit:
            with self.server.lock:
                self.server.refused_plain += 1
            self._reply(400, b"<Error>InvalidRequest: a file this large needs Range</Error>")
            return
        whole = ranged and (
            self.server.ignores_range
            or (self.server.gzip_ignores_range and accepts_gzip(self.headers))
        )
        if whole:
            with self.server.lock:
                self.server.whole_for_gzip += 1
        self._send_range(data, [("ETag", etag)], rate=self.server.rate, honour_range=not whole)


def accepts_gzip(headers) -> bool:
    """Whether `Accept-Encoding` accepts gzip (named, or `*`, with a q-value above 0)."""
    for item in (headers.get("Accept-Encoding") or "").split(","):
        coding, _, params = item.strip().partition(";")
        q = params.strip().removeprefix("q=") if params.strip().startswith("q=") else "1"
        if coding.strip().lower() in ("gzip", "x-gzip", "*") and q not in ("0", "0.0", "0.00"):
            return True
    return False


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
        self.public_url: str | None = None  # the address signed URLs name (a relay), if not ours
        # A bridge's ways (see `Bridge`); a plain storage host has neither.
        self.plain_get_limit: int | None = None
        self.gzip_ignores_range = False
        self.ignores_range = False  # every ranged GET gets the whole file with 200 (a bad CDN)
        self.refused_plain = 0  # plain GETs answered 400
        self.whole_for_gzip = 0  # ranged GETs answered 200 with the whole file
        super().__init__(_StorageHandler)

    def sign(self, sha: str) -> str:
        expires = str(int(time.time() + self.ttl))
        sig = self._sig(sha, expires)
        return f"{self.public_url or self.base}/{sha}?Expires={expires}&Signature={sig}"

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
        """Blocks until `n` more bytes fit the rate (one schedule shared by all connections).
        A test may lift the rate (0) while an earlier reply is still being sent: no wait then."""
        rate = self.rate
        if not rate:
            return
        with self._rate_lock:
            now = time.monotonic()
            start = max(now, self._next_send)
            self._next_send = start + n / rate
        if start > now:
            time.sleep(start - now)


class Bridge(Storage):
    """The host Xet-backed files are served from in 2026 (cas-bridge.xethub.hf.co, a CloudFront
    distribution): blobs by Xet hash behind signed URLs valid for `ttl` seconds; `Range` honoured
    with 206; a plain (non-ranged) GET of a file above `plain_get_limit` bytes answered 400 (50 GB
    on the real host); `Range` ignored, the whole file sent with 200, when the request accepts
    gzip (as CloudFront does)."""

    def __init__(self, rate: int = 0, plain_get_limit: int = 50 * 10**9):
        super().__init__(rate)
        self.plain_get_limit = plain_get_limit
        self.gzip_ignores_range = True


def xet_hash(data: bytes) -> str:
    """A stand-in for a file's Xet hash (a Merkle hash of its chunks): 64 hex digits that differ
    from its sha256."""
    return hashlib.sha256(b"xet-merkle:" + data).hexdigest()


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
                    if repo.xet:
                        entry["xetHash"] = xet_hash(data)
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
        data = hub.current(path, data, self.command == "GET")
        if is_lfs(path, data) and path not in hub.plain and repo.xet:
            self._xet_redirect(hub, repo_id, commit, data)
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

    def _xet_redirect(self, hub: MockHub, repo_id: str, commit: str, data: bytes) -> None:
        """A Xet-backed file as the Hub answers it in 2026: 302 to a signed bridge URL, with the
        file's metadata on the 302 itself."""
        xet = xet_hash(data)
        hub.bridge.blobs[xet] = data
        links = (
            f'<{hub.base}/api/models/{repo_id}/xet-read-token/{commit}>; rel="xet-auth", '
            f'<{hub.base}/cas/v1/reconstructions/{xet}>; rel="xet-reconstruction-info"'
        )
        headers = [
            ("X-Repo-Commit", commit),
            ("ETag", f'"{git_blob_sha1(data)}"'),
            ("X-Linked-Size", str(len(data))),
            ("X-Linked-Etag", f'"{lfs_sha256(data)}"'),
            ("X-Xet-Hash", xet),
            ("Link", links),
            ("Location", hub.bridge.sign(xet)),
        ]
        self._reply(302, b"", headers)


class MockHub(_Server):
    """The Hub's API and `resolve/`, with a `Storage` server for LFS blobs."""

    def __init__(self, rate: int = 0, port: int = 0):
        self.repos: dict[str, Repo] = {}
        self.renamed: dict[str, str] = {}  # old repo id -> new
        self.tokens: set[str] = set()  # valid tokens
        self.gated_access: dict[str, set[str]] = {}  # gated repo -> tokens that accepted
        self.plain: set[str] = set()  # paths kept out of LFS whatever their name or size
        self.storage = Storage(rate)
        self.bridge = Bridge(rate)
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
        xet: bool = False,
    ) -> str:
        """Commits `files` (the whole tree) to `branch` of `repo_id`; returns the commit id."""
        repo = self.repos.setdefault(repo_id, Repo())
        repo.private = repo.private or private
        repo.gated = repo.gated or gated
        repo.xet = repo.xet or xet
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
        self.bridge.close()


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
    parser.add_argument("--xet", action="store_true", help="serve the repo as Xet-backed")
    args = parser.parse_args()
    hub = MockHub(rate=int(args.rate))
    files = {
        str(p.relative_to(args.dir)): p.read_bytes() for p in args.dir.rglob("*") if p.is_file()
    }
    hub.add(args.repo, files, xet=args.xet)
    print(hub.base, flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    hub.close()


if __name__ == "__main__":
    main()
