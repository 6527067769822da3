"""A small Azure Blob Storage server on 127.0.0.1 for the az:// tests (Azurite is npm only).

It implements what object_store's Azure client sends to read checkpoints, the way the service
answers it:
- `GET`/`HEAD /{account}/{container}/{blob}` (path style, as for Azurite and custom endpoints),
  `Range` or `x-ms-range` (servers/ranges.py) → 206 with `Content-Range`, 416 `InvalidRange`;
  `Content-Length`, `ETag`, `Last-Modified`;
- `GET /{account}/{container}?restype=container&comp=list` with `prefix`, `delimiter`, `marker`,
  `maxresults`: an `EnumerationResults` XML document, blobs and `BlobPrefix`es in name order,
  paged with `NextMarker` (`page_size` forces paging);
- errors as the service sends them: `x-ms-error-code` and an XML `<Error>` body (404
  `BlobNotFound` / `ContainerNotFound`, 401 `NoAuthenticationInformation`, 403
  `AuthenticationFailed` whose detail echoes the string to sign and the signature, as Azure does);
- SharedKey authentication, verified: `Authorization: SharedKey {account}:{signature}` must name
  the account of the path, and the signature must be the HMAC-SHA256 (with that account's key) of
  the canonical string built from the request as received
  (https://learn.microsoft.com/rest/api/storageservices/authorize-with-shared-key); the request's
  `x-ms-date` or `Date` must be within 15 minutes. Containers in `public` are readable without
  authentication (anonymous access), as with public access level "container".
Writes go through `put()` in-process; the server has no write API.
"""

from __future__ import annotations

import base64
import email.utils
import hashlib
import hmac
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from xml.sax.saxutils import escape

from .base import Handler, Server
from .ranges import serve, write

# Azurite's well-known development account (public, documented by Microsoft).
EMULATOR_ACCOUNT = "devstoreaccount1"
EMULATOR_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
MAX_CLOCK_SKEW = 15 * 60

_SIGNED_HEADERS = [
    "Content-Encoding",
    "Content-Language",
    "Content-Length",
    "Content-MD5",
    "Content-Type",
    "Date",
    "If-Modified-Since",
    "If-Match",
    "If-None-Match",
    "If-Unmodified-Since",
    "Range",
]


def string_to_sign(method: str, raw_path: str, query: str, headers, account: str) -> str:
    """The SharedKey string to sign for Blob service versions 2015-02-21 and later."""
    lines = [method]
    for name in _SIGNED_HEADERS:
        value = headers.get(name, "")
        if name == "Content-Length" and value == "0":
            value = ""
        if name == "Date" and headers.get("x-ms-date"):
            value = ""
        lines.append(value)
    ms = sorted(
        (k.lower(), " ".join(v.split()))
        for k, v in headers.items()
        if k.lower().startswith("x-ms-")
    )
    canonical_headers = "".join(f"{k}:{v}\n" for k, v in ms)
    resource = f"/{account}{raw_path}"
    params: dict[str, list[str]] = {}
    for k, v in urllib.parse.parse_qsl(query, keep_blank_values=True):
        params.setdefault(k.lower(), []).append(v)
    for k in sorted(params):
        resource += f"\n{k}:{','.join(sorted(params[k]))}"
    return "\n".join(lines) + "\n" + canonical_headers + resource


def sign(key: str, text: str) -> str:
    mac = hmac.new(base64.b64decode(key), text.encode("utf-8"), hashlib.sha256)
    return base64.b64encode(mac.digest()).decode()


@dataclass
class Blob:
    data: bytes
    etag: str
    modified: str


@dataclass
class Stats:
    requests: list = field(default_factory=list)  # (method, path, query, status)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, method=None, status=None, comp=None) -> int:
        with self.lock:
            return sum(
                1
                for m, _, q, s in self.requests
                if (method is None or m == method)
                and (status is None or s == status)
                and (comp is None or f"comp={comp}" in q)
            )


class AzureBlobServer(Server):
    """Serves blobs of the accounts in `accounts` ({name: base64 key}) from memory."""

    def __init__(self, accounts: dict[str, str], page_size: int = 5000):
        self.accounts = dict(accounts)
        self.page_size = page_size
        self.containers: dict[tuple[str, str], dict[str, Blob]] = {}
        self.public: set[tuple[str, str]] = set()
        self.stats = Stats()
        super().__init__(_Handler)

    def endpoint(self, account: str) -> str:
        """The account's blob endpoint (path style), as `endpoint` / `BlobEndpoint` take it."""
        return f"{self.base}/{account}"

    def put(self, account: str, container: str, files: dict[str, Path | bytes]) -> None:
        blobs = self.containers.setdefault((account, container), {})
        for name, src in files.items():
            data = src if isinstance(src, bytes) else Path(src).read_bytes()
            etag = f'"0x8D{hashlib.md5(data).hexdigest()[:13].upper()}"'
            blobs[name] = Blob(data, etag, email.utils.formatdate(usegmt=True))

    def put_dir(self, account: str, container: str, prefix: str, directory: Path) -> None:
        files = {f"{prefix}/{p.name}": p for p in sorted(directory.iterdir()) if p.is_file()}
        self.put(account, container, files)


def start_azure(accounts: dict[str, str], page_size: int = 5000) -> AzureBlobServer:
    return AzureBlobServer(accounts, page_size)


class _Handler(Handler):
    server_version = "fastload-test-azure/1"
    server: AzureBlobServer

    def do_GET(self):
        self._handle(send_body=True)

    def do_HEAD(self):
        self._handle(send_body=False)

    def do_PUT(self):
        self._error(405, "UnsupportedHttpVerb", "This test server is read-only.", True)

    do_DELETE = do_POST = do_PUT

    # -----------------------------------------------------------------------------------------

    def _handle(self, send_body: bool) -> None:
        raw_path, _, query = self.path.partition("?")
        parts = [urllib.parse.unquote(p) for p in raw_path.split("/")[1:]]
        account = parts[0] if parts else ""
        container = parts[1] if len(parts) > 1 else ""
        blob = "/".join(parts[2:])
        self._recorded = False
        try:
            if account not in self.server.accounts:
                return self._error(400, "InvalidUri", "Unknown account.", send_body)
            key = (account, container)
            if not self._authorized(account, raw_path, query, key, send_body):
                return
            blobs = self.server.containers.get(key)
            if blobs is None:
                return self._error(
                    404, "ContainerNotFound", "The specified container does not exist.", send_body
                )
            params = dict(urllib.parse.parse_qsl(query, keep_blank_values=True))
            if not blob and params.get("restype") == "container" and params.get("comp") == "list":
                return self._list(account, container, blobs, params, send_body)
            if blob not in blobs:
                return self._error(
                    404, "BlobNotFound", "The specified blob does not exist.", send_body
                )
            return self._blob(blobs[blob], send_body)
        finally:
            if not self._recorded:  # no response was sent (the handler failed)
                self._record(0)

    def send_response(self, code, message=None) -> None:
        # Recorded before the client can see the response, so that a test that counts requests
        # right after its call returned never misses the last one.
        self._record(code)
        super().send_response(code, message)

    def _record(self, status: int) -> None:
        raw_path, _, query = self.path.partition("?")
        with self.server.stats.lock:
            self.server.stats.requests.append((self.command, raw_path, query, status))
        self._recorded = True

    def _authorized(self, account, raw_path, query, key, send_body) -> bool:
        auth = self.headers.get("Authorization")
        if auth is None:
            if key in self.server.public:
                return True
            self._error(
                401,
                "NoAuthenticationInformation",
                "Server failed to authenticate the request. Please refer to the information in "
                "the www-authenticate header.",
                send_body,
            )
            return False
        scheme, _, credential = auth.partition(" ")
        named, _, signature = credential.partition(":")
        text = string_to_sign(self.command, raw_path, query, self.headers, account)
        when = self.headers.get("x-ms-date") or self.headers.get("Date") or ""
        try:
            skew = abs(time.time() - email.utils.parsedate_to_datetime(when).timestamp())
        except (TypeError, ValueError):
            skew = float("inf")
        if scheme != "SharedKey" or named != account:
            detail = f"Authorization header must be SharedKey {account}:signature."
        elif skew > MAX_CLOCK_SKEW:
            detail = f"Request date header too old or missing: '{when}'."
        elif not hmac.compare_digest(signature, sign(self.server.accounts[account], text)):
            detail = (
                f"The MAC signature found in the HTTP request '{signature}' is not the same as "
                f"any computed signature. Server used following string to sign: '{text}'."
            )
        else:
            return True
        self._error(
            403,
            "AuthenticationFailed",
            "Server failed to authenticate the request. Make sure the value of Authorization "
            "header is formed correctly including the signature.",
            send_body,
            detail=detail,
        )
        return False

    def _blob(self, blob: Blob, send_body: bool) -> None:
        def refuse(status: int, message: str, headers: list) -> None:
            self._error(
                status,
                "InvalidRange",
                "The range specified is invalid for the current size of the resource.",
                send_body,
                headers=headers,
            )

        # Azure reads `x-ms-range` where `Range` is absent.
        rng = self.headers.get("Range") or self.headers.get("x-ms-range") or ""
        reply = serve(
            self,
            blob.data,
            [
                ("Content-Type", "application/octet-stream"),
                ("Last-Modified", blob.modified),
                ("x-ms-blob-type", "BlockBlob"),
                *self._common(),
            ],
            etag=blob.etag,
            check_if_match=False,
            range_header=rng,
            refuse=refuse,
        )
        if send_body:
            write(self, reply.body)

    def _list(self, account, container, blobs, params, send_body) -> None:
        prefix = params.get("prefix", "")
        delimiter = params.get("delimiter", "")
        marker = params.get("marker", "")
        page = min(int(params.get("maxresults") or 5000), self.server.page_size)
        # Blobs and collapsed prefixes, in name order, as the service lists them.
        entries: dict[str, Blob | None] = {}
        for name in sorted(blobs):
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix) :]
            if delimiter and delimiter in rest:
                entries[prefix + rest.split(delimiter, 1)[0] + delimiter] = None
            else:
                entries[name] = blobs[name]
        names = [n for n in sorted(entries) if n >= marker]
        shown, more = names[:page], names[page:]
        items = []
        for name in shown:
            blob = entries[name]
            if blob is None:
                items.append(f"<BlobPrefix><Name>{escape(name)}</Name></BlobPrefix>")
                continue
            items.append(
                f"<Blob><Name>{escape(name)}</Name><Properties>"
                f"<Creation-Time>{blob.modified}</Creation-Time>"
                f"<Last-Modified>{blob.modified}</Last-Modified>"
                f"<Etag>{escape(blob.etag)}</Etag>"
                f"<Content-Length>{len(blob.data)}</Content-Length>"
                "<Content-Type>application/octet-stream</Content-Type>"
                "<BlobType>BlockBlob</BlobType>"
                "<LeaseStatus>unlocked</LeaseStatus><LeaseState>available</LeaseState>"
                "</Properties></Blob>"
            )
        next_marker = more[0] if more else ""
        body = (
            '<?xml version="1.0" encoding="utf-8"?>'
            f'<EnumerationResults ServiceEndpoint="{self.server.endpoint(account)}/" '
            f'ContainerName="{escape(container)}">'
            f"<Prefix>{escape(prefix)}</Prefix><Marker>{escape(marker)}</Marker>"
            f"<MaxResults>{page}</MaxResults><Delimiter>{escape(delimiter)}</Delimiter>"
            f"<Blobs>{''.join(items)}</Blobs>"
            + (
                f"<NextMarker>{escape(next_marker)}</NextMarker>"
                if next_marker
                else "<NextMarker />"
            )
            + "</EnumerationResults>"
        ).encode()
        self.send_response(200)
        self._common_headers()
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def _common(self) -> list[tuple[str, str]]:
        return [
            ("x-ms-request-id", str(uuid.uuid4())),
            ("x-ms-version", self.headers.get("x-ms-version", "2021-08-06")),
        ]

    def _common_headers(self) -> None:
        for k, v in self._common():
            self.send_header(k, v)

    def _error(self, status, code, message, send_body, headers=(), detail="") -> None:
        extra = f"<AuthenticationErrorDetail>{escape(detail)}</AuthenticationErrorDetail>"
        body = (
            '<?xml version="1.0" encoding="utf-8"?>'
            f"<Error><Code>{code}</Code><Message>{escape(message)}\n"
            f"RequestId:{uuid.uuid4()}\nTime:{time.strftime('%Y-%m-%dT%H:%M:%SZ')}</Message>"
            + (extra if detail else "")
            + "</Error>"
        ).encode()
        self.send_response(status)
        self._common_headers()
        self.send_header("x-ms-error-code", code)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body) if send_body else 0))
        self.end_headers()
        if send_body:
            self.wfile.write(body)
