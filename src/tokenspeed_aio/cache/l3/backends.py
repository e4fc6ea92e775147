"""Storage backends: where L3 objects live. Host-only: bytes in, bytes out, no device and
no torch. Every call may block (the executor's worker threads make them); a failure is an
exception (``StorageError``), never a silent miss.

- ``FileBackend``: one file per object under a directory, one subdirectory per namespace.
  A write goes to a temporary name, is fsynced, then renamed over the final name, so a
  crash mid-write leaves no readable half object (a stray temporary is never read).
- ``MooncakeBackend``: ``MooncakeDistributedStore`` of the mooncake-transfer-engine package
  family (TCP), whose master (``mooncake_master``) runs apart; this client contributes a
  segment of its own memory to the store.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

BACKENDS = ("file", "mooncake")


class StorageError(RuntimeError):
    """A storage call failed (the store is down, refused, or returned an error)."""


class StorageBackend(Protocol):
    name: str

    def exists(self, keys: Sequence[str]) -> list[bool]: ...

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The objects, None for one that does not exist (one batch where the store has
        batches)."""
        ...

    def put_many(self, keys: Sequence[str], values: Sequence[bytes]) -> None: ...

    def delete_namespace(self, namespace: str) -> None:
        """Drop every object whose key starts with ``namespace/``."""
        ...

    def close(self) -> None: ...


class FileBackend:
    name = "file"

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ValueError(f"--kvstore-storage-dir {str(root)!r}: {err}") from err

    def _path(self, key: str) -> Path:
        namespace, _, name = key.partition("/")
        return self.root / namespace / name.replace("/", "-")

    def exists(self, keys: Sequence[str]) -> list[bool]:
        try:
            return [self._path(key).is_file() for key in keys]
        except OSError as err:
            raise StorageError(f"file store: {err}") from err

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self._get(key) for key in keys]

    def put_many(self, keys: Sequence[str], values: Sequence[bytes]) -> None:
        for key, value in zip(keys, values):
            self._put(key, value)

    def _get(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as err:
            raise StorageError(f"file store: reading {key}: {err}") from err

    def _put(self, key: str, value: bytes) -> None:
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(value)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)  # the rename itself survives a crash
            finally:
                os.close(fd)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            raise StorageError(f"file store: writing {key}: {err}") from err

    def delete_namespace(self, namespace: str) -> None:
        try:
            shutil.rmtree(self.root / namespace, ignore_errors=False)
        except FileNotFoundError:
            return  # nothing was ever stored under it
        except OSError as err:
            raise StorageError(f"file store: deleting {namespace}: {err}") from err

    def close(self) -> None:
        return None


class SlowBackend:
    """A backend whose every call waits ``delay`` seconds first: a slow store, for the
    fault tests (``TOKENSPEED_INJECT_STORAGE_DELAY``)."""

    def __init__(self, inner: StorageBackend, delay: float) -> None:
        self.inner = inner
        self.delay = delay
        self.name = f"{inner.name} (+{delay:g} s per call)"

    def exists(self, keys: Sequence[str]) -> list[bool]:
        time.sleep(self.delay)
        return self.inner.exists(keys)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        time.sleep(self.delay)
        return self.inner.get_many(keys)

    def put_many(self, keys: Sequence[str], values: Sequence[bytes]) -> None:
        time.sleep(self.delay)
        self.inner.put_many(keys, values)

    def delete_namespace(self, namespace: str) -> None:
        self.inner.delete_namespace(namespace)

    def close(self) -> None:
        self.inner.close()


@dataclass(frozen=True)
class MooncakeSettings:
    master: str  # HOST:PORT of mooncake_master's RPC service
    metadata_server: str  # e.g. http://HOST:PORT/metadata (the master's HTTP one)
    segment_bytes: int  # memory this client contributes to the store
    local_hostname: str = "127.0.0.1"
    local_buffer_bytes: int = 64 * 2**20
    protocol: str = "tcp"


class MooncakeBackend:
    name = "mooncake"

    def __init__(self, settings: MooncakeSettings) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as err:
            raise ValueError(
                "--kvstore-storage-backend mooncake needs the mooncake-transfer-engine "
                "package (pip install 'tokenspeed_aio[l3]', and the system library libibverbs1)"
            ) from err
        self.settings = settings
        self._store = MooncakeDistributedStore()
        status = self._store.setup(
            settings.local_hostname,
            settings.metadata_server,
            settings.segment_bytes,
            settings.local_buffer_bytes,
            settings.protocol,
            "",
            settings.master,
        )
        if status != 0:
            raise ValueError(
                f"mooncake store: setup returned {status} (master {settings.master}, "
                f"metadata {settings.metadata_server}); check --kvstore-mooncake-master and "
                "--kvstore-mooncake-metadata-server"
            )
        self._closed = threading.Event()

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        found = self._store.batch_is_exist(list(keys))
        bad = [code for code in found if code not in (0, 1)]
        if bad:
            raise StorageError(f"mooncake store: batch_is_exist returned {bad[0]}")
        return [code == 1 for code in found]

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        # An empty answer is a missing object or a failed call alike: either is a miss
        # (the GET fails and its request recomputes).
        values = self._store.get_batch(list(keys))
        return [value or None for value in values]

    def put_many(self, keys: Sequence[str], values: Sequence[bytes]) -> None:
        status = self._store.put_batch(list(keys), list(values))
        if status != 0:
            raise StorageError(f"mooncake store: put_batch of {len(keys)} returned {status}")

    def delete_namespace(self, namespace: str) -> None:
        status = self._store.remove_by_regex(f"^{re.escape(namespace)}/", True)
        if status < 0:
            raise StorageError(f"mooncake store: remove_by_regex returned {status}")

    def close(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            self._store.close()
