"""Soak: many chat requests from concurrent clients against ``vlmbatch serve`` while a
batch runs, checking what must hold under load.

A fresh server (``--engines``, 1 torch thread each); a batch of ``--batch`` lines is
submitted first, then ``--requests`` chat requests (the example images, two questions,
``max_tokens: 1``) from ``--clients`` keep-alive HTTP/1.1 connections. A 429 is retried by
its client (after 50 ms; counted); any other non-200 is an error. The server's RSS (its
process and its engine processes) is sampled every 0.5 s. Checks (exit 1 naming any that
failed): 0 errors; the batch completed with every line answered exactly once; RSS after
warm-up (the first ``--warmup`` of the requests) within 10% of its value there (max over
min); p50/p99 latency printed.

    python bench/soak.py --requests 20000 --clients 64 --batch 200
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.checks import Checks  # noqa: E402
from tests.server.serving import IMAGES, Server, batch_lines, chat_body  # noqa: E402
from tests.waiting import NeverHappened, wait_until  # noqa: E402

QS = ("Is there a red shape?", "Is there a circle?")


@dataclass
class Soak:
    latency: list[float] = field(default_factory=list)  # seconds, answered requests
    errors: list[str] = field(default_factory=list)  # non-200, non-429 answers
    retried_429: int = 0
    rss: list[tuple[int, int]] = field(default_factory=list)  # (requests done, bytes)


def rss_of(pid: int) -> int:
    """Resident bytes of ``pid`` and its engine processes (children of any thread)."""
    total = 0
    pids = [str(pid)]
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            pids += (task / "children").read_text().split()
        except FileNotFoundError:
            continue
    for p in pids:
        try:
            if p != str(pid) and b"engine_process" not in Path(f"/proc/{p}/cmdline").read_bytes():
                continue
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except FileNotFoundError:
            continue
    return total


def requests(n: int, key: str | None) -> list[bytes]:
    """``n`` pre-encoded POSTs cycling over the example images and two questions."""
    images = sorted(IMAGES.glob("scene_*.png"))
    urls = ["data:image/png;base64," + base64.b64encode(p.read_bytes()).decode()
            for p in images]
    auth = f"Authorization: Bearer {key}\r\n".encode() if key else b""
    out = []
    for i in range(n):
        data = json.dumps(chat_body(urls[i % len(urls)], QS[(i // len(urls)) % 2],
                                    max_tokens=1)).encode()
        out.append(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n" + auth
                   + b"Content-Type: application/json\r\nContent-Length: "
                   + str(len(data)).encode() + b"\r\n\r\n" + data)
    return out


async def _client(port: int, todo: list[bytes], s: Soak) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while todo:
            req = todo.pop()
            while True:
                t0 = time.perf_counter()
                writer.write(req)
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(x.split(b":")[1] for x in head.split(b"\r\n")
                                  if x.lower().startswith(b"content-length:")))
                body = await reader.readexactly(length)
                if head.startswith(b"HTTP/1.1 429"):
                    s.retried_429 += 1
                    await asyncio.sleep(0.05)
                    continue
                if head.startswith(b"HTTP/1.1 200"):
                    s.latency.append(time.perf_counter() - t0)
                else:
                    s.errors.append((head[:40] + body[:200]).decode(errors="replace"))
                break
    finally:
        writer.close()


def run_soak(server: Server, n: int, clients: int, key: str | None) -> Soak:
    """``n`` chat requests from ``clients`` connections against ``server``, RSS sampled."""
    s = Soak()
    todo = requests(n, key)[::-1]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.5):
            s.rss.append((n - len(todo), rss_of(server.proc.pid)))

    t = threading.Thread(target=sample, daemon=True)
    t.start()

    async def all_clients() -> None:
        await asyncio.gather(*(_client(server.port, todo, s) for _ in range(clients)))

    try:
        asyncio.run(all_clients())
    finally:
        stop.set()
        t.join()
    s.rss.append((n, rss_of(server.proc.pid)))
    return s


def start_batch(c: httpx.Client, n: int) -> tuple[str, list[str]]:
    images = sorted(IMAGES.glob("scene_*.png"))
    reqs = [(f"s{i}", "data:image/png;base64," + base64.b64encode(
        images[i % len(images)].read_bytes()).decode(), QS[i % 2]) for i in range(n)]
    f = c.post("/v1/files", files={"file": ("in.jsonl", batch_lines(reqs).encode())},
               data={"purpose": "batch"}).json()
    b = c.post("/v1/batches", json={"input_file_id": f["id"], "completion_window": "24h",
                                    "endpoint": "/v1/chat/completions"}).json()
    return b["id"], [cid for cid, _, _ in reqs]


def batch_once(c: httpx.Client, batch_id: str, ids: list[str], timeout: float) -> str | None:
    """None when the batch completed with each of ``ids`` answered once, else why not."""
    def finished() -> dict | None:
        b = c.get(f"/v1/batches/{batch_id}").json()
        return b if b["status"] in ("completed", "failed", "cancelled") else None

    try:
        b = wait_until(finished, timeout, f"batch {batch_id} finished", interval=0.2)
    except NeverHappened as e:
        return str(e)
    if b["status"] != "completed":
        return f"batch {b['status']}"
    lines = c.get(f"/v1/files/{b['output_file_id']}/content").text.splitlines()
    got = sorted(json.loads(x)["custom_id"] for x in lines)
    return None if got == sorted(ids) else f"batch lines {len(got)} != {len(ids)} once each"


def check(s: Soak, batch: str | None, warmup: float, checks: Checks) -> None:
    lat = sorted(s.latency)
    p50, p99 = statistics.median(lat), lat[int(0.99 * (len(lat) - 1))]
    after = [r for done, r in s.rss if done >= warmup * max(d for d, _ in s.rss)]
    growth = max(after) / min(after) - 1 if after else 0.0
    print(f"answered {len(lat)}, errors {len(s.errors)}, 429s retried {s.retried_429}; "
          f"latency p50 {1000 * p50:.1f} ms, p99 {1000 * p99:.1f} ms; RSS after warm-up "
          f"{min(after) / 2**20:.0f}-{max(after) / 2**20:.0f} MiB ({100 * growth:.1f}%)")
    print(f"errors other than retried 429s: {len(s.errors)} "
          f"{checks.verdict(not s.errors, f'{len(s.errors)} errors: {s.errors[:3]}')}")
    print(f"batch completed exactly once: {batch or 'yes'} "
          f"{checks.verdict(batch is None, f'batch: {batch}')}")
    print(f"RSS flat within 10% after warm-up: {100 * growth:.1f}% "
          f"{checks.verdict(growth <= 0.10, f'RSS grew {100 * growth:.1f}% after warm-up')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--batch", type=int, default=200, help="lines of the batch running")
    ap.add_argument("--engines", type=int, default=1)
    ap.add_argument("--warmup", type=float, default=0.2, help="fraction of the requests")
    args = ap.parse_args()
    checks = Checks()
    with tempfile.TemporaryDirectory(prefix="vlmbatch-soak-") as tmp:
        server = Server(Path(tmp) / "data", "--engines", str(args.engines),
                        "--images-per-batch", "4", key=None).wait_ready(300)
        try:
            with server.client() as c:
                batch_id, ids = start_batch(c, args.batch)
                t0 = time.perf_counter()
                s = run_soak(server, args.requests, args.clients, None)
                secs = time.perf_counter() - t0
                batch = batch_once(c, batch_id, ids, 600)
        finally:
            server.stop()
    print(f"{args.requests} requests, {args.clients} clients, --engines {args.engines}, "
          f"a batch of {args.batch}: {secs:.1f} s ({60 * args.requests / secs:.0f} QPM)")
    check(s, batch, args.warmup, checks)
    checks.exit()


if __name__ == "__main__":
    main()
