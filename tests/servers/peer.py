"""A test-only peer: a server speaking fastload's peer protocol v1 (docs/peers.md) from bytes
held in memory, with the faults the client must survive: dying after some bytes (the connection
cut and the port closed), stalling after some bytes (the connection held open, silent), and
lying after some bytes (another `X-Fastload-Identity`). It counts the bytes it sent.

`canonical()` is the identity string the Rust side computes (src/source/identity.rs), written
again here so that a test can build a manifest from an origin's validators."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

from .base import HUNG_UP, Handler, Server
from .ranges import parse_range


def canonical(
    size: int, etag: str | None = None, version: str | None = None, sha256: str | None = None
) -> str:
    if sha256:
        return f"sha256:{sha256.lower()}"
    tag = (etag or "").strip()
    tag = f"W/{tag[2:].strip().strip(chr(34))}" if tag.startswith("W/") else tag.strip('"')
    v = version if version and version != "null" else "-"
    return f"etag:{tag or '-'};version:{v};size:{size}"


@dataclass
class PeerFile:
    data: bytes
    identity: dict  # {"sha256", "etag", "version", "commit"}
    origin_uri: str | None

    @property
    def canonical(self) -> str:
        i = self.identity
        return canonical(len(self.data), i.get("etag"), i.get("version"), i.get("sha256"))


@dataclass
class Fault:
    """What goes wrong once `after` bytes were sent in all (None: nothing)."""

    after: int | None = None
    kind: str = "none"  # "die", "stall", "lie"


@dataclass
class PeerState:
    checkpoints: dict[str, tuple[str | None, dict[str, PeerFile]]]
    token: str | None = None
    fault: Fault = field(default_factory=Fault)
    sent: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: list = field(default_factory=list)  # (path, identity header, auth ok)
    release: threading.Event = field(default_factory=threading.Event)
    manifest_asked: threading.Event = field(default_factory=threading.Event)


class PeerServer(Server):
    state: PeerState

    def kill(self) -> None:
        """Dies: no new connection is accepted (the port closes)."""
        self.shutdown()
        self.server_close()


class _PeerHandler(Handler):
    server: PeerServer

    def _authorized(self) -> bool:
        token = self.server.state.token
        return token is None or self.headers.get("Authorization") == f"Bearer {token}"

    def _plain(self, status: int, body: bytes = b"", headers: tuple = ()) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        state = self.server.state
        ok = self._authorized()
        state.requests.append((self.path, self.headers.get("X-Fastload-Identity"), ok))
        if self.path == "/healthz":
            return self._plain(200, b"ok")
        if not ok:
            return self._plain(401, b"", (("WWW-Authenticate", "Bearer"),))
        if self.path == "/v1/manifest":
            state.manifest_asked.set()
            return self._plain(200, json.dumps(self._manifest()).encode())
        prefix = "/v1/files/"
        name, _, path = self.path[len(prefix) :].partition("/")
        entry = state.checkpoints.get(name)
        f = entry[1].get(path) if entry and self.path.startswith(prefix) else None
        if f is None:
            return self._plain(404)
        self._file(f)

    def _manifest(self) -> dict:
        state = self.server.state
        return {
            "protocol": 1,
            "checkpoints": [
                {
                    "name": name,
                    "origin": origin,
                    "files": [
                        {
                            "path": path,
                            "size": len(f.data),
                            "identity": f.identity,
                            "origin_uri": f.origin_uri,
                            "held": True,
                        }
                        for path, f in files.items()
                    ],
                }
                for name, (origin, files) in state.checkpoints.items()
            ],
            "tiers": ["http"],
        }

    def _file(self, f: PeerFile) -> None:
        state = self.server.state
        asked = self.headers.get("X-Fastload-Identity")
        if asked is not None and asked != f.canonical:
            return self._plain(409, b"not here", (("X-Fastload-Identity", f.canonical),))
        got = parse_range(self.headers.get("Range") or "", len(f.data))
        if got == "unsatisfiable":
            return self._plain(416)
        start, end = got if isinstance(got, tuple) else (0, len(f.data))
        fault = state.fault
        lying = fault.kind == "lie" and fault.after is not None and state.sent >= fault.after
        identity = "etag:lie;version:-;size:0" if lying else f.canonical
        self.send_response(206 if isinstance(got, tuple) else 200)
        self.send_header("Content-Length", str(end - start))
        if isinstance(got, tuple):
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(f.data)}")
        self.send_header("ETag", f'"{f.canonical}"')
        self.send_header("X-Fastload-Identity", identity)
        self.end_headers()
        self._body(memoryview(f.data)[start:end])

    def _body(self, body: memoryview) -> None:
        state = self.server.state
        step = 64 << 10
        for at in range(0, len(body), step):
            chunk = body[at : at + step]
            with state.lock:
                fault = state.fault
                if fault.after is not None and fault.kind in ("die", "stall"):
                    room = max(0, fault.after - state.sent)
                    chunk = chunk[:room]
                state.sent += len(chunk)
            try:
                if chunk:
                    self.wfile.write(chunk)
                    self.wfile.flush()
            except HUNG_UP:
                self.close_connection = True
                return
            if len(chunk) < min(step, len(body) - at):
                self._fail(fault.kind)
                return

    def _fail(self, kind: str) -> None:
        self.close_connection = True
        if kind == "die":
            threading.Thread(target=self.server.kill, daemon=True).start()
        elif kind == "stall":
            # Silent, the connection open, until the test ends it.
            self.server.state.release.wait(120)


def start(
    checkpoints: dict[str, tuple[str | None, dict[str, PeerFile]]],
    token: str | None = None,
    fault: Fault | None = None,
) -> PeerServer:
    server = PeerServer(_PeerHandler)
    server.state = PeerState(checkpoints, token, fault or Fault())
    return server


def wait_closed(server: PeerServer, timeout: float = 5.0) -> None:
    """Waits until a dying peer stopped accepting."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and server.socket.fileno() != -1:
        time.sleep(0.01)
