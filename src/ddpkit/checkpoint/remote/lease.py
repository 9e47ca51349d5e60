"""A run owns its remote folder: a lease object, created only where none exists, renewed while the run lives.

Object stores have no file locks. The lock's job is done with what S3 offers: a conditional create
(``PutObject`` with ``If-None-Match: *``, fsspec's exclusive mode ``"xb"``) of ``<prefix>/.ddpkit.lease.json``,
which names its holder (host, pid, since, command). Exactly one of two runs starting together creates it;
the other is refused in one line::

    s3://ckpt/run is in use by another run (host node7, pid 4121, since 2026-11-28 02:40:11 UTC: ddpkit train
    ...); wait for it to end or write to another prefix (dir=...); if that run is gone, delete
    s3://ckpt/run/.ddpkit.lease.json, or wait 120 s for its lease to lapse

The holder rewrites the object every ``LEASE_SECONDS / 4`` while it lives and deletes it at the end. A
holder that died without deleting it (SIGKILL, a lost node) stops renewing it: once ``LEASE_SECONDS`` have
passed since its last renewal the next run takes the lease over, and a restarted worker on the same host
takes it over at once when the holder's process is gone (on another host, once the lease lapses). A store without conditional creates (fsspec
file systems other than s3fs may lack ``"xb"``) gets the same lease written after a check, which two runs
starting within the same second can both pass.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from typing import Any

from ddpkit.checkpoint.disk.folder_lock import FolderInUseError, describe_holder, holder_record
from ddpkit.checkpoint.disk.storage import StorageError
from ddpkit.checkpoint.remote.store import RemoteFolder, unreachable
from ddpkit.log import get_logger

__all__ = ["LEASE_FILE", "LEASE_SECONDS", "RemoteLease"]

LEASE_FILE = ".ddpkit.lease.json"
"""The lease object under a remote checkpoints folder."""
LEASE_SECONDS = 120.0
"""A lease not renewed for this long is taken over: its holder is gone."""


class RemoteLease:
    """The lease of one remote folder; see the module docstring.

    Args:
        folder: the remote checkpoints folder.
        fix: how the refusal says to write elsewhere.
        lease_seconds: how long an unrenewed lease holds.
    """

    def __init__(self, folder: RemoteFolder, fix: str = "dir=...", lease_seconds: float = LEASE_SECONDS):
        self.folder, self.fix, self.lease_seconds = folder, fix, lease_seconds
        self.path = folder.join(LEASE_FILE)
        self._token = ""
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    @property
    def held(self) -> bool:
        """True between :meth:`acquire` and :meth:`release`."""
        return bool(self._token)

    def acquire(self, restarted: bool = False) -> RemoteLease:
        """Take the lease, or fail at once; start renewing it.

        Args:
            restarted: this is a restarted worker: a holder on this host whose process is gone is its
                predecessor, taken over at once; one on another host is waited for until its lease lapses.

        Raises:
            FolderInUseError: another live run holds it (the message names it and the fix).
            StorageError: the store cannot be written (no such bucket, no credentials, refused): one line.
        """
        if self._token:
            return self
        token = uuid.uuid4().hex
        try:
            created = self._create(token)
        except Exception as e:  # the store's library raises its own kinds (no bucket, no credentials, refused)
            raise StorageError(unreachable(self.folder, e)) from None
        if not created:
            holder = self._read()
            # A restarted worker on another host waits for its predecessor's lease to lapse.
            deadline = time.monotonic() + (self.lease_seconds * 1.25 if restarted else 0)
            while holder is not None and not self._lapsed(holder, restarted) and time.monotonic() < deadline:
                time.sleep(min(5.0, self.lease_seconds / 4))
                holder = self._read()
            if holder is not None and not self._lapsed(holder, restarted):
                raise FolderInUseError(self._refusal(holder))
            get_logger().warning(
                f"{self.folder.url}: taking over the lease of a run that is gone ({describe_holder(holder)})"
            )
            with contextlib.suppress(FileNotFoundError):
                self.folder.fs.rm_file(self.path)
            if not self._create(token):  # another run took it over first
                raise FolderInUseError(self._refusal(self._read()))
        self._token = token
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew, name="ddpkit-lease", daemon=True)
        self._renewer.start()
        return self

    def release(self) -> None:
        """Stop renewing and delete the lease (if it is still ours); idempotent."""
        if not self._token:
            return
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        holder = self._read()
        if holder is not None and holder.get("token") == self._token:
            with contextlib.suppress(OSError):
                self.folder.fs.rm_file(self.path)
        self._token = ""

    def _record(self, token: str) -> bytes:
        record = {**holder_record(), "token": token, "renewed": time.time(), "lease_seconds": self.lease_seconds}
        return (json.dumps(record) + "\n").encode()

    def _create(self, token: str) -> bool:
        """Create the lease object unless one exists; False when one does."""
        fs, data = self.folder.fs, self._record(token)
        try:
            with fs.open(self.path, "xb") as file:
                file.write(data)
            return True
        except FileExistsError:
            return False
        except (ValueError, NotImplementedError):  # no exclusive create on this file system: check, then write
            if fs.exists(self.path):
                return False
            fs.pipe_file(self.path, data)
            return True

    def _read(self) -> dict[str, Any] | None:
        try:
            holder = json.loads(self.folder.fs.cat_file(self.path))
        except (FileNotFoundError, ValueError):
            return None
        return holder if isinstance(holder, dict) else None

    def _lapsed(self, holder: dict[str, Any], restarted: bool) -> bool:
        """True when ``holder`` is gone: its lease lapsed, or (a restart) its process on this host ended."""
        if time.time() - float(holder.get("renewed", 0)) > float(holder.get("lease_seconds", self.lease_seconds)):
            return True
        return restarted and holder.get("host") == socket.gethostname() and not _alive(int(holder.get("pid", 0)))

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_seconds / 4):
            holder = self._read()
            if holder is not None and holder.get("token") != self._token:
                get_logger().warning(
                    f"{self.folder.url}: another run took over this run's lease ({describe_holder(holder)}); "
                    "two runs may now write here: stop one of them"
                )
                return
            with contextlib.suppress(OSError):  # a store briefly unreachable: the next renewal tries again
                self.folder.fs.pipe_file(self.path, self._record(self._token))

    def _refusal(self, holder: dict[str, Any] | None) -> str:
        return (
            f"{self.folder.url} is in use by another run ({describe_holder(holder)}); wait for it to end or write "
            f"to another prefix ({self.fix}); if that run is gone, delete {self.folder.url_of(LEASE_FILE)}, or "
            f"wait {self.lease_seconds:.0f} s for its lease to lapse"
        )


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
