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
P(yes) is checked against the offline one: both are the 6-decimal values every output shows,
so a difference is a whole number of 1e-6 steps, compared with ``<= --check-tol`` (1e-6: one
step of the rounding) once the float noise of subtracting two 6-decimal numbers is rounded
off (to 1e-9); the script exits 1 after its table when a row is not within it, naming it on
stderr. Also CPU milliseconds per question: the HTTP process's (all its threads), its engine
processes', and the client loop's, against the offline run's; on a shared machine wall clock
swings with other work, CPU time much less.

``--profile DIR``: every thread of the offline run, the HTTP process and the engine
processes under cProfile (``bench/profiling/sitecustomize.py``); each row's Python calls per
question are printed (a count: the machine's load does not move it) and the profiles kept
in DIR (``python -m pstats DIR/ROW/PID.prof``).

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
import cProfile
import json
import os
import pstats
import re
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vlmbatch  # noqa: E402
from bench.checks import Checks  # noqa: E402
from tests.server.serving import Server, chat_body, engine_pids  # noqa: E402
from vlmbatch.cli.evaluate import easy_vqa_set  # noqa: E402

PROFILING = Path(__file__).resolve().parent / "profiling"  # its sitecustomize.py


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


def server_cpu(pid: int) -> tuple[float, float]:
    """CPU seconds of the server: its HTTP process, and its engine processes (children
    running ``engine_process``, whichever thread started them); decoder processes are not
    counted, as the offline row's are not."""
    engine = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except FileNotFoundError:
            continue
        for c in children:
            try:
                if b"engine_process" in Path(f"/proc/{c}/cmdline").read_bytes():
                    engine += proc_cpu(int(c))
            except FileNotFoundError:
                continue
    return proc_cpu(pid), engine


def calls(folder: Path) -> dict[str, int]:
    """Python calls recorded by the profiles in ``folder``: by process ("http", "engine",
    or "offline")."""
    out: dict[str, int] = {}
    for prof in folder.glob("*.prof"):
        cmd = prof.with_suffix(".cmd").read_text() if prof.with_suffix(".cmd").exists() else ""
        kind = ("engine" if "engine_process" in cmd else "decoder" if "decoder_process" in cmd
                else "http" if cmd else "offline")
        out[kind] = out.get(kind, 0) + pstats.Stats(str(prof)).total_calls  # type: ignore[attr-defined]
    return out


def offline(items: list, warm: list, threads: int, profile: Path | None) -> Row:
    """One offline round (fresh engine, warmed on ``warm``)."""
    vlm = vlmbatch.VLM(threads=threads)
    list(vlm.ask_many(warm))
    prof = cProfile.Profile() if profile is not None else None
    cpu0, start = time.process_time(), time.perf_counter()
    if prof is not None:
        prof.enable()
    p = [a.p_yes for a in vlm.ask_many(items)]
    if prof is not None:
        prof.disable()
    secs, cpu = time.perf_counter() - start, time.process_time() - cpu0
    if prof is not None and profile is not None:
        profile.mkdir(parents=True, exist_ok=True)
        prof.dump_stats(str(profile / "offline.prof"))
    return Row(secs, [], p, cpu, 0.0, 0.0, calls(profile) if profile else {})


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


@dataclass
class Row:
    secs: float
    latency: list[float]
    p_yes: list
    cpu: float  # the offline run's, or the HTTP process's (seconds)
    engine_cpu: float  # the engine processes'
    client_cpu: float  # the client loop's
    calls: dict[str, int]  # Python calls by process (--profile; the whole server life)


def served(bodies: list[bytes], warm: list[bytes], n: int, threads: int,
           engines: int, profile: Path | None) -> Row:
    """One served round on ``--engines engines``."""
    if profile is not None:  # every process of the server under cProfile, from its start
        os.environ["VLMBATCH_BENCH_PROFILE"] = str(profile)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(PROFILING), *filter(None, [os.environ.get("PYTHONPATH")])])
    try:
        with tempfile.TemporaryDirectory(prefix="vlmbatch-bench-serve-") as tmp:
            s = Server(Path(tmp) / "data", "--threads", str(threads), "--engines",
                       str(engines), key=None).wait_ready(300)
            try:
                asyncio.run(_clients(s.port, warm, min(n, len(warm))))
                if profile is not None:  # the profiles count the measured round from here
                    for pid in [s.proc.pid, *engine_pids(s)]:
                        os.kill(pid, signal.SIGUSR1)
                    time.sleep(0.5)
                cpu0, (http0, engine0) = time.process_time(), server_cpu(s.proc.pid)
                secs, lat, p = asyncio.run(_clients(s.port, bodies, n))
                http1, engine1 = server_cpu(s.proc.pid)
                client = time.process_time() - cpu0
            finally:
                s.stop()
    finally:
        os.environ.pop("VLMBATCH_BENCH_PROFILE", None)
    return Row(secs, lat, p, http1 - http0, engine1 - engine0, client,
               calls(profile) if profile else {})


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
                    help="bound on |served - offline P(yes)| per question, both rounded to 6 "
                    "decimals as every output shows them (a whole number of 1e-6 steps); "
                    "exit 1 past it")
    ap.add_argument("--profile", type=Path, default=None, metavar="DIR",
                    help="profile every thread (cProfile) of the offline run and of the "
                    "server's processes; print Python calls per question; keep the profiles "
                    "in DIR/ROW/")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    items = easy_vqa_set("test").items[: args.images]
    warm_items = easy_vqa_set("train").items[:16]
    bodies, warm = encoded(requests_of(items)[0]), encoded(requests_of(warm_items)[0])
    n = len(bodies)
    best: dict[str, Row] = {}

    def keep(name: str, row: Row) -> None:
        if name not in best or row.secs < best[name].secs:
            best[name] = row

    def folder(name: str, r: int) -> Path | None:
        return args.profile / f"{name}-{r}" if args.profile else None

    for r in range(args.rounds):
        keep("offline", offline(items, warm_items, args.threads, folder("offline", r)))
        for c in args.clients:
            for e in args.engines:
                keep(f"{c} cl. e{e}", served(bodies, warm, c, args.server_threads
                                             or args.threads, e, folder(f"{c}cl-e{e}", r)))
    report(best, n, len(items), args).exit()


def report(best: dict[str, Row], n: int, images: int, args: argparse.Namespace) -> Checks:
    """QPM and its ratio to offline (wall clock), latencies, and CPU milliseconds per
    question (the offline run's; the server's HTTP process, engine processes and the client
    loop): on a shared machine wall clock follows the load, CPU time much less."""
    off = best["offline"]
    checks = Checks()
    print(f"easy-vqa test: {images} images, {n} yes/no questions, torch threads: offline "
          f"{args.threads}, server {args.server_threads or args.threads}; built-in model; "
          f"best of {args.rounds} rounds; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'row':<12}{'seconds':>9}{'QPM':>9}{'x offline':>11}{'p50 ms':>9}{'p99 ms':>9}"
          f"{'CPU ms/q':>10}{'HTTP':>8}{'engine':>8}{'+client':>9}{'x offline':>11}"
          f"{'max |dP|':>10}" + (f"{'calls/q':>9}{'HTTP':>8}{'engine':>8}"
                                 if args.profile else ""))
    for name, row in best.items():
        lat = row.latency
        p50 = f"{1000 * statistics.median(lat):.1f}" if lat else "-"
        p99 = f"{1000 * sorted(lat)[int(0.99 * (len(lat) - 1))]:.1f}" if lat else "-"
        # 6-decimal values: |a - b| is a whole number of 1e-6 steps, up to float noise
        dp = round(max(abs(a - b) for a, b in zip(row.p_yes, off.p_yes)), 9)
        checks.verdict(dp <= args.check_tol, f"{name}: served P(yes) = offline within "
                       f"{args.check_tol:g}: max |dP| = {dp:.1e}")
        server = row.cpu + row.engine_cpu
        http, engine = (("-", "-") if name == "offline" else
                        (f"{1000 * row.cpu / n:.2f}", f"{1000 * row.engine_cpu / n:.2f}"))
        line = (f"{name:<12}{row.secs:>9.2f}{60 * n / row.secs:>9.0f}"
                f"{off.secs / row.secs:>11.2f}{p50:>9}{p99:>9}{1000 * server / n:>10.2f}"
                f"{http:>8}{engine:>8}{1000 * row.client_cpu / n:>9.2f}"
                f"{off.cpu / server:>11.2f}{dp:>10.1e}")
        if args.profile:
            c = row.calls
            total = sum(v for k, v in c.items() if k != "decoder")
            line += (f"{total / n:>9.0f}{c.get('http', 0) / n:>8.0f}"
                     f"{c.get('engine', 0) / n:>8.0f}")
        print(line)
    print(f"check: served P(yes) = offline within {args.check_tol:g} on every row: "
          f"{'FAILED' if checks.failed else 'OK'}")
    return checks


if __name__ == "__main__":
    main()
