"""A delaying TCP proxy on 127.0.0.1: every chunk is held for a fixed one-way delay in each
direction, so a 10 ms delay gives a ~20 ms round trip, while throughput is kept (a delay line, not
a rate limit: chunks are timestamped on arrival and released in order when their time comes,
however many are in flight). New connections also pay one round trip before their first byte
moves, as a TCP handshake over that link would.

This kernel has no netem qdisc, so this stands in for `tc qdisc ... netem delay`.

With a rate (`--rate-mbps`, `start_in_thread(..., rate=bytes per second)`), what the target sends
also crosses one link of that rate, shared by every connection (a node's network card): each
chunk waits for the link to be free, takes its length / rate on it, then the delay. Without one
the link is as fast as the host (about 0.3 to 0.8 GB/s through this proxy on these VMs), where
reading twice the bytes costs little more; a rate makes a load's bytes cost what they cost
behind a real link (a 10 Gb/s card shared by 8 GPU workers gives each about 150 MB/s).

    python benches/latency_proxy.py --target 127.0.0.1:8333 --delay-ms 10
    # prints "PORT <n>" once listening; serves until killed, or for --lifetime seconds

Or in-process: `start_in_thread(target, delay_s) -> (port, stop)`. `--splice` (`splice=True`) is
the SpliceLine below, for links of GB/s that this asyncio relay cannot carry.

Built on asyncio protocols (no stream buffering): one copy from the socket into `bytes`, one send.
Cost measured here: about 0.6 CPU-seconds per GB relayed (uvloop did not lower it), so at the
0.3 GB/s SeaweedFS reaches on these VMs the proxy takes about a fifth of one core.
Bounds: each direction holds at most `high_water` bytes before it stops reading its source (so a
slow receiver slows the sender, as TCP would); the whole proxy stops after `lifetime` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import select
import socket
import subprocess
import sys
import threading
import time

HIGH_WATER = 64 << 20  # bytes in flight per direction before reading pauses
LOW_WATER = 16 << 20


class _Side(asyncio.Protocol):
    """One socket of a proxied connection. Data it receives is queued, stamped with its release
    time, and written to the peer's socket when that time comes (strictly in arrival order)."""

    def __init__(self, proxy: LatencyProxy, start_after: float = 0.0) -> None:
        self.proxy = proxy
        self.loop = proxy.loop
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.queue: collections.deque = collections.deque()  # (due, bytes | "eof" | "close")
        self.pending = 0
        self.timer: asyncio.TimerHandle | None = None
        self.reading_paused = False
        self.peer_writing_paused = False
        self.start_after = start_after  # no byte leaves before this loop time (handshake RTT)
        self.closed = False

    # -- source side: what this socket receives -----------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _enqueue(self, item, link: bool = False) -> None:
        due = max(self.loop.time(), self.start_after)
        if link and self.proxy.rate:
            # On the shared link after what is already on it, for its length / rate.
            due = self.proxy.link_free = (
                max(self.proxy.link_free, due) + len(item) / self.proxy.rate
            )
        due += self.proxy.delay
        self.queue.append((due, item))
        if self.timer is None:
            self.timer = self.loop.call_at(self.queue[0][0], self._flush)

    def data_received(self, data: bytes) -> None:
        self.pending += len(data)
        self.proxy.bytes += len(data)
        # What the target sends (this side's socket is the upstream one) crosses the link.
        self._enqueue(data, link=not isinstance(self, _Client))
        if self.pending > HIGH_WATER and not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        self._enqueue("eof")
        return True  # keep the socket open for the other direction (half-close)

    def connection_lost(self, exc) -> None:
        self.closed = True
        self._enqueue("close")

    # -- sink side: releasing queued data to the peer -------------------------------------------
    def _flush(self) -> None:
        self.timer = None
        now = self.loop.time()
        peer = self.peer.transport if self.peer is not None else None
        while self.queue and self.queue[0][0] <= now:
            if peer is None:
                # The upstream connection is not up yet: try again shortly.
                self.timer = self.loop.call_later(0.001, self._flush)
                return
            _, item = self.queue.popleft()
            try:
                if item == "eof":
                    if peer.can_write_eof() and not peer.is_closing():
                        peer.write_eof()
                elif item == "close":
                    peer.close()
                else:
                    self.pending -= len(item)
                    if not peer.is_closing():
                        peer.write(item)
            except OSError:  # the peer went away meanwhile (ENOTCONN on shutdown): drop it all
                peer.close()
        if self.queue:
            self.timer = self.loop.call_at(self.queue[0][0], self._flush)
        self._maybe_resume()

    def _maybe_resume(self) -> None:
        if (
            self.reading_paused
            and self.pending < LOW_WATER
            and not self.peer_writing_paused
            and not self.closed
        ):
            self.reading_paused = False
            self.transport.resume_reading()

    # Flow control of writes *to this socket* (the peer's data): stop reading the peer's source.
    def pause_writing(self) -> None:
        if self.peer is not None:
            self.peer.peer_writing_paused = True
            if not self.peer.reading_paused and not self.peer.closed:
                self.peer.reading_paused = True
                self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None:
            self.peer.peer_writing_paused = False
            self.peer._maybe_resume()


class _Client(_Side):
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.proxy.connections += 1
        # One round trip before the first byte moves: the handshake of a real link.
        self.start_after = self.loop.time() + 2 * self.proxy.delay
        self.loop.create_task(self._connect())

    async def _connect(self) -> None:
        try:
            _, upstream = await asyncio.wait_for(
                self.loop.create_connection(
                    lambda: _Side(self.proxy), self.proxy.target[0], self.proxy.target[1]
                ),
                timeout=10,
            )
        except (OSError, asyncio.TimeoutError):
            self.queue.clear()
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            self.transport.close()
            return
        upstream.peer, self.peer = self, upstream
        upstream.start_after = self.start_after


class LatencyProxy:
    def __init__(
        self, target: tuple[str, int], delay_s: float, port: int = 0, rate: float | None = None
    ) -> None:
        self.target = target
        self.delay = delay_s
        self.rate = rate  # bytes per second of the shared link (None: no link)
        self.link_free = 0.0  # loop time at which the link is free
        self.port = port
        self.bytes = 0
        self.connections = 0
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, lifetime: float, ready=None, stop: threading.Event | None = None):
        self.loop = asyncio.get_running_loop()
        server = await self.loop.create_server(
            lambda: _Client(self), "127.0.0.1", self.port, backlog=1024
        )
        self.port = server.sockets[0].getsockname()[1]
        if ready is not None:
            ready(self.port)
        deadline = time.monotonic() + lifetime
        async with server:
            while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
                await asyncio.sleep(0.2)


class SpliceLine:
    """The same link for rates a Python relay cannot carry (gigabytes a second): the target's
    replies move socket -> pipe -> socket with os.splice, so their bytes never enter Python,
    paced on the shared link by the bytes each splice moved (a chunk leaves when the link would
    have carried its last byte). The round trip is put on the requests (small: Python holds
    each for twice the one-way delay, in arrival order) instead of half on each direction: a
    reply still comes one round trip plus its time on the link after its request, as over the
    real link, for any request/reply protocol (HTTP). A connection's first request also pays
    one round trip (the handshake). Threads: per connection, one reads requests, one sends them
    when due, one splices the replies (os.splice and the sleeps release the GIL).

    What it carries is checked where it is used: benches/peer_bench.py's row "raw parallel GET
    through the same delay line" against the line's rate."""

    def __init__(
        self, target: tuple[str, int], delay_s: float, port: int = 0, rate: float | None = None
    ) -> None:
        self.target = target
        self.delay = delay_s
        self.rate = rate
        self.port = port
        self.bytes = 0
        self.connections = 0
        self.link_free = 0.0  # time.monotonic() at which the link is free
        self.lock = threading.Lock()

    def serve(self, lifetime: float, ready=None, stop: threading.Event | None = None) -> None:
        listener = socket.create_server(("127.0.0.1", self.port), backlog=1024)
        listener.settimeout(0.2)
        self.port = listener.getsockname()[1]
        if ready is not None:
            ready(self.port)
        deadline = time.monotonic() + lifetime
        with listener:
            while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
                try:
                    client, _ = listener.accept()
                except socket.timeout:
                    continue
                self.connections += 1
                threading.Thread(target=self._connection, args=(client,), daemon=True).start()

    def _connection(self, client: socket.socket) -> None:
        client.settimeout(None)
        start_after = time.monotonic() + 2 * self.delay  # the handshake's round trip
        try:
            upstream = socket.create_connection(self.target, timeout=10)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        for s in (client, upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        due: collections.deque = collections.deque()
        ready = threading.Condition()
        threading.Thread(
            target=self._send_requests, args=(upstream, due, ready), daemon=True
        ).start()
        threading.Thread(target=self._replies, args=(upstream, client), daemon=True).start()
        while True:
            try:
                data = client.recv(1 << 16)
            except OSError:
                data = b""
            self.bytes += len(data)
            with ready:
                due.append((max(time.monotonic(), start_after) + 2 * self.delay, data))
                ready.notify()
            if not data:
                return

    @staticmethod
    def _send_requests(upstream: socket.socket, due: collections.deque, ready) -> None:
        while True:
            with ready:
                while not due:
                    ready.wait()
                when, data = due.popleft()
            time.sleep(max(0.0, when - time.monotonic()))
            try:
                if not data:
                    upstream.shutdown(socket.SHUT_WR)
                    return
                upstream.sendall(data)
            except OSError:
                return

    def _replies(self, upstream: socket.socket, client: socket.socket) -> None:
        """The target's replies to the client through a pipe: this thread fills it from the
        upstream socket, another drains it into the client's, paced, so that reading and
        writing overlap (one thread doing both waits on each in turn)."""
        import fcntl

        r, w = os.pipe()
        try:
            fcntl.fcntl(w, 1031, SPLICE_CHUNK)  # F_SETPIPE_SZ
        except OSError:
            pass
        drain = threading.Thread(target=self._drain, args=(r, upstream, client), daemon=True)
        drain.start()
        arrived = select.poll()
        arrived.register(upstream.fileno(), select.POLLIN)
        try:
            # A splice from a socket holds the pipe's lock while it waits for the socket, which
            # would stop the drain too: it is only asked once bytes (or the end) are there.
            while arrived.poll() and os.splice(upstream.fileno(), w, SPLICE_CHUNK):
                pass
        except OSError:
            pass
        finally:
            os.close(w)  # the drain sees the end once the pipe is empty
        drain.join()
        os.close(r)
        upstream.close()

    def _drain(self, r: int, upstream: socket.socket, client: socket.socket) -> None:
        try:
            while True:
                # What the pipe holds, up to a chunk (Linux 6.5+ sends the last piece without
                # MSG_MORE when the pipe is empty: nothing is held back).
                n = os.splice(r, client.fileno(), SPLICE_CHUNK)
                if n == 0:  # the filling side closed the pipe: the end of the replies
                    client.shutdown(socket.SHUT_WR)
                    break
                self.bytes += n
                if not self.rate:
                    continue
                with self.lock:
                    # A link left idle only because this relay was not scheduled (a busy VM)
                    # may catch up by at most SLACK: over any longer span it carries no more
                    # than its rate.
                    now = time.monotonic()
                    self.link_free = max(self.link_free, now - SLACK) + n / self.rate
                    wait = self.link_free - now
                # Waits shorter than SLACK cost a wakeup each (as long as a small chunk's time
                # on the link on a busy VM): the link time stays booked for the next chunks.
                if wait > SLACK:
                    time.sleep(wait)
        except OSError:
            # The client went away: stop the filling side too.
            try:
                upstream.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        finally:
            client.close()


SPLICE_CHUNK = 1 << 20  # the most a pipe holds unprivileged (/proc/sys/fs/pipe-max-size)
SLACK = 0.002  # seconds of link time a late relay may make up (1% of a 0.2 s transfer)


def start_in_thread(
    target: tuple[str, int],
    delay_s: float,
    lifetime: float = 3600.0,
    rate: float | None = None,
    splice: bool = False,
) -> tuple[int, threading.Event]:
    """Runs a proxy on a daemon thread; returns its port and an Event that stops it (its
    ``proxy`` attribute: the proxy, whose ``bytes`` count what it relayed both ways). ``rate``:
    bytes per second of the link the target's replies share (None: none); ``splice``: the
    :class:`SpliceLine` (for rates the asyncio relay cannot carry)."""
    stop = threading.Event()
    got: list[int] = []
    ready = threading.Event()

    def run() -> None:
        if splice:
            line = SpliceLine(target, delay_s, rate=rate)
            stop.proxy = line  # type: ignore[attr-defined]
            line.serve(lifetime, ready=lambda p: (got.append(p), ready.set()), stop=stop)
            return
        proxy = LatencyProxy(target, delay_s, rate=rate)
        stop.proxy = proxy  # type: ignore[attr-defined]  # its counters, for the caller
        asyncio.run(proxy.serve(lifetime, ready=lambda p: (got.append(p), ready.set()), stop=stop))

    threading.Thread(target=run, daemon=True).start()
    if not ready.wait(10):
        raise RuntimeError("latency proxy did not start within 10 s")
    return got[0], stop


def start_process(
    target: tuple[str, int], delay_s: float, rate: float | None = None
) -> tuple[int, subprocess.Popen]:
    """The :class:`SpliceLine` in a process of its own (its threads then share no GIL with the
    caller's, a raw client's say); returns its port and the process (kill it to stop)."""
    args = [sys.executable, __file__, "--splice", "--target", f"{target[0]}:{target[1]}"]
    args += ["--delay-ms", str(delay_s * 1000)]
    if rate:
        args += ["--rate-mbps", str(rate / 1e6)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    if not line.startswith("PORT "):
        proc.kill()
        raise RuntimeError(f"latency proxy did not start: {line!r}")
    return int(line.split()[1]), proc


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", required=True, help="host:port to forward to")
    ap.add_argument("--delay-ms", type=float, default=10.0, help="one-way delay per direction")
    ap.add_argument("--port", type=int, default=0, help="listening port (default: any free)")
    ap.add_argument("--lifetime", type=float, default=3600.0, help="seconds before it exits")
    ap.add_argument(
        "--rate-mbps", type=float, default=None, help="MB/s of the link the replies share"
    )
    ap.add_argument(
        "--splice", action="store_true", help="relay replies with os.splice (GB/s rates)"
    )
    args = ap.parse_args(argv)
    host, port = args.target.rsplit(":", 1)
    rate = None if args.rate_mbps is None else args.rate_mbps * 1e6
    if args.splice:
        line = SpliceLine((host, int(port)), args.delay_ms / 1000.0, args.port, rate)
        try:
            line.serve(args.lifetime, ready=lambda p: print(f"PORT {p}", flush=True))
        except KeyboardInterrupt:
            pass
        return
    proxy = LatencyProxy((host, int(port)), args.delay_ms / 1000.0, args.port, rate)

    def ready(p: int) -> None:
        print(f"PORT {p}", flush=True)

    try:
        asyncio.run(proxy.serve(args.lifetime, ready=ready))
    except KeyboardInterrupt:
        pass
    print(f"relayed {proxy.bytes} bytes over {proxy.connections} connections", file=sys.stderr)


if __name__ == "__main__":
    main()
