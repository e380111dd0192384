"""Manifests, policies, folders and image sources."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from vlmbatch.inputs.manifest import items_from_folder, read_manifest, read_policy
from vlmbatch.pipeline.questions import ManifestError, Question
from vlmbatch.preprocessing.sources import SourceError, read_bytes


def write(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_manifest_questions_and_policy(tmp_path: Path) -> None:
    m = write(tmp_path / "m.jsonl", [
        {"id": "a", "image": "a.png", "questions": ["Is it red?", {"id": "c", "text": "Circle?",
                                                                   "threshold": 0.7}]},
        "",
        {"id": "b", "image": "b.png"},
    ])
    policy = (Question("p", "Is there a shape?"),)
    items = read_manifest(m, policy)
    assert [it.id for it in items] == ["a", "b"]
    assert [q.id for q in items[0].questions] == ["q0", "c", "p"]
    assert items[0].questions[1].threshold == 0.7
    assert items[1].questions == policy
    assert items[0].base_dir == tmp_path


@pytest.mark.parametrize("bad,msg", [
    ("{not json", "not valid JSON"),
    ('["a list"]', "JSON object"),
    ('{"id": "x"}', "missing 'image'"),
    ('{"image": "x.png", "questions": "Is it red?"}', "must be a list"),
    ('{"image": "x.png", "questions": [{"text": "q", "threshold": 2}]}', "threshold"),
    ('{"image": "x.png", "questions": []}', "no questions"),
    ('{"id": "a", "image": "y.png", "questions": ["q"]}', "appears twice"),
])
def test_malformed_line_names_line_number(tmp_path: Path, bad: str, msg: str) -> None:
    m = write(tmp_path / "m.jsonl", [{"id": "a", "image": "a.png", "questions": ["ok?"]}, bad])
    with pytest.raises(ManifestError, match=rf"m\.jsonl:2: .*{msg}"):
        read_manifest(m)


def test_policy_yaml_and_toml(tmp_path: Path) -> None:
    y = tmp_path / "p.yaml"
    y.write_text("questions:\n  - {id: red, text: \"Is there a red shape?\", threshold: 0.6}\n"
                 "  - Is there a circle?\n")
    t = tmp_path / "p.toml"
    t.write_text('[[questions]]\nid = "red"\ntext = "Is there a red shape?"\nthreshold = 0.6\n'
                 '[[questions]]\ntext = "Is there a circle?"\n')
    assert read_policy(y) == read_policy(t) == (
        Question("red", "Is there a red shape?", 0.6), Question("p1", "Is there a circle?"))
    (tmp_path / "bad.yaml").write_text("questions: [\n")
    with pytest.raises(ManifestError, match="cannot parse"):
        read_policy(tmp_path / "bad.yaml")
    (tmp_path / "none.yaml").write_text("name: x\n")
    with pytest.raises(ManifestError, match="questions"):
        read_policy(tmp_path / "none.yaml")


def test_folder(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    for name in ["b.png", "a.jpg", "sub/c.webp", "notes.txt"]:
        (tmp_path / name).write_bytes(b"x")
    items = items_from_folder(tmp_path, (Question("q", "?"),))
    assert [it.id for it in items] == ["a.jpg", "b.png", "sub/c.webp"]
    with pytest.raises(ManifestError, match="--policy"):
        items_from_folder(tmp_path, ())


def test_sources(tmp_path: Path) -> None:
    (tmp_path / "x.bin").write_bytes(b"abc")
    assert read_bytes("x.bin", tmp_path) == b"abc"
    assert read_bytes(f"file://{tmp_path}/x.bin", Path("/")) == b"abc"
    assert read_bytes("data:image/png;base64," + base64.b64encode(b"abc").decode(), tmp_path) \
        == b"abc"
    for src, msg in [("missing.png", "not found"), ("ftp://example.com/a.png", "scheme 'ftp'"),
                     ("https://example.com/a.png", "fetch stage"),
                     ("data:image/png;base64,@@@", "base64"), (".", "directory")]:
        with pytest.raises(SourceError, match=msg):
            read_bytes(src, tmp_path)


def test_policy_and_line_ids(tmp_path: Path) -> None:
    m = write(tmp_path / "m.jsonl", [{"image": "a.png", "questions": ["Is it red?"]}])
    policy_file = tmp_path / "p.yaml"
    policy_file.write_text("questions:\n  - Is there a circle?\n")
    (item,) = read_manifest(m, read_policy(policy_file))
    assert [(q.id, q.text) for q in item.questions] == [("q0", "Is it red?"),
                                                        ("p0", "Is there a circle?")]
    clash = write(tmp_path / "c.jsonl", [{"image": "a.png", "questions": [
        {"id": "p0", "text": "Other?"}]}])
    with pytest.raises(ManifestError, match=r"c\.jsonl:1: .*'p0'.*both"):
        read_manifest(clash, read_policy(policy_file))


def test_non_utf8_line_is_named(tmp_path: Path) -> None:
    m = tmp_path / "m.jsonl"
    m.write_bytes(b'{"image": "a.png", "questions": ["ok"]}\n{"image": "\xff.png"}\n')
    with pytest.raises(ManifestError, match=r"m\.jsonl:2: not UTF-8"):
        read_manifest(m)


def test_odd_sources_are_item_errors(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="bad path"):
        read_bytes("a\x00.png", tmp_path)
    assert read_bytes("data:image/png,%89PNG%00", tmp_path) == b"\x89PNG\x00"


def test_items_keep_absolute_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Items read from relative paths still find their images from another working directory
    (a job stores its items and may run anywhere)."""
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.png").write_bytes(b"A")
    write(tmp_path / "d" / "m.jsonl", [{"image": "a.png", "questions": ["?"]}])
    monkeypatch.chdir(tmp_path)
    (from_manifest,) = read_manifest(Path("d/m.jsonl"))
    (from_folder,) = items_from_folder(Path("d"), (Question("q", "?"),))
    monkeypatch.chdir("/")
    for it in (from_manifest, from_folder):
        assert it.base_dir.is_absolute() and read_bytes(it.image, it.base_dir) == b"A"


def test_unknown_question_key_is_named(tmp_path: Path) -> None:
    m = write(tmp_path / "m.jsonl",
              [{"image": "a.png", "questions": [{"text": "Red?", "threshhold": 0.9}]}])
    with pytest.raises(ManifestError, match=r"m\.jsonl:1: question 0 has unknown key\(s\) "
                                            r"\['threshhold'\]"):
        read_manifest(m)


def test_policy_not_utf8_or_a_folder(tmp_path: Path) -> None:
    p = tmp_path / "p.yaml"
    p.write_bytes("questions: [caf\xe9?]\n".encode("latin-1"))
    with pytest.raises(ManifestError, match=r"p\.yaml: not UTF-8"):
        read_policy(p)
    with pytest.raises(ManifestError, match="is a folder"):
        read_policy(tmp_path)
    p.write_bytes(b"\xef\xbb\xbfquestions: [\"ok?\"]\n")  # a BOM is fine
    assert read_policy(p)[0].text == "ok?"


@pytest.mark.parametrize("bad", ["-1", "2.5", "true", '"8"'])
def test_a_questions_max_new_tokens_is_a_whole_number(tmp_path: Path, bad: str) -> None:
    m = tmp_path / "m.jsonl"
    m.write_text('{"id": "a", "image": "a.png", "questions": [{"text": "Why?", '
                 '"max_new_tokens": 16}, "Red?"]}\n')
    (q1, q2), = [it.questions for it in read_manifest(m)]
    assert (q1.max_new_tokens, q2.max_new_tokens) == (16, None)
    m.write_text('{"id": "a", "image": "a.png", "questions": [{"text": "Why?", '
                 f'"max_new_tokens": {bad}}}]}}\n')
    with pytest.raises(ManifestError, match=r"m.jsonl:1: question 0 max_new_tokens must be"):
        read_manifest(m)


def test_label_sets_system_turns_and_instructions(tmp_path: Path) -> None:
    """``choices``, ``prompt`` and ``system`` on manifest lines and in policies: a policy's
    ``system:`` goes to each of its questions that has none of its own."""
    y = tmp_path / "p.yaml"
    y.write_text("system: You are a content moderator.\nquestions:\n"
                 "  - {id: cat, text: 'Which category?', choices: [safe, sexual, violence, hate]}\n"
                 "  - {id: own, text: 'Is it red?', prompt: 'Answer yes or no.',"
                 " system: 'Be brief.'}\n")
    cat, own = read_policy(y)
    assert cat == Question("cat", "Which category?", choices=("safe", "sexual", "violence",
                                                               "hate"),
                           system="You are a content moderator.")
    assert (own.system, own.prompt, own.user_text) == ("Be brief.", "Answer yes or no.",
                                                       "Answer yes or no.\nIs it red?")
    m = write(tmp_path / "m.jsonl", [{"id": "a", "image": "a.png", "questions": [
        {"id": "c", "text": "Colour?", "choices": ["red", "grün"]}]}])
    (item,) = read_manifest(m, (cat,))
    assert [q.choices for q in item.questions] == [("red", "grün"), cat.choices]


@pytest.mark.parametrize("choices,msg", [
    (["safe"], "at least 2"),
    ([], "at least 2"),
    (["safe", " "], "choice 1 is empty"),
    (["safe", "hate", "safe"], "repeat: \\['safe'\\]"),
    ([f"c{i}" for i in range(65)], "65 choices, over the limit of 64"),
    ("safe,hate", "list of strings"),
    (["safe", 3], "list of strings"),
])
def test_malformed_label_sets_name_the_line(tmp_path: Path, choices: object, msg: str) -> None:
    m = write(tmp_path / "m.jsonl", [
        {"id": "a", "image": "a.png", "questions": [{"text": "q", "choices": ["x", "y"]}]},
        {"id": "b", "image": "b.png", "questions": [{"text": "q", "choices": choices}]}])
    with pytest.raises(ManifestError, match=rf"m\.jsonl:2: question 0.*{msg}"):
        read_manifest(m)
    read_manifest(write(tmp_path / "ok.jsonl", [{"id": "a", "image": "a.png", "questions": [
        {"text": "q", "choices": [f"c{i}" for i in range(64)]}]}]))  # 64 is allowed


def test_label_set_with_threshold_or_blank_texts(tmp_path: Path) -> None:
    for q, msg in [({"text": "q", "choices": ["a", "b"], "threshold": 0.5}, "threshold"),
                   ({"text": "q", "prompt": " "}, "prompt must be a non-empty"),
                   ({"text": "q", "system": 3}, "system must be a non-empty")]:
        m = write(tmp_path / "m.jsonl", [{"id": "a", "image": "a.png", "questions": [q]}])
        with pytest.raises(ManifestError, match=rf"m\.jsonl:1: .*{msg}"):
            read_manifest(m)
    y = tmp_path / "p.yaml"
    y.write_text("system: ''\nquestions: ['Is it red?']\n")
    with pytest.raises(ManifestError, match="system must be a non-empty"):
        read_policy(y)
