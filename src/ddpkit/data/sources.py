"""Where dataset files come from: local folders first, then the official mirrors.

A dataset's files are looked for, in order, in:

1. the ``data_dir`` option, when given (then nowhere else);
2. ``$DDPKIT_DATA_DIR``;
3. the user cache, ``$XDG_CACHE_HOME/ddpkit/<dataset>`` (``~/.cache/ddpkit/<dataset>``);
4. system folders such as ``/usr/share/datasets/fashion-mnist`` (Debian's
   ``dataset-fashion-mnist`` package).

When no folder has them all and download is allowed, they are downloaded
into the user cache (or ``data_dir``) from the official mirrors, each file
checked against its published MD5 before it is moved into place. A file lock
in the target folder makes concurrent processes (the ranks of one node, or
two jobs on a shared filesystem) download once: the first takes the lock and
downloads, the others wait and then find the files.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from ddpkit.errors import UserError


@dataclass(frozen=True)
class RemoteFile:
    """One file of a dataset and its published checksum."""

    name: str
    """File name, identical on every mirror and in local folders."""
    md5: str
    """MD5 of the file as published by the dataset's authors."""


@dataclass(frozen=True)
class DatasetSource:
    """The files of a dataset, its mirrors and the system folders that may hold it."""

    name: str
    """Dataset name as used in the config."""
    files: tuple[RemoteFile, ...]
    """Every file the dataset needs."""
    mirrors: tuple[str, ...]
    """Base URLs tried in order; a file's URL is base + name."""
    system_dirs: tuple[str, ...] = ()
    """Folders where system packages install the files."""


class DataNotFoundError(UserError, FileNotFoundError):
    """The dataset is in no known folder and could not be downloaded."""


def user_cache_dir(environ: Mapping[str, str]) -> Path:
    """``$XDG_CACHE_HOME/ddpkit``, or ``~/.cache/ddpkit``."""
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ddpkit"


def candidate_dirs(source: DatasetSource, data_dir: str, environ: Mapping[str, str]) -> list[Path]:
    """The folders searched for ``source``'s files, in order (see the module docstring)."""
    if data_dir:
        return [Path(data_dir)]
    dirs = []
    if environ.get("DDPKIT_DATA_DIR"):
        dirs.append(Path(environ["DDPKIT_DATA_DIR"]))
    dirs.append(user_cache_dir(environ) / source.name)
    dirs += [Path(d) for d in source.system_dirs]
    return dirs


def locate(
    source: DatasetSource,
    data_dir: str = "",
    download: bool = True,
    mirrors: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> Path:
    """Return a folder holding every file of ``source``, downloading them if needed.

    Args:
        source: the dataset's files and mirrors.
        data_dir: the only folder to use, when not empty.
        download: fetch missing files from the mirrors.
        mirrors: base URLs tried before the dataset's own.
        environ: the environment (defaults to ``os.environ``).

    Raises:
        DataNotFoundError: no folder has the files and downloading failed or
            is disabled; the message lists where it looked and what to do.
    """
    environ = os.environ if environ is None else environ
    dirs = candidate_dirs(source, data_dir, environ)
    found = next((d for d in dirs if _has_all(d, source)), None)
    if found is not None:
        return found
    target = dirs[0] if data_dir else user_cache_dir(environ) / source.name
    if not download:
        raise DataNotFoundError(
            f"{source.name} not found in {', '.join(map(str, dirs))}; "
            f"put its files ({', '.join(f.name for f in source.files)}) in one of them or set download=true"
        )
    return fetch(source, target, tuple(mirrors) + source.mirrors)


def fetch(source: DatasetSource, target: Path, mirrors: Sequence[str]) -> Path:
    """Download the files of ``source`` missing from ``target``, under a file lock.

    Raises:
        DataNotFoundError: a file could not be downloaded from any mirror.
    """
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataNotFoundError(
            f"cannot create {target} for {source.name} ({e.strerror}); set data_dir to a writable folder"
        ) from None
    with FileLock(str(target / ".download.lock")):
        for file in source.files:
            if not (target / file.name).is_file():
                _download_verified(file, target, mirrors)
    return target


def _has_all(folder: Path, source: DatasetSource) -> bool:
    return all((folder / f.name).is_file() for f in source.files)


def _download_verified(file: RemoteFile, target: Path, mirrors: Sequence[str]) -> None:
    errors = []
    for base in mirrors:
        url = base.rstrip("/") + "/" + file.name
        try:
            _download_to(url, file, target)
            return
        except (urllib.error.URLError, OSError, ValueError) as e:
            errors.append(f"{url}: {getattr(e, 'reason', e)}")
    raise DataNotFoundError(
        f"could not download {file.name} ({'; '.join(errors)}); "
        f"without network, copy the files into {target} (or set data_dir to a folder that has them)"
    )


def _download_to(url: str, file: RemoteFile, target: Path) -> None:
    # Download beside the target, check, then rename: a partial or corrupt
    # download never takes the final name.
    fd, tmp = tempfile.mkstemp(dir=target, prefix=f".{file.name}.", suffix=".part")
    try:
        digest = hashlib.md5()
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=30) as response:
            while chunk := response.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != file.md5:
            raise UserError(f"checksum mismatch (md5 {digest.hexdigest()}, expected {file.md5})")
        os.replace(tmp, target / file.name)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
