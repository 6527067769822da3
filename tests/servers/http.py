"""A plain HTTP server on 127.0.0.1 that honours Range requests, for the http(s):// tests.

`RangeServer` is `http.server` based and serves files from memory: 206 Partial Content with
Content-Range, HEAD with Content-Length, 416 for ranges past the end, ETag and Last-Modified, and
no listing (PROPFIND gets 501, as `http.server` answers, or 405, as nginx does). `If-Match` is
honoured as real servers do (412 Precondition Failed when no tag matches the current ETag,
strongly compared), and so is a GET's `If-None-Match` (304 Not Modified when a tag matches,
weakly compared, as nginx answers). A `Behaviour` makes it misbehave the way some servers do:
ignore Range (200 with the whole body, as some static servers and CDNs do), answer the first
requests with an error status, forbid everything, send bodies at a trickle, have an object
overwritten after a number of GETs of it (optionally ignoring `If-Match` and
`If-Unmodified-Since`, as some servers do), or send its validators as some servers and proxies do
(no ETag at all, none with a GET's bytes, a rewritten one).
"""

from __future__ import annotations

import email.utils
import hashlib
import random
import socket
import struct
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from .base import HUNG_UP, Handler, Server
from .ranges import RANGE, parse_range, plain_refuse, serve, write

__all__ = ["FAULTS", "RANGE", "Behaviour", "RangeServer", "parse_range", "start_server"]

# What a chaotic server does to a body: answer 503, reset the connection midway, end the body
# early (a clean close short of Content-Length), stall midway for seconds, or trickle it.
FAULTS = ("503", "reset", "truncate", "stall", "trickle")


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
    ignore_if_match: bool = False  # and If-Unmodified-Since
    # Validators as some servers and proxies send them: `etags=False`, none at all (Last-Modified
    # only); `get_etags=False`, none with the bytes of a GET (HEAD still sends it, and If-Match is
    # still honoured, as behind a proxy that strips it); `get_etag`, this one with the bytes of a
    # GET in place of the real one (a CDN rewriting ETags; If-Match is compared with the real
    # one). A swap moves Last-Modified on by `swap_modified_by` seconds.
    etags: bool = True
    get_etags: bool = True
    get_etag: str | None = None
    if_match_against_get_etag: bool = False  # the CDN compares If-Match with its own tag
    swap_modified_by: int = 10
    gets: int = 0  # GETs of swap_path so far
    refused_if_match: int = 0  # 412s answered
    rng: random.Random | None = None
    failed: int = 0
    # Every request waits (up to 10 s) until `hold` is set; `held_out` counts the waits that ran
    # out (a client that asked something else only after this server answered).
    hold: threading.Event | None = None
    held_out: int = 0
    log: list = field(default_factory=list)  # (method, path, Range header, status)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Handler(Handler):
    server_version = "fastload-test-range/1"
    server: RangeServer

    def do_HEAD(self):
        self._serve(send_body=False)

    def do_GET(self):
        self._serve(send_body=True)

    def do_PROPFIND(self):
        status = self.server.behaviour.propfind
        self.server.behaviour.log.append((self.command, self.path, None, status))
        plain_refuse(self)(status, "no listing here", [])

    def _serve(self, send_body: bool) -> None:
        b: Behaviour = self.server.behaviour
        files: dict[str, bytes] = self.server.files
        path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        rng = self.headers.get("Range")
        if b.hold is not None and not b.hold.wait(10):
            with b.lock:
                b.held_out += 1
        with b.lock:
            failing = b.failed < b.fail_first
            if failing:
                b.failed += 1
        fault = self._draw_fault(b) if self.command == "GET" else None
        if fault == "503":
            b.log.append((self.command, path, rng, 503))
            plain_refuse(self)(503, "slow down", [])
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
            plain_refuse(self)(status, f"{status} for {path}", [])
            return
        with b.lock:
            if self.command == "GET" and path == b.swap_path:
                b.gets += 1
                if b.gets == b.swap_after + 1:
                    self.server.put({path: b.swap_data})
                    later = email.utils.parsedate_to_datetime(self.server.modified).timestamp()
                    self.server.modified = email.utils.formatdate(
                        later + b.swap_modified_by, usegmt=True
                    )
            data, etag = files[path], self.server.etags[path]
            modified = self.server.modified
        sent_etag = etag if b.etags else None
        if self.command == "GET" and not b.get_etags:
            sent_etag = None
        elif self.command == "GET" and b.get_etag is not None:
            sent_etag = b.get_etag

        def noted(status: int) -> None:
            if status == 412:
                with b.lock:
                    b.refused_if_match += 1
            b.log.append((self.command, path, rng, status))

        if self.command == "GET" and sent_etag and _none_match(self, sent_etag):
            noted(304)
            self.send_response(304)
            self.send_header("ETag", sent_etag)
            self.end_headers()
            return
        reply = serve(
            self,
            data,
            [("Content-Type", "application/octet-stream")],
            etag=(b.get_etag if b.if_match_against_get_etag else etag) if b.etags else None,
            sent_etag=sent_etag,
            last_modified=modified,
            check_if_match=not b.ignore_if_match,
            honour_range=not b.ignore_range,
            on_status=noted,
        )
        if not reply.body:
            return
        if b.trickle_rate and reply.start >= b.trickle_from:
            self._trickle(reply.body, b.trickle_rate)
        elif fault is not None:
            self._misbehave(fault, reply.body)
        else:
            # A client that stops reading (one that saw the object change, above all) is let go.
            write(self, reply.body)

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
        except HUNG_UP:
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
        except HUNG_UP:
            self.close_connection = True


class RangeServer(Server):
    """Serves `files` ({"/url/path": bytes}) on 127.0.0.1 from a daemon thread."""

    def __init__(self, files: dict[str, bytes], behaviour: Behaviour | None = None, tls=None):
        self.files: dict[str, bytes] = {}
        self.etags: dict[str, str] = {}
        self.put(files)
        self.modified = email.utils.formatdate(usegmt=True)
        self.behaviour = behaviour or Behaviour()
        super().__init__(_Handler, tls=tls)

    def overwrite(self, files: dict[str, Path | bytes], later_by: int = 10) -> None:
        """Puts `files` as an overwrite does: new bytes, Last-Modified `later_by` seconds on."""
        with self.behaviour.lock:
            self.put(files)
            then = email.utils.parsedate_to_datetime(self.modified).timestamp()
            self.modified = email.utils.formatdate(then + later_by, usegmt=True)

    def put(self, files: dict[str, Path | bytes]) -> None:
        """Serves each file's bytes at its URL path ("/a/b" or "a/b")."""
        for name, src in files.items():
            data = src if isinstance(src, bytes) else Path(src).read_bytes()
            path = "/" + name.lstrip("/")
            self.etags[path] = f'"{hashlib.md5(data).hexdigest()}"'
            self.files[path] = data


def _none_match(handler: Handler, etag: str) -> bool:
    """Whether the request's `If-None-Match` names `etag` (or `*`), weakly compared."""
    tags = handler.headers.get("If-None-Match")
    if tags is None:
        return False
    bare = etag.removeprefix("W/")
    return any(t.strip() == "*" or t.strip().removeprefix("W/") == bare for t in tags.split(","))


def start_server(files, behaviour=None, tls=None) -> RangeServer:
    return RangeServer(files, behaviour, tls)
