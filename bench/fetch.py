"""Fetch-stage benchmark: `vlmbatch run` over the same images as local files, as http:// URLs
that a server on loopback answers only after ``--latency-ms`` (50) each, at
``--fetch-concurrency`` (64) and at a low concurrency for contrast, as a Parquet table of their
bytes (read by row reference in the workers), as WebDataset shards on disk and as the same
shards over HTTP (one range read per member; at once and after ``--latency-ms`` each), side by
side in one process.

The HTTP server (``python -m tests.loopback DIR``, ``tests/loopback.py``) runs in a process of
its own, so the run shares no GIL with it and its CPU is not counted as ours; nothing leaves
127.0.0.1. Images: ``--images`` synthetic photo-like JPEGs (``--size``, quality 90), 2
questions each, the built-in model. Each row's time is the answering loop's (model loading
excluded), best of ``--rounds`` interleaved rounds, each starting at another row.

Beside the time: this process's CPU ms per image split by thread (``bench/thread_cpu.py``: the
fetch stage's threads, the decoder processes' handoff threads, the main thread (the drive and
the model's Python), torch's native threads) and its decoder processes' (mean over rounds;
the fetch stage's moves little with load, the model's does: torch's threads spin while they
wait for a core), the HTTP server's (not ours), and the server's counts: requests per image
and the most in flight at once. Checks (exit 1): every round of every row answers exactly as
the local-files row does, id for id; each http image, and each shard member over http, is
requested exactly once (a shard once more, listed when the run starts); the http row at
``--fetch-concurrency`` had that many requests in flight at once and reaches ``--min-ratio``
x local QPM.

    python bench/fetch.py                                  # CPU
    python bench/fetch.py --images 512 --device cuda --dtype bfloat16

Not a test: timings on shared machines are noisy; compare the rows of one run.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.checks import Checks  # noqa: E402
from bench.thread_cpu import CpuSplit, ThreadCpu, process_cpu  # noqa: E402
from vlmbatch.cli.run import run  # noqa: E402
from vlmbatch.engine.config import ModelConfig  # noqa: E402
from vlmbatch.jobs.config import RunConfig  # noqa: E402
from vlmbatch.pipeline.config import PrepareConfig  # noqa: E402

QUESTIONS = ["Is there a red shape?", "Is there a circle?"]


def make_images(folder: Path, n: int, size: tuple[int, int]) -> list[Path]:
    """n JPEGs of ``size`` (w, h): smooth noise and a few discs, quality 90."""
    rng = np.random.default_rng(0)
    w, h = size
    paths = []
    for i in range(n):
        small = rng.integers(0, 256, (max(h // 40, 2), max(w // 40, 2), 3), dtype=np.uint8)
        img = cv2.resize(small, (w, h), interpolation=cv2.INTER_CUBIC)
        for _ in range(3):
            centre = (int(rng.integers(0, w)), int(rng.integers(0, h)))
            colour = tuple(int(c) for c in rng.integers(0, 256, 3))
            cv2.circle(img, centre, int(rng.integers(h // 10, h // 3)), colour, -1)
        paths.append(folder / f"{i:05d}.jpg")
        cv2.imwrite(str(paths[-1]), img, [cv2.IMWRITE_JPEG_QUALITY, 90])
    return paths


def write_manifest(path: Path, images: list[Path], where: Callable[[Path], str]) -> Path:
    path.write_text("".join(json.dumps({"id": p.stem, "image": where(p)}) + "\n"
                            for p in images))
    return path


def write_parquet(path: Path, images: list[Path]) -> Path:
    import pyarrow as pa  # optional dependency (the parquet extra): this row only
    import pyarrow.parquet as pq  # optional dependency, as above

    table = pa.table({"id": [p.stem for p in images], "image": [p.read_bytes() for p in images]})
    pq.write_table(table, path, row_group_size=64)
    return path


def write_shards(folder: Path, images: list[Path], per_shard: int) -> str:
    """Shards ``00000.tar``.. of ``KEY.jpg`` + ``KEY.json`` (its id); their brace pattern."""
    folder.mkdir(parents=True, exist_ok=True)
    n = 0
    for s in range(0, len(images), per_shard):
        with tarfile.open(folder / f"{n:05d}.tar", "w") as tar:
            for p in images[s:s + per_shard]:
                for name, data in ((f"{p.stem}.jpg", p.read_bytes()),
                                   (f"{p.stem}.json", json.dumps({"id": p.stem}).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        n += 1
    return f"{{00000..{n - 1:05d}}}.tar"


def answer(cfg: RunConfig) -> tuple[float, dict[tuple[str, str], tuple]]:
    """The answering loop's seconds and (id, question) -> (answer, p_yes) of one run."""
    out = io.StringIO()
    summary = run(cfg, out)
    if summary.failed_images:  # generated images on loopback: none may fail
        raise SystemExit(f"{summary.failed_images} images failed: {out.getvalue()[:2000]}")
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    return summary.seconds, {(d["id"], d["question"]): (d["answer"], d["p_yes"]) for d in lines}


@dataclass(frozen=True)
class Server:
    """The loopback server's process and address."""
    pid: int
    base: str

    def stats(self) -> dict:
        """``requests`` so far, ``max_in_flight`` since the last call, ``cpu`` seconds so
        far (its process's, all threads)."""
        with urllib.request.urlopen(f"{self.base}/stats") as r:
            return {**json.loads(r.read()), "cpu": process_cpu(self.pid)}


def start_server(folder: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "tests.loopback", str(folder)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def write_inputs(tmp: Path, images: list[Path], args: argparse.Namespace) -> str:
    """The policy, the local manifest, the table and the shards under ``tmp``; the shards'
    brace pattern."""
    (tmp / "policy.yaml").write_text("questions:\n" + "".join(f"  - {q}\n" for q in QUESTIONS))
    write_manifest(tmp / "local.jsonl", images, str)
    write_parquet(tmp / "t.parquet", images)
    return write_shards(tmp / "shards", images, args.per_shard)


def rows(tmp: Path, images: list[Path], shards: str, base: str,
         args: argparse.Namespace) -> dict:
    """Row name -> its RunConfig (the inputs under ``tmp``, served from ``base``)."""
    policy, local, table = tmp / "policy.yaml", tmp / "local.jsonl", tmp / "t.parquet"
    slow = f"{base}/slow/{args.latency_ms}/img/"
    remote = write_manifest(tmp / "http.jsonl", images, lambda p: slow + p.name)

    def cfg(concurrency: int = args.fetch_concurrency, **inp: object) -> RunConfig:
        return RunConfig(**inp, policy=policy, images_per_batch=args.images_per_batch,
                         progress=False, prepare=PrepareConfig(fetch_concurrency=concurrency),
                         model=ModelConfig(device=args.device, dtype=args.dtype))

    ms = args.latency_ms
    return {
        "local files (manifest)": cfg(manifest=local),
        f"http://, {ms} ms each, --fetch-concurrency {args.fetch_concurrency}":
            cfg(manifest=remote),
        f"http://, {ms} ms each, --fetch-concurrency {args.low_concurrency}":
            cfg(args.low_concurrency, manifest=remote),
        "Parquet, a bytes column (local)": cfg(dataset=str(table), id_column="id"),
        "WebDataset shards (local)": cfg(dataset=str(tmp / "shards" / shards)),
        "WebDataset shards over http:// (no delay)": cfg(dataset=f"{base}/img/shards/{shards}"),
        f"WebDataset shards over http://, {ms} ms each":
            cfg(dataset=f"{base}/slow/{ms}/shards/{shards}"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--size", default="640x480", help="WxH of each JPEG")
    ap.add_argument("--latency-ms", type=int, default=50)
    ap.add_argument("--fetch-concurrency", type=int, default=64)
    ap.add_argument("--low-concurrency", type=int, default=4)
    ap.add_argument("--per-shard", type=int, default=64)
    ap.add_argument("--images-per-batch", type=int, default=16)
    ap.add_argument("--torch-threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-ratio", type=float, default=0.9,
                    help="check: the http row at --fetch-concurrency reaches this x local QPM")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads)
    w, h = (int(x) for x in args.size.split("x"))
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        (tmp / "img").mkdir()
        images = make_images(tmp / "img", args.images, (w, h))
        shards = write_inputs(tmp, images, args)
        proc, base = start_server(tmp)  # serves tmp: /img/img/NAME, /img/shards/...
        try:
            configs = rows(tmp, images, shards, base, args)
            with ThreadCpu() as cpu:
                got = measure(configs, args.rounds, cpu, Server(proc.pid, base))
        finally:
            proc.kill()
            proc.wait()
    report(got, args)


@dataclass
class Row:
    """One row's rounds: the answering loop's seconds, answers, CPU split, and the server's
    requests (each round's), most requests in flight at once and CPU seconds (all rounds)."""
    seconds: list[float]
    outputs: list[dict]
    cpu: list[CpuSplit]
    requests: int
    max_in_flight: int
    server_cpu: float


def measure(configs: dict, rounds: int, cpu: ThreadCpu, server: Server) -> dict[str, Row]:
    cpu.measure(lambda: answer(next(iter(configs.values()))))  # warm-up: model load, ...
    got: dict[str, Row] = {}
    names = list(configs)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # no row always first
            before = server.stats()
            (secs, out), split = cpu.measure(lambda: answer(configs[name]))  # noqa: B023
            after = server.stats()
            row = got.setdefault(name, Row([], [], [], 0, 0, 0.0))
            row.seconds.append(secs)
            row.cpu.append(split)
            row.outputs.append(out)
            row.requests = after["requests"] - before["requests"]  # the same each round
            row.max_in_flight = max(row.max_in_flight, after["max_in_flight"])
            row.server_cpu += after["cpu"] - before["cpu"]
    return got


def cpu_table(got: dict[str, Row], images: int) -> None:
    """CPU ms per image, mean over rounds, this process by thread and its decoders."""
    kinds = sorted({k for row in got.values() for c in row.cpu for k in c.threads},
                   key=lambda k: (k != "main", k != "native", k))
    print("\nCPU ms per image (mean over rounds): this process, by thread; its decoder "
          "processes; the HTTP server's (its own process, not ours: on a small machine it "
          "competes for the cores); the server's requests per image and most in flight at "
          "once\n")
    print("| input | this process | " + " | ".join(kinds) + " | decoder processes | "
          "server (not ours) | requests/image | max in flight |")
    print("|---|---|" + "---|" * len(kinds) + "---|---|---|---|")
    for name, row in got.items():
        per = [statistics.mean(c.threads.get(k, 0.0) for c in row.cpu) * 1e3 / images
               for k in kinds]
        mean = statistics.mean
        print(f"| {name} | {mean(c.process for c in row.cpu) * 1e3 / images:.2f} | "
              + " | ".join(f"{x:.2f}" for x in per)
              + f" | {mean(c.children for c in row.cpu) * 1e3 / images:.2f} | "
              f"{row.server_cpu / len(row.cpu) * 1e3 / images:.2f} | "
              f"{row.requests / images:.2f} | {row.max_in_flight} |")


def report(got: dict[str, Row], args: argparse.Namespace) -> None:
    names = list(got)
    best = {n: min(got[n].seconds) for n in names}
    q = len(QUESTIONS) * args.images
    print(f"\n{args.images} JPEGs ({args.size}), {q} questions, built-in model, {args.device} "
          f"{args.dtype}, {args.torch_threads} torch threads, {args.images_per_batch} images "
          f"per group, best of {args.rounds} rounds (the answering loop: model loading "
          "excluded)\n")
    print("| input | seconds | QPM | vs local files |")
    print("|---|---|---|---|")
    for n in names:
        print(f"| {n} | {best[n]:.2f} | {60 * q / best[n]:,.0f} | "
              f"{best[names[0]] / best[n]:.2f}x |")
    cpu_table(got, args.images)
    checks = Checks()
    same = all(o == got[names[0]].outputs[0] for n in names for o in got[n].outputs)
    ratio = best[names[0]] / best[names[1]]
    shards = -(-args.images // args.per_shard)
    http = {n: args.images for n in names if n.startswith("http://")}
    http |= {n: args.images + shards for n in names if " shards over http://" in n}
    once = all(got[n].requests == want for n, want in http.items())
    want, peak = min(args.fetch_concurrency, args.images), got[names[1]].max_in_flight
    print(f"\ncheck: every round's answers = the local files' (id, question, answer, p_yes): "
          f"{checks.verdict(same, 'answers identical across rows')}")
    print(f"check: each image over http:// requested once ({[got[n].requests for n in http]} "
          f"requests, want {list(http.values())}: {args.images} images, and each of {shards} "
          f"shards listed once): {checks.verdict(once, 'each http image requested once')}")
    print(f"check: {names[1]} had {want} requests in flight at once ({peak}): "
          f"{checks.verdict(peak >= want, f'{peak} of {want} requests in flight at once')}")
    print(f"check: {names[1]} >= {args.min_ratio}x local QPM ({ratio:.2f}x): "
          f"{checks.verdict(ratio >= args.min_ratio, f'http QPM {ratio:.2f}x local')}")
    checks.exit()


if __name__ == "__main__":
    main()
