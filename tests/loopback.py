"""A real HTTP server on 127.0.0.1 for the fetch stage's tests and ``bench/fetch.py``: keep-alive
(HTTP/1.1, so the client's connection pool is exercised), ``Range`` requests, and paths that
misbehave on purpose. Nothing leaves the loopback interface.

    /img/NAME                    the file NAME (200, or 206 for a Range request)
    /slow/MS/NAME                the same after MS milliseconds
    /fail/N/NAME                 503 for the first N requests of this path, then the file
    /retry-after/S/NAME          429 with ``Retry-After: S`` for the first request, then the file
    /redirect/K/NAME             K redirects (302), then the file
    /location/QUOTED             a 302 to the URL QUOTED percent-decodes to (any host)
    /status/CODE/NAME            always CODE
    /big                         claims 1 GiB (Content-Length) and trickles it out
    /chunked/MIB                 MIB MiB, chunked (no Content-Length)
    /flaky/NAME                  503 while ``server.failing`` holds NAME, else the file
    /hold/NAME                   the file once ``server.gate`` is set (at most HOLD_S later)
    /stats                       JSON: ``requests`` so far, and ``max_in_flight`` since the
                                 last /stats (these not counted)

``requests[path]`` counts requests per path, ``sent[path]`` the body bytes written,
``in_flight`` the requests being answered and ``max_in_flight`` the most at once. Like any
server worth measuring against, it sends a response without waiting for the client's ACK
(``TCP_NODELAY``: else the body, written after its headers, waits ~40 ms on the client's
delayed ACK) and keeps a deep accept queue (http.server's 5 drops the SYNs of a burst of
connections: 1 s until they are sent again). ``python -m tests.loopback DIR`` serves a folder
from a process of its own (``serve``).
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

CHUNK = 64 << 10
HOLD_S = 30.0  # the longest a /hold/ request waits for the gate


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now (the tests' one home for it:
    another process may take it before the caller binds, so bind soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LoopbackServer:
    """The server in a daemon thread (module docstring); ``url(path)`` is its address."""

    def __init__(self, files: dict[str, bytes] | None = None) -> None:
        self.files = dict(files or {})
        self.requests: Counter[str] = Counter()
        self.sent: Counter[str] = Counter()
        self.failing: set[str] = set()
        self.gate = threading.Event()
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0
        handler = type("Handler", (_Handler,), {"owner": self})
        self.httpd = _Server(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_port}"

    def url(self, path: str) -> str:
        return self.base + path

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> LoopbackServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Server(ThreadingHTTPServer):
    request_queue_size = 1024  # http.server's 5 drops the SYNs of a burst of connections


class _Server(ThreadingHTTPServer):
    request_queue_size = 1024  # the accept queue (module docstring)

    def handle_error(self, request: object, client_address: object) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # else: a client hung up
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    disable_nagle_algorithm = True  # TCP_NODELAY (module docstring)
    disable_nagle_algorithm = True  # else a body written after its headers waits ~40 ms
    owner: LoopbackServer

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def do_GET(self) -> None:  # noqa: N802  (http.server's name)
        o = self.owner
        if self.path == "/stats":
            return self._stats()
        with o.lock:
            o.requests[self.path] += 1
            n = o.requests[self.path]
            o.in_flight += 1
            o.max_in_flight = max(o.max_in_flight, o.in_flight)
        try:
            self._route(self.path.split("?")[0].strip("/").split("/"), n)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client hung up (a refused body, a timeout)
        finally:
            with o.lock:
                o.in_flight -= 1

    def _route(self, parts: list[str], n: int) -> None:
        kind, rest = parts[0], parts[1:]
        if kind == "img":
            return self._file("/".join(rest))
        if kind == "slow":
            time.sleep(int(rest[0]) / 1000)
            return self._file("/".join(rest[1:]))
        if kind == "fail":
            return (self._status(503) if n <= int(rest[0]) else self._file("/".join(rest[1:])))
        if kind == "retry-after":
            if n == 1:
                return self._status(429, {"Retry-After": rest[0]})
            return self._file("/".join(rest[1:]))
        if kind == "redirect":
            k, name = int(rest[0]), "/".join(rest[1:])
            target = f"/redirect/{k - 1}/{name}" if k > 1 else f"/img/{name}"
            return self._status(302, {"Location": target})
        if kind == "location":
            return self._status(302, {"Location": unquote("/".join(rest))})
        if kind == "status":
            return self._status(int(rest[0]))
        if kind == "hold":
            self.owner.gate.wait(HOLD_S)
            return self._file("/".join(rest))
        if kind == "flaky":
            name = "/".join(rest)
            return self._status(503) if name in self.owner.failing else self._file(name)
        if kind == "big":
            return self._trickle(1 << 30, {"Content-Length": str(1 << 30)})
        if kind == "chunked":
            return self._chunked(int(rest[0]) << 20)
        return self._status(404)

    def _stats(self) -> None:
        o = self.owner
        with o.lock:
            stats = {"requests": sum(o.requests.values()), "max_in_flight": o.max_in_flight}
            o.max_in_flight = o.in_flight
        body = json.dumps(stats).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _status(self, code: int, headers: dict[str, str] | None = None) -> None:
        body = f"{code}\n".encode()
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _file(self, name: str) -> None:
        data = self.owner.files.get(name)
        if data is None:
            return self._status(404)
        rng = self.headers.get("Range")
        code = 200
        if rng and rng.startswith("bytes="):
            a, _, b = rng[6:].partition("-")
            data, code = data[int(a):int(b) + 1], 206
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self._write(data)

    def _write(self, data: bytes) -> None:
        self.wfile.write(data)
        with self.owner.lock:
            self.owner.sent[self.path] += len(data)

    def _trickle(self, size: int, headers: dict[str, str]) -> None:
        self.send_response(200)
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        for _ in range(size // CHUNK):
            self._write(b"\0" * CHUNK)
            time.sleep(0.01)

    def _chunked(self, size: int) -> None:
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for _ in range(size // CHUNK):
            self.wfile.write(f"{CHUNK:x}\r\n".encode())
            self._write(b"\0" * CHUNK)
            self.wfile.write(b"\r\n")
        self.wfile.write(b"0\r\n\r\n")


def serve(folder: str) -> None:
    """``python -m tests.loopback DIR``: every file under DIR served (read into memory
    first), in its own process (a benchmark's client then shares no GIL with the server);
    prints the base URL, then serves until killed."""
    root = Path(folder)
    files = {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*")
             if p.is_file()}
    server = LoopbackServer(files)
    print(server.base, flush=True)
    server.thread.join()


if __name__ == "__main__":
    serve(sys.argv[1])
