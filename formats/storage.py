"""A tiny storage layer: the same read calls for a local directory and for any fsspec URL.

Local roots keep the fast path (``os.open`` + ``os.preadv`` straight into the caller's buffer).
Remote roots (``s3://``, ``gs://``, ... any fsspec protocol) read with ranged requests
(``fs.cat_file(path, start=, end=)``): nothing is downloaded whole. ``file://`` URLs are local.
Credentials come from the environment / config files of the backend (``AWS_*`` variables,
``~/.aws``, ``AWS_ENDPOINT_URL`` for S3-compatible servers); they never appear in messages.
Remote errors become :mod:`formats.errors` types with a one-line message naming the URL and a fix.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from formats.errors import CheckpointNotFoundError, ConfigError, DestinationError, StorageError, clip
from formats.fsutil import read_error, read_exact_into, safe_join

_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
_SECRET_VARS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "GOOGLE_APPLICATION_CREDENTIALS",
                "AZURE_STORAGE_KEY", "AZURE_STORAGE_CONNECTION_STRING")
CREDENTIALS_FIX = ("set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or ~/.aws/credentials (S3; other stores: "
                   "their usual credentials)")
ENDPOINT_FIX = "check the endpoint (AWS_ENDPOINT_URL for S3-compatible servers) and the network"


def is_url(path: Any) -> bool:
    """True for ``scheme://...`` strings (``file://`` included)."""
    return isinstance(path, str) and bool(_URL_RE.match(path))


def source_label(path: Any) -> str:
    """How a source is recorded in metadata and journals: a URL as given, a local path resolved."""
    text = os.fspath(path) if not isinstance(path, str) else path
    return text if is_url(text) else str(Path(text).resolve())


def is_remote(path: Any) -> bool:
    """True for URLs that are not ``file://`` (they need an fsspec backend)."""
    return is_url(path) and not path.lower().startswith(("file://", "local://"))


def local_path(path: str | os.PathLike) -> Path:
    """A local path for a local path or ``file://`` URL."""
    if isinstance(path, str) and path.lower().startswith("file://"):
        return Path(path[len("file://"):])
    return Path(path)


def check_relative(root: Any, relative: str) -> str:
    """Refuse relative names that leave ``root``: empty, absolute, ``..``, control characters."""
    if not relative or any(ord(c) < 32 for c in relative) or relative.startswith(("/", "\\")):
        raise DestinationError(f"refusing unsafe relative path {relative!r} under {root}")
    if any(p in ("..", "", ".") for p in relative.split("/")):
        raise DestinationError(f"refusing path {relative!r}: it leaves {root}")
    return relative


class RemotePath(str):
    """A URL that joins like a path (``url / "name"``), for messages and ``str()`` of roots."""

    def __truediv__(self, relative: str) -> RemotePath:
        return RemotePath(self.rstrip("/") + "/" + str(relative))

    @property
    def name(self) -> str:
        return self.rstrip("/").rsplit("/", 1)[-1]


class RandomFile(Protocol):
    """Thread-safe positional reads of one file (no shared seek)."""

    size: int

    def readinto(self, view: memoryview, offset: int) -> int: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------------------------
# Error mapping


def _redact(text: str) -> str:
    for var in _SECRET_VARS:
        value = os.environ.get(var)
        if value and len(value) >= 4:
            text = text.replace(value, "***")
    return text


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return clip(_redact(text[0]), 200) if text else type(exc).__name__


def remote_error(url: str, exc: BaseException) -> Exception:
    """The ckptconv error for a backend exception raised while touching ``url`` (a URL's
    storage service; an OSError while writing a local output is
    :func:`converter.run.executor.storage_error`'s)."""
    from formats.errors import CkptConvError

    if isinstance(exc, CkptConvError):
        return exc
    names = {c.__name__ for c in type(exc).__mro__}
    if isinstance(exc, FileNotFoundError) or "NoSuchBucket" in str(exc):
        return CheckpointNotFoundError(f"{url}: no such object, prefix or bucket; check the URL")
    if isinstance(exc, PermissionError) or names & {"NoCredentialsError", "PartialCredentialsError"}:
        return StorageError(f"{url}: access denied ({_first_line(exc)}); {CREDENTIALS_FIX}")
    if names & {"EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError"} or isinstance(
        exc, (ConnectionError, TimeoutError)
    ):
        return StorageError(f"{url}: cannot reach the storage service ({_first_line(exc)}); {ENDPOINT_FIX}")
    return StorageError(f"{url}: storage request failed ({type(exc).__name__}: {_first_line(exc)}); "
                        f"{ENDPOINT_FIX}")


@contextlib.contextmanager
def remote_errors(url: str) -> Iterator[None]:
    """Turn backend exceptions raised inside the block into ckptconv errors naming ``url``."""
    from formats.errors import CkptConvError

    try:
        yield
    except CkptConvError:
        raise
    except Exception as exc:  # backends raise botocore / aiohttp / OSError types
        raise remote_error(url, exc) from None


def filesystem(url: str) -> tuple[Any, str]:
    """``(fs, path)`` for a remote URL; a ConfigError naming the extra to install if needed."""
    try:
        from fsspec.core import url_to_fs
    except ImportError:  # pragma: no cover - fsspec is a core dependency
        raise ConfigError(f"{url}: URLs need fsspec; pip install fsspec") from None
    try:
        fs, path = url_to_fs(url)
    except ImportError as exc:
        raise ConfigError(f"{url}: no backend for this URL ({_first_line(exc)}); for s3:// install "
                          "ckptconv[s3] (s3fs), for gs:// gcsfs") from None
    except ValueError as exc:
        raise ConfigError(f"{url}: unknown URL scheme ({_first_line(exc)})") from None
    return fs, path.rstrip("/")


# ---------------------------------------------------------------------------------------------
# Local


class LocalFile:
    """A read-only fd; ``readinto`` is ``os.preadv`` (thread safe)."""

    def __init__(self, path: Path) -> None:
        try:
            self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{path}: file disappeared") from None
        except OSError as e:
            raise read_error(path, e) from None
        self.size = os.fstat(self.fd).st_size

    def readinto(self, view: memoryview, offset: int) -> int:
        return read_exact_into(self.fd, view, offset)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class LocalStorage:
    """A local directory. Names are checked with :func:`formats.fsutil.safe_join`."""

    is_local = True

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = local_path(root)

    def path(self, relative: str) -> Path:
        """The checked local path of ``relative`` (DestinationError if it leaves the root)."""
        return safe_join(self.root, relative)

    def exists(self, relative: str = "") -> bool:
        return (self.path(relative) if relative else self.root).exists()

    def is_dir(self, relative: str = "") -> bool:
        return (self.path(relative) if relative else self.root).is_dir()

    def is_file(self, relative: str) -> bool:
        return self.path(relative).is_file()

    def list(self, relative: str = "") -> list[str]:
        """Names directly under ``relative`` (the root by default)."""
        return os.listdir(self.path(relative) if relative else self.root)

    def size(self, relative: str) -> int:
        """Size in bytes; CheckpointNotFoundError if missing."""
        path = self.path(relative)
        try:
            if path.is_dir():
                raise IsADirectoryError(relative)
            return path.stat().st_size
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise CheckpointNotFoundError(f"{path}: no such file") from None
        except OSError as e:  # a name too long, a loop: one line naming the file
            raise read_error(path, e) from None

    def read_bytes(self, relative: str, start: int | None = None, end: int | None = None) -> bytes:
        """The bytes ``[start, end)`` of a (small) file."""
        path = self.path(relative)
        try:
            if start is None and end is None:
                return path.read_bytes()
            with open(path, "rb") as f:
                f.seek(start or 0)
                return f.read(-1 if end is None else max(0, end - (start or 0)))
        except OSError as e:
            raise read_error(path, e) from None

    def open_random(self, relative: str) -> LocalFile:
        return LocalFile(self.path(relative))


# ---------------------------------------------------------------------------------------------
# Remote (fsspec)


class RemoteFile:
    """Ranged reads of one remote object: each ``readinto`` is one ``cat_file`` range request."""

    def __init__(self, fs: Any, path: str, url: str, size: int | None = None) -> None:
        self._fs, self._path, self.url, self._size = fs, path, url, size

    @property
    def size(self) -> int:
        """The object's size (one metadata request, the first time)."""
        if self._size is None:
            with remote_errors(self.url):
                self._size = int(self._fs.size(self._path))
        return self._size

    def readinto(self, view: memoryview, offset: int) -> int:
        """One ranged GET of ``[offset, offset + len(view))``, copied into ``view``; bytes read
        (fewer at the end of the object)."""
        n = len(view) if self._size is None else max(0, min(len(view), self._size - offset))
        if n == 0:
            return 0
        with remote_errors(self.url):
            data = self._fs.cat_file(self._path, start=offset, end=offset + n)
        view[: len(data)] = data
        return len(data)

    def close(self) -> None:
        pass


class RemoteStorage:
    """A prefix of an fsspec filesystem (a "directory" in a bucket)."""

    is_local = False

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.root = RemotePath(self.url)
        self.fs, self._base = filesystem(self.url)
        self._sizes: dict[str, int] = {}  # relative name -> bytes, from prefetch_sizes
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(self._base)  # other processes may have written since

    def _key(self, relative: str) -> str:
        return f"{self._base}/{check_relative(self.root, relative)}" if relative else self._base

    def exists(self, relative: str = "") -> bool:
        with remote_errors(self.root / relative if relative else self.url):
            return bool(self.fs.exists(self._key(relative)))

    def is_dir(self, relative: str = "") -> bool:
        with remote_errors(self.root / relative if relative else self.url):
            return bool(self.fs.isdir(self._key(relative)))

    def is_file(self, relative: str) -> bool:
        with remote_errors(self.root / relative):
            return bool(self.fs.isfile(self._key(relative)))

    def list(self, relative: str = "") -> list[str]:
        """Names directly under ``relative``; [] when nothing is there."""
        key = self._key(relative)
        with remote_errors(self.root / relative if relative else self.url):
            try:
                found = self.fs.ls(key, detail=False)
            except FileNotFoundError:
                return []
        return sorted({p.rstrip("/").rsplit("/", 1)[-1] for p in found if p.rstrip("/") != key})

    def size(self, relative: str) -> int:
        """Size in bytes (from the :meth:`prefetch_sizes` listing when it covered ``relative``)."""
        if relative in self._sizes:
            return self._sizes[relative]
        with remote_errors(self.root / relative):
            return int(self.fs.size(self._key(relative)))

    def prefetch_sizes(self, relative: str = "") -> int:
        """List every object under ``relative`` recursively (one paged listing, ~1000 objects a
        request) and remember their sizes, so that later :meth:`size` calls need no request.
        Returns how many objects were listed (0 when nothing is there)."""
        key = self._key(relative)
        with remote_errors(self.root / relative if relative else self.url):
            try:
                found = self.fs.find(key, detail=True)
            except FileNotFoundError:
                return 0
        for path, info in found.items():
            if info.get("type", "file") == "file" and path.startswith(self._base + "/"):
                self._sizes[path[len(self._base) + 1:]] = int(info["size"])
        return len(found)

    def read_bytes(self, relative: str, start: int | None = None, end: int | None = None) -> bytes:
        with remote_errors(self.root / relative):
            return bytes(self.fs.cat_file(self._key(relative), start=start, end=end))

    def open_random(self, relative: str) -> RemoteFile:
        """Ranged reads of one object (no request until the first read)."""
        return RemoteFile(self.fs, self._key(relative), self.root / relative)

    # -- writing (a URL destination: converter.run.remote) ----------------------------------

    def list_all(self) -> list[str]:
        """Every object under the prefix, recursively, as names relative to it."""
        base = self._base.rstrip("/") + "/"
        with remote_errors(self.url):
            try:
                found = self.fs.find(self._base)
            except FileNotFoundError:
                return []
        return [k[len(base):] for k in found if k.startswith(base)]

    def put_file(self, local: str | os.PathLike, relative: str) -> None:
        """Upload the local file ``local`` as ``relative`` under the prefix."""
        with remote_errors(self.root / relative):
            self.fs.put_file(str(local), self._key(relative))

    def remove_all(self) -> None:
        """Delete every object under the prefix (the caller checked they may go)."""
        with remote_errors(self.url):
            self.fs.rm(self._base, recursive=True)
        self.refresh()

    def refresh(self) -> None:
        """Forget cached listings of the prefix (after this or another process wrote to it)."""
        with remote_errors(self.url):
            self.fs.invalidate_cache(self._base)


Storage = LocalStorage | RemoteStorage


def open_storage(root: str | os.PathLike | LocalStorage | RemoteStorage) -> Storage:
    """The storage for a local path, a ``file://`` URL or any fsspec URL (an open one as is)."""
    if isinstance(root, (LocalStorage, RemoteStorage)):
        return root
    if is_remote(root):
        return RemoteStorage(str(root))
    return LocalStorage(root)


class OpenFiles:
    """The files of one checkpoint a reader reads, each opened once and shared by its threads:
    an fd (local; ``source_path``-checked, a vanished file is CheckpointNotFoundError) or a
    ranged-read file (URL). ``on_open(relative, path, fd)`` may check a newly opened local file
    (it closes the fd itself when it raises). :meth:`close` closes them all; a later
    :meth:`get` reopens."""

    def __init__(self, storage: Storage, on_open: Any = None) -> None:
        import threading

        self._storage, self._on_open = storage, on_open
        self._files: dict[str, int | RandomFile] = {}
        self._lock = threading.Lock()

    def get(self, relative: str) -> int | RandomFile:
        """The open file for ``relative`` (opened on first use)."""
        from formats.fsutil import source_path

        with self._lock:
            f = self._files.get(relative)
            if f is not None:
                return f
            if not self._storage.is_local:
                f = self._files[relative] = self._storage.open_random(relative)
                return f
            path = source_path(self._storage.root, relative)
            try:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except FileNotFoundError:
                raise CheckpointNotFoundError(f"{path}: file disappeared") from None
            except OSError as e:
                raise read_error(path, e) from None
            if self._on_open is not None:
                self._on_open(relative, path, fd)
            self._files[relative] = fd
            return fd

    def close(self) -> None:
        """Close every open file."""
        with self._lock:
            files, self._files = self._files, {}
        for f in files.values():
            close_file(f)


class CachedFds:
    """Read-only descriptors of many local files (a store's chunk files: one per tensor), each
    opened on its first read and kept open for the next ones, up to ``capacity`` idle descriptors
    (the least recently used one is closed first; one in use is never closed). Every read of a
    --mesh tp2,dp32 conversion reads 1/64 of a chunk file: an open and a close per read was a
    third of the reader's time. Thread-safe."""

    def __init__(self, capacity: int = 32) -> None:
        import collections
        import threading

        self.capacity = capacity
        self._lock = threading.Lock()
        self._fds: collections.OrderedDict[str, list[int]] = collections.OrderedDict()  # path -> [fd, users]

    def acquire(self, path: str | os.PathLike) -> int:
        """The descriptor of ``path`` (opened if none is), in use until :meth:`release`; OSError
        as ``os.open`` raises it."""
        path = os.fspath(path)
        with self._lock:
            entry = self._fds.get(path)
            if entry is not None:
                entry[1] += 1
                self._fds.move_to_end(path)
                return entry[0]
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        extra = None
        with self._lock:
            entry = self._fds.get(path)
            if entry is not None:  # another thread opened it meanwhile: use that one
                entry[1] += 1
                extra, fd = fd, entry[0]
            else:
                self._fds[path] = [fd, 1]
            idle = self._trim()
        for f in ([extra] if extra is not None else []) + idle:
            os.close(f)
        return fd

    def release(self, path: str | os.PathLike) -> None:
        """Done with the descriptor :meth:`acquire` gave."""
        with self._lock:
            self._fds[os.fspath(path)][1] -= 1
            idle = self._trim()
        for f in idle:
            os.close(f)

    def _trim(self) -> list[int]:
        """The idle descriptors past the capacity, oldest first, taken out (closed by the caller
        outside the lock)."""
        out: list[int] = []
        if len(self._fds) <= self.capacity:
            return out
        for path in [p for p, e in self._fds.items() if not e[1]]:
            if len(self._fds) <= self.capacity:
                break
            out.append(self._fds.pop(path)[0])
        return out

    def close(self) -> None:
        """Close every descriptor (none may be in use)."""
        with self._lock:
            fds, self._fds = [e[0] for e in self._fds.values()], type(self._fds)()
        for fd in fds:
            os.close(fd)

    def __len__(self) -> int:
        return len(self._fds)

    def __del__(self) -> None:  # a reader dropped without close(): its descriptors go with it
        for entry in getattr(self, "_fds", {}).values():
            try:
                os.close(entry[0])
            except OSError:
                pass


def listdir(root: str | os.PathLike | LocalStorage | RemoteStorage) -> list[str]:
    """Names directly under ``root`` (a path, URL or storage)."""
    return open_storage(root).list()


def read_into(f: int | RandomFile, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``offset`` of an fd (``os.preadv`` loop) or a RandomFile; bytes read."""
    if isinstance(f, int):
        return read_exact_into(f, view, offset)
    done = 0
    while done < len(view):
        n = f.readinto(view[done:], offset + done)
        if n <= 0:
            break
        done += n
    return done


def close_file(f: int | RandomFile) -> None:
    """Close an fd or a RandomFile."""
    if isinstance(f, int):
        os.close(f)
    else:
        f.close()
