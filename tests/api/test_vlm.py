"""The Python API answers as ``vlmbatch run`` does, takes every kind of image, streams, and
turns a bad image into that answer's error."""

from __future__ import annotations

import io
import json
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image

import vlmbatch
from vlmbatch.cli.commands import EXIT_OK
from vlmbatch.cli.main import main
from vlmbatch.engine.config import ChoiceError
from vlmbatch.inputs.manifest import read_manifest, read_policy
from vlmbatch.pipeline.questions import ManifestError

ROOT = Path(__file__).resolve().parents[2]
MANIFEST, POLICY = ROOT / "examples" / "manifest.jsonl", ROOT / "examples" / "policy.yaml"
QUESTIONS = ["Is there a red shape?", {"id": "c", "text": "Is there a circle?", "threshold": 0.7}]


@pytest.fixture(scope="module")
def vlm() -> vlmbatch.VLM:
    return vlmbatch.VLM()


def test_answers_equal_the_run_lines_on_the_examples(vlm: vlmbatch.VLM, tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    assert main(["run", str(MANIFEST), "--policy", str(POLICY), "-o", str(out),
                 "--no-progress"]) == EXIT_OK
    want = [json.loads(x) for x in out.read_text().splitlines()]
    got = [a.line() for a in vlm.ask_many(read_manifest(MANIFEST, read_policy(POLICY)))]
    assert got == want and len(got) == 60


def test_label_sets_and_instructions_equal_the_run_lines(vlm: vlmbatch.VLM,
                                                         tmp_path: Path) -> None:
    """The label-set example (choices, a policy's system turn, an instruction): ``ask``'s
    ``Answer``s carry label, probs and logprobs and equal ``vlmbatch run``'s lines."""
    m, p = ROOT / "examples" / "labels.jsonl", ROOT / "examples" / "labels.yaml"
    out = tmp_path / "r.jsonl"
    assert main(["run", str(m), "--policy", str(p), "-o", str(out), "--no-progress"]) == EXIT_OK
    want = [json.loads(x) for x in out.read_text().splitlines()]
    got = list(vlm.ask_many(read_manifest(m, read_policy(p))))
    assert len(got) == len(want) == 13
    for a, line in zip(got, want):  # a warm cache's KV vs this run's: float32 rounding apart
        assert same_line(a.line(), line), (a.line(), line)
    labelled = [a for a in got if a.choices]
    assert len(labelled) == 9 and all(a.p_yes is None and a.label == a.answer for a in labelled)
    # the README's showcase: the single-shape scenes answered right, each winner's logprob
    # near 0; the counting label set, phrasings the model never learnt, flagged by logprobs
    # far below (its answer, "one shape" for two triangles, is wrong at probability 0.99)
    truth = {"scene_04": ("green", "circle"), "scene_07": ("yellow", "rectangle"),
             "l30": ("red", "triangle")}
    for line in want:
        if line["id"] in truth and line["question_id"] in ("colour", "shape"):
            assert line["label"] == truth[line["id"]][line["question_id"] == "shape"], line
            assert max(line["logprobs"].values()) > -1, line
    (size,) = [line for line in want if line["question_id"] == "size"]
    assert max(size["logprobs"].values()) < -20 and size["label"] == "one shape"
    for a in labelled:
        assert a.probs is not None and a.logprobs is not None
        assert list(a.probs) == list(a.choices) and abs(sum(a.probs.values()) - 1) < 1e-5
        assert a.label == max(a.logprobs, key=a.logprobs.__getitem__)
    (one,) = vlm.ask([ROOT / "examples" / "images" / "scene_07.png"], [
        {"id": "colour", "text": "What color is the shape?", "system":
         "You are a careful image annotator.",
         "choices": ["red", "green", "blue", "black", "gray", "teal", "yellow", "brown"]}])
    assert one.image_id == "0" and same_line({**one.line(), "id": "scene_07"}, want[3])


def same_line(a: dict, b: dict) -> bool:
    """Equal result lines, a label set's probs and logprobs to 1e-5 (their 6 decimals move
    with float32 rounding between batches and cached or computed prefixes)."""
    maps = ("probs", "logprobs")
    return ({k: v for k, v in a.items() if k not in maps}
            == {k: v for k, v in b.items() if k not in maps}
            and all(a.get(k) == pytest.approx(b.get(k), abs=1e-5) for k in maps))


def test_every_kind_of_image_gets_the_same_answer(vlm: vlmbatch.VLM) -> None:
    path = ROOT / "examples" / "images" / "scene_03.png"
    data = path.read_bytes()
    rgb = cv2.cvtColor(cv2.imread(str(path)), cv2.COLOR_BGR2RGB)
    kinds = [str(path), path, data, rgb, Image.open(io.BytesIO(data)),
             f"file://{path}", np.dstack([rgb, np.full(rgb.shape[:2], 255, np.uint8)])]
    answers = list(vlm.ask(kinds, QUESTIONS))
    assert [a.image_id for a in answers] == [str(i) for i in range(len(kinds)) for _ in "ab"]
    assert [a.question_id for a in answers[:2]] == ["q0", "c"]
    assert all(a.error is None for a in answers)
    first = answers[:2]
    for i in range(1, len(kinds)):
        assert [(a.p_yes, a.answer) for a in answers[2 * i: 2 * i + 2]] == \
            [(a.p_yes, a.answer) for a in first], f"image kind {i}"
    assert first[1].answer == ("yes" if first[1].p_yes >= 0.7 else "no")  # its threshold


def test_ask_many_keeps_your_ids(vlm: vlmbatch.VLM) -> None:
    """Issue 38: ``ImageItem(image=..., questions=[...], id="s2")`` needed a base_dir and the
    internal Question records. Now an item is built from what a user has (a path, bytes, a
    PIL image; question strings and objects), or given as (id, image, questions); answers
    carry the ids, and two items of one id in one group each get their own image's."""
    paths = [ROOT / "examples" / "images" / f"scene_{k:02d}.png" for k in range(4)]
    ref = list(vlm.ask(paths, QUESTIONS))  # ids "0".."3"
    items = [vlmbatch.ImageItem(image=str(paths[0]), questions=QUESTIONS, id="s2"),
             ("dup", paths[1], QUESTIONS),
             ("dup", Image.open(paths[2]), QUESTIONS),
             vlmbatch.ImageItem(7, paths[3].read_bytes(), QUESTIONS)]
    got = list(vlm.ask_many(items))
    assert [a.image_id for a in got] == ["s2", "s2", "dup", "dup", "dup", "dup", "7", "7"]
    assert [(a.question_id, a.p_yes, a.answer) for a in got] == \
        [(a.question_id, a.p_yes, a.answer) for a in ref]
    assert ref[2].p_yes != ref[4].p_yes  # the two "dup" images answer differently
    mixed = list(vlm.ask_many([(paths[1], ["Is there a red shape?"]),
                               ("s9", str(paths[1]), "Is there a red shape?")]))
    assert [(a.image_id, a.p_yes) for a in mixed] == [("0", ref[2].p_yes), ("s9", ref[2].p_yes)]


def test_a_bad_image_is_its_answers_error(vlm: vlmbatch.VLM, tmp_path: Path) -> None:
    good = ROOT / "examples" / "images" / "scene_00.png"
    images = [good, b"not an image", tmp_path / "missing.png",
              np.zeros((4, 4), dtype=np.float32), good]
    answers = list(vlm.ask(images, ["Red?"]))
    kinds = [a.error_kind.value if a.error_kind else None for a in answers]
    assert kinds == [None, "decode", "source", "decode", None]
    assert answers[0].p_yes == answers[4].p_yes and answers[1].p_yes is None
    assert "missing.png" in answers[2].error


def test_what_is_no_image_at_all_is_its_answers_error(vlm: vlmbatch.VLM) -> None:
    """``None`` or ``42`` among the images is that item's ``source`` error (as the module
    docstring promises), in ``ask`` as in ``ask_many``, never a TypeError for the call."""
    good = ROOT / "examples" / "images" / "scene_00.png"
    answers = list(vlm.ask([good, None, 42, good], ["Red?"]))  # type: ignore[list-item]
    kinds = [a.error_kind.value if a.error_kind else None for a in answers]
    assert kinds == [None, "source", "source", None]
    assert "not NoneType" in answers[1].error and "not int" in answers[2].error
    (alone,) = vlm.ask(None, ["Red?"])  # type: ignore[arg-type]
    assert alone.error_kind is not None and alone.error_kind.value == "source"
    many = list(vlm.ask_many([("s1", 42, ["Red?"]), ("s2", good, ["Red?"])]))  # type: ignore[list-item]
    assert [(a.image_id, a.error_kind is None) for a in many] == [("s1", False), ("s2", True)]
    assert many[1].p_yes == answers[0].p_yes


def test_vlm_embed_names_the_model_vlmbatch_embed_uses(vlm: vlmbatch.VLM) -> None:
    """``VLM()`` is the built-in yes/no model; ``vlmbatch embed``'s default is the built-in
    embedding model: the call refuses, saying how to get the CLI's vectors, rather than
    embedding with another model than the CLI's."""
    for call in (lambda: vlm.embed(texts=["a red circle"]),
                 lambda: list(vlm.embed_many(["a red circle"]))):
        with pytest.raises(ValueError, match=r"vlmbatch\.VLM\(vlmbatch\.EMBED_MODEL\)"):
            call()


def test_a_question_over_a_length_limit_is_a_value_error_naming_it(vlm: vlmbatch.VLM) -> None:
    """Over ``max_prompt_chars`` (16,384 by default) or the model's 4,096-token context:
    a ``ValueError`` naming the question, before any work, in ``ask`` and ``ask_many``."""
    image = ROOT / "examples" / "images" / "scene_00.png"
    with pytest.raises(ValueError, match=r"questions\[1\]: question 'q1' is 16,385 characters"):
        vlm.ask([image], ["Red?", "y" * 16_385])
    with pytest.raises(ValueError, match=r"question 'long' is 4,\d+ tokens before its image's, "
                                         r"over the model's context of 4,096"):
        vlm.ask([image], [{"id": "long", "text": "Is there a red shape? " * 700}])
    with pytest.raises(ValueError, match=r"item 's2': question 'q0' is 4 characters"):
        next(vlmbatch.VLM(max_prompt_chars=3).ask_many([("s2", image, ["Red?"])]))


def test_bad_questions_and_options_fail_before_any_work(vlm: vlmbatch.VLM) -> None:
    with pytest.raises(ManifestError, match="threshold"):
        vlm.ask(["x.png"], [{"text": "Red?", "threshold": 2}])
    with pytest.raises(ManifestError, match="unknown key"):
        vlm.ask(["x.png"], [{"text": "Red?", "treshold": 0.2}])
    with pytest.raises(ManifestError, match="at least 2"):
        vlm.ask(["x.png"], [{"text": "Colour?", "choices": ["red"]}])
    first = vlmbatch.VLM(choice_scoring="first-token")
    with pytest.raises(ChoiceError, match="'red' and 'red shape'"):
        first.ask(["x.png"], [{"text": "Colour?", "choices": ["red", "red shape"]}])
    with pytest.raises(ChoiceError, match="'red' and 'red shape'"):
        list(first.ask_many([("x.png", [{"text": "Colour?", "choices": ["red", "red shape"]}])]))
    with pytest.raises(TypeError, match="unknown VLM option.*prefix_cahce"):
        vlmbatch.VLM(prefix_cahce=False)


def test_ask_many_streams_with_bounded_lookahead(vlm: vlmbatch.VLM) -> None:
    """The first answers come after a few batches are read, not the whole input."""
    good = (ROOT / "examples" / "images" / "scene_00.png").read_bytes()
    pulled = []

    def items():  # noqa: ANN202
        for i in range(10_000):
            pulled.append(i)
            yield good, ["Red?"]

    stream = vlm.ask_many(items())
    first = next(stream)
    assert first.image_id == "0" and first.error is None
    assert len(pulled) <= 4 * vlm.images_per_batch  # the group, 2 ahead, one more read
    stream.close()


def test_options_reach_the_engine() -> None:
    vlm = vlmbatch.VLM(prefix_cache=False, max_new_tokens=3, tiling="reference",
                       resize="reference")
    (a,) = vlm.ask([ROOT / "examples" / "images" / "scene_00.png"], ["Is there a red shape?"])
    assert a.text in ("yes", "no")  # the built-in model answers in one word
    assert vlm.engine.summary().cache_hit_rate is None
    assert vlm.engine.image_plan.mode == "reference"  # type: ignore[attr-defined]
    # the built-in model is HF-layout InternVL: GotOcr2ImageProcessor's torchvision resize
    assert vlm.engine.image_plan.resize == "torchvision"  # type: ignore[attr-defined]
