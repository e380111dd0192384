"""Job inputs: JSONL manifests, policy files (YAML/TOML) and folders of images.

Manifest line: ``{"id": ..., "image": <path | file:// URL | data: URL>, "questions": [...]}``;
instead of ``image``, ``"images": [...]`` (one prompt holding 1 to 64 images in order) or
``"video": <path | URL>`` with its sampling keys ``fps`` or ``num_frames``, and
``max_frames`` (``pipeline/media_inputs.py``; the run's ``--fps``... where a line gives
none);
where a question is a string or ``{"id", "text", "threshold"?, "max_new_tokens"?,
"choices"?, "prompt"?, "system"?, "expected"?}`` (``max_new_tokens``: also generate up to that
many answer tokens for this question, e.g. an explanation for the few questions that need
one; default the run's ``--max-new-tokens``; ``choices``: a label set of 2 to 64 distinct
non-empty strings, the answer the most probable of them instead of yes/no; ``prompt``: an
instruction placed before the question in its user turn; ``system``: a system turn;
``expected``: the user's label, ``"yes"`` or ``"no"`` (one of its choices for a label-set
question), which only ``vlmbatch eval MANIFEST`` reads). Relative paths are resolved against
the manifest's folder. A policy names questions applied to every image, and may give them a
system turn (a question's own ``system`` wins):

    system: You are a content moderator.
    questions:
      - {id: red, text: "Is there a red shape?", threshold: 0.5}
      - {id: beds, text: "Are there more than 3 beds? Answer yes or no, then explain.",
         max_new_tokens: 64}
      - {id: category, text: "Which category fits the image best?",
         choices: [safe, sexual, violence, hate]}

A line has no other keys, a policy no other top-level keys than ``questions`` and
``system``, a question object no other keys than those above: an unknown key at any level is
refused (``pipeline/questions.py`` ``check_keys``: the key, the keys allowed there, a close
match), never ignored with what it held (a misspelt ``questions`` would otherwise leave the
line only the policy's questions). Validation is complete before any work starts: a
malformed line raises ``ManifestError`` naming the file and line number. Reading image bytes
happens later, per item, so a missing image is that item's error, not the job's.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml

from vlmbatch.inputs.errors import check_unicode
from vlmbatch.inputs.openai_batch import is_openai_request, parse_request
from vlmbatch.pipeline.media_inputs import (
    SAMPLING_KEYS,
    ImageList,
    VideoInput,
    check_images,
    check_sampling,
)
from vlmbatch.pipeline.questions import (
    QUESTION_KEYS,
    ManifestError,
    PromptLimits,
    Question,
    brief,
    check_id,
    check_keys,
    parse_question,
)
from vlmbatch.pipeline.records import ImageItem, ItemMedia

LINE_KEYS = frozenset({"id", "image", "images", "video", "questions", "per_image",
                       *SAMPLING_KEYS})
POLICY_KEYS = frozenset({"questions", "system"})
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff"}


def _questions(raw: object, where: str, prefix: str = "q") -> tuple[Question, ...]:
    """Questions without an id get ``{prefix}{index}``: q0, q1... in a manifest line,
    p0, p1... in a policy, so the two never collide by default."""
    if not isinstance(raw, list):
        raise ManifestError(f"{where}: 'questions' must be a list, got {type(raw).__name__}")
    qs = tuple(parse_question(q, where, i, prefix) for i, q in enumerate(raw))
    ids = [q.id for q in qs]
    if len(set(ids)) != len(ids):
        raise ManifestError(f"{where}: question ids repeat: {brief(ids)}")
    return qs


def read_policy(path: Path) -> tuple[Question, ...]:
    """Questions of a YAML (.yaml/.yml) or TOML (.toml) policy file."""
    path = Path(path)
    if path.is_dir():
        raise ManifestError(f"policy {path} is a folder; give the policy's .yaml/.toml file")
    if not path.is_file():
        raise ManifestError(f"policy file {path} not found")
    try:
        text = path.read_text(encoding="utf-8-sig")  # a BOM is tolerated
    except UnicodeDecodeError as e:
        raise ManifestError(f"{path}: not UTF-8 ({e.reason} at byte {e.start}); save the "
                            "policy as UTF-8") from None
    if path.suffix not in (".toml", ".yaml", ".yml"):
        raise ManifestError(f"{path}: policy must be .yaml, .yml or .toml")
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (yaml.YAMLError, ValueError, RecursionError) as e:  # TOMLDecodeError: a ValueError
        raise ManifestError(f"{path}: cannot parse policy: {_reason(e)}") from None
    return policy_questions(data, str(path))


def policy_questions(data: object, where: str) -> tuple[Question, ...]:
    """Questions of a policy already parsed (``{"questions": [...], "system": ...}``, as a
    policy file holds it); ``where`` names it in errors."""
    if not isinstance(data, dict) or "questions" not in data:
        raise ManifestError(f"{where}: a policy needs a top-level 'questions' list")
    check_keys(data, POLICY_KEYS, where, "a policy", inner=("a question object",
                                                             QUESTION_KEYS))
    system = data.get("system")
    if system is not None and (not isinstance(system, str) or not system.strip()):
        raise ManifestError(f"{where}: system must be a non-empty string, got {brief(system)}")
    qs = tuple(q if q.system is not None else dataclasses.replace(q, system=system)
               for q in _questions(data["questions"], where, prefix="p"))
    check_unicode((s for q in qs for s in _texts(q)), where)
    if not qs:
        raise ManifestError(f"{where}: the policy has no questions")
    return qs


def _texts(q: Question) -> list[str]:
    """Every string of a question (what the results file and the prompt will hold)."""
    return [q.id, q.text, *q.choices, *(t for t in (q.system, q.prompt) if t is not None)]


def read_manifest(path: Path, policy: tuple[Question, ...] = (),
                  limits: PromptLimits | None = None) -> list[ImageItem]:
    """Parse and validate every line; policy questions follow each line's own questions."""
    items: list[ImageItem] = []
    seen: dict[str, int] = {}  # id -> line
    for lineno, item in iter_manifest(path, policy, limits=limits):
        if (first := seen.setdefault(item.id, lineno)) != lineno:
            raise ManifestError(f"{path}:{lineno}: id {brief(item.id)} appears twice (first "
                                f"on line {first})")
        items.append(item)
    return items


def iter_manifest(path: Path, policy: tuple[Question, ...] = (), merge: bool = False,
                  limits: PromptLimits | None = None) -> Iterator[tuple[int, ImageItem]]:
    """(line number, item) for each line, validated as read, in bounded memory. Duplicate
    ids are the caller's check (``read_manifest`` keeps a set; the job store a UNIQUE key).
    ``merge``: a policy question with the id of a line's is that question (``with_policy``),
    as ``vlmbatch eval`` reads it. ``limits``: each question's length checked, the error
    naming the line."""
    path = Path(path)
    if path.is_dir():
        raise ManifestError(f"{path} is a folder, not a manifest (nor a job folder): for a "
                            "folder of images use --images DIR --policy FILE")
    if not path.is_file():
        raise ManifestError(f"manifest {path} not found")
    # absolute: a job stores its items and may run from another working directory
    base_dir = path.parent.absolute()
    fmt: dict[str, str] = {}
    n = 0
    with path.open("rb") as f:
        for lineno, raw_line in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:  # a BOM (Windows editors write one) is tolerated, as in a policy
                line = raw_line.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ManifestError(f"{where}: not UTF-8 ({e.reason} at byte {e.start})") from e
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ManifestError(f"{where}: not valid JSON ({e.msg})") from e
            except (ValueError, RecursionError) as e:  # 4,300+ digit numbers; deep nesting
                raise ManifestError(f"{where}: not valid JSON ({_reason(e)})") from None
            if not isinstance(rec, dict):
                raise ManifestError(f"{where}: each line must be a JSON object")
            item = _item(rec, where, lineno, base_dir, policy, merge)
            asked = [t for q in item.questions for t in _texts(q)]
            check_unicode([item.id, *_paths(item.image), *asked], where)
            if limits is not None:
                for q in item.questions:
                    limits.check(q, where)
            if (kind := "openai" if is_openai_request(rec) else "vlmbatch") != fmt.setdefault(
                    "kind", kind):
                raise ManifestError(f"{where}: mixes OpenAI batch requests and vlmbatch lines")
            n += 1
            yield lineno, item
    if not n:
        raise ManifestError(f"manifest {path} has no items")


def _item(rec: dict, where: str, lineno: int, base_dir: Path,
          policy: tuple[Question, ...], merge: bool = False) -> ImageItem:
    if is_openai_request(rec):
        if policy:
            raise ManifestError(f"{where}: a policy does not apply to OpenAI batch requests "
                                "(each request carries its own question)")
        return parse_request(rec, where, base_dir)
    check_keys(rec, LINE_KEYS, where, "a manifest line", inner=("a question object",
                                                                 QUESTION_KEYS))
    media = _media(rec, where)
    own = _questions(rec.get("questions", []), where)
    qs = with_policy(own, policy, where, "give 'questions' or --policy", "this line", merge)
    return ImageItem(check_id(rec.get("id", lineno), where, "id"), media, qs, base_dir)


def _media(rec: dict, where: str) -> ItemMedia:
    """A line's ``image``, ``images`` (one prompt holding them in order) or ``video`` (with
    its sampling keys): exactly one of them, each path or URL a non-empty string."""
    given = [k for k in ("image", "images", "video") if k in rec]
    if len(given) != 1:
        raise ManifestError(f"{where}: " + ("missing 'image' (a path, file:// or data: URL), "
                            "'images' (a list of them) or 'video' (a clip's)" if not given
                            else f"give one of {' / '.join(given)}, not several"))
    key = given[0]
    keys = [k for k in SAMPLING_KEYS if k in rec]
    if keys and key != "video":
        raise ManifestError(f"{where}: {', '.join(keys)} sample a clip: give 'video' with it")
    if "per_image" in rec and (key != "images" or not isinstance(rec["per_image"], bool)):
        raise ManifestError(f"{where}: 'per_image' (true: each image asked alone) goes with "
                            f"'images' and is true or false, got {brief(rec['per_image'])}")
    try:
        if key == "images":
            check_images(rec["images"], where, count=False)  # the count: the item's error
            for k, s in enumerate(rec["images"]):
                _path(s, f"{where}: images[{k}]")
            return ImageList(tuple(rec["images"]), bool(rec.get("per_image", False)))
        _path(rec[key], f"{where}: '{key}'")
        if key == "video":
            return VideoInput(rec["video"], check_sampling(rec, where))
    except ValueError as e:
        raise ManifestError(str(e)) from None
    return rec["image"]


def _path(value: object, what: str) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a path or URL (a non-empty string), got "
                         f"{brief(value)}")


def _paths(media: ItemMedia) -> list[str]:
    """A manifest item's paths or URLs (strings, as a line holds them)."""
    if isinstance(media, ImageList):
        return [s for s in media.images if isinstance(s, str)]
    src = media.source if isinstance(media, VideoInput) else media
    return [src] if isinstance(src, str) else []


def with_policy(own: tuple[Question, ...], policy: tuple[Question, ...], where: str,
                hint: str, holder: str = "this item", merge: bool = False
                ) -> tuple[Question, ...]:
    """An item's own questions, then the policy's: ManifestError naming ``where`` when an id
    is in both (``holder``: what holds the own ones) or there is none (``hint``: how to give
    some). One check for manifest lines, table rows, shard members and Ray Data rows.
    ``merge`` (``vlmbatch eval MANIFEST --policy``): an id in both is one question instead,
    asked as ``merged`` says."""
    if merge:
        by_id = {q.id: q for q in policy}
        own = tuple(merged(q, by_id[q.id], where) if q.id in by_id else q for q in own)
        policy = tuple(q for q in policy if q.id not in {q.id for q in own})
    clash = {q.id for q in own} & {q.id for q in policy}
    if clash:
        raise ManifestError(f"{where}: question id(s) {brief(sorted(clash))} are used by both "
                            f"{holder} and the policy; rename one")
    if not own + policy:
        raise ManifestError(f"{where}: no questions ({hint})")
    return own + policy


def merged(own: Question, policy: Question, where: str) -> Question:
    """A question a line and the policy both give (one id): the policy's threshold (what a
    policy written by ``calibrate`` is for), every other field the line's where it sets it,
    else the policy's. A text or label set that differs, or another field both set
    differently, is a contradiction: ManifestError naming ``where``, the id and the field."""
    def kind(q: Question) -> str:
        return f"a label set {brief(list(q.choices))}" if q.choices else "a yes/no question"

    for same, mine, theirs in ((own.text == policy.text, brief(own.text), brief(policy.text)),
                               (own.choices == policy.choices, kind(own), kind(policy))):
        if not same:
            raise ManifestError(f"{where}: question {own.id!r} is {mine} on this line but "
                                f"{theirs} in the policy; a policy's threshold holds for its "
                                "own question: give both the same, or another id")
    def one(name: str) -> Any:
        mine, theirs = getattr(own, name), getattr(policy, name)
        if mine is not None and theirs is not None and mine != theirs:
            raise ManifestError(f"{where}: question {own.id!r} has {name} {brief(mine)} on this "
                                f"line and {brief(theirs)} in the policy; give one")
        return mine if mine is not None else theirs

    return dataclasses.replace(own, threshold=policy.threshold, max_new_tokens=one(
        "max_new_tokens"), system=one("system"), prompt=one("prompt"), expected=one("expected"))


def first_line(path: Path, item_id: str, policy: tuple[Question, ...] = ()) -> int:
    """The line of the first item with ``item_id``, for a repeated id's message when the ids
    were not kept (a job's store finds the repeat): rescans, so call it on that error only."""
    return next(ln for ln, it in iter_manifest(path, policy) if it.id == item_id)


def manifest_format(path: Path) -> str:
    """"openai" if the manifest holds OpenAI batch requests, else "vlmbatch"."""
    with Path(path).open("rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    rec = json.loads(raw)
                except (ValueError, RecursionError):  # iter_manifest names what is wrong
                    return "vlmbatch"
                return "openai" if isinstance(rec, dict) and is_openai_request(rec) \
                    else "vlmbatch"
    return "vlmbatch"


def _reason(e: Exception) -> str:
    """A parser's exception in a few words (RecursionError's own message names no input)."""
    return "nested too deeply" if isinstance(e, RecursionError) else str(e).split("; use ")[0]


def items_from_folder(folder: Path, policy: tuple[Question, ...]) -> list[ImageItem]:
    """Every image file under ``folder`` (sorted, recursive), each asked the policy."""
    if not Path(folder).is_dir():
        raise ManifestError(f"image folder {folder} not found")
    folder = Path(folder).absolute()  # items keep it (see iter_manifest)
    if not policy:
        raise ManifestError("a folder of images needs --policy to say which questions to ask")
    files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise ManifestError(f"no image files ({', '.join(sorted(IMAGE_SUFFIXES))}) in {folder}")
    return [ImageItem(str(p.relative_to(folder)), str(p.relative_to(folder)), policy, folder)
            for p in files]


def label_sets(items: Iterable[object]) -> set[tuple[str, ...]]:
    """The distinct label sets asked of ``items`` (what ``check_label_sets`` checks)."""
    return {q.choices for it in items if isinstance(it, ImageItem) for q in it.questions
            if q.choices}
