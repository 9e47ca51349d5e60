"""A real S3-protocol server on loopback for the tests of checkpoints in object storage.

moto's standalone server (``moto.server.ThreadedMotoServer``, what the s3fs and fsspec test suites run):
a real HTTP endpoint on 127.0.0.1 and a free port, in a thread of the test process, that s3fs, botocore
and every worker process talk to as they would to AWS. It keeps its buckets in memory and honours
``If-None-Match`` on PutObject (the lease's conditional create). One server serves the whole session;
each test makes its own bucket (:meth:`S3Server.bucket`).

A test hands :attr:`S3Server.env` to the commands it runs (``Commands.run(..., env=server.env)``), and sets
it in its own process for a library call with :meth:`S3Server.environment` (the guard against leaked
variables then finds them put back).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections.abc import Iterator
from typing import Any

import pytest

from ddpkit.commands.launching import environ_set
from ddpkit.env.ports import free_port

ACCESS_KEY = "AKIADDPKITTESTKEY0001"
"""The fake credentials; a test greps what a run wrote for them."""
SECRET_KEY = "ddpkit-test-secret-Zq81Xw"

_BUCKETS = itertools.count()


class S3Server:
    """A running moto server: its endpoint, the environment that points a client at it, a file system on it."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.env = {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint,  # botocore's own variable: s3fs and boto3 follow it
            # No profile or instance role of the machine's may answer instead of the variables above.
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        """The variables that point botocore (s3fs, boto3) at this server with the fake credentials."""

    @property
    def fs(self) -> Any:
        """An s3fs file system on the server (listings never cached: workers write behind its back)."""
        import s3fs

        return s3fs.S3FileSystem(
            key=ACCESS_KEY,
            secret=SECRET_KEY,
            endpoint_url=self.endpoint,
            use_listings_cache=False,
            skip_instance_cache=True,
        )

    def bucket(self) -> str:
        """A new empty bucket's name."""
        name = f"ddpkit-test-{os.getpid()}-{next(_BUCKETS)}"
        self.fs.mkdir(name)
        return name

    @contextlib.contextmanager
    def environment(self) -> Iterator[None]:
        """:attr:`env` set in this process for the block (for a library call made here)."""
        with environ_set(self.env):
            yield


@contextlib.contextmanager
def s3_server() -> Iterator[S3Server]:
    """Start moto's S3 server on 127.0.0.1 and a free port for the block."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # not a line per request in the test's output
    port = free_port("127.0.0.1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield S3Server(f"http://127.0.0.1:{port}")
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3() -> Iterator[S3Server]:
    """The session's S3 server (see the module docstring); import it into a conftest.py or test module."""
    with s3_server() as server:
        yield server
