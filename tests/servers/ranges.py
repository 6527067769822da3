"""The one reading of `Range` and `If-Match`, and the one body writer, for every test server.

`serve()` answers a GET or HEAD of some bytes as servers do: 412 Precondition Failed when
`If-Match` names no tag strongly equal to the ETag (RFC 9110 13.1.1), or, without `If-Match`, when
the bytes were modified after `If-Unmodified-Since` (13.1.4), 416 with `Content-Range:
bytes */size` for a range past the end, 206 with `Content-Range` for one satisfiable range
(`bytes=a-b`, `a-`, `-n`), and 200 with the whole body otherwise (no header, a malformed one, or
several ranges, as RFC 9110 allows). It sends the status line and headers and returns what is
left to do: the status, and the part of the body to write (the caller writes it its own way:
at full speed with `write()`, throttled, trickled or cut).
"""

from __future__ import annotations

import email.utils
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler

from .base import HUNG_UP

RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")

# Sends an error response in a server's own dialect: (status, message, extra headers).
Refuse = Callable[[int, str, list], None]


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


def if_match(header: str | None, etag: str) -> bool:
    """Whether `If-Match` lets the request through (RFC 9110 13.1.1: absent, `*`, or one of its
    tags strongly equal to the current ETag; a weak tag never matches)."""
    if header is None or header.strip() == "*":
        return True
    tags = [t.strip() for t in header.split(",")]
    return not etag.startswith("W/") and etag in tags


def if_unmodified_since(header: str | None, last_modified: str | None) -> bool:
    """Whether `If-Unmodified-Since` lets the request through (RFC 9110 13.1.4: absent, not a
    date, or a representation without a Last-Modified, else modified at or before the date)."""
    if header is None or last_modified is None:
        return True
    try:
        since = email.utils.parsedate_to_datetime(header)
        modified = email.utils.parsedate_to_datetime(last_modified)
    except (TypeError, ValueError):
        return True
    return modified <= since


@dataclass
class Reply:
    status: int  # 200, 206, 412 or 416
    body: memoryview  # what is left to write (empty for HEAD and for 412/416, already sent)
    start: int = 0  # where `body` starts in the object


def plain_refuse(handler: BaseHTTPRequestHandler) -> Refuse:
    """Errors as a plain text body."""

    def refuse(status: int, message: str, headers: list) -> None:
        body = f"{message}\n".encode()
        handler.send_response(status)
        handler.send_header("Content-Length", str(len(body)))
        handler.send_header("Content-Type", "text/plain")
        for k, v in headers:
            handler.send_header(k, v)
        handler.end_headers()
        if handler.command != "HEAD":
            write(handler, memoryview(body))

    return refuse


def serve(
    handler: BaseHTTPRequestHandler,
    data: bytes,
    headers: Iterable[tuple[str, str]] = (),
    *,
    etag: str | None = None,
    sent_etag: str | bool | None = True,
    last_modified: str | None = None,
    check_if_match: bool = True,
    honour_range: bool = True,
    range_header: str | None = None,
    refuse: Refuse | None = None,
    on_status: Callable[[int], None] | None = None,
) -> Reply:
    """Answers `handler`'s GET/HEAD of `data` (see the module's docstring). `etag` is sent and is
    what `If-Match` is compared with (`sent_etag`, when not True, is sent in its place: None for
    no ETag header), `last_modified` (an HTTP date) is sent and is what
    `If-Unmodified-Since` is compared with (`check_if_match=False` ignores both preconditions);
    `range_header` overrides the request's `Range` (Azure's
    `x-ms-range`); `honour_range=False` serves the whole body with 200 whatever was asked;
    `on_status(status)` runs before anything is sent (a log that a client never sees late)."""
    refuse = refuse or plain_refuse(handler)
    noted = on_status or (lambda status: None)
    size = len(data)
    empty = memoryview(b"")
    tags = handler.headers.get("If-Match")
    if tags is not None:
        refused = etag is not None and not if_match(tags, etag)
    else:
        since = handler.headers.get("If-Unmodified-Since")
        refused = not if_unmodified_since(since, last_modified)
    if check_if_match and refused:
        noted(412)
        refuse(412, "precondition failed", [])
        return Reply(412, empty)
    rng = range_header if range_header is not None else handler.headers.get("Range")
    got = parse_range(rng, size) if (rng and honour_range) else None
    if got == "unsatisfiable":
        noted(416)
        refuse(416, "range not satisfiable", [("Content-Range", f"bytes */{size}")])
        return Reply(416, empty)
    status, (start, end) = (206, got) if isinstance(got, tuple) else (200, (0, size))
    noted(status)
    handler.send_response(status)
    handler.send_header("Content-Length", str(end - start))
    if honour_range:
        handler.send_header("Accept-Ranges", "bytes")
    shown = etag if sent_etag is True else sent_etag
    if isinstance(shown, str):
        handler.send_header("ETag", shown)
    if last_modified is not None:
        handler.send_header("Last-Modified", last_modified)
    for k, v in headers:
        handler.send_header(k, v)
    if status == 206:
        handler.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
    handler.end_headers()
    if handler.command == "HEAD":
        return Reply(status, empty, start)
    return Reply(status, memoryview(data)[start:end], start)


def write(
    handler: BaseHTTPRequestHandler,
    body: memoryview,
    step: int = 1 << 20,
    throttle: Callable[[int], None] | None = None,
) -> bool:
    """Writes `body` in `step`-byte pieces (each after `throttle(n)`, if given); False, and the
    connection marked to close, when the client hung up."""
    try:
        for at in range(0, len(body), step):
            chunk = body[at : at + step]
            if throttle is not None:
                throttle(len(chunk))
            handler.wfile.write(chunk)
    except HUNG_UP:
        handler.close_connection = True
        return False
    return True
