"""The reduction of a parted item's answers (``pipeline/parts.py``) on answers written here:
yes/no (the highest p_yes, the first of equals), label sets (the most probable choice's
part), the tags of part and item lines, and their round trip through a job store's record.
A failed clip in windows: its item's error, no part line (through ``vlmbatch run``)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.preprocessing.video_clips import FFV1_MKV, frames, make_clip
from vlmbatch.cli.commands import EXIT_ITEM_ERRORS
from vlmbatch.cli.main import main
from vlmbatch.engine.records import Score
from vlmbatch.models.paths import DEFAULT_QWEN_MODEL
from vlmbatch.pipeline.parts import reduced
from vlmbatch.pipeline.questions import Question
from vlmbatch.pipeline.records import Answer

YES = Question("q", "Red?", 0.5)
LABEL = Question("c", "Colour?", 0.5, choices=("red", "blue"))


def yes(p: float) -> Answer:
    return Answer.scored("x", YES, Score(p, p - 0.5, 10))


def label(lp: tuple[float, float]) -> Answer:
    return Answer.scored("x", LABEL, Score(0.0, 0.0, 10, logprobs=lp))


def test_the_item_line_is_the_surest_part() -> None:
    windows = ((0.0, 4.0), (4.0, 8.0), (8.0, 12.0))
    parts = [[yes(0.2), label((-1.0, -2.0))], [yes(0.7), label((-3.0, -0.1))],
             [yes(0.7), label((-0.5, -4.0))]]
    lines = reduced(windows, parts)
    assert [(a.part, a.window) for a in lines[:6]] == [
        (0, (0.0, 4.0)), (0, (0.0, 4.0)), (1, (4.0, 8.0)), (1, (4.0, 8.0)),
        (2, (8.0, 12.0)), (2, (8.0, 12.0))]
    y, c = lines[6:]
    assert (y.p_yes, y.answer, y.trigger, y.trigger_window, y.parts) == (
        0.7, "yes", 1, (4.0, 8.0), 3)  # the first of two equal parts
    # part 2's red: exp(0) / (1 + exp(-3.5)) = 0.97; part 1's blue: 1 / (1 + exp(-2.9))
    assert (c.label, c.trigger) == ("red", 2) and c.part is None
    assert c.probs == parts[2][1].probs
    for a in lines:  # what a job store keeps reads back as it was
        assert Answer.from_record(json.loads(json.dumps(a.record()))) == a
    alone = reduced(None, [[yes(0.1)], [yes(0.3)]])
    assert (alone[0].image, alone[1].image, alone[2].trigger_image) == (0, 1, 1)
    assert "window" not in alone[0].line() and alone[2].line()["trigger_image"] == 1
    assert not {"part", "parts", "trigger"} & yes(0.4).line().keys()


def test_a_clip_that_cannot_be_read_has_no_part_line(tmp_path: Path) -> None:
    data = make_clip(frames(40, 32, 24), FFV1_MKV, rate=10)
    (tmp_path / "cut.mkv").write_bytes(data[: len(data) // 3])
    (tmp_path / "m.jsonl").write_text(json.dumps(
        {"id": "cut", "video": "cut.mkv", "segment_seconds": 1, "questions": ["A?", "B?"]})
        + "\n")
    out = tmp_path / "o.jsonl"
    assert main(["run", str(tmp_path / "m.jsonl"), "--model", str(DEFAULT_QWEN_MODEL),
                 "--out", str(out), "--no-progress"]) == EXIT_ITEM_ERRORS
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 2 and all(x["error_kind"] == "decode" for x in lines)
    assert not any("part" in x or "parts" in x for x in lines)
