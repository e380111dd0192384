"""Tabular and sharded inputs: Parquet (bytes, HF Image structs, paths, URLs; a file, a folder,
a glob), an HF dataset saved with ``save_to_disk`` and WebDataset shards (local and over HTTP
on loopback) give the answers the same images give in a manifest; their ids, questions and
validation; Parquet dataset results."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.inputs.datasets_helpers import (
    QUESTIONS,
    answers,
    make_images,
    same,
    write_manifest,
    write_parquet,
    write_policy,
    write_shards,
)
from tests.loopback import LoopbackServer
from vlmbatch.cli.commands import EXIT_BAD_INPUT, EXIT_OK
from vlmbatch.cli.main import main
from vlmbatch.inputs.datasets import expand_braces, input_kind, iter_dataset
from vlmbatch.jobs.store import image_item_from_json, image_item_to_json
from vlmbatch.pipeline.questions import ManifestError, Question
from vlmbatch.preprocessing.sources import MemberRef, RowRef

pa = pytest.importorskip("pyarrow")
N = 7


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory,
              random_model_dir: Path) -> tuple[list[Path], dict, list[str]]:
    """The images, their answers through a manifest (ids 0..N-1), and the model options:
    answered once for the module (CI time)."""
    tmp = tmp_path_factory.mktemp("reference")
    images = make_images(tmp / "img", N)
    opts = ["--model", str(random_model_dir), "--policy", str(write_policy(tmp)),
            "--images-per-batch", "3", "--no-progress"]
    m = write_manifest(tmp, images, [str(i) for i in range(N)])
    assert main(["run", str(m), "-o", str(tmp / "ref.jsonl"), *opts]) == EXIT_OK
    return images, answers(tmp / "ref.jsonl"), opts


@pytest.fixture
def ref(tmp_path: Path, reference: tuple) -> tuple[list[Path], dict, list[str]]:
    """``reference`` with the images copied to ``tmp_path / "img"`` (tables name them
    relative to their own folder)."""
    images, want, opts = reference
    (tmp_path / "img").mkdir()
    return [Path(shutil.copy(p, tmp_path / "img")) for p in images], want, opts


def run_input(tmp_path: Path, text: str, opts: list[str], *extra: str,
              rc: int = EXIT_OK) -> dict:
    out = tmp_path / "out.jsonl"
    assert main(["run", text, "-o", str(out), *opts, *extra]) == rc
    return answers(out) if rc == EXIT_OK else {}


def renamed(got: dict, ids: dict[str, str]) -> dict:
    return {(ids[i], q): v for (i, q), v in got.items()}


def test_parquet_columns_of_bytes_structs_paths_and_urls(tmp_path: Path, ref: tuple) -> None:
    images, want, opts = ref
    data = [p.read_bytes() for p in images]
    ids = [str(i) for i in range(N)]
    with LoopbackServer({p.name: p.read_bytes() for p in images}) as server:
        forms = {
            "bytes": data,
            "struct": [{"bytes": d, "path": None} if i % 2 else {"bytes": None, "path": p.name}
                       for i, (d, p) in enumerate(zip(data, images))],
            "paths": [f"img/{p.name}" for p in images],  # relative to the file's folder
            "urls": [server.url(f"/img/{p.name}") for p in images],
        }
        for name, column in forms.items():
            f = write_parquet(tmp_path / (name if name == "struct" else "") / f"{name}.parquet",
                              {"key": ids, "picture": column})
            if name == "struct":  # its paths are relative to its own folder
                for p in images:
                    (f.parent / p.name).write_bytes(p.read_bytes())
            got = run_input(tmp_path, str(f), opts, "--image-column", "picture",
                            "--id-column", "key")
            assert same(got, want), name


def test_default_ids_folders_globs_and_row_groups(tmp_path: Path, ref: tuple) -> None:
    images, want, opts = ref
    data = [p.read_bytes() for p in images]
    write_parquet(tmp_path / "t" / "a.parquet", {"image": data[:4]}, row_group_size=2)
    write_parquet(tmp_path / "t" / "sub" / "b.parquet", {"image": data[4:]}, row_group_size=2)
    ids = {f"a.parquet:{i}": str(i) for i in range(4)}
    ids.update({f"sub/b.parquet:{i}": str(4 + i) for i in range(3)})
    assert same(renamed(run_input(tmp_path, str(tmp_path / "t"), opts), ids), want)
    ids = {k.replace("sub/", ""): v for k, v in ids.items() if "b.parquet" in k}
    got = run_input(tmp_path, str(tmp_path / "t" / "*" / "*.parquet"), opts)
    assert same(renamed(got, ids), {k: v for k, v in want.items() if int(k[0]) >= 4})


def test_an_hf_dataset_saved_to_disk(tmp_path: Path, ref: tuple) -> None:
    datasets = pytest.importorskip("datasets")
    images, want, opts = ref
    ds = datasets.Dataset.from_dict({"image": [str(p) for p in images],
                                     "name": [str(i) for i in range(N)]})
    ds.cast_column("image", datasets.Image()).save_to_disk(str(tmp_path / "hf"), max_shard_size=
                                                           "2KB")
    assert len(list((tmp_path / "hf").glob("*.arrow"))) > 1  # several Arrow files, in order
    assert same(run_input(tmp_path, str(tmp_path / "hf"), opts, "--id-column", "name"), want)
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    run_input(tmp_path, str(tmp_path / "dd"), opts, rc=EXIT_BAD_INPUT)


def test_a_questions_column_and_table_validation(tmp_path: Path, ref: tuple,
                                                 capsys: pytest.CaptureFixture) -> None:
    images, want, opts = ref
    data = [p.read_bytes() for p in images[:2]]
    f = write_parquet(tmp_path / "q.parquet", {"image": data, "n": [1, 2], "q": [
        QUESTIONS[1], json.dumps([{"id": "own", "text": QUESTIONS[0], "threshold": 0.9}])]})
    no_policy = [o for i, o in enumerate(opts) if o != "--policy" and opts[i - 1] != "--policy"]
    got = run_input(tmp_path, str(f), no_policy, "--questions-column", "q")
    assert set(got) == {("q.parquet:0", QUESTIONS[1]), ("q.parquet:1", QUESTIONS[0])}
    assert same({0: got["q.parquet:0", QUESTIONS[1]]}, {0: want["0", QUESTIONS[1]]})
    lists = write_parquet(tmp_path / "l.parquet", {"image": data, "q": [[QUESTIONS[1]], []]})
    got = run_input(tmp_path, str(lists), opts, "--questions-column", "q")
    # its own question, then the policy's
    assert same({0: got["l.parquet:0", QUESTIONS[1]]}, {0: want["0", QUESTIONS[1]]})
    assert len(got) == 2 + 2
    capsys.readouterr()
    for extra, message in [(["--image-column", "nope"], "no column 'nope'"),
                           (["--image-column", "n"], "column 'n' is int64"),
                           (["--id-column", "missing"], "no column 'missing'")]:
        run_input(tmp_path, str(f), opts, *extra, rc=EXIT_BAD_INPUT)
        assert message in capsys.readouterr().err
    dup = write_parquet(tmp_path / "dup.parquet", {"image": data, "id": ["x", "x"]})
    run_input(tmp_path, str(dup), opts, "--id-column", "id", rc=EXIT_BAD_INPUT)
    assert "'x' appears twice" in capsys.readouterr().err
    run_input(tmp_path, str(f), no_policy, rc=EXIT_BAD_INPUT)  # no questions at all
    assert "no questions" in capsys.readouterr().err


def test_webdataset_shards_local_and_over_http(tmp_path: Path, ref: tuple) -> None:
    images, want, opts = ref
    meta = {0: {"id": "first"}, 1: {"questions": ["Is it blue?"]}}  # own questions + policy
    shards = write_shards(tmp_path / "shards", images, per_shard=3, meta=meta)
    ids = {"first": "0", **{f"{i // 3:04d}.tar:sample{i:04d}": str(i) for i in range(1, N)}}
    pattern = str(tmp_path / "shards" / "{0000..0002}.tar")
    got = run_input(tmp_path, pattern, opts)
    assert ("0000.tar:sample0001", "Is it blue?") in got  # its own question, then the policy's
    del got["0000.tar:sample0001", "Is it blue?"]
    assert same(renamed(got, ids), want)
    with LoopbackServer({s.name: s.read_bytes() for s in shards}) as server:
        got = run_input(tmp_path, server.url("/img/{0000..0002}.tar"), opts)
        assert server.requests["/img/0001.tar"] == 1 + 3  # listed once, then 3 range reads
    del got["0000.tar:sample0001", "Is it blue?"]
    assert same(renamed(got, ids), want)


def test_shard_validation(tmp_path: Path, ref: tuple, capsys: pytest.CaptureFixture) -> None:
    images, _, opts = ref
    write_shards(tmp_path / "s", images[:2], per_shard=2, meta={1: {"id": [5]}})
    bad = tmp_path / "s" / "0000.tar"
    for text, message in [(str(tmp_path / "s" / "{0001..0002}.tar"), "not found"),
                          (str(tmp_path / "none.tar.gz"), "compressed")]:
        run_input(tmp_path, text, opts, rc=EXIT_BAD_INPUT)
        assert message in capsys.readouterr().err
    with pytest.raises(ManifestError, match="sample0001: id must be a non-blank string"):
        list(iter_dataset(str(bad), "image", None, None, (_q(),)))
    write_shards(tmp_path / "s", images[:2], per_shard=2, meta={1: {"question": ["Red?"]}})
    with pytest.raises(ManifestError, match=r"sample0001\.json: unknown key\(s\) \['question'\] "
                       r"\(did you mean 'questions'\?\); a sample's json has \['id', "
                       r"'questions'\]"):  # was ignored: the sample got the policy's only
        list(iter_dataset(str(bad), "image", None, None, (_q(),)))
    bad.write_bytes(b"not a tar" * 100)
    run_input(tmp_path, str(bad), opts, rc=EXIT_BAD_INPUT)
    assert "not a readable tar shard" in capsys.readouterr().err


def test_brace_expansion_is_bashs() -> None:
    for pattern in ["s/{00000..00012}.tar", "a{1,2}b{x,yy}.tar", "{a,b{0..2}}.tar", "{9..11}",
                    "x.tar", "{05..3}", "{a,{b,c}d}e", "{-2..2}", "{1..3}{a,b}", "lit{x}.{0,1}",
                    "{9..011}"]:
        bash = subprocess.run(["bash", "-c", f"printf '%s\\n' {pattern}"], capture_output=True,
                              text=True, check=True).stdout.split()
        assert expand_braces(pattern) == bash, pattern


def test_input_kinds(tmp_path: Path) -> None:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "state.json").write_text("{}")
    assert [input_kind(t) for t in ["m.jsonl", "d.parquet", "x/*.parquet", str(tmp_path / "hf"),
                                    "https://h/s/{0..9}.tar", "s.tar", str(tmp_path)]] \
        == [None, "table", "table", "table", "shards", "shards", None]


def test_the_store_keeps_references_not_images(tmp_path: Path, ref: tuple) -> None:
    images, _, _ = ref
    write_parquet(tmp_path / "r.parquet", {"image": [p.read_bytes() for p in images]})
    write_shards(tmp_path / "w", images, per_shard=N)
    for text in (str(tmp_path / "r.parquet"), str(tmp_path / "w" / "0000.tar")):
        for _, item in iter_dataset(text, "image", None, None, (_q(),)):
            assert isinstance(item.image, (RowRef, MemberRef))
            stored = image_item_to_json(item)
            assert len(stored) < 600 and image_item_from_json(stored) == item


def _q() -> Question:
    return Question("p0", QUESTIONS[0])


def test_results_as_a_parquet_dataset(tmp_path: Path, ref: tuple) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    images, _, opts = ref
    f = write_parquet(tmp_path / "r.parquet", {"image": [p.read_bytes() for p in images]})
    job = tmp_path / "job"
    assert main(["submit", str(f), "--job", str(job), *opts, "--wait"]) == EXIT_OK
    assert main(["results", str(job), "-o", str(tmp_path / "one.parquet")]) == EXIT_OK
    assert main(["results", str(job), "-o", str(tmp_path / "ds") + "/",
                 "--rows-per-file", "4"]) == EXIT_OK
    files = sorted((tmp_path / "ds").iterdir())
    assert [p.name for p in files] == [f"part-{i:05d}.parquet" for i in range(4)]  # 14 rows
    assert [pq.read_metadata(p).num_rows for p in files] == [4, 4, 4, 2]
    one = pq.read_table(tmp_path / "one.parquet")
    assert pq.read_table(tmp_path / "ds").to_pylist() == one.to_pylist()
    assert main(["results", str(job), "-o", str(tmp_path / "ds") + "/"]) == EXIT_BAD_INPUT
