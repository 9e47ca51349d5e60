"""The S3 server on loopback that the tests of checkpoints in object storage write to (tests/helpers/s3.py)."""

from tests.helpers.s3 import s3

__all__ = ["s3"]
