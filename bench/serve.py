"""Server benchmark: N concurrent clients sending chat completions vs the offline run of the
same questions, in one invocation.

The questions are bench/qpm.py's: every yes/no question of the first ``--images`` images of
easy-vqa's test split. Offline: ``vlmbatch.VLM(...).ask_many`` (what ``vlmbatch run`` does:
images decoded once, batched, prefix-cached), a fresh engine each round. Served: ``vlmbatch
serve`` in a subprocess (``--threads`` torch threads, the same engine defaults), a fresh
server for each (clients, round) so every row starts with an empty prefix cache; N clients
take the questions in order (image by image, as the offline run does) from one queue, each
request carrying its image as a data: URL and ``max_tokens: 1``. A client is one keep-alive
HTTP/1.1 connection sending pre-encoded requests (asyncio streams), so that the clients,
which share the machine with the server here, take little of its CPU (the official
``openai`` client costs ~3.6 ms of CPU per request on our machines, more than the
server). Rows: QPM, latency p50/p99, and the ratio to offline QPM; the served
P(yes) is checked against the offline one (equal to ``--check-tol``, 1e-6; the script exits 1
after its table when a row is not, naming it on stderr). Also CPU milliseconds per
question: the server process's (all its threads) and the client loop's, against the offline
run's; on a shared machine wall clock swings with other work, CPU time much less.

Each served row runs once per ``--engines`` layout (default ``1 0``: one engine process,
then the engine thread in the HTTP process, the layout before the split), named
``N cl. eE``; the server's CPU then counts its engine processes too.

``--rounds N`` repeats the rows interleaved (offline, 1, 8, 32 clients, then again) and keeps
each row's best. On one machine the clients share the CPU with the server: on our 2 cores
this costs the server part of its throughput (the client loop's own CPU is reported).

    python bench/serve.py --images 60 --clients 1 8 32 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vlmbatch  # noqa: E402
from bench.checks import Checks  # noqa: E402
from tests.app.server.serving import Server, chat_body  # noqa: E402
from vlmbatch.app.evaluate import easy_vqa_set  # noqa: E402


def requests_of(items: list) -> tuple[list[dict], list[tuple[str, str]]]:
    """One chat body per (image, question), in item then question order, and their keys."""
    bodies, keys = [], []
    for it in items:
        url = "data:image/png;base64," + base64.b64encode(Path(it.image).read_bytes()).decode()
        for q in it.questions:
            bodies.append(chat_body(url, q.text, max_tokens=1))
            keys.append((it.id, q.id))
    return bodies, keys


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process has used so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_cpu(pid: int) -> float:
    """CPU seconds of the server: its process and its engine processes (children running
    ``engine_process``, whichever thread started them); decoder processes are not counted,
    as the offline row's are not."""
    total = proc_cpu(pid)
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except FileNotFoundError:
            continue
        for c in children:
            try:
                if b"engine_process" in Path(f"/proc/{c}/cmdline").read_bytes():
                    total += proc_cpu(int(c))
            except FileNotFoundError:
                continue
    return total


def offline(items: list, warm: list, threads: int) -> tuple:
    """Seconds, P(yes) and CPU seconds of one offline round (fresh engine, warmed on
    ``warm``)."""
    vlm = vlmbatch.VLM(threads=threads)
    list(vlm.ask_many(warm))
    cpu0, start = time.process_time(), time.perf_counter()
    p = [a.p_yes for a in vlm.ask_many(items)]
    return time.perf_counter() - start, [], p, time.process_time() - cpu0, 0.0


def encoded(bodies: list[dict]) -> list[bytes]:
    """Each request as the bytes of one HTTP/1.1 POST (keep-alive)."""
    out = []
    for b in bodies:
        data = json.dumps(b).encode()
        out.append(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                   b"Content-Type: application/json\r\nContent-Length: "
                   + str(len(data)).encode() + b"\r\n\r\n" + data)
    return out


async def _connection(port: int, todo: list[int], requests: list[bytes],
                      latency: list[float], answers: list) -> None:
    """One client: a keep-alive connection sending the next request once answered."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while todo:
            i = todo.pop()
            t0 = time.perf_counter()
            writer.write(requests[i])
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
            body = await reader.readexactly(length)
            latency[i] = time.perf_counter() - t0
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"{head[:40]!r}: {body[:300]!r}")
            answers[i] = json.loads(body)["vlmbatch"]["p_yes"]
    finally:
        writer.close()


async def _clients(port: int, requests: list[bytes], n: int) -> tuple[float, list[float], list]:
    """``n`` clients taking ``requests`` in order from one list; (seconds, latencies,
    P(yes))."""
    todo = list(range(len(requests)))[::-1]  # popped from the end: in order
    latency: list[float] = [0.0] * len(requests)
    answers: list = [None] * len(requests)
    start = time.perf_counter()
    await asyncio.gather(*(_connection(port, todo, requests, latency, answers)
                           for _ in range(n)))
    return time.perf_counter() - start, latency, answers


def served(bodies: list[bytes], warm: list[bytes], n: int, threads: int,
           engines: int) -> tuple:
    """Seconds, latencies, P(yes), the server's CPU seconds (engine processes included)
    and the client loop's, of one served round on ``--engines engines``."""
    with tempfile.TemporaryDirectory(prefix="vlmbatch-bench-serve-") as tmp:
        s = Server(Path(tmp) / "data", "--threads", str(threads), "--engines", str(engines),
                   key=None).wait_ready(300)
        try:
            asyncio.run(_clients(s.port, warm, min(n, len(warm))))
            cpu0, server0 = time.process_time(), server_cpu(s.proc.pid)
            secs, lat, p = asyncio.run(_clients(s.port, bodies, n))
            return (secs, lat, p, server_cpu(s.proc.pid) - server0,
                    time.process_time() - cpu0)
        finally:
            s.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--images", type=int, default=60)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--threads", type=int, default=2, help="torch threads, offline")
    ap.add_argument("--server-threads", type=int, default=None,
                    help="the server's torch threads (default: --threads); its event loop "
                    "and request threads need CPU too")
    ap.add_argument("--engines", type=int, nargs="+", default=[1, 0],
                    help="the served layouts, side by side: engine processes (the server's "
                    "--engines; 0: the engine thread in the HTTP process)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--check-tol", type=float, default=1e-6,
                    help="bound on |served - offline P(yes)| per question; exit 1 past it")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    items = easy_vqa_set("test").items[: args.images]
    warm_items = easy_vqa_set("train").items[:16]
    bodies, warm = encoded(requests_of(items)[0]), encoded(requests_of(warm_items)[0])
    n = len(bodies)
    best: dict[str, tuple] = {}
    for _ in range(args.rounds):
        row = offline(items, warm_items, args.threads)
        if "offline" not in best or row[0] < best["offline"][0]:
            best["offline"] = row
        for c in args.clients:
            for e in args.engines:
                row = served(bodies, warm, c, args.server_threads or args.threads, e)
                name = f"{c} cl. e{e}"
                if name not in best or row[0] < best[name][0]:
                    best[name] = row
    report(best, n, len(items), args).exit()


def report(best: dict[str, tuple], n: int, images: int, args: argparse.Namespace) -> Checks:
    """QPM and its ratio to offline (wall clock), latencies, and CPU milliseconds per
    question (the server's process, or the offline run's, plus the client loop's): on a
    shared machine wall clock follows the load, CPU time much less."""
    t_off, _, p_off, cpu_off, _ = best["offline"]
    checks = Checks()
    print(f"easy-vqa test: {images} images, {n} yes/no questions, torch threads: offline "
          f"{args.threads}, server {args.server_threads or args.threads}; built-in model; "
          f"best of {args.rounds} rounds; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'row':<12}{'seconds':>9}{'QPM':>9}{'x offline':>11}{'p50 ms':>9}{'p99 ms':>9}"
          f"{'CPU ms/q':>10}{'+client':>9}{'x offline':>11}{'max |dP|':>10}")
    for name, (secs, lat, p, cpu, client) in best.items():
        p50 = f"{1000 * statistics.median(lat):.1f}" if lat else "-"
        p99 = f"{1000 * sorted(lat)[int(0.99 * (len(lat) - 1))]:.1f}" if lat else "-"
        dp = max(abs(a - b) for a, b in zip(p, p_off))
        checks.verdict(dp <= args.check_tol, f"{name}: served P(yes) = offline within "
                       f"{args.check_tol:g}: max |dP| = {dp:.1e}")
        print(f"{name:<12}{secs:>9.2f}{60 * n / secs:>9.0f}{t_off / secs:>11.2f}{p50:>9}"
              f"{p99:>9}{1000 * cpu / n:>10.2f}{1000 * client / n:>9.2f}"
              f"{cpu_off / (cpu + client):>11.2f}{dp:>10.1e}")
    print(f"check: served P(yes) = offline within {args.check_tol:g} on every row: "
          f"{'FAILED' if checks.failed else 'OK'}")
    return checks


if __name__ == "__main__":
    main()
