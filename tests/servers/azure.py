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

And what its client sends to write (https://learn.microsoft.com/rest/api/storageservices/):
- Put Blob (`PUT` a blob with `x-ms-blob-type: BlockBlob`): the whole blob at once; with
  `If-None-Match: *` an existing blob is refused (409 `BlobAlreadyExists`, object_store's
  `PutMode::Create`); the service's MD5 of the body is stored and sent back as `Content-MD5`;
- Put Block (`?comp=block&blockid=`): an uncommitted block, invisible to reads and listings;
- Put Block List (`?comp=blocklist`, a `<BlockList>` of `<Latest>`/`<Uncommitted>`/`<Committed>`
  ids): the blob becomes those blocks, in that order, at once, and the blob's other uncommitted
  blocks are discarded, as the service discards them (400 `InvalidBlockList` for an unknown id,
  and nothing changes); `x-ms-blob-content-md5` is stored as the blob's `Content-MD5`;
- Delete Blob (202; 404 `BlobNotFound`);
- `x-ms-meta-*` user metadata on Put Blob and Put Block List, sent back on GET/HEAD;
- `Content-MD5` on Put Blob and Put Block is checked against the body when sent (400
  `Md5Mismatch`, nothing stored), as the service checks it. `x-ms-content-crc64` is refused (400
  `UnsupportedHeader`): this server does not compute the service's CRC-64, so a client that
  starts sending it is noticed here rather than trusted.
Writes are authenticated like reads (public containers are read-only to anonymous clients).
`put()` stores blobs in-process (fixtures); `fail_blocks = n` answers the next n Put Block
requests with 500 (a store that fails parts); `corrupt_uploads = n` flips a byte of the next n
Put Block / Put Blob bodies before they are checked and stored (corruption on the way);
`stats.writes` records each write's headers.
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
    md5: bytes | None = None  # the blob's Content-MD5, when it has one
    meta: dict[str, str] = field(default_factory=dict)  # x-ms-meta-* (lowercase names)


def new_blob(data: bytes, md5: bytes | None, meta: dict[str, str] | None = None) -> Blob:
    etag = f'"0x8D{hashlib.md5(data).hexdigest()[:13].upper()}{uuid.uuid4().hex[:3].upper()}"'
    return Blob(data, etag, email.utils.formatdate(usegmt=True), md5, dict(meta or {}))


@dataclass
class Stats:
    requests: list = field(default_factory=list)  # (method, path, query, status)
    # Each write as received: (comp or "blob", blob name, {header: value} of its x-ms-*,
    # Content-MD5 and If-* headers, status).
    writes: list = field(default_factory=list)
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
        # Uncommitted blocks: (account, container, blob) -> {block id: bytes}.
        self.blocks: dict[tuple[str, str, str], dict[str, bytes]] = {}
        self.public: set[tuple[str, str]] = set()
        self.stats = Stats()
        self.fail_blocks = 0
        self.corrupt_uploads = 0
        self.corrupt_prefix = ""  # only uploads to blobs whose names start with it
        self.lock = threading.Lock()
        super().__init__(_Handler)

    def endpoint(self, account: str) -> str:
        """The account's blob endpoint (path style), as `endpoint` / `BlobEndpoint` take it."""
        return f"{self.base}/{account}"

    def put(self, account: str, container: str, files: dict[str, Path | bytes]) -> None:
        blobs = self.containers.setdefault((account, container), {})
        for name, src in files.items():
            data = src if isinstance(src, bytes) else Path(src).read_bytes()
            blobs[name] = new_blob(data, hashlib.md5(data).digest())

    def uncommitted(self, account: str, container: str) -> dict[str, int]:
        """Blob name -> uncommitted blocks held for it (blocks never committed)."""
        with self.lock:
            return {
                blob: len(blocks)
                for (a, c, blob), blocks in self.blocks.items()
                if (a, c) == (account, container) and blocks
            }

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
        self._handle(send_body=True)

    def do_DELETE(self):
        self._handle(send_body=True)

    def do_POST(self):
        self._read_body = None
        self._body()
        self._error(405, "UnsupportedHttpVerb", "This test server does not take POST.", True)

    # -----------------------------------------------------------------------------------------

    def _handle(self, send_body: bool) -> None:
        raw_path, _, query = self.path.partition("?")
        parts = [urllib.parse.unquote(p) for p in raw_path.split("/")[1:]]
        account = parts[0] if parts else ""
        container = parts[1] if len(parts) > 1 else ""
        blob = "/".join(parts[2:])
        self._recorded = False
        self._read_body = None
        body = self._body() if self.command in ("PUT", "DELETE") else b""
        try:
            if account not in self.server.accounts:
                return self._error(400, "InvalidUri", "Unknown account.", send_body)
            key = (account, container)
            writing = self.command != "GET" and self.command != "HEAD"
            if not self._authorized(account, raw_path, query, key, send_body, writing):
                return
            blobs = self.server.containers.get(key)
            if blobs is None:
                return self._error(
                    404, "ContainerNotFound", "The specified container does not exist.", send_body
                )
            params = dict(urllib.parse.parse_qsl(query, keep_blank_values=True))
            if self.command == "PUT" and blob:
                return self._put(account, container, blob, params, body)
            if self.command == "DELETE" and blob:
                return self._delete(blobs, blob)
            if self.command not in ("GET", "HEAD"):
                return self._error(
                    400, "UnsupportedHttpVerb", "Not supported by this server.", True
                )
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

    def _body(self) -> bytes:
        if getattr(self, "_read_body", None) is None:
            length = int(self.headers.get("Content-Length") or 0)
            self._read_body = self.rfile.read(length) if length else b""
        return self._read_body

    def _authorized(self, account, raw_path, query, key, send_body, writing=False) -> bool:
        auth = self.headers.get("Authorization")
        if auth is None:
            if key in self.server.public and not writing:
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

    # -- writes -----------------------------------------------------------------------------

    def _noted(self, what: str, blob: str, status: int) -> None:
        shown = {
            k.lower(): v
            for k, v in self.headers.items()
            if k.lower().startswith(("x-ms-", "if-", "content-md5"))
        }
        with self.server.stats.lock:
            self.server.stats.writes.append((what, blob, shown, status))

    def _checked(self, body: bytes) -> str | None:
        """Why the body does not match the checksum sent with it (None: it matches, or none)."""
        if self.headers.get("x-ms-content-crc64") is not None:
            return "UnsupportedHeader"
        sent = self.headers.get("Content-MD5")
        if sent is not None:
            try:
                want = base64.b64decode(sent, validate=True)
            except ValueError:
                return "InvalidMd5"
            if want != hashlib.md5(body).digest():
                return "Md5Mismatch"
        return None

    def _meta(self) -> dict[str, str]:
        return {
            k.lower()[len("x-ms-meta-") :]: v
            for k, v in self.headers.items()
            if k.lower().startswith("x-ms-meta-")
        }

    def _created(self, blob: Blob | None = None, status: int = 201) -> None:
        self.send_response(status)
        self._common_headers()
        if blob is not None:
            self.send_header("ETag", blob.etag)
            self.send_header("Last-Modified", blob.modified)
            if blob.md5 is not None:
                self.send_header("Content-MD5", base64.b64encode(blob.md5).decode())
        self.send_header("x-ms-request-server-encrypted", "true")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _put(self, account, container, name, params, body) -> None:
        server = self.server
        comp = params.get("comp", "")
        blobs = server.containers[(account, container)]
        blocks_key = (account, container, name)
        what = comp or "blob"
        if comp in ("", "block") and body and name.startswith(server.corrupt_prefix):
            with server.lock:
                corrupt = server.corrupt_uploads > 0
                server.corrupt_uploads -= corrupt
            if corrupt:
                body = bytes([body[0] ^ 0x01]) + body[1:]

        def refuse(status, code, message):
            self._noted(what, name, status)
            self._error(status, code, message, True)

        if comp == "block":
            if server.fail_blocks > 0:
                with server.lock:
                    server.fail_blocks -= 1
                return refuse(500, "InternalError", "A failure injected by the test.")
            why = self._checked(body)
            if why is not None:
                return refuse(400, why, "The MD5 value specified in the request did not match.")
            block_id = params.get("blockid", "")
            if not block_id:
                return refuse(400, "InvalidQueryParameterValue", "blockid is missing.")
            with server.lock:
                server.blocks.setdefault(blocks_key, {})[block_id] = body
            self._noted(what, name, 201)
            return self._created()
        if comp == "blocklist":
            import xml.etree.ElementTree as ET

            try:
                ids = [e.text or "" for e in ET.fromstring(body)]
            except ET.ParseError:
                return refuse(400, "InvalidXmlDocument", "The block list is not XML.")
            with server.lock:
                held = server.blocks.get(blocks_key, {})
                committed = blobs.get(name)
                missing = [i for i in ids if i not in held]
                if missing:
                    return refuse(400, "InvalidBlockList", "The specified block list is invalid.")
                data = b"".join(held[i] for i in ids)
                md5 = self.headers.get("x-ms-blob-content-md5")
                blob = new_blob(data, base64.b64decode(md5) if md5 else None, self._meta())
                if committed is not None and self.headers.get("If-None-Match") == "*":
                    return refuse(409, "BlobAlreadyExists", "The specified blob already exists.")
                blobs[name] = blob
                server.blocks.pop(blocks_key, None)  # the others are discarded
            self._noted(what, name, 201)
            return self._created(blob)
        if comp:
            return refuse(400, "InvalidQueryParameterValue", f"comp={comp} is not supported.")
        if self.headers.get("x-ms-blob-type") != "BlockBlob":
            return refuse(400, "InvalidHeaderValue", "x-ms-blob-type must be BlockBlob.")
        why = self._checked(body)
        if why is not None:
            return refuse(400, why, "The MD5 value specified in the request did not match.")
        blob = new_blob(body, hashlib.md5(body).digest(), self._meta())
        with server.lock:
            if name in blobs and self.headers.get("If-None-Match") == "*":
                return refuse(409, "BlobAlreadyExists", "The specified blob already exists.")
            blobs[name] = blob
            server.blocks.pop(blocks_key, None)
        self._noted(what, name, 201)
        self._created(blob)

    def _delete(self, blobs, name) -> None:
        with self.server.lock:
            found = blobs.pop(name, None)
        if found is None:
            return self._error(404, "BlobNotFound", "The specified blob does not exist.", True)
        self.send_response(202)
        self._common_headers()
        self.send_header("Content-Length", "0")
        self.end_headers()

    # -- reads --------------------------------------------------------------------------------

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
                # The whole blob's MD5: `Content-MD5` on a whole read, `x-ms-blob-content-md5`
                # on a ranged one, as the service sends them.
                *(
                    [
                        (
                            "x-ms-blob-content-md5" if rng else "Content-MD5",
                            base64.b64encode(blob.md5).decode(),
                        )
                    ]
                    if blob.md5 is not None
                    else []
                ),
                *((f"x-ms-meta-{k}", v) for k, v in blob.meta.items()),
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
