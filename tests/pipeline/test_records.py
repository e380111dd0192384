"""The result record (``Answer``): the line every output derives from, for yes/no and
label-set questions, and what a job store keeps and reads back (stores written before label
sets and error kinds included)."""

from __future__ import annotations

import csv
import io
import json
import math

from vlmbatch.engine.records import Score
from vlmbatch.outputs.lines import to_output
from vlmbatch.outputs.sinks import RESULT_COLUMNS, line_writer
from vlmbatch.pipeline.questions import Question
from vlmbatch.pipeline.records import Answer, ErrorKind, ItemError

YES_NO = Question("red", "Is there a red shape?", 0.5)
LABELS = Question("cat", "Which category?", choices=("safe", "violence", "hate"))
LINE_KEYS = ["id", "question_id", "question", "answer", "p_yes", "margin", "image_tokens",
             "error", "error_kind"]


def test_a_yes_no_line_is_todays_line_with_its_error_kind() -> None:
    a = Answer.scored("img", YES_NO, Score(0.8123456789, 1.23456789, 16))
    assert list(a.line()) == LINE_KEYS
    assert a.line()["p_yes"] == 0.812346 and a.line()["error_kind"] is None
    f = Answer.failed("img", YES_NO, ItemError(ErrorKind.DECODE, "img: bad"))
    assert f.line()["error_kind"] == "decode" and list(f.line()) == LINE_KEYS


def test_a_label_set_line() -> None:
    lp = (-0.2, -2.5, -7.0)
    a = Answer.scored("img", LABELS, Score(0.5, 0.0, 16, logprobs=lp))
    line = a.line()
    assert list(line) == [*LINE_KEYS, "label", "probs", "logprobs"]
    assert line["label"] == line["answer"] == "safe" and line["p_yes"] is None
    assert list(line["probs"]) == list(LABELS.choices)  # in the given order
    z = sum(math.exp(v) for v in lp)
    for c, v in zip(LABELS.choices, lp):
        assert abs(line["probs"][c] - math.exp(v) / z) <= 1e-6
        assert line["logprobs"][c] == v
    f = Answer.failed("img", LABELS, ItemError(ErrorKind.ENGINE, "engine failed: x"))
    assert f.line()["label"] is None and f.line()["probs"] is None and "probs" in f.line()


def test_records_read_back_old_and_new() -> None:
    for a in (Answer.scored("i", YES_NO, Score(0.3, -0.8, 4, text="no, none")),
              Answer.scored("i", LABELS, Score(0.5, 0.0, 4, logprobs=(-3.0, -0.1, -4.0))),
              Answer.failed("i", LABELS, ItemError(ErrorKind.SOURCE, "gone")),
              Answer.failed("i", YES_NO, ItemError(ErrorKind.TOO_LARGE, "big"))):
        back = Answer.from_record(json.loads(json.dumps(a.record())))
        assert back == a and back.line() == a.line()
    # what a store from before this version holds: no error_kind on a success, none at all
    # on a failure of a store from before the kinds
    old_ok = {"id": "i", "question_id": "red", "question": "Red?", "answer": "yes",
              "p_yes": 0.9, "margin": 2.2, "image_tokens": 4, "error": None}
    assert Answer.from_record(old_ok).line() == {**old_ok, "error_kind": None}
    old_failed = {**old_ok, "answer": None, "p_yes": None, "margin": None,
                  "image_tokens": None, "error": "x: gone"}
    assert Answer.from_record(old_failed).error_kind is ErrorKind.UNKNOWN


def test_csv_rows_and_the_openai_line_derive_from_the_answer() -> None:
    a = Answer.scored("i", LABELS, Score(0.5, 0.0, 4, logprobs=(-3.0, -0.1, -4.0)))
    b = Answer.scored("i", YES_NO, Score(0.9, 2.2, 4))
    out = io.StringIO(newline="")
    line_writer(out, "csv")([a, b])
    rows = list(csv.DictReader(io.StringIO(out.getvalue())))
    assert tuple(rows[0]) == RESULT_COLUMNS
    assert json.loads(rows[0]["probs"]) == a.probs and rows[0]["label"] == "violence"
    assert rows[1]["label"] == rows[1]["probs"] == "" and rows[1]["p_yes"] == "0.9"
    body = to_output(a)["response"]["body"]
    assert body["choices"][0]["message"]["content"] == "violence"
    assert body["vlmbatch"]["probs"] == a.probs and body["vlmbatch"]["logprobs"] == a.logprobs
    assert "label" not in to_output(b)["response"]["body"]["vlmbatch"]
