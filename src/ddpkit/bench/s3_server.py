"""A loopback S3 server for the benchmarks: moto's standalone server, in a process of its own.

T16 times checkpoints written to an ``s3://`` URL. The server is moto's (``python -m moto.server``, from the
``test`` extra: ``pip install 'ddpkit[test]'``), the S3-protocol server the s3fs and fsspec test suites use, on
127.0.0.1 and a port the OS hands out. It runs as a process of its own so that its request handling takes
its own share of the CPU, as a real store's does, instead of the benchmark's interpreter lock.

While the block runs, this process's environment names the server and fake credentials (s3fs reads
``AWS_ENDPOINT_URL``/``FSSPEC_S3_ENDPOINT_URL`` and the ``AWS_*`` keys, as it would a real account's); both
are put back after.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from typing import IO

from ddpkit.env.ports import free_port

FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "ddpkit-bench",
    "AWS_SECRET_ACCESS_KEY": "ddpkit-bench-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}
"""What moto accepts: any key; these never leave this machine."""
START_SECONDS = 60.0
"""How long the server may take to answer its first request."""


@contextlib.contextmanager
def loopback_s3(bucket: str = "ddpkit-bench") -> Iterator[str]:
    """Start moto's S3 server on loopback with ``bucket`` created; yield ``s3://<bucket>``; stop it after.

    Raises:
        RuntimeError: moto is not installed, or the server did not answer within ``START_SECONDS``.
    """
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: moto logs every request, and a full pipe blocks it
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=log,
        text=True,
    )
    saved = {name: os.environ.get(name) for name in (*FAKE_CREDENTIALS, "AWS_ENDPOINT_URL", "FSSPEC_S3_ENDPOINT_URL")}
    try:
        _wait_until_up(server, endpoint, log)
        os.environ.update({**FAKE_CREDENTIALS, "AWS_ENDPOINT_URL": endpoint, "FSSPEC_S3_ENDPOINT_URL": endpoint})
        import fsspec  # type: ignore[import-untyped]  # fsspec ships no type information

        fsspec.filesystem("s3", skip_instance_cache=True).mkdir(bucket)
        yield f"s3://{bucket}"
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


def _wait_until_up(server: subprocess.Popen[str], endpoint: str, log: IO[str]) -> None:
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        if server.poll() is not None:
            log.seek(0)
            error = log.read()
            hint = " (pip install 'moto[server]')" if "No module named" in error else ""
            raise RuntimeError(f"moto's S3 server exited {server.returncode}{hint}: {error.strip()[-500:]}")
        try:
            with urllib.request.urlopen(endpoint, timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"moto's S3 server did not answer at {endpoint} within {START_SECONDS:.0f} s")
