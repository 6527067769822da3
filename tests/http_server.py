"""A plain HTTP server on 127.0.0.1 that honours Range requests, for the http(s):// tests.

`RangeServer` is `http.server` based and serves files from memory: 206 Partial Content with
Content-Range, HEAD with Content-Length, 416 for ranges past the end, ETag and Last-Modified, and
no listing (PROPFIND gets 501, as `http.server` answers, or 405, as nginx does). `If-Match` is
honoured as real servers do (412 Precondition Failed when no tag matches the current ETag,
strongly compared). A `Behaviour` makes it misbehave the way some servers do: ignore Range (200
with the whole body, as some static servers and CDNs do), answer the first requests with an error
status, forbid everything, send bodies at a trickle, or have an object overwritten after a number
of GETs of it (optionally ignoring `If-Match`, as some servers do).
"""

from __future__ import annotations

import email.utils
import hashlib
import random
import re
import socket
import struct
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")

# What a chaotic server does to a body: answer 503, reset the connection midway, end the body
# early (a clean close short of Content-Length), stall midway for seconds, or trickle it.
FAULTS = ("503", "reset", "truncate", "stall", "trickle")


def parse_range(header: str, size: int) -> tuple[int, int] | str | None:
    """(start, end) for a satisfiable single range, "unsatisfiable" for one past the end, or None
    when the header is malformed or asks for several ranges (then the whole object is served, as
    RFC 9110 allows)."""
    m = RANGE.match(header.strip())
    if not m or (not m.group(1) and not m.group(2)):
        return None
    first, last = m.group(1), m.group(2)
    if not first:  # suffix range: the last N bytes
        n = int(last)
        return "unsatisfiable" if n == 0 or size == 0 else (max(0, size - n), size)
    start = int(first)
    end = size if not last else int(last) + 1
    if last and end <= start:
        return None
    if start >= size:
        return "unsatisfiable"
    return start, min(end, size)


@dataclass
class Behaviour:
    """What the server does besides serving files correctly."""

    ignore_range: bool = False  # always 200 with the whole body
    fail_first: int = 0  # the first N GET/HEAD requests get `fail_status`
    fail_status: int = 503
    forbid: bool = False  # every request gets 403
    propfind: int = 501  # WebDAV listing: 501 as http.server answers, 405 as nginx does
    trickle_rate: int = 0  # bytes/s for bodies of ranges from `trickle_from` (0: full speed)
    trickle_from: int = 0
    # Fault injection for the soak (benches/soak.py): each GET with a body draws a fault with
    # probability `chaos`, one of FAULTS, from a generator seeded with `seed`.
    chaos: float = 0.0
    seed: int = 0
    faults: dict = field(default_factory=dict)  # fault name -> times injected
    # An overwrite during a load: after `swap_after` GETs of `swap_path`, it holds `swap_data`
    # (and its ETag changes with it). `ignore_if_match`: serve whatever If-Match says.
    swap_path: str | None = None
    swap_data: bytes = b""
    swap_after: int = 0
    ignore_if_match: bool = False
    gets: int = 0  # GETs of swap_path so far
    refused_if_match: int = 0  # 412s answered
    rng: random.Random | None = None
    failed: int = 0
    log: list = field(default_factory=list)  # (method, path, Range header, status)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as a real server: clients pool connections
    server_version = "fastload-test-range/1"

    def log_message(self, format, *args):
        pass

    def do_HEAD(self):
        self._serve(send_body=False)

    def do_GET(self):
        self._serve(send_body=True)

    def do_PROPFIND(self):
        status = self.server.behaviour.propfind
        self.server.behaviour.log.append((self.command, self.path, None, status))
        self._reply(status, b"no listing here\n", True)

    def _reply(self, status: int, body: bytes, send_body: bool, headers=()) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Type", "text/plain")
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        if send_body:
            try:
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):  # a client that gave up (a 412)
                self.close_connection = True

    def _serve(self, send_body: bool) -> None:
        b: Behaviour = self.server.behaviour
        files: dict[str, bytes] = self.server.files
        path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        rng = self.headers.get("Range")
        with b.lock:
            failing = b.failed < b.fail_first
            if failing:
                b.failed += 1
        fault = self._draw_fault(b) if self.command == "GET" else None
        if fault == "503":
            b.log.append((self.command, path, rng, 503))
            self._reply(503, b"slow down\n", send_body)
            return
        if b.forbid:
            status = 403
        elif failing:
            status = b.fail_status
        elif path not in files:
            status = 404
        else:
            status = 200
        if status != 200:
            b.log.append((self.command, path, rng, status))
            self._reply(status, f"{status} for {path}\n".encode(), send_body)
            return
        with b.lock:
            if self.command == "GET" and path == b.swap_path:
                b.gets += 1
                if b.gets == b.swap_after + 1:
                    self.server.put({path: b.swap_data})
            data, etag = files[path], self.server.etags[path]
        if not b.ignore_if_match and not _if_match(self.headers.get("If-Match"), etag):
            with b.lock:
                b.refused_if_match += 1
            b.log.append((self.command, path, rng, 412))
            self._reply(412, b"precondition failed\n", send_body)
            return
        size = len(data)
        start, end = 0, size
        got = None if (rng is None or b.ignore_range) else parse_range(rng, size)
        if got == "unsatisfiable":
            b.log.append((self.command, path, rng, 416))
            self._reply(
                416, b"range not satisfiable\n", send_body, [("Content-Range", f"bytes */{size}")]
            )
            return
        if got is not None:
            status, (start, end) = 206, got
        b.log.append((self.command, path, rng, status))
        self.send_response(status)
        self.send_header("Content-Length", str(end - start))
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("ETag", etag)
        self.send_header("Last-Modified", self.server.modified)
        if not b.ignore_range:
            self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if not send_body:
            return
        view = memoryview(data)
        if b.trickle_rate and start >= b.trickle_from:
            self._trickle(view[start:end], b.trickle_rate)
            return
        if fault is not None:
            self._misbehave(fault, view[start:end])
            return
        try:
            for at in range(start, end, 1 << 20):
                self.wfile.write(view[at : min(end, at + (1 << 20))])
        except (BrokenPipeError, ConnectionResetError):
            # A client that stopped reading: one that saw the object change, above all.
            self.close_connection = True

    def _draw_fault(self, b: Behaviour) -> str | None:
        if not b.chaos:
            return None
        with b.lock:
            if b.rng is None:
                b.rng = random.Random(b.seed)
            if b.rng.random() >= b.chaos:
                return None
            fault = b.rng.choice(FAULTS)
            b.faults[fault] = b.faults.get(fault, 0) + 1
            return fault

    def _misbehave(self, fault: str, body: memoryview) -> None:
        half = len(body) // 2
        try:
            if fault == "trickle":
                self._trickle(body, 2048)
                return
            self.wfile.write(body[:half])
            self.wfile.flush()
            if fault == "stall":
                time.sleep(5)
            elif fault == "reset":
                # An abortive close: the client sees a connection reset.
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
        except (BrokenPipeError, ConnectionResetError):
            pass
        self.close_connection = True

    def _trickle(self, body: memoryview, rate: int) -> None:
        """Sends `body` at `rate` bytes per second, a twentieth of a second's worth at a time,
        until the client hangs up."""
        step = max(1, rate // 20)
        try:
            for at in range(0, len(body), step):
                self.wfile.write(body[at : at + step])
                self.wfile.flush()
                time.sleep(step / rate)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True


def _if_match(header: str | None, etag: str) -> bool:
    """Whether `If-Match` lets the request through (RFC 9110 13.1.1: absent, `*`, or one of its
    tags strongly equal to the current ETag; a weak tag never matches)."""
    if header is None or header.strip() == "*":
        return True
    tags = [t.strip() for t in header.split(",")]
    return not etag.startswith("W/") and etag in tags


class RangeServer(ThreadingHTTPServer):
    """Serves `files` ({"/url/path": bytes}) on 127.0.0.1 from a daemon thread."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, files: dict[str, bytes], behaviour: Behaviour | None = None, tls=None):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.files: dict[str, bytes] = {}
        self.etags: dict[str, str] = {}
        self.put(files)
        self.modified = email.utils.formatdate(usegmt=True)
        self.behaviour = behaviour or Behaviour()
        self.scheme = "http"
        if tls is not None:
            self.socket = tls.wrap_socket(self.socket, server_side=True)
            self.scheme = "https"
        self._thread = threading.Thread(
            target=self.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True
        )
        self._thread.start()

    def put(self, files: dict[str, Path | bytes]) -> None:
        """Serves each file's bytes at its URL path ("/a/b" or "a/b")."""
        for name, src in files.items():
            data = src if isinstance(src, bytes) else Path(src).read_bytes()
            path = "/" + name.lstrip("/")
            self.etags[path] = f'"{hashlib.md5(data).hexdigest()}"'
            self.files[path] = data

    def url(self, path: str) -> str:
        return f"{self.scheme}://127.0.0.1:{self.server_address[1]}/{path.lstrip('/')}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        self._thread.join(timeout=5)


def start_server(files, behaviour=None, tls=None) -> RangeServer:
    return RangeServer(files, behaviour, tls)
