"""Ctrl-C and other threads during a wait of ours (issue 13 item 2, issue 14 items 2 and 8).

Every blocking call waits in slices with the GIL released and runs Python's signal handlers
between them, so SIGINT raises KeyboardInterrupt within a slice even while a server says nothing;
`stats()` and `close()` never wait for a `next()` in progress on another thread. Each case runs in
a subprocess with a timeout, so that a hang fails the test instead of hanging the suite.
"""

from __future__ import annotations

import signal
import socket
import threading
import time

import pytest
from helpers import finish_probe, start_probe
from servers.base import Handler, Server
from servers.ranges import serve

# Before the fix SIGINT waited for the native call: 57-60 s with a silent server, for ever with a
# trickling one. A generous bound for a loaded machine, far below either.
INTERRUPT_BOUND = 5.0


class SilentServer:
    """Accepts connections on 127.0.0.1 and never answers."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        deadline = time.monotonic() + 300
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                continue
            self._held.append(conn)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for s in [*self._held, self._sock]:
            s.close()


class TrickleServer(Server):
    """Serves one file over HTTP with Range; a ranged GET that starts at byte 0 (the header read)
    comes at full speed, every other body one byte every `pause` seconds, bounded by `close()`."""

    def __init__(self, data: bytes, pause: float = 0.2) -> None:
        self.data, self.pause, self.stop = data, pause, threading.Event()
        super().__init__(_TrickleHandler)

    def close(self) -> None:
        self.stop.set()
        super().close()


class _TrickleHandler(Handler):
    server: TrickleServer

    def do_HEAD(self) -> None:
        serve(self, self.server.data, etag='"fixed"')

    def do_GET(self) -> None:
        reply = serve(self, self.server.data, etag='"fixed"')
        try:
            if reply.start == 0:
                self.wfile.write(reply.body)
                return
            for i in range(len(reply.body)):
                if self.server.stop.wait(self.server.pause):
                    return
                self.wfile.write(reply.body[i : i + 1])
                self.wfile.flush()
        except OSError:  # the interrupted client went away
            self.close_connection = True


@pytest.fixture
def silent():
    server = SilentServer()
    yield server
    server.close()


@pytest.fixture
def trickle(dtypes_file):
    server = TrickleServer(dtypes_file.read_bytes())
    yield server
    server.close()


# The probe: prints READY, then runs `CALL`; on KeyboardInterrupt it notes when, then loads a
# local file in the same process and checks it.
INTERRUPTED = """
import signal
from safetensors.torch import load_file
# As in a terminal, whatever the test runner inherited: a shell's background job (CI started with
# `nohup ... &`) starts with SIGINT ignored, and Python then installs no KeyboardInterrupt handler.
signal.signal(signal.SIGINT, signal.default_int_handler)
uri, local = sys.argv[1], sys.argv[2]
opts = {"storage_options": {"timeout": "120"}}
print("READY", flush=True)
try:
    CALL
    emit(error="the call returned")
except KeyboardInterrupt:
    caught = time.time()
    # The interrupted call's connections are closed (its requests cancelled), not left waiting
    # for the server in the background.
    port = int(uri.split(":")[2].split("/")[0])
    def established():
        rows = open("/proc/net/tcp").read().splitlines()[1:]
        return sum(1 for r in rows
                   if int(r.split()[2].split(":")[1], 16) == port and r.split()[3] == "01")
    deadline = time.monotonic() + 3
    while established() and time.monotonic() < deadline:
        time.sleep(0.05)
    want = load_file(local)
    got = fastload.load(local)
    same = sorted(got) == sorted(want) and all(
        torch.equal(got[n].reshape(-1).view(torch.uint8), want[n].reshape(-1).view(torch.uint8))
        for n in want
    )
    emit(caught=caught, same=same, established=established())
"""

CALLS = {
    "load": "fastload.load(uri, **opts)",
    "stream": "list(fastload.stream(uri, **opts))",
    "inspect": "fastload.inspect(uri, storage_options=opts['storage_options'])",
    "cli": "fastload._fastload.cli_main(['fastload', 'inspect', uri])",
}


def _interrupt(uri: str, local, call: str, wait: float = 1.0) -> float:
    """Starts the probe, sends SIGINT `wait` s after it is ready; returns the delay to the
    KeyboardInterrupt, after checking the process loaded a local file afterwards."""
    proc = start_probe(INTERRUPTED.replace("CALL", CALLS[call]), uri, local)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "READY", line
    time.sleep(wait)
    assert proc.poll() is None, "the call ended before it was interrupted"
    sent = time.time()
    proc.send_signal(signal.SIGINT)
    out = finish_probe(proc, timeout=60)
    assert out.get("same") is True and out["established"] == 0, out
    print(f"{call}: KeyboardInterrupt {out['caught'] - sent:.3f} s after SIGINT")
    return out["caught"] - sent


@pytest.mark.parametrize("call", sorted(CALLS))
def test_sigint_during_a_silent_server(silent, dtypes_file, call):
    uri = f"http://127.0.0.1:{silent.port}/model.safetensors"
    took = _interrupt(uri, dtypes_file, call)
    assert took < INTERRUPT_BOUND, f"KeyboardInterrupt came {took:.1f} s after SIGINT"


@pytest.mark.parametrize("call", ["load", "stream"])
def test_sigint_during_a_trickling_body(trickle, dtypes_file, call):
    # Headers come at once; the first data block trickles, so the wait is in next().
    took = _interrupt(trickle.url("model.safetensors"), dtypes_file, call, wait=1.5)
    assert took < INTERRUPT_BOUND, f"KeyboardInterrupt came {took:.1f} s after SIGINT"


CLOSE_FROM_ANOTHER_THREAD = """
from fastload import StreamClosedError
s = fastload.stream(sys.argv[1], storage_options={"timeout": "120"})
out = {}
def consume():
    try:
        for _ in s:
            pass
        out["end"] = "StopIteration"
    except StreamClosedError as e:
        out["end"] = "StreamClosedError"
        out["message"] = str(e)
        out["valueerror"] = isinstance(e, ValueError)
t = threading.Thread(target=consume)
t.start()
time.sleep(1.0)  # the consumer is waiting on the trickling body
polled = []
for _ in range(50):  # stats() while next() waits: never blocked by it
    started = time.monotonic()
    polled.append(s.stats()["tensors_delivered"])
    time.sleep(0.001)
started = time.monotonic()
s.close()
closed_in = time.monotonic() - started
t.join(timeout=30)
emit(alive=t.is_alive(), closed_in=closed_in, polled=len(polled), **out,
     after=s.stats()["tensors_delivered"])
"""


def test_close_from_another_thread_raises_in_the_consumer(trickle):
    out = finish_probe(
        start_probe(CLOSE_FROM_ANOTHER_THREAD, trickle.url("model.safetensors")), timeout=60
    )
    assert not out["alive"], out
    assert out["end"] == "StreamClosedError" and out["valueerror"], out
    assert "closed before it finished" in out["message"], out
    assert out["polled"] == 50, out


STATS_THREAD = """
from fastload import _fastload
path, target = sys.argv[1], sys.argv[2]

def allocate(sizes):  # called from the copy thread, with the GIL
    ts = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    return None, [(t, t.data_ptr()) for t in ts]

s = _fastload.Stream([path], target=target, allocate=allocate, block_size="1MiB",
                     memory_limit="8MiB")
stop = threading.Event()
calls = [0]
def poll():
    while not stop.is_set():
        s.stats()
        calls[0] += 1
        time.sleep(0.001)
t = threading.Thread(target=poll)
t.start()
n = 0
for batch in s:
    n += len(batch)
    time.sleep(0.005)  # leave the poller time to run while next() waits
stop.set()
t.join()
emit(n=n, calls=calls[0], delivered=s.stats().tensors_delivered)
"""


def test_stats_thread_never_stalls_a_staged_load(big_file):
    # Before the fix: next() held the loader's mutex through its wait, the poller held the GIL
    # waiting for that mutex, and the copy thread needed the GIL to allocate: a deadlock.
    out = finish_probe(start_probe(STATS_THREAD, big_file, "host"), timeout=120)
    assert out["n"] == out["delivered"] == 64, out
    assert out["calls"] > 0, out


def test_stats_thread_never_stalls_a_simulated_gpu_load(fake_cuda, big_file, tmp_path):
    import cuda_sim

    log = tmp_path / "log"
    env = cuda_sim.env(fake_cuda, log)
    out = finish_probe(start_probe(STATS_THREAD, big_file, "cuda:0", env=env), timeout=120)
    assert out["n"] == out["delivered"] == 64, out
    assert out["calls"] > 0, out
    assert cuda_sim.log(log)["violations"] == 0


def test_next_after_close_is_a_closed_error_unless_finished(dtypes_file, tiny_file):
    import fastload

    s = fastload.stream(tiny_file, memory_limit="1MiB")
    next(s)
    s.close()
    with pytest.raises(fastload.StreamClosedError, match="closed before it finished") as info:
        next(s)
    assert isinstance(info.value, ValueError)
    # A stream that delivered everything ends as usual, closed or not.
    done = fastload.stream(dtypes_file)
    n = len(list(done))
    done.close()
    assert n > 0 and list(done) == []
