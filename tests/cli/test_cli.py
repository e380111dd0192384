"""The ``vlmbatch`` command end to end: results, item errors, bad input, exit codes."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from csv import DictReader
from pathlib import Path

import cv2
import numpy as np
import pytest

from tests.waiting import wait_until
from vlmbatch.cli.commands import EXIT_BAD_INPUT, EXIT_ITEM_ERRORS, EXIT_OK
from vlmbatch.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def png(path: Path, h: int = 60, w: int = 90) -> bytes:
    img = np.random.default_rng(h * w).integers(0, 256, (h, w, 3), dtype=np.uint8)
    ok, buf = cv2.imencode(".png", img)
    assert ok
    path.write_bytes(buf.tobytes())
    return buf.tobytes()


@pytest.fixture()
def job(tmp_path: Path) -> Path:
    data = png(tmp_path / "good.png")
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "text.png").write_text("hello")
    (tmp_path / "trunc.png").write_bytes(data[: len(data) // 3])
    from PIL import Image

    Image.new("1", (12_000, 10_000)).save(tmp_path / "huge.png")  # 120 MP in a few KB
    lines = [
        {"id": "good", "image": "good.png", "questions": ["Is there a red shape?"]},
        {"id": "data", "image": "data:image/png;base64," + base64.b64encode(data).decode()},
        {"id": "missing", "image": "nope.png"},
        {"id": "empty", "image": "empty.png"},
        {"id": "text", "image": "text.png"},
        {"id": "trunc", "image": "trunc.png"},
        {"id": "ftp", "image": "ftp://example.com/a.png"},  # http(s) is fetched
        {"id": "huge", "image": "huge.png"},
    ]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (tmp_path / "p.yaml").write_text("questions:\n  - {id: c, text: Does it contain a circle}\n")
    return tmp_path


def test_run_with_item_errors(job: Path, random_model_dir: Path) -> None:
    out = job / "out.jsonl"
    rc = main(["run", str(job / "m.jsonl"), "--policy", str(job / "p.yaml"), "--model",
               str(random_model_dir), "--out", str(out), "--no-progress"])
    assert rc == EXIT_ITEM_ERRORS
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 2 + 7  # good: own question + policy; the rest: policy only
    by_id = {}
    for r in rows:
        by_id.setdefault(r["id"], []).append(r)
    for r in by_id["good"] + by_id["data"]:
        assert r["error"] is None and r["answer"] in ("yes", "no") and 0 <= r["p_yes"] <= 1
        assert r["answer"] == ("yes" if r["p_yes"] >= 0.5 else "no")
        assert r["image_tokens"] > 0
    assert by_id["good"][1]["p_yes"] == by_id["data"][0]["p_yes"]  # same pixels, same answer
    reasons = {"missing": "not found", "empty": "empty", "text": "not a decodable",
               "trunc": "not a decodable", "ftp": "scheme 'ftp'",
               "huge": "over the limit"}
    for item, reason in reasons.items():
        (r,) = by_id[item]
        assert r["answer"] is None and reason in r["error"], r


def test_all_ok_exit_code(job: Path, random_model_dir: Path, capsys) -> None:  # noqa: ANN001
    good = job / "good.jsonl"
    good.write_text(json.dumps({"id": "g", "image": "good.png", "questions": ["Red?"]}) + "\n")
    rc = main(["run", str(good), "--model", str(random_model_dir), "--no-progress"])
    assert rc == EXIT_OK
    (row,) = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert row["id"] == "g" and row["error"] is None


def test_folder_input(job: Path, random_model_dir: Path) -> None:
    out = job / "f.jsonl"
    rc = main(["run", "--images", str(job), "--policy", str(job / "p.yaml"), "--model",
               str(random_model_dir), "-o", str(out), "--no-progress"])
    assert rc == EXIT_ITEM_ERRORS  # the folder holds the broken files too
    assert {json.loads(x)["id"] for x in out.read_text().splitlines()} == {
        "good.png", "empty.png", "text.png", "trunc.png", "huge.png"}


def test_malformed_manifest_fails_before_work(job: Path, random_model_dir: Path,
                                              capsys) -> None:  # noqa: ANN001
    bad = job / "bad.jsonl"
    bad.write_text('{"image": "good.png", "questions": ["q"]}\n{"image": 3}\n')
    out = job / "never.jsonl"
    rc = main(["run", str(bad), "--model", str(random_model_dir), "-o", str(out)])
    assert rc == EXIT_BAD_INPUT
    assert "bad.jsonl:2:" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("extra,says", [
    ({"question": ["Is it red?"]}, "unknown key(s) ['question'] (did you mean 'questions'?)"),
    ({"qestions": ["Is it red?"]}, "unknown key(s) ['qestions'] (did you mean 'questions'?)"),
    ({"questions": ["Is it red?"], "treshold": 0.3},
     "unknown key(s) ['treshold'] ('threshold' is a key of a question object"),
])
def test_a_misspelt_key_fails_the_run_with_a_policy(job: Path, random_model_dir: Path,
                                                    extra: dict, says: str,
                                                    capsys: pytest.CaptureFixture) -> None:
    """With --policy, a line whose questions sit under a misspelt key still has questions
    (the policy's): it ran, exit 0, its own questions silently dropped. Now exit 2 before any
    work, naming the line, the key and the keys a line has."""
    bad = job / "bad.jsonl"
    bad.write_text(json.dumps({"id": "g", "image": "good.png", "questions": ["q"]}) + "\n"
                   + json.dumps({"id": "ok", "image": "good.png", **extra}) + "\n")
    out = job / "never.jsonl"
    rc = main(["run", str(bad), "--policy", str(job / "p.yaml"), "--model",
               str(random_model_dir), "-o", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == EXIT_BAD_INPUT, err
    assert f"bad.jsonl:2: {says}" in err and "a manifest line has ['fps', 'id', 'image', " \
        "'images', 'max_frames', 'max_video_tokens', 'num_frames', 'per_image', 'questions', " \
        "'segment_seconds', 'segment_stride', 'video']" in err
    assert not out.exists()


def test_label_sets_first_token_clash_fails_before_work(job: Path, random_model_dir: Path,
                                                         capsys) -> None:  # noqa: ANN001
    """``--choice-scoring first-token`` with two choices that start with the same token is
    bad input naming them, for ``run`` and ``submit``, before any work; exact scoring runs
    the same label set, and a CSV row holds its maps as JSON text."""
    m = job / "labels.jsonl"
    m.write_text(json.dumps({"id": "good", "image": "good.png", "questions": [
        {"id": "c", "text": "Which?", "choices": ["red", "red shape", "blue"]}]}) + "\n")
    out = job / "never.jsonl"
    for argv in (["run", str(m), "-o", str(out)], ["submit", str(m), "--job", str(job / "j")]):
        rc = main([*argv, "--model", str(random_model_dir), "--choice-scoring", "first-token"])
        assert rc == EXIT_BAD_INPUT
        assert "'red' and 'red shape'" in capsys.readouterr().err
    assert not out.exists() and not (job / "j").exists()
    csv = job / "r.csv"
    assert main(["run", str(m), "--model", str(random_model_dir), "-o", str(csv),
                 "--no-progress"]) == EXIT_OK
    with csv.open(newline="") as f:
        (row,) = list(DictReader(f))
    probs = json.loads(row["probs"])
    assert list(probs) == ["red", "red shape", "blue"] and row["label"] == row["answer"]
    assert row["label"] == max(probs, key=probs.__getitem__) and row["p_yes"] == ""


def test_unknown_model(job: Path, capsys) -> None:  # noqa: ANN001
    rc = main(["run", str(job / "m.jsonl"), "--policy", str(job / "p.yaml"), "--model",
               str(job / "no_such_model")])
    assert rc == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "config.json" in err and "--model" in err


def test_help_lists_commands() -> None:
    r = subprocess.run([sys.executable, "-m", "vlmbatch", "--help"], capture_output=True,
                       text=True, cwd=ROOT, check=True)
    assert "run" in r.stdout and "eval" in r.stdout and "yes/no" in r.stdout


def test_engine_failure_fails_its_group_only(job: Path) -> None:
    from vlmbatch.inputs.manifest import read_manifest
    from vlmbatch.pipeline.drive import answer_group
    from vlmbatch.pipeline.questions import Question
    from vlmbatch.pipeline.records import ErrorKind
    from vlmbatch.preprocessing.prepare import TilingConfig

    class Broken:
        image_plan = TilingConfig(tile_size=56)
        video_plan = None  # the Engine interface's default: no clips

        def score(self, images, requests):  # noqa: ANN001, ANN202
            raise RuntimeError("CUDA out of memory")

    items = read_manifest(job / "m.jsonl", (Question("c", "Circle?"),))[:2]
    answers = answer_group(Broken(), items)  # type: ignore[arg-type]
    assert len(answers) == 3
    assert all(a.answer is None and "out of memory" in a.error for a in answers)
    assert {a.error_kind for a in answers} == {ErrorKind.ENGINE}


def test_out_directory_is_created(job: Path, random_model_dir: Path) -> None:
    good = job / "good.jsonl"
    good.write_text(json.dumps({"id": "g", "image": "good.png", "questions": ["Red?"]}) + "\n")
    out = job / "new" / "dir" / "r.jsonl"
    assert main(["run", str(good), "--model", str(random_model_dir), "-o", str(out),
                 "--no-progress"]) == EXIT_OK
    assert out.is_file()


def test_bad_option_is_bad_input(job: Path, random_model_dir: Path, capsys) -> None:  # noqa: ANN001
    rc = main(["run", str(job / "m.jsonl"), "--policy", str(job / "p.yaml"), "--model",
               str(random_model_dir), "--yes", "zzqqxx", "--no-progress"])
    assert rc == EXIT_BAD_INPUT and "single token" in capsys.readouterr().err


def test_summary_reports_graph_memory_only_when_graphs_ran() -> None:
    from vlmbatch.cli.run import RunSummary
    from vlmbatch.engine.base import EngineSummary

    base = dict(images=2, questions=4, failed_images=0, failed_questions=0, seconds=1.0)
    assert "CUDA graphs" not in RunSummary(**base, engine=EngineSummary(40, 80, 0.5)).text()
    text = RunSummary(**base, engine=EngineSummary(40, 80, 0.5, 7, 3 << 20)).text()
    assert text.endswith("; vision CUDA graphs: 7 batch sizes, 3 MiB")


@pytest.mark.parametrize("device,says", [("tpu", "not supported: use cpu, cuda or cuda:N"),
                                         ("cuda:x", "not supported")])
def test_bad_device_is_named(device: str, says: str, capsys: pytest.CaptureFixture) -> None:
    rc = main(["run", str(ROOT / "examples/manifest.jsonl"), "--device", device])
    assert rc == EXIT_BAD_INPUT and says in capsys.readouterr().err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_says_what_to_do(capsys: pytest.CaptureFixture) -> None:
    rc = main(["run", str(ROOT / "examples/manifest.jsonl"), "--device", "cuda"])
    err = capsys.readouterr().err
    assert rc == EXIT_BAD_INPUT and "--device cuda: torch" in err and "--device cpu" in err


def test_relative_images_folder(job: Path, random_model_dir: Path, monkeypatch) -> None:  # noqa: ANN001
    """`--images sub/dir` given relative to the working directory (every image used to fail:
    the folder was joined twice)."""
    (job / "imgs").mkdir()
    png(job / "imgs" / "a.png")
    monkeypatch.chdir(job)
    out = job / "r.jsonl"
    assert main(["run", "--images", "imgs", "--policy", "p.yaml", "--model",
                 str(random_model_dir), "-o", str(out), "--no-progress"]) == EXIT_OK
    (line,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert line["id"] == "a.png" and line["error"] is None


@pytest.mark.parametrize("out,says,extra", [
    (".", "is a folder", []), ("m.jsonl", "is the manifest", []),
    ("p.yaml", "is the policy", []), ("r.parquet", "`run` streams JSONL or CSV", []),
    ("m.jsonl", "is the manifest", ["--executor", "ray"])])
def test_bad_out_fails_before_work(job: Path, random_model_dir: Path, capsys,  # noqa: ANN001
                                   out: str, says: str, extra: list[str]) -> None:
    before = (job / "m.jsonl").read_text(), (job / "p.yaml").read_text()
    rc = main(["run", str(job / "m.jsonl"), "--policy", str(job / "p.yaml"), "--model",
               str(random_model_dir), "-o", str(job / out), "--no-progress", *extra])
    assert rc == EXIT_BAD_INPUT and says in capsys.readouterr().err
    assert ((job / "m.jsonl").read_text(), (job / "p.yaml").read_text()) == before


def test_unwritable_out_is_a_message_not_a_traceback(job: Path, random_model_dir: Path,
                                                     capsys) -> None:  # noqa: ANN001
    rc = main(["run", str(job / "m.jsonl"), "--policy", str(job / "p.yaml"), "--model",
               str(random_model_dir), "-o", str(job / "good.png" / "r.jsonl"),
               "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("vlmbatch: error: ") and "good.png" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv", [["run", "x.jsonl", "--threads", "-1"],
                                  ["eval", "--limit", "0"],
                                  ["export-vit", "--out", "o", "--opset", "5"]])
def test_out_of_range_options_are_usage_errors(argv: list[str], capsys) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "error: " in capsys.readouterr().err


def test_folder_given_as_manifest_points_to_images(job: Path, capsys) -> None:  # noqa: ANN001
    assert main(["run", str(job), "--policy", str(job / "p.yaml")]) == EXIT_BAD_INPUT
    assert "--images DIR" in capsys.readouterr().err


@pytest.mark.parametrize("argv,says", [
    (["--address", "head:1"], "--address: Ray executor options; add --executor ray"),
    (["--ignore-eos"], "give max_new_tokens (--max-new-tokens N) too"),
    (["--executor", "ray", "--preprocess-threads", "4"], "use --preprocess-workers"),
    (["--executor", "ray", "--threads", "4"], "runs --model-cpus torch threads")])
def test_options_that_would_do_nothing_are_refused(argv: list[str], says: str,
                                                   capsys) -> None:  # noqa: ANN001
    assert main(["run", str(ROOT / "examples/manifest.jsonl"), *argv]) == EXIT_BAD_INPUT
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("sig, rc, says", [("SIGINT", 130, "interrupted"),
                                           ("SIGTERM", 143, "terminated (SIGTERM)")])
def test_ctrl_c_keeps_lines_and_says_how_to_resume(tmp_path: Path, sig: str, rc: int,
                                                   says: str) -> None:
    """SIGINT or SIGTERM mid-run: exit 130 or 143, every line written parses, and the
    message points to jobs. A fault hook holds each group 0.3 s, so the run is always still
    going when the signal comes (200 groups)."""
    import os
    import signal

    lines = []
    for i in range(200):
        png(tmp_path / f"{i}.png", 40 + i % 50, 60)
        lines.append({"id": str(i), "image": f"{i}.png", "questions": ["Red?", "Round?"]})
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "r.jsonl"
    p = subprocess.Popen([sys.executable, "-m", "tests.faults", '{"group_delay": 0.3}', "--",
                          "run", str(tmp_path / "m.jsonl"), "-o", str(out),
                          "--images-per-batch", "1", "--no-progress"], cwd=ROOT,
                         stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    wait_until(lambda: out.exists() and out.stat().st_size > 0, 60, f"a line in {out}")
    p.send_signal(getattr(signal, sig))
    _, err = p.communicate(timeout=60)
    assert p.returncode == rc and f"vlmbatch: {says}" in err and "vlmbatch submit" in err
    text = out.read_text()
    got = [json.loads(x) for x in text.splitlines()]
    assert 0 < len(got) < 400 and text.endswith("\n")


def test_os_errors_named_by_the_user_are_messages_others_tracebacks(monkeypatch, capsys) -> None:  # noqa: ANN001
    import errno

    import vlmbatch.cli.commands as commands

    def fail(code: int):  # noqa: ANN202
        def cmd(a, hooks) -> int:  # noqa: ANN001
            raise OSError(code, "boom")
        return cmd

    monkeypatch.setattr(commands, "cmd_status", fail(errno.ENOSPC))  # COMMANDS reads it live
    assert main(["status", "j"]) == 1
    assert capsys.readouterr().err == "vlmbatch: error: boom\n"
    monkeypatch.setattr(commands, "cmd_status", fail(errno.EMFILE))  # a bug, not the user's
    with pytest.raises(OSError):
        main(["status", "j"])


def test_a_question_can_ask_for_an_explanation(tmp_path: Path) -> None:
    """A policy question with its own max_new_tokens gets a text answer; the others only
    P(yes), unchanged. The built-in model answers 'yes'/'no' in words, so a text landing on
    another row of the batch would disagree with that row's answer."""
    policy = tmp_path / "p.yaml"
    policy.write_text("questions:\n"
                      '  - {id: red, text: "Is there a red shape?", max_new_tokens: 4}\n'
                      '  - {id: circle, text: "Does the image contain a circle?"}\n'
                      '  - {id: several, text: "Is there more than one shape?", '
                      "max_new_tokens: 2}\n")
    outs = {}
    for name, extra in (("mixed", []), ("all", ["--max-new-tokens", "4"]), ("none", [])):
        out = tmp_path / f"{name}.jsonl"
        pol = policy if name == "mixed" else ROOT / "examples/policy.yaml"
        assert main(["run", str(ROOT / "examples/manifest.jsonl"), "--policy", str(pol),
                     "-o", str(out), "--no-progress", *extra]) == EXIT_OK
        outs[name] = [json.loads(x) for x in out.read_text().splitlines()]
    for got, every, plain in zip(outs["mixed"], outs["all"], outs["none"]):
        assert (got["p_yes"], got["answer"]) == (plain["p_yes"], plain["answer"])
        if got["question_id"] in ("red", "several"):  # the manifest's own q0, q1: no text
            assert got["text"] == every["text"] == got["answer"], (got, every)
        else:
            assert "text" not in got
    assert {ln["text"] for ln in outs["mixed"] if "text" in ln} == {"yes", "no"}
