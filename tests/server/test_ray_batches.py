"""``vlmbatch serve --executor ray`` on a local Ray instance: two batches in progress at
once, each a job driven on the Ray executor, one of them with an image whose prepare
worker dies (``crash_on``: the process exits as a decoder segfault would); both complete,
every request answered exactly once, the crashed one as its own error line, the others
equal to the in-process server's answers (``vlmbatch run``'s lines)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.server.serving import IMAGES, Server, batch_lines, wait_batch
from vlmbatch.cli.commands import EXIT_ITEM_ERRORS
from vlmbatch.cli.main import main

pytest.importorskip("ray")

QS = ("Is there a red shape?", "Is there a circle?")


@pytest.mark.slow  # a server, its engine process and a local Ray instance: ~2 min on 2 cores
def test_two_batches_on_ray_one_with_a_killed_prepare_worker(tmp_path: Path) -> None:
    reqs = {name: [(f"{name}{i}", (IMAGES / f"scene_{i:02d}.png").as_uri(), QS[i % 2])
                   for i in range(6)] for name in ("a", "b")}
    s = Server(tmp_path / "data", "--executor", "ray", "--model-cpus", "1",
               "--allowed-local-media-path", str(IMAGES), "--images-per-batch", "2",
               faults={"crash_on": "scene_02.png"}).wait_ready(300)
    try:
        client = s.openai()
        ids = {}
        for name, lines in reqs.items():
            f = client.files.create(file=("in.jsonl", batch_lines(lines).encode()),
                                    purpose="batch")
            ids[name] = client.batches.create(input_file_id=f.id, completion_window="24h",
                                              endpoint="/v1/chat/completions").id
        done = {name: wait_batch(client, b) for name, b in ids.items()}
        outputs = {name: (client.files.content(b.output_file_id).text.splitlines(),
                          client.files.content(b.error_file_id).text.splitlines())
                   for name, b in done.items()}
    finally:
        assert s.stop() in (0, 143), s.output()
    for name, b in done.items():
        assert b.status == "completed", (b, s.output())
        assert (b.request_counts.completed, b.request_counts.failed) == (5, 1)
        ok, errors = outputs[name]
        assert [json.loads(x)["custom_id"] for x in errors] == [f"{name}2"]
        assert "preprocessing worker died" in json.dumps(json.loads(errors[0])["error"])
        (tmp_path / f"{name}.jsonl").write_text(batch_lines(reqs[name]))
        run_out = tmp_path / f"{name}.out.jsonl"
        assert main(["run", str(tmp_path / f"{name}.jsonl"), "-o", str(run_out),
                     "--no-progress", "--images-per-batch", "2"]) in (0, EXIT_ITEM_ERRORS)
        want = {json.loads(x)["custom_id"]: json.loads(x) for x in
                run_out.read_text().splitlines()}
        for line in map(json.loads, ok):
            got_p = line["response"]["body"]["vlmbatch"]["p_yes"]
            assert got_p == pytest.approx(
                want[line["custom_id"]]["response"]["body"]["vlmbatch"]["p_yes"], abs=1e-5)
        assert sorted(json.loads(x)["custom_id"] for x in ok) == \
            sorted(c for c, _, _ in reqs[name] if c != f"{name}2")
