"""The fetch stage: the bytes of remote images and of images inside tables or shards, read
many at once, ahead of the decoders (``sources.py`` says which sources those are).

    Fetcher(opts).submit(source, base_dir) -> Future[bytes]     on ``opts.concurrency`` threads
        http(s)://      httpx, one pooled client: retries on 429/5xx/connection errors with
                        backoff (``Retry-After`` honoured up to MAX_RETRY_AFTER_S), at most
                        MAX_REDIRECTS redirects, a body over ``max_bytes`` refused from its
                        Content-Length before it is read (or once the bytes read pass it)
        s3:// gs:// az://   fsspec (the ``s3``, ``gcs``, ``azure`` extras: s3fs, gcsfs,
                        adlfs), credentials and endpoints as each SDK reads them
                        (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...); size checked first
        RowRef          the cell of a Parquet/Arrow file (``table_rows.py``; a struct's path
                        read as a source of its own)
        MemberRef       a byte range of a tar shard: a local read, an HTTP ``Range`` request,
                        or an fsspec range read

With ``opts.guard`` (a server's remote media), every http(s) connection, the first and each
redirect's, goes through the SSRF guard (``guard.py``: resolved, every address checked,
connected to the checked address), and object-store URLs are refused.

Every failure is a ``SourceError`` with its ``reason`` (``sources.py``): that item's error,
never the caller's. Fetching has its own deadline (``timeout_s`` per attempt), apart from the
decoders' ``--decode-timeout``, which then measures decoding alone. Threads, not asyncio:
each blocks in a socket read or in pyarrow, both outside the GIL.
"""

from __future__ import annotations

import contextlib
import email.utils
import io
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from queue import SimpleQueue
from typing import Any

import httpcore
import httpx

from vlmbatch.preprocessing.guard import (
    GuardedBackend,
    MediaBlocked,
    PinnedTransport,
    Resolve,
    system_resolve,
)
from vlmbatch.preprocessing.limits import MAX_REDIRECTS, MAX_RETRY_AFTER_S, FetchOptions
from vlmbatch.preprocessing.sources import (
    HTTP,
    MemberRef,
    NotAnImage,
    RowRef,
    SourceError,
    is_remote,
    read_bytes,
    scheme,
)
from vlmbatch.preprocessing.table_rows import TableRows

RETRIED_STATUS = frozenset({429, 500, 502, 503, 504})
EXTRAS = {"s3": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure",
          "abfss": "azure"}


class DaemonPool:
    """A few daemon threads running submitted calls, FIFO, each result in a ``Future``. Unlike
    ``ThreadPoolExecutor`` (whose threads Python joins at exit), a thread blocked in a read
    never keeps the process alive."""

    def __init__(self, threads: int, name: str = "vlmbatch-prepare") -> None:
        self.jobs: SimpleQueue = SimpleQueue()
        for i in range(threads):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()
        self.threads = threads

    def submit(self, fn: Callable, *args: object) -> Future:
        f: Future = Future()
        self.jobs.put((f, fn, args))
        return f

    def stop(self) -> None:
        for _ in range(self.threads):
            self.jobs.put(None)

    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            f, fn, args = job
            if not f.set_running_or_notify_cancel():
                continue  # cancelled before it started
            try:
                f.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001  (handed to whoever waits on f)
                f.set_exception(e)


class Fetcher:
    """The fetch stage (module docstring). Its threads and HTTP client start with the first
    remote image, so a run over local files pays for none; ``stop`` ends them, for good: an
    http(s) fetch in flight (its connection closed) or asked for later fails, never retried
    on a client made again."""

    def __init__(self, opts: FetchOptions = FetchOptions(), resolve: Resolve = system_resolve,
                 network: httpcore.NetworkBackend | None = None) -> None:
        """``resolve`` and ``network``: the guard's DNS lookup and socket maker (tests stub
        them; used only with ``opts.guard``)."""
        self.opts, self.resolve, self.network = opts, resolve, network
        self.lock = threading.Lock()
        self.pool: DaemonPool | None = None
        self.client: httpx.Client | None = None
        self.stopped = False  # then no client is made again: a fetch in flight fails
        self.fs: dict[str, Any] = {}  # fsspec file systems by protocol, made on first use
        self.tables = TableRows()

    @staticmethod
    def needs(source: object) -> bool:
        return is_remote(source)

    def submit(self, source: object, base_dir: Path) -> Future:
        """The bytes of ``source`` in a future (or its ``SourceError``)."""
        with self.lock:
            if self.pool is None:
                self.pool = DaemonPool(self.opts.concurrency, "vlmbatch-fetch")
        return self.pool.submit(self.fetch, source, base_dir)

    def __enter__(self) -> Fetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        with self.lock:
            pool, client, self.pool, self.client = self.pool, self.client, None, None
            self.stopped = True
        if pool is not None:
            pool.stop()
        if client is not None:
            client.close()

    def fetch(self, source: object, base_dir: Path) -> bytes:
        """The bytes of ``source``, in this thread. Any failure is a ``SourceError``: what the
        SDKs raise beyond the cases named here (botocore's ``NoCredentialsError``, an SDK's
        own DNS, TLS or timeout error, a store's extra missing a dependency) is reported with
        its type and message, as that item's error, never the run's."""
        try:
            return self._fetch(source, base_dir)
        except SourceError:
            raise
        except Exception as e:  # noqa: BLE001  (one item's bytes: its error, whatever the SDK)
            raise SourceError(f"{type(e).__name__}: {e}", unexpected_reason(e)) from None

    def _fetch(self, source: object, base_dir: Path) -> bytes:
        if isinstance(source, RowRef):
            return self._row(source)
        if isinstance(source, MemberRef):
            return self._range(source)
        if isinstance(source, NotAnImage):
            raise SourceError(source.why)
        if not isinstance(source, str):
            raise SourceError(f"not an image source: {type(source).__name__}")
        if not is_remote(source):
            return read_bytes(source, base_dir)
        if scheme(source) in HTTP:
            return self.http_get(source)
        if self.opts.guard is not None:
            raise MediaBlocked(f"refused by the SSRF guard: {scheme(source)}:// URLs are not "
                               "fetched (http(s) only)")
        return self._object(source)

    # --- tables and shards -----------------------------------------------------------------

    def _row(self, ref: RowRef) -> bytes:
        cell = self.tables.cell(ref)
        if isinstance(cell, dict):  # HF datasets' Image feature: {"bytes", "path"}
            data, path = cell.get("bytes"), cell.get("path")
            if data is None and path:
                return self.fetch(path, Path(ref.file).parent)
            cell = data
        if isinstance(cell, str) and cell:  # a column of paths or URLs read as a RowRef
            return self.fetch(cell, Path(ref.file).parent)
        if not isinstance(cell, bytes) or not cell:
            raise SourceError(f"row {ref.row} of {ref.file} has no image in column "
                              f"{ref.column!r}", "not_found")
        self._check_size(len(cell))
        return cell

    def _range(self, ref: MemberRef) -> bytes:
        self._check_size(ref.size)
        end = ref.offset + ref.size  # exclusive
        if scheme(ref.shard) in HTTP:
            return self.http_get(ref.shard, (ref.offset, end))
        if is_remote(ref.shard):
            return self._object(ref.shard, (ref.offset, end))
        try:
            with open(ref.shard, "rb") as f:
                f.seek(ref.offset)
                data = f.read(ref.size)
        except FileNotFoundError:
            raise SourceError(f"shard not found: {ref.shard}", "not_found") from None
        except OSError as e:
            raise SourceError(f"cannot read {ref.shard}: {e.strerror or e}") from None
        if len(data) != ref.size:
            raise SourceError(f"{ref.source}: the shard is shorter than when it was listed")
        return data

    def _check_size(self, size: int) -> None:
        if size > self.opts.max_bytes:
            raise SourceError(f"{size:,} bytes, over the limit of {self.opts.max_bytes:,} "
                              "(raise --max-image-mib to allow it)", "too_large")

    # --- http(s) ---------------------------------------------------------------------------

    def _client(self) -> httpx.Client:
        with self.lock:
            if self.stopped:  # its requests in flight broke off: not sent again
                raise SourceError("the fetch stage was stopped", "connection")
            if self.client is None:
                n = self.opts.concurrency
                limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
                guard = self.opts.guard
                transport = None if guard is None else PinnedTransport(
                    GuardedBackend(guard, self.resolve, self.network), limits)
                self.client = httpx.Client(
                    timeout=httpx.Timeout(self.opts.timeout_s), follow_redirects=True,
                    max_redirects=MAX_REDIRECTS, limits=limits, transport=transport)
            return self.client

    def http_get(self, url: str, span: tuple[int, int] | None = None) -> bytes:
        """The body of ``url`` (bytes ``[a, b)`` of it for ``span``), retried as the module
        docstring says."""
        headers = {"Range": f"bytes={span[0]}-{span[1] - 1}"} if span else {}
        for attempt in range(self.opts.retries + 1):
            last = attempt == self.opts.retries
            try:
                with self._client().stream("GET", url, headers=headers) as r:
                    if r.status_code in RETRIED_STATUS and not last:
                        wait = self._wait(r, attempt)
                    else:
                        return self._body(r, span)
            except httpx.TooManyRedirects:
                raise SourceError(f"more than {MAX_REDIRECTS} redirects", "redirects") from None
            except httpx.TimeoutException as e:
                raise SourceError(f"timed out after {self.opts.timeout_s:g}s "
                                  f"({type(e).__name__})", "timeout") from None
            except (httpx.NetworkError, httpx.RemoteProtocolError) as e:
                if last:
                    raise SourceError(f"connection failed after {attempt + 1} attempts: "
                                      f"{type(e).__name__}: {e}", "connection") from None
                wait = self._backoff(attempt)
            except httpx.InvalidURL as e:
                raise SourceError(f"bad URL: {e}") from None
            except httpx.HTTPError as e:  # e.g. a redirect to a scheme httpx does not fetch
                raise SourceError(f"{type(e).__name__}: {e}") from None
            time.sleep(wait)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _backoff(self, attempt: int) -> float:
        return self.opts.backoff_s * 2 ** attempt * (1 + 0.25 * random.random())

    def _wait(self, r: httpx.Response, attempt: int) -> float:
        """Seconds to wait before retrying ``r`` (a 429/5xx): its ``Retry-After``, else the
        backoff; a ``Retry-After`` past MAX_RETRY_AFTER_S fails the fetch now."""
        after = retry_after(r.headers.get("retry-after"))
        if after is None:
            return self._backoff(attempt)
        if after > MAX_RETRY_AFTER_S:
            raise SourceError(f"HTTP {r.status_code}, Retry-After {after:g}s (more than "
                              f"{MAX_RETRY_AFTER_S:g}s)", "status")
        return after

    def _body(self, r: httpx.Response, span: tuple[int, int] | None) -> bytes:
        if not (r.status_code == 200 or (span is not None and r.status_code == 206)):
            raise status_error(r)
        length = r.headers.get("content-length")
        if span is None and length and length.isdigit():
            self._check_size(int(length))  # refused before reading the body
        body = bytearray()
        for chunk in r.iter_bytes():
            body += chunk
            if span is None:
                self._check_size(len(body))
        if span is not None:
            data = bytes(body) if r.status_code == 206 else bytes(body[span[0]:span[1]])
            if len(data) != span[1] - span[0]:
                raise SourceError("the shard is shorter than when it was listed")
            return data
        return bytes(body)

    @contextlib.contextmanager
    def open_stream(self, url: str) -> Iterator[io.BufferedReader]:
        """``url``'s body as a file read front to back (a tar shard being listed), in bounded
        memory: http(s) streamed (its first response retried as ``http_get`` is), an object
        store through fsspec. A failure to open is a ``SourceError``."""
        if scheme(url) not in HTTP:
            fs, path = self._fs_of(url)
            try:
                f = fs.open(path, "rb", block_size=8 << 20)
            except FileNotFoundError:
                raise SourceError(f"{url}: not found", "not_found") from None
            except (OSError, ValueError) as e:
                raise SourceError(f"{url}: cannot open: {e}", "connection") from None
            with f:
                yield f
            return
        try:
            for attempt in range(self.opts.retries + 1):
                with self._client().stream("GET", url) as r:
                    if r.status_code in RETRIED_STATUS and attempt < self.opts.retries:
                        wait = self._wait(r, attempt)
                    elif r.status_code != 200:
                        raise status_error(r)
                    else:
                        yield io.BufferedReader(_Chunks(r.iter_bytes()), 1 << 20)
                        return
                time.sleep(wait)
        except httpx.HTTPError as e:
            raise SourceError(f"{type(e).__name__}: {e}", "connection") from None

    # --- object stores ---------------------------------------------------------------------

    def _object(self, url: str, span: tuple[int, int] | None = None) -> bytes:
        fs, path = self._fs_of(url)
        try:
            if span is not None:
                return bytes(fs.cat_file(path, start=span[0], end=span[1]))
            size = fs.info(path).get("size")
            if isinstance(size, int):
                self._check_size(size)
            return bytes(fs.cat_file(path))
        except SourceError:
            raise
        except FileNotFoundError:
            raise SourceError("not found", "not_found") from None
        except PermissionError as e:
            raise SourceError(f"access denied ({e})", "access_denied") from None
        except TimeoutError as e:
            raise SourceError(f"timed out ({e})", "timeout") from None
        except (OSError, ValueError) as e:
            raise SourceError(f"cannot read: {type(e).__name__}: {e}", "connection") from None

    def _fs_of(self, url: str) -> tuple[Any, str]:
        proto = scheme(url)
        try:  # optional dependency: fsspec and the store's implementation (extras)
            import fsspec
        except ModuleNotFoundError:
            raise SourceError(f"{proto}:// images need fsspec: pip install "
                              f"'vlmbatch[{EXTRAS.get(proto, proto)}]'") from None
        with self.lock:
            fs = self.fs.get(proto)
            if fs is None:
                try:
                    fs = self.fs[proto] = fsspec.filesystem(proto, skip_instance_cache=True,
                                                            **self._fs_options(proto))
                except (ImportError, ValueError) as e:
                    raise SourceError(f"{proto}:// images need the {EXTRAS.get(proto, proto)!r} "
                                      f"extra: pip install 'vlmbatch[{EXTRAS.get(proto, proto)}]' "
                                      f"({e})") from None
        return fs, fs._strip_protocol(url)

    def _fs_options(self, proto: str) -> dict:
        """s3fs: botocore's timeouts and retries from ours (the others keep their SDK's)."""
        if proto != "s3":
            return {}
        t = self.opts.timeout_s
        return {"config_kwargs": {"connect_timeout": t, "read_timeout": t,
                                  "retries": {"max_attempts": self.opts.retries + 1}}}


class _Chunks(io.RawIOBase):
    """An iterator of byte chunks as a raw, read-only file."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self.chunks, self.rest = chunks, b""

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not self.rest:
            self.rest = next(self.chunks, b"")
            if not self.rest:
                return 0
        n = min(len(b), len(self.rest))
        b[:n], self.rest = self.rest[:n], self.rest[n:]
        return n


def retry_after(value: str | None) -> float | None:
    """A ``Retry-After`` header's seconds (delta-seconds or an HTTP date), None if absent or
    unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def unexpected_reason(e: Exception) -> str:
    """The reason of a failure the fetch stage did not name itself: a credentials or
    permission error (botocore's ``NoCredentialsError``, ``ClientError`` AccessDenied, ...) is
    ``access_denied``, a timeout ``timeout``, a network error ``connection``."""
    name = type(e).__name__.lower()
    text = str(e).lower()
    if "credential" in name or "accessdenied" in text.replace(" ", "") or "forbidden" in text:
        return "access_denied"
    if "timeout" in name or isinstance(e, TimeoutError):
        return "timeout"
    if isinstance(e, (ConnectionError, OSError)) or "connect" in name or "ssl" in name:
        return "connection"
    return "unreadable"


def status_error(r: httpx.Response) -> SourceError:
    reason = {404: "not_found", 410: "not_found", 401: "access_denied",
              403: "access_denied"}.get(r.status_code, "status")
    words = {"not_found": " (not found)", "access_denied": " (access denied)"}.get(reason, "")
    return SourceError(f"HTTP {r.status_code} {r.reason_phrase}{words}", reason)
