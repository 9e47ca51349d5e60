"""A real HTTP server on loopback serving a tiny MNIST-like dataset, with a request log."""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ddpkit.data.idx import write_idx
from ddpkit.data.sources import DatasetSource, RemoteFile

FILE_NAMES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)


def make_idx_files(folder: Path, num_train: int = 12, num_test: int = 5) -> None:
    """Write a random dataset in the MNIST file layout into ``folder``."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    write_idx(folder / FILE_NAMES[0], rng.integers(0, 256, (num_train, 28, 28)))
    write_idx(folder / FILE_NAMES[1], rng.integers(0, 10, num_train))
    write_idx(folder / FILE_NAMES[2], rng.integers(0, 256, (num_test, 28, 28)))
    write_idx(folder / FILE_NAMES[3], rng.integers(0, 10, num_test))


def source_for(folder: Path, mirror: str = "") -> DatasetSource:
    """A DatasetSource whose checksums are those of the files in ``folder``."""
    files = tuple(RemoteFile(n, hashlib.md5((folder / n).read_bytes()).hexdigest()) for n in FILE_NAMES)
    return DatasetSource("tiny", files, mirrors=(mirror,) if mirror else ())


@contextlib.contextmanager
def serve_folder(folder: Path) -> Iterator[tuple[str, list[str]]]:
    """Serve ``folder`` over HTTP on 127.0.0.1; yields (base URL, list of requested paths)."""
    requests: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(folder), **kwargs)

        def log_message(self, *args):
            requests.append(self.path)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    # shutdown() waits for serve_forever to look at its flag: every poll_interval (0.5 s by default).
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", requests
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
