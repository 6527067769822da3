"""Bytes a ``fastload.safe_open(...).get_slice(name)[...]`` of a quarter of a large tensor reads
over ``hf://`` (the mock Hub, tests/servers/hub.py) and ``s3://`` (SeaweedFS, tests/servers/s3.py),
against the tensor's size.

    python benches/slice_bytes.py                 # an 8192 x 8192 bf16 tensor (128 MiB)
    python benches/slice_bytes.py --rows 4096 --cols 4096 --json

Three quarters: rows (``[:n/4]``, what a row-parallel shard reads), columns (``[:, :n/4]``, a
column-parallel shard: short runs in every row) and a middle block (``[n/4:n/2, n/4:n/2]``).
"Bytes read" is what the storage served for the slice, counted by the servers (ranged GETs
after the header was read) and by fastload (``safe_open.bytes_read``); requests likewise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--cols", type=int, default=8192)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--skip-s3", action="store_true", help="only the mock Hub")
    args = ap.parse_args()

    import fastload
    import torch
    from safetensors.torch import save_file

    r, c = args.rows, args.cols
    w = torch.arange(r * c, dtype=torch.int32).to(torch.bfloat16).reshape(r, c)
    tmp = Path(tempfile.mkdtemp(prefix="slice-bench-"))
    path = tmp / "model.safetensors"
    save_file({"w": w, "bias": torch.zeros(c)}, str(path))
    data = path.read_bytes()
    size = w.numel() * w.element_size()
    quarters = {
        "rows [:n/4]": slice(0, r // 4),
        "cols [:, :n/4]": (slice(None), slice(0, c // 4)),
        "block [n/4:n/2, n/4:n/2]": (slice(r // 4, r // 2), slice(c // 4, c // 2)),
    }
    results = []

    def measure(store: str, uri: str, served, **options) -> None:
        with fastload.safe_open(uri, "pt", **options) as f:
            for label, index in quarters.items():
                before, log_before = f.bytes_read, served(None)
                t0 = time.perf_counter()
                part = f.get_slice("w")[index]
                dt = time.perf_counter() - t0
                assert torch.equal(part, w[index]), label
                got = served(log_before)
                results.append(
                    {
                        "store": store,
                        "slice": label,
                        "tensor_bytes": size,
                        "needed_bytes": part.numel() * part.element_size(),
                        "fastload_bytes": f.bytes_read - before,
                        "served_bytes": got[0],
                        "requests": got[1],
                        "seconds": dt,
                    }
                )

    # hf:// through the mock Hub (LFS blobs served by its storage server, which logs each GET).
    from servers.hub import MockHub

    hub = MockHub()
    try:
        hub.add("bench/model", {"model.safetensors": data})
        os.environ["HF_ENDPOINT"] = hub.base
        os.environ["HF_HOME"] = str(tmp / "hf_home")

        def hub_served(since):
            gets = [q for q in hub.requests(hub.storage) if q[0] == "GET"]
            if since is None:
                return len(gets)
            total = 0
            for _, _, headers in gets[since:]:
                a, b = headers["range"].removeprefix("bytes=").split("-")
                total += int(b) - int(a) + 1
            return total, len(gets) - since

        measure("hf://", "hf://bench/model/model.safetensors", hub_served)
    finally:
        hub.close()

    if not args.skip_s3:
        from servers import s3 as s3_server

        if s3_server.find_weed() is None:
            print("SeaweedFS `weed` not found: s3:// skipped", file=sys.stderr)
        else:
            server = s3_server.start_seaweed(tmp / "seaweed")
            try:
                s3_server.upload(server.client(), s3_server.BUCKET, {"model.safetensors": path})
                opts = server.storage_options()

                def fastload_only(since):
                    # SeaweedFS keeps no per-request log: fastload's own counters.
                    return (None, None) if since is not None else 0

                measure(
                    "s3://",
                    f"s3://{s3_server.BUCKET}/model.safetensors",
                    fastload_only,
                    storage_options=opts,
                )
            finally:
                server.stop()

    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(f"tensor w: {r} x {c} bf16, {size / 2**20:.0f} MiB")
    head = (
        f"{'store':<7}{'slice':<26}{'needed MiB':>11}{'read MiB':>10}{'of tensor':>10}{'GETs':>6}"
    )
    print(head)
    for x in results:
        read = x["served_bytes"] if x["served_bytes"] is not None else x["fastload_bytes"]
        print(
            f"{x['store']:<7}{x['slice']:<26}{x['needed_bytes'] / 2**20:>11.1f}"
            f"{read / 2**20:>10.1f}{read / size:>9.0%} {x['requests'] or '':>5}"
        )


if __name__ == "__main__":
    main()
