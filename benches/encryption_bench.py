"""What encryption at rest (``keyset=``, Tink's streaming AEAD) costs a load.

Writes a checkpoint, encrypts it with the ``tink`` package (``AES256_GCM_HKDF_1MB``), and times,
each ``--reps`` times (best and median), the plain file against the encrypted one:

- ``load``: ``fastload.load(path, method="read")`` (the plain file also with the default
  ``method``, which maps it: an encrypted file is always read, decrypted into buffers);
- ``stream``: ``for name, t in fastload.stream(path)``;
- ``http``: ``fastload.load(url)`` from tests/servers/http.py's Range server (a process of its
  own), as a remote store is read;
- ``s3`` (with ``--s3``): ``fastload.load("s3://...")`` from a local SeaweedFS (``weed mini``,
  tests/servers/s3.py), SigV4 signed;

cold (the file evicted from the page cache before each run) and warm; with ``--save`` also
``save_file``: the checkpoint's tensors (in memory) written plain against written with
``keyset=`` (each run syncs the file to the disk, overwriting the last). Every run reads every page
of every tensor inside the clock (``fastload._peers.touch``). Beside them, the CPU's AES-GCM rate:
one thread decrypting the whole encrypted file in memory (``_fastload._tink_decrypt``, the same
code a load runs per segment, into one reused segment buffer so that page faults are not timed),
the bound a load with ``concurrency`` readers divides among them; only a module built with
``maturin develop --release --features bench-bindings`` has it (the shipped one does not).

No key material is printed: the keyset lives in memory only.

    python benches/encryption_bench.py                 # 256 MiB
    python benches/encryption_bench.py --size 2GiB --reps 3 --s3 --save
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import fastload
import torch
from fastload._pagecache import evict
from fastload._peers import touch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent

SERVER = """
import sys, time
sys.path.insert(0, sys.argv[3])
from servers.http import start_server
server = start_server({"plain.safetensors": sys.argv[1], "enc.safetensors": sys.argv[2]})
print(server.url(""), flush=True)
time.sleep(1e9)
"""


def checkpoint(path: Path, size: int) -> Path:
    per = 16 << 20  # bytes per tensor (bf16)
    g = torch.Generator().manual_seed(0)
    tensors = {
        f"layer.{i}.weight": torch.randn(per // 2, generator=g).to(torch.bfloat16)
        for i in range(max(1, size // per))
    }
    save_file(tensors, str(path))
    return path


def encrypt(plain: Path, out: Path) -> str:
    """Encrypts `plain` into `out` with a fresh AES256_GCM_HKDF_1MB keyset (returned as JSON)."""
    import tink
    from tink import cleartext_keyset_handle, streaming_aead

    streaming_aead.register()
    handle = tink.new_keyset_handle(streaming_aead.streaming_aead_key_templates.AES256_GCM_HKDF_1MB)
    text = io.StringIO()
    cleartext_keyset_handle.write(tink.JsonKeysetWriter(text), handle)
    primitive = handle.primitive(streaming_aead.StreamingAead)
    with plain.open("rb") as src, out.open("wb") as dst:
        with primitive.new_encrypting_stream(dst, b"") as w:
            while chunk := src.read(64 << 20):
                w.write(chunk)
    return text.getvalue()


def timed(fn, reps: int, before=None) -> dict:
    runs = []
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        out = fn()
        if out is not None:
            touch(out.values())
        runs.append(time.perf_counter() - t0)
        del out
    return {"best_s": min(runs), "median_s": statistics.median(runs), "runs": runs}


def streamed(path, **options) -> dict:
    return dict(fastload.stream(str(path), **options))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size", default="256MiB", help="checkpoint size (default 256MiB)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--s3", action="store_true", help="also load both from a local SeaweedFS")
    ap.add_argument("--save", action="store_true", help="also time save_file, plain and encrypted")
    args = ap.parse_args()
    size = fastload._fastload.parse_size(args.size)
    with tempfile.TemporaryDirectory(prefix="fastload-encryption-bench-") as tmp:
        work = Path(tmp)
        plain = checkpoint(work / "plain.safetensors", size)
        enc = work / "enc.safetensors"
        keyset = encrypt(plain, enc)
        ciphertext = enc.read_bytes()
        aes = []
        # Only a module built with the `bench-bindings` feature has it (not the shipped one).
        decrypt = getattr(fastload._fastload, "_tink_decrypt", None)
        for _ in range(args.reps if decrypt is not None else 0):
            t0 = time.perf_counter()
            decrypt(keyset, ciphertext, discard=True)
            aes.append(time.perf_counter() - t0)
        del ciphertext
        server = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(plain), str(enc), str(ROOT / "tests")],
            stdout=subprocess.PIPE,
            text=True,
        )
        seaweed = None
        try:
            base = server.stdout.readline().strip()
            s3: dict = {}
            if args.s3:
                sys.path.insert(0, str(ROOT / "tests"))
                from servers import s3 as s3_server

                seaweed = s3_server.start_seaweed(work / "seaweed")
                s3_server.upload(
                    seaweed.client(),
                    s3_server.BUCKET,
                    {"plain.safetensors": plain, "enc.safetensors": enc},
                )
                url = f"s3://{s3_server.BUCKET}/"
                opts = seaweed.storage_options()
                s3 = {
                    "s3 plain": (
                        lambda: fastload.load(url + "plain.safetensors", storage_options=opts),
                        None,
                    ),
                    "s3 encrypted": (
                        lambda: fastload.load(
                            url + "enc.safetensors", storage_options=opts, keyset=keyset
                        ),
                        None,
                    ),
                }
            cases = {
                "load plain (auto)": (lambda: fastload.load(plain), plain),
                "load plain (read)": (lambda: fastload.load(plain, method="read"), plain),
                "load encrypted": (lambda: fastload.load(enc, keyset=keyset), enc),
                "stream plain (read)": (lambda: streamed(plain, method="read"), plain),
                "stream encrypted": (lambda: streamed(enc, keyset=keyset), enc),
                "http plain": (lambda: fastload.load(base + "plain.safetensors"), None),
                "http encrypted": (
                    lambda: fastload.load(base + "enc.safetensors", keyset=keyset),
                    None,
                ),
                **s3,
            }
            if args.save:
                tensors = fastload.load(plain)
                out = work / "saved.safetensors"
                cases["save_file plain"] = (
                    lambda: fastload.save_file(tensors, out, overwrite=True),
                    None,
                )
                cases["save_file encrypted"] = (
                    lambda: fastload.save_file(tensors, out, overwrite=True, keyset=keyset),
                    None,
                )
            results: dict = {
                "bytes": plain.stat().st_size,
                "encrypted_bytes": enc.stat().st_size,
                "aes_gcm_one_thread_gb_per_s": plain.stat().st_size / min(aes) / 1e9
                if aes
                else None,
                "runs": {},
            }
            for name, (fn, path) in cases.items():
                fn()  # warms the runtime, and the page cache for the warm runs
                row = {"warm": timed(fn, args.reps)}
                if path is not None:
                    row["cold"] = timed(fn, args.reps, before=lambda p=path: evict(p))
                results["runs"][name] = row
        finally:
            server.kill()
            server.wait()
            if seaweed is not None:
                seaweed.stop()
    if args.json:
        print(json.dumps(results, indent=2))
        return
    gb = results["bytes"] / 1e9
    print(
        f"{gb:.2f} GB checkpoint ({results['encrypted_bytes'] / 1e9:.2f} GB encrypted), best of "
        f"{args.reps} (median), every page read"
    )
    aes_rate = results["aes_gcm_one_thread_gb_per_s"]
    print(
        f"  AES-256-GCM decrypt, one thread: {aes_rate:.2f} GB/s"
        if aes_rate is not None
        else "  AES-256-GCM decrypt, one thread: not measured (build the module with "
        "`maturin develop --release --features bench-bindings`)"
    )
    print(f"  {'case':22s} {'cold GB/s':>10s} {'warm GB/s':>10s}")
    for name, row in results["runs"].items():
        cold = f"{gb / row['cold']['best_s']:10.2f}" if "cold" in row else f"{'-':>10s}"
        print(f"  {name:22s} {cold} {gb / row['warm']['best_s']:10.2f}")


if __name__ == "__main__":
    main()
