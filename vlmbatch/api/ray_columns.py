"""The Ray Data stages' columns for items beyond one still image (issue 44), and the answer
rows' Arrow schema (``api/ray_data.py`` uses both).

In, per row, one of:

- ``image``: a cell as ``ray_data.image_cell`` reads it (bytes, a path or URL, uint8 pixels,
  an HF ``{"bytes", "path"}`` struct), as before;
- ``images``: a list of such cells (one prompt holding them in order, 1 to ``MAX_IMAGES``);
- ``video``: a clip's path or URL, its bytes, or an HF-style ``{"bytes", "path"}`` struct,
  sampled by the row's ``fps`` / ``num_frames`` / ``max_frames`` columns where they are not
  null (else the checkpoint's video processor's, ``preprocessing/video_plan.py``).

A row with none of them, with two, or with a bad cell or sampling value is that row's error
(kind ``source``, naming the row and the column), never the batch's. Sampling columns are
read only on a clip's row (a table's column is shared by all its rows: a still image's row
may hold a value there, ignored). Null is ``None`` or a float NaN (pandas' missing value).

Out: ``Answer.COLUMNS`` as before, then ``frames`` (int64) and ``seconds`` (list<double>), set
on a clip's rows and null on the others, so every batch has one Arrow schema.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from vlmbatch.pipeline.media_inputs import (
    SAMPLING_KEYS,
    ImageList,
    SamplingKeys,
    VideoInput,
    check_images,
    check_sampling,
)
from vlmbatch.pipeline.records import Answer, ErrorKind, ItemError, ItemMedia

CLIP_COLUMNS = ("frames", "seconds")  # after Answer.COLUMNS, in this order
Cell = Callable[[object], Any]  # ray_data.image_cell: a cell -> an image or its ItemError


def _pa() -> Any:
    import pyarrow  # optional dependency (Ray Data brings it)
    return pyarrow


def is_null(value: object) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def media_cells(cols: dict[str, list], n: int, names: tuple[str, str, str], ids: list[str],
                image_cell: Cell) -> list[ItemMedia | ItemError]:
    """Each row's media (module docstring): ``names`` are the (image, images, video) columns;
    a batch without the last two reads the image column as before (its messages included).
    KeyError when the batch has none of the three columns (a misconfiguration)."""
    image, images, video = names
    present = [c for c in names if c in cols]
    if not present:
        raise KeyError(f"none of the columns {list(names)} in the batch (columns: "
                       f"{sorted(cols)}): give image_column=, images_column= or video_column=")
    if present == [image]:
        return [image_cell(v) for v in cols[image]]
    out: list[ItemMedia | ItemError] = []
    for i in range(n):
        given = [c for c in present if not is_null(cols[c][i])]
        where = f"row {ids[i]}"
        if len(given) != 1:
            what = "none of" if not given else "more than one of"
            out.append(ItemError(ErrorKind.SOURCE, f"{where}: {what} the columns "
                                 f"{present} set; give one (an image, a list or a clip)"))
        elif given[0] == image:
            out.append(image_cell(cols[image][i]))
        elif given[0] == images:
            out.append(_image_list(cols[images][i], where, image_cell))
        else:
            out.append(_clip(cols[video][i], _sampling(cols, i), where))
    return out


def _image_list(value: object, where: str, image_cell: Cell) -> ImageList | ItemError:
    """A list cell (a list, or the object array Ray's numpy batches hold) as an ImageList."""
    cells: Any = list(value) if isinstance(value, (list, tuple)) or (
        isinstance(value, np.ndarray) and value.dtype == object) else value
    try:
        check_images(cells, f"{where}: images")
    except ValueError as e:
        return ItemError(ErrorKind.SOURCE, str(e))
    parts = []
    for k, c in enumerate(cells):
        got = image_cell(c)
        if isinstance(got, ItemError):
            return ItemError(got.kind, f"{where}: images[{k}]: {got.message}")
        parts.append(got)
    return ImageList(tuple(parts))


def _sampling(cols: dict[str, list], i: int) -> dict[str, Any]:
    """Row ``i``'s sampling values, null ones left out; a whole float (pandas' int column
    with a null in it) read as the whole number it is."""
    raw = {}
    for k in SAMPLING_KEYS:
        v = cols[k][i] if k in cols else None
        if is_null(v):
            continue
        if k != "fps" and isinstance(v, float) and v.is_integer():
            v = int(v)
        raw[k] = v
    return raw


def _clip(value: object, raw: dict[str, Any], where: str) -> VideoInput | ItemError:
    if isinstance(value, Mapping):  # {"bytes", "path"}, as an HF Image struct holds them
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytearray, memoryview)):
        value = bytes(value)
    if not isinstance(value, (str, bytes)) or not value:
        return ItemError(ErrorKind.SOURCE, f"{where}: no clip in the video cell: "
                         f"{type(value).__name__} (need a path/URL or the clip's bytes)")
    try:
        keys: SamplingKeys = check_sampling(raw, where)
    except ValueError as e:
        return ItemError(ErrorKind.SOURCE, str(e))
    return VideoInput(value, keys)


def answer_table(answers: Sequence[Answer]) -> Any:
    """``Answer.row``s plus each clip's ``frames``/``seconds`` as a ``pyarrow.Table`` of one
    fixed schema: ``Answer.COLUMNS`` (their names and order as every result file has them)
    then ``CLIP_COLUMNS``."""
    pa = _pa()
    types = {str: pa.string(), float: pa.float64(), int: pa.int64()}
    base = [(name, types[t]) for name, t in Answer.COLUMNS if name not in CLIP_COLUMNS]
    schema = pa.schema([*base, ("frames", pa.int64()), ("seconds", pa.list_(pa.float64()))])
    rows = []
    for a in answers:
        row = a.row()
        row["frames"] = a.frames
        row["seconds"] = None if a.seconds is None else list(a.seconds)
        rows.append(row)
    return pa.Table.from_pylist(rows, schema=schema)
