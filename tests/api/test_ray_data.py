"""The Ray Data stages (``vlmbatch/api/ray_data.py``) on local Ray: ``read_parquet``,
``read_images`` and ``read_webdataset`` through ``Answerer`` (one stage, and ``Preparer`` then
``Answerer``) give ``VLM.ask``'s answers on the same images (``VLM.ask`` equals ``vlmbatch
run``'s lines: tests/api/test_vlm.py); bad rows are their rows' errors; ``Embedder`` gives
``VLM.embed_many``'s vectors; rows holding an ``images`` list or a ``video`` clip answer as
the local path does (``api/ray_columns.py``). One Ray instance for the module; CI runs the
Parquet tests and the two-stage one in-process, the other two are marked slow (71 s for the
three on 2 cores)."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import cv2
import numpy as np
import pytest

import vlmbatch

ray = pytest.importorskip("ray")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from vlmbatch.api.ray_data import Answerer, Embedder, Preparer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
POLICY = {"questions": [
    {"id": "red", "text": "Is there a red shape?"},
    {"id": "colour", "text": "What color is the shape?", "choices": ["red", "green", "blue"]}]}


def picture(i: int) -> bytes:
    """A generated PNG: a coloured shape on a background, a size of its own."""
    rng = np.random.default_rng(i)
    img = np.full((40 + 7 * i, 60 - 5 * i, 3), rng.integers(0, 255, 3), np.uint8)
    cv2.circle(img, (20, 20), 8 + i, tuple(int(c) for c in rng.integers(0, 255, 3)), -1)
    ok, data = cv2.imencode(".png", img)
    assert ok
    return data.tobytes()


IMAGES = [picture(i) for i in range(3)]


@pytest.fixture(scope="module")
def local_ray() -> object:
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": env})
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def want() -> dict[tuple[str, str], dict]:
    """``VLM.ask`` in this process: each image's line by (image index, question id)."""
    with vlmbatch.VLM() as vlm:
        return {(a.image_id, a.question_id): a.row()
                for a in vlm.ask(IMAGES, POLICY["questions"])}


def pool(n: int = 1) -> object:
    return ray.data.ActorPoolStrategy(size=n)


def check(rows: list[dict], want: dict[tuple[str, str], dict], image_of: dict[str, str]
          ) -> None:
    """``rows`` (by their id, ``image_of[id]`` the image's index) equal ``want``: the same
    answers, labels and columns, P(yes) and probs within 5e-6 (6-decimal rounding across
    batchings), margins within 2e-4."""
    assert len(rows) == len(image_of) * len(POLICY["questions"])
    for r in rows:
        w = want[(image_of[r["id"]], r["question_id"])]
        assert r.pop("frames") is None and r.pop("seconds") is None  # a still image's row
        assert {k: v for k, v in r.items() if k not in ("id", "p_yes", "margin", "probs",
                                                        "logprobs")} == \
            {k: v for k, v in w.items() if k not in ("id", "p_yes", "margin", "probs",
                                                     "logprobs")}, (r, w)
        if w["p_yes"] is not None:
            assert abs(r["p_yes"] - w["p_yes"]) <= 5e-6 and abs(r["margin"] - w["margin"]) <= 2e-4
        else:
            assert r["p_yes"] is None and r["label"] == w["label"] and r["probs"] is not None


def test_parquet_bytes_answers_equal_vlm_ask_and_bad_rows_are_errors(
        local_ray: object, want: dict, tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"image": [*IMAGES, b"not an image", None],
                             "key": ["a", "b", "c", "junk", "null"]}), path)
    ds = ray.data.read_parquet(str(path)).map_batches(
        Answerer, fn_constructor_kwargs={"policy": POLICY, "id_column": "key"},
        compute=pool(), batch_size=2, batch_format="numpy")
    rows = ds.take_all()
    bad = [r for r in rows if r["id"] in ("junk", "null")]
    check([r for r in rows if r not in bad], want, {"a": "0", "b": "1", "c": "2"})
    assert {(r["id"], r["question_id"], r["error_kind"]) for r in bad} == {
        ("junk", "red", "decode"), ("junk", "colour", "decode"),
        ("null", "red", "source"), ("null", "colour", "source")}
    assert all(r["answer"] is None and r["error"] for r in bad)
    # the rows in row then question order, whatever the batching
    assert [(r["id"], r["question_id"]) for r in rows] == [
        (k, q) for k in ("a", "b", "c", "junk", "null") for q in ("red", "colour")]


@pytest.mark.slow  # ~18 s: CI keeps the Parquet test (~33 s with Ray's start)
def test_read_images_one_stage_and_prepare_then_answer(local_ray: object, want: dict,
                                                       tmp_path: Path) -> None:
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i, data in enumerate(IMAGES):
        (folder / f"{i}.png").write_bytes(data)
    image_of = {str(folder / f"{i}.png"): str(i) for i in range(3)}
    ds = ray.data.read_images(str(folder), include_paths=True)
    one = ds.map_batches(Answerer, fn_constructor_kwargs={"policy": POLICY,
                                                          "id_column": "path"},
                         compute=pool(), batch_size=3)
    check(one.take_all(), want, image_of)
    # two actor pools and the read tasks on 2 CPUs: each stage asks for half of one
    two = ds.map_batches(Preparer, fn_constructor_kwargs={"id_column": "path"},
                         compute=pool(), batch_size=2, num_cpus=0.5) \
            .map_batches(Answerer, fn_constructor_kwargs={"policy": POLICY, "prepared": True},
                         compute=pool(), batch_size=3, num_cpus=0.5)
    check(two.take_all(), want, image_of)


@pytest.mark.slow  # ~16 s
def test_read_webdataset_and_embeddings(local_ray: object, want: dict, tmp_path: Path) -> None:
    if not hasattr(ray.data, "read_webdataset"):
        pytest.skip(f"Ray {ray.__version__} has no ray.data.read_webdataset")
    shard = tmp_path / "s.tar"
    with tarfile.open(shard, "w") as t:
        for i, data in enumerate([*IMAGES, b"broken"]):
            info = tarfile.TarInfo(f"k{i}.png")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    ds = ray.data.read_webdataset(str(shard), decoder=None)  # the members' encoded bytes
    rows = ds.map_batches(Answerer, fn_constructor_kwargs={
        "policy": POLICY, "image_column": "png", "id_column": "__key__"},
        compute=pool(), batch_size=4).take_all()
    check([r for r in rows if r["id"] != "k3"], want, {f"k{i}": str(i) for i in range(3)})
    assert {r["error_kind"] for r in rows if r["id"] == "k3"} == {"decode"}

    emb = ds.map_batches(Embedder, fn_constructor_kwargs={"image_column": "png",
                                                          "id_column": "__key__"},
                         compute=pool(), batch_size=4).take_all()
    with vlmbatch.VLM(vlmbatch.EMBED_MODEL) as vlm:
        ref = list(vlm.embed_many([(im, None) for im in IMAGES]))
    by_id = {r["id"]: r for r in emb}
    for i, e in enumerate(ref):
        got = np.asarray(by_id[f"k{i}"]["embedding"], np.float32)
        assert e.vector is not None and got.shape == e.vector.shape
        assert np.abs(got - e.vector).max() <= 1e-5 and by_id[f"k{i}"]["tokens"] == e.tokens
    assert by_id["k3"]["embedding"] is None and by_id["k3"]["error_kind"] == "decode"


def test_lists_and_clips_in_rows_answer_as_the_local_path(local_ray: object,
                                                          tmp_path: Path) -> None:
    """Rows with an ``image``, an ``images`` list or a ``video`` (sampled by the row's
    ``num_frames``/``fps`` columns) answer with ``VLM.ask_many``'s P(yes) on the same items
    (the local path), clips with the frames transformers' InternVL rule gives (written here
    by hand: the middle of each of n equal segments of 20 frames at 25 fps); a row with two
    media or a bad clip is its row's error; the schema has ``frames``/``seconds`` (null off
    clips)."""
    from tests.preprocessing.video_clips import FFV1_MKV, frames, make_clip

    clip = make_clip(frames(20, 64, 48), FFV1_MKV)
    qs = [{"id": "red", "text": "Is there a red shape?"}]
    rows = [("still", IMAGES[0], None, None, None, None),
            ("pair", None, [IMAGES[1], IMAGES[2]], None, None, None),
            ("clip4", None, None, clip, 4, None),
            ("clip_fps", None, None, clip, None, 2.5),
            ("both", IMAGES[0], None, clip, None, None),
            ("bad", None, None, b"not a clip", 2, None)]
    path = tmp_path / "media.parquet"
    names = ["key", "image", "images", "video", "num_frames", "fps"]
    types = [pa.string(), pa.binary(), pa.list_(pa.binary()), pa.binary(), pa.int64(),
             pa.float64()]
    pq.write_table(pa.table({n: pa.array([r[i] for r in rows], t)
                             for i, (n, t) in enumerate(zip(names, types))}), path)
    ds = ray.data.read_parquet(str(path)).map_batches(
        Answerer, fn_constructor_kwargs={"questions": qs, "id_column": "key"},
        compute=pool(), batch_size=6, batch_format="numpy")
    table = ds.to_arrow_refs()
    got_tables = [ray.get(t) for t in table]
    assert all(t.schema.field("frames").type == pa.int64() for t in got_tables)
    assert all(t.schema.field("seconds").type == pa.list_(pa.float64()) for t in got_tables)
    got = {r["id"]: r for t in got_tables for r in t.to_pylist()}

    with vlmbatch.VLM(decode_timeout=0) as vlm:  # the local path, on threads
        want = {a.image_id: a for a in vlm.ask_many([
            vlmbatch.ImageItem("still", IMAGES[0], qs),
            vlmbatch.ImageItem("pair", [IMAGES[1], IMAGES[2]], qs),
            vlmbatch.ImageItem("clip4", vlmbatch.video(clip, num_frames=4), qs),
            vlmbatch.ImageItem("clip_fps", vlmbatch.video(clip, fps=2.5), qs)])}
    for k, w in want.items():
        assert w.error is None and got[k]["error"] is None, got[k]
        assert abs(got[k]["p_yes"] - w.p_yes) <= 2e-6 and got[k]["answer"] == w.answer, k
    assert got["still"]["frames"] is None and got["pair"]["seconds"] is None
    assert got["clip4"]["frames"] == 4
    assert got["clip4"]["seconds"] == [i / 25 for i in (2, 7, 12, 17)]
    # 2.5 fps of 20 frames at 25 fps: int(20 / 25 * 2.5) = 2 segments (the row's fps)
    assert got["clip_fps"]["seconds"] == [i / 25 for i in (5, 15)]
    for k in ("clip4", "clip_fps"):
        assert got[k]["frames"] == want[k].frames and tuple(got[k]["seconds"]) == want[k].seconds
    assert got["both"]["error_kind"] == "source" and "more than one" in got["both"]["error"]
    assert got["bad"]["error_kind"] == "decode" and got["bad"]["frames"] is None


def test_preparer_then_answerer_take_lists_and_clips(tmp_path: Path) -> None:
    """The two-stage form on the same rows, each stage called in this process (what an
    actor runs, without Ray's start-up): a list's and a clip's ``MediaItem`` pickled by the
    ``Preparer`` and answered by an ``Answerer(prepared=True)`` as ``VLM.ask_many`` answers
    them; the clip sampled by the row's ``num_frames``."""
    from tests.preprocessing.video_clips import FFV1_MKV, frames, make_clip

    clip = make_clip(frames(20, 64, 48), FFV1_MKV)
    qs = [{"id": "red", "text": "Is there a red shape?"}]
    batch = {"key": np.array(["pair", "clip", "bad"], object),
             "images": np.array([np.array([IMAGES[1], IMAGES[2]], object), None, None], object),
             "video": np.array([None, clip, b"not a clip"], object),
             "num_frames": np.array([np.nan, 4.0, np.nan])}  # pandas' int column with nulls
    prepared = Preparer(id_column="key", decode_timeout=0)(batch)
    answerer = Answerer(questions=qs, prepared=True, decode_timeout=0)
    got = {r["id"]: r for r in answerer(prepared.to_pydict()).to_pylist()}
    with vlmbatch.VLM(decode_timeout=0) as vlm:
        want = {a.image_id: a for a in vlm.ask_many([
            vlmbatch.ImageItem("pair", [IMAGES[1], IMAGES[2]], qs),
            vlmbatch.ImageItem("clip", vlmbatch.video(clip, num_frames=4), qs)])}
    for k, w in want.items():
        assert abs(got[k]["p_yes"] - w.p_yes) <= 2e-6 and got[k]["frames"] == w.frames, k
    assert got["clip"]["seconds"] == [i / 25 for i in (2, 7, 12, 17)]
    assert got["bad"]["error_kind"] == "decode" and got["pair"]["frames"] is None
