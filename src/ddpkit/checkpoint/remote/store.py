"""Where a remote checkpoints folder lives: a URL, its fsspec file system, and the object paths under it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpkit.errors import UserError

__all__ = [
    "S3_EXTRA",
    "RemoteFolder",
    "default_cache",
    "folded_url",
    "is_remote",
    "missing_library",
    "remote_folder",
    "unreachable",
]

_INSTALL = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}
"""The package each common store's scheme needs: a path whose first part is one of them is a folded URL."""
S3_EXTRA = "pip install 'ddpkit[s3]'"
"""The install line of S3 support (s3fs)."""


def missing_library(scheme: str) -> str:
    """The end of the line for a URL whose file system's library is not installed: what it needs and the install
    line (``needs s3fs, which is not installed: pip install 'ddpkit[s3]'``); ``scheme`` is one fsspec knows."""
    from fsspec.registry import known_implementations  # type: ignore[import-untyped]  # fsspec ships no types

    library = _INSTALL.get(scheme) or str(known_implementations[scheme]["class"]).split(".")[0]
    return f"needs {library}, which is not installed: {S3_EXTRA if library == 's3fs' else f'pip install {library}'}"


def _scheme(path: str | os.PathLike[str]) -> str:
    text = os.fspath(path)
    head, sep, _ = text.partition("://")
    # A scheme is letters, digits, + - . (RFC 3986); "C:\\..." or "./a://b" is a local path.
    if not sep or not head or not head[0].isalpha() or not all(c.isalnum() or c in "+-." for c in head):
        return ""
    return head.lower()


def folded_url(path: str | os.PathLike[str]) -> str:
    """The URL a local path was made from when ``pathlib`` folded its ``//`` (``Path("s3://b/run")`` is
    ``s3:/b/run``), else "": a path whose first part is a known store's scheme and a colon."""
    head, sep, rest = os.fspath(path).partition(":/")
    if sep and not rest.startswith("/") and head.lower() in _INSTALL:
        return f"{head}://{rest}"
    return ""


def is_remote(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a URL of a file system other than the local one (``s3://``, ``gs://``...).

    ``file://`` and plain paths are local. A URL whose scheme fsspec does not know is remote too:
    :func:`remote_folder` then says in one line what to install, instead of a folder named ``s3:``.
    """
    scheme = _scheme(path)
    return bool(scheme) and scheme not in ("file", "local")


@dataclass(frozen=True)
class RemoteFolder:
    """A checkpoints folder in object storage: the URL as given and the file system that reaches it."""

    url: str
    """The URL as given, without a trailing slash (``s3://bucket/prefix/run``)."""
    fs: Any
    """The fsspec file system (``s3fs.S3FileSystem`` for s3://)."""
    path: str
    """The folder's path on ``fs`` (``bucket/prefix/run``)."""

    def join(self, *names: str) -> str:
        """The path on ``fs`` of ``names`` under the folder."""
        return "/".join([self.path, *names])

    def url_of(self, *names: str) -> str:
        """The URL of ``names`` under the folder, for messages."""
        return "/".join([self.url, *names])

    def forget_listings(self) -> None:
        """Drop the file system's cached listings: another process (or run) may have written since."""
        self.fs.invalidate_cache(self.path)


def remote_folder(url: str | os.PathLike[str]) -> RemoteFolder:
    """The :class:`RemoteFolder` of ``url``.

    Raises:
        UserError: the scheme's file system is not installed (the message names the package), or unknown.
    """
    # Only for a remote folder: a local run needs neither fsspec nor a store's library (fsspec ships no types).
    import fsspec  # type: ignore[import-untyped]

    text = os.fspath(url).rstrip("/")
    scheme = _scheme(text)
    try:
        fs, path = fsspec.core.url_to_fs(text)
    except ImportError:
        raise UserError(f"{text} {missing_library(scheme)}; or write to a local folder") from None
    except ValueError:
        raise UserError(
            f"{text}: no file system is known for {scheme}://; use s3://, gs://, az://... or a local folder"
        ) from None
    return RemoteFolder(text, fs, path.rstrip("/"))


def unreachable(folder: RemoteFolder, error: BaseException) -> str:
    """One line for a store that refused or could not be reached: what it said, and what to check."""
    said = " ".join(str(error).split())[:200] or type(error).__name__
    return (
        f"{folder.url} cannot be written ({type(error).__name__}: {said}); check the bucket's name, the store's "
        "address (AWS_ENDPOINT_URL for S3), the credentials and their permissions, or write to a local folder"
    )


def default_cache(environ: Mapping[str, str]) -> Path:
    """ddpkit's cache of checkpoints: ``$DDPKIT_CACHE/checkpoints``, else ``~/.cache/ddpkit/checkpoints``."""
    base = environ.get("DDPKIT_CACHE") or os.path.join(environ.get("HOME") or str(Path.home()), ".cache", "ddpkit")
    return Path(base) / "checkpoints"
