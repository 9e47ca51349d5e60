"""Where the CPU of one checkpoint upload to the loopback S3 server goes: the client's process against the server's.

T16 times the training loop while a 302 MB checkpoint is uploaded to moto's
S3 server on 127.0.0.1 (:mod:`ddpkit.bench.s3_server`), both on the same
cores as the training. This measures what one upload of that size costs
each side in CPU seconds, to tell the client's share (s3fs, in the training
process: what ddpkit's background upload can hide at best) from the
server's (moto, which a real store runs on its own machines). The client's
CPU time is this process's; the server's is read from its process
(``/proc``, through psutil) before and after each upload.

Run from the repository root, with the venv's python (moto and s3fs from the
``test`` extra)::

    python benchmarks/s3_upload_cpu.py --megabytes 302 --uploads 3 --name s3-upload-cpu-2core-xeon-2026-11-29

It prints one line per upload and writes benchmarks/NAME.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import psutil

from ddpkit.bench.s3_server import loopback_s3


def _cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def _server(parent: psutil.Process) -> psutil.Process:
    """The moto server process that :func:`loopback_s3` started."""
    return next(child for child in parent.children() if "moto.server" in " ".join(child.cmdline()))


def measure(megabytes: int, uploads: int) -> list[dict[str, float]]:
    """Upload a file of ``megabytes`` MiB of random bytes ``uploads`` times; each upload's wall and CPU seconds."""
    import fsspec  # type: ignore[import-untyped]  # fsspec ships no type information

    rows = []
    with tempfile.TemporaryDirectory() as folder, loopback_s3() as url:
        blob = Path(folder) / "blob"
        blob.write_bytes(os.urandom(megabytes * 1024 * 1024))
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        server = _server(psutil.Process())
        for upload in range(uploads):
            server_before, client_before, wall_before = _cpu_seconds(server), time.process_time(), time.perf_counter()
            fs.put_file(str(blob), f"{url}/upload-{upload}")
            rows.append(
                {
                    "wall_s": time.perf_counter() - wall_before,
                    "client_cpu_s": time.process_time() - client_before,
                    "server_cpu_s": _cpu_seconds(server) - server_before,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    """Parse the arguments, measure, write benchmarks/NAME.json."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=302)
    parser.add_argument("--uploads", type=int, default=3)
    parser.add_argument("--name", required=True, help="benchmarks/NAME.json is written")
    args = parser.parse_args()
    rows = measure(args.megabytes, args.uploads)
    medians = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    result = {"megabytes": args.megabytes, "uploads": rows, "medians": medians, "date": time.strftime("%Y-%m-%d")}
    Path("benchmarks", f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    print("medians:", json.dumps(medians))


if __name__ == "__main__":
    main()
