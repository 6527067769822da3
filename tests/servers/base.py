"""The threaded server base every test server derives from.

`Server` serves from daemon threads (a test never waits on a client that keeps its connection
open), starts itself, and is quiet when a client hangs up mid-response (a load that was cut,
interrupted or gave up after a 412): `socketserver` would print "Exception occurred during
processing of request" and a traceback for each. `Handler` speaks HTTP/1.1 with keep-alive, as
real servers do (clients pool connections), and logs nothing.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# What a client that went away looks like from the server's side.
HUNG_UP = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)


class Server(ThreadingHTTPServer):
    """A `ThreadingHTTPServer` on 127.0.0.1 (a free port unless `port`), serving from a daemon
    thread from construction until `close()`."""

    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    # listen()'s backlog (socketserver's default is 5): a client with 16 or 64 reads in flight
    # connects that many times at once, and connections beyond the backlog lose their SYN and
    # retry it 1, 3, 7, 15, 31 s later (the 15 and 30 s outliers once seen in
    # benches/transformers_bench.py's 200 MB/s rows, with the mock Hub).
    request_queue_size = 128
    scheme = "http"

    def __init__(self, handler: type[BaseHTTPRequestHandler], port: int = 0, tls=None) -> None:
        super().__init__(("127.0.0.1", port), handler)
        if tls is not None:
            self.socket = tls.wrap_socket(self.socket, server_side=True)
            self.scheme = "https"
        self._thread = threading.Thread(
            target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    @property
    def base(self) -> str:
        """scheme://127.0.0.1:port, without a trailing slash."""
        return f"{self.scheme}://127.0.0.1:{self.server_address[1]}"

    def url(self, path: str = "") -> str:
        return f"{self.base}/{path.lstrip('/')}"

    def handle_error(self, request, client_address) -> None:
        import sys

        if isinstance(sys.exc_info()[1], HUNG_UP):
            return  # a client that hung up: expected, nothing to report
        super().handle_error(request, client_address)

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        self._thread.join(timeout=5)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as a real server: clients pool connections

    def log_message(self, format, *args) -> None:
        pass
