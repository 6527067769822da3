"""A server that answers each request as the test's function says (`serve(answer)`): the bodies
a broken or hostile server sends (chunked without an end in sight, echoed credentials)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from servers.base import HUNG_UP, Handler, Server


class _Handler(Handler):
    """Answers as `server.answer(handler)` says; HTTP/1.1 with chunked bodies available."""

    def do_GET(self):
        self.server.answer(self)

    do_HEAD = do_GET

    def reply(self, status: int, body: bytes = b"", headers=()) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def chunked(self, parts: Iterator[bytes], headers=()) -> None:
        """A 200 whose body has no Content-Length: only reading it tells how long it is."""
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        try:
            for part in parts:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\n\r\n")
        except HUNG_UP:
            pass
        self.close_connection = True


class AnswerServer(Server):
    def __init__(self, answer):
        self.answer = answer
        super().__init__(_Handler)


@pytest.fixture
def serve():
    servers: list[AnswerServer] = []

    def start(answer) -> AnswerServer:
        servers.append(AnswerServer(answer))
        return servers[-1]

    yield start
    for s in servers:
        s.close()
