"""``ddpkit train``'s options that name a place: which take an object-storage URL, checked before anything starts.

Checkpoints may live in object storage through fsspec (``s3://bucket/prefix``, ``gs://...``, ``az://...``
where the file system's library is installed): ``checkpoint.dir``, ``output_dir`` (its checkpoints; the run's
own files stay in a local folder, see :func:`ddpkit.train.config.with_remote_checkpoints`), ``resume=URL`` of one
checkpoint and ``init_from=URL``. The dataset folder and the staging cache are local folders: a URL there is
refused, with the way to do it.

A URL is refused in one line when its scheme is not a file system fsspec knows, when it names no bucket, or
when the file system's library is missing (``pip install 'ddpkit[s3]'`` for S3). Without these checks a URL
became a local folder (``output_dir=s3://b/run`` wrote ``./s3:/b/run``).

No torch, and fsspec only when a value is a URL: ``ddpkit train --help`` reads the config module.
"""

from __future__ import annotations

import re

from ddpkit.errors import UserError

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_NOT_STORAGE = frozenset(
    {
        # fsspec's wrappers and containers: they take another URL or an archive, not a bucket
        "async_wrapper",
        "asyncwrapper",
        "blockcache",
        "cached",
        "filecache",
        "simplecache",
        "dir",
        "generic",
        "reference",
        "tar",
        "zip",
        "libarchive",
        "data",
        # in this process's memory only: another worker cannot see it
        "memory",
    }
)


def url_scheme(value: str) -> str:
    """The scheme of a URL (``s3`` of ``s3://bucket/run``), lower-case; '' for a local path."""
    match = _SCHEME.match(value)
    return match.group(1).lower() if match else ""


def check_storage_url(option: str, url: str) -> None:
    """Raise UserError, in one line, when ``url`` (the value of ``option``) cannot hold checkpoints.

    Raises:
        UserError: a ``file://`` URL (give the path), a scheme fsspec does not know, no bucket, or the file
            system's library not installed.
    """
    from fsspec.registry import get_filesystem_class, known_implementations, registry  # type: ignore[import-untyped]  # fsspec ships no type information

    scheme = url_scheme(url)
    if scheme in ("file", "local"):
        raise UserError(f"{option}={url}: give a local folder as its path ({option}={url[len(scheme) + 3 :]})")
    if scheme not in {*known_implementations, *registry} or scheme in _NOT_STORAGE:
        raise UserError(
            f"{option}={url}: {scheme}:// is not a storage ddpkit keeps checkpoints in; use s3://BUCKET/PREFIX "
            "(or gs://, az://... with their fsspec library installed), or a local folder"
        )
    if not url[len(scheme) + 3 :].split("/")[0]:
        raise UserError(f"{option}={url} names no bucket; use {scheme}://BUCKET/PREFIX, e.g. {scheme}://my-bucket/run")
    try:
        get_filesystem_class(scheme)
    except ImportError:
        # Deferred as fsspec is: ``ddpkit train --help`` reads this module, and the checkpoint package imports torch.
        from ddpkit.checkpoint import missing_library

        raise UserError(f"{option}={url} {missing_library(scheme)}") from None


LOCAL_ONLY = {
    "data_dir": "the dataset is read from a local folder; copy it there first (e.g. aws s3 sync) and pass that folder",
    "checkpoint.cache": "checkpoints are staged in a local folder before their upload; pass a local folder",
}
"""The options that name a place and take no URL, and why."""


def check_url_options(values: dict[str, str]) -> None:
    """Check each option (name -> value) that holds a URL; those of :data:`LOCAL_ONLY` refuse any URL.

    Raises:
        UserError: see :func:`check_storage_url`; or a URL given to an option of :data:`LOCAL_ONLY`.
    """
    for option, value in values.items():
        if not url_scheme(value):
            continue
        if option in LOCAL_ONLY:
            raise UserError(f"{option}={value}: {LOCAL_ONLY[option]}")
        check_storage_url(option, value)


def remote_run_name(url: str) -> str:
    """The name, under ``runs/``, of the local folder of a run whose ``output_dir`` is ``url``: its bucket, then
    its prefix, one folder each.

    ``s3://ckpt/team/run1`` -> ``ckpt/team/run1``: the same URL gives the same folder, so the same command run
    again (``resume=auto``) finds the run's local files; ``s3://a-b/c`` and ``s3://a/b-c`` give two folders.
    """
    path = url[len(url_scheme(url)) + 3 :]
    parts = [re.sub(r"[^A-Za-z0-9._-]+", ".", part).strip(".") for part in path.split("/")]
    return "/".join(part for part in parts if part) or "run"
