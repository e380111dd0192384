"""The command layer: every option declared once, on the config field it fills, and every
command's parser made of what its config roots take.

Each option of each command is typed alone (with what its config needs beside it) and must
land in its field, changing it from the command line without it; an option string names one
declaration in a command, and an option of a shared sub-config (model, engine, images,
executor, embeddings) one declaration in all of them. The messages of issue 38 (units in
metavars, a misspelt option, ``embed --help``, a hub id given as ``--model``) are here too.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from vlmbatch.cli.args import BY_NAME, COMMANDS, Command, CommandLine, build_parser, parse
from vlmbatch.cli.commands import EXIT_BAD_INPUT
from vlmbatch.cli.config import ResumeConfig
from vlmbatch.cli.main import main
from vlmbatch.cli.model_commands import typed_run_config
from vlmbatch.common.options import Declared, build, declared, opt
from vlmbatch.engine.config import ConfigError, EmbedConfig, EngineConfig, ModelConfig
from vlmbatch.jobs.config import ExecutorConfig, RayOptions, RunConfig
from vlmbatch.models.paths import DEFAULT_MODEL
from vlmbatch.pipeline.config import PrepareConfig
from vlmbatch.server.config import ServerConfig, server_config

ROOT = Path(__file__).resolve().parents[2]
SHARED = (ModelConfig, EngineConfig, EmbedConfig, PrepareConfig, ExecutorConfig, RayOptions)

# a value of each kind of option (by metavar), different from every default
VALUES = {"N": "5", "TOKENS": "7", "MIB": "3", "MS": "2", "SECONDS": "5", "PIXELS": "100",
          "FACTOR": "1.5", "CPUS": "1.5", "DEVICE": "cuda:1", "ADDRESS": "head:1",
          "HOST": "0.0.0.0", "PORT": "9", "KEY": "k", "NAME": "m", "CHARS": "9", "TEXT": "Q: ",
          "COLUMN": "c", "WORD,WORD": "si,oui", "HOST,HOST": "a.com", "P": "0.5", "R": "0.5",
          "F": "0.5", "FILE": "f.jsonl", "P.yaml": "p.yaml", "PATH": "o.jsonl",
          "IMAGE": "a.png", "D": "1.5", "URL": "http://127.0.0.1:9", "TOKEN": "t",
          "TITLE|ID": "p", "OLD_JOB": "old", "K": "3", "WxH,...": "96x96",
          "FIELD=V,V": "prefix_cache=on,off"}
POSITIONAL = {"manifest": ["m.jsonl"], "results": ["r.jsonl"], "texts": ["hello"]}
# what each command needs typed to be valid: (option key -> tokens)
BASE: dict[str, dict[str, list[str]]] = {
    "run": {"manifest": ["m.jsonl"]},
    "submit": {"manifest": ["m.jsonl"], "job": ["--job", "{dir}"]},
    "report": {"job": ["{dir}"], "out": ["-o", "r.html"]},
    "calibrate": {"results": ["r.jsonl"], "labels": ["--labels", "l.jsonl"], "f1": ["--f1"]},
    "quantize": {"method": ["--method", "rtn"], "calib": ["--calib", "c.jsonl"],
                 "out": ["--out", "{dir}"]},
    "export-vit": {"out": ["--out", "{dir}"]},
    "review": {"action": ["export"], "source": ["{dir}"]},
    **{c: {"job": ["{dir}"]} for c in ("status", "cancel", "resume", "results")},
}
RAY = {"executor": ["--executor", "ray"]}
EMBEDDING = {"task": ["--task", "embed"]}
TABLE = {"manifest": ["t.parquet"]}
# what an option needs beside it (None: leave that base entry out); entries for options the
# command does not have are skipped
BESIDE: dict[str, dict[str, list[str] | None]] = {
    "ignore_eos": {"max_new_tokens": ["--max-new-tokens", "2"]},
    "segment_stride": {"segment_seconds": ["--segment-seconds", "8"]},
    "address": RAY, "preprocess_workers": RAY, "model_workers": RAY, "model_cpus": RAY,
    "force_dimensions": {"dimensions": ["--dimensions", "8"], **EMBEDDING},
    **{k: EMBEDDING for k in ("pooling", "dimensions", "multi_vector", "prompt",
                              "query_prefix", "document_prefix")},
    "images": {"manifest": None, "policy": ["--policy", "p.yaml"]},
    "image_column": TABLE, "id_column": TABLE, "questions_column": TABLE,
    "precision": {"f1": None}, "recall": {"f1": None}, "max_fpr": {"f1": None},
    "policy": {"manifest": ["m.jsonl"]}, "json": {"manifest": ["m.jsonl"]},
    "limit": {"eval": ["--eval"]},
    "token": {"url": ["--url", "http://127.0.0.1:9"]},
    "project": {"url": ["--url", "http://127.0.0.1:9"]},
    "allowed_media_domains": {"allow_remote_media": ["--allow-remote-media"]},
}


def root_of(cmd: Command, d: Declared) -> type:
    return next(r for r in cmd.roots if any(x.option is d.option for x in declared(r)))


def build_root(root: type, line: CommandLine, tmp: Path) -> Any:
    """The root as the command builds it."""
    if root is RunConfig:
        return typed_run_config(line)
    if root is ServerConfig:
        return server_config(line.typed)
    if root is ResumeConfig and line.command == "run":
        return build(ResumeConfig, line.typed, job=tmp)
    return build(root, line.typed)


def at(cfg: Any, path: str) -> Any:
    for name in path.split("."):
        cfg = getattr(cfg, name)
    return cfg


def sample(d: Declared, tmp: Path) -> list[str]:
    """``d`` typed with a value unlike its default."""
    o = d.option
    if o.positional:
        return [str(tmp)] if o.key in ("job", "images") else POSITIONAL[o.key]  # images: bench
    if o.action not in ("store", "append"):  # append: bench --sweep, typed once here
        return [o.flags[0]]
    if o.key == "model":
        return [o.flags[0], str(DEFAULT_MODEL)]  # read when a run is configured
    if o.choices is not None:
        return [o.flags[0], str(next(c for c in o.choices if str(c) != d.default))]
    if isinstance(o.metavar, tuple):  # one value each (--maxsim QUERIES DOCS)
        return [o.flags[0], *(f"{m.lower()}.txt" for m in o.metavar)]
    return [o.flags[0], str(tmp) if o.metavar == "DIR" else VALUES[str(o.metavar)]]


def argvs(cmd: Command, d: Declared, tmp: Path) -> tuple[list[str], list[str]]:
    """(the command line typing ``d``, the same without it)."""
    keys = {x.option.key for x in cmd.options()}
    parts = dict(BASE.get(cmd.name, {}))
    for k, tokens in BESIDE.get(d.option.key, {}).items():
        if k in keys and tokens is None:
            parts.pop(k, None)
        elif k in keys:
            parts[k] = tokens
    mine = parts.pop(d.option.key, None)  # needed anyway: typed as BASE has it
    rest = [t.format(dir=tmp) for tokens in parts.values() for t in tokens]
    own = sample(d, tmp) if mine is None else [t.format(dir=tmp) for t in mine]
    if mine is not None and d.option.positional:  # positionals keep their order (review)
        at = list(BASE[cmd.name]).index(d.option.key)
        ahead = [t for tokens in list(parts.values())[:at] for t in tokens]
        return [cmd.name, *ahead, *own, *rest[len(ahead):]], [cmd.name, *rest]
    return [cmd.name, *rest, *own], [cmd.name, *rest]


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: c.name)
def test_each_option_fills_its_field(cmd: Command, tmp_path: Path) -> None:
    """Every option of every command, typed alone, reaches the field it is declared on (and
    changes it): nothing a parser takes is dropped or lands elsewhere."""
    for d in cmd.options():
        if d.hidden:
            continue
        typed, without = argvs(cmd, d, tmp_path)
        root = root_of(cmd, d)
        line = parse(typed)
        got = at(build_root(root, line, tmp_path), d.path)
        value = line.typed[d.option.key]
        value = tuple(value) if isinstance(value, list) else value
        assert got in (value, Path(str(value))), (typed, d.path, got, value)
        if d.option.key in ("manifest", "images", *BASE.get(cmd.name, {})) \
                or d.option.exclusive is not None:
            continue  # what the command needs (one of): without it there is no config
        assert got != at(build_root(root, parse(without), tmp_path), d.path), typed


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: c.name)
def test_each_parser_takes_what_its_roots_declare(cmd: Command) -> None:
    """The parser's arguments are the roots' declared fields less what the command omits,
    each under one declaration; what it omits is declared there (not a stale name)."""
    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices[cmd.name]
    dests = {a.dest for a in parser._actions if a.dest != "help"}
    want = {d.option.key for r in cmd.roots for d in declared(r) if not cmd.omits(d.path)}
    assert dests == want
    paths = {d.path for r in cmd.roots for d in declared(r)}
    assert all(any(p == o or p.startswith(o + ".") for p in paths) for o in cmd.omit)


def test_an_option_string_is_one_declaration() -> None:
    """Within a command one flag is one declaration; an option of a shared sub-config is the
    same declaration wherever it appears, and no other declaration takes its flags (a
    command's own flags, such as ``--out``, may mean different things in different
    commands)."""
    shared = {id(d.option): d.option for c in SHARED for d in declared(c)}
    by_flag: dict[str, set[int]] = {}
    for cmd in COMMANDS:
        for d in cmd.options():  # raises on two declarations of one flag
            for flag in d.option.flags:
                by_flag.setdefault(flag, set()).add(id(d.option))
    for flag, ids in by_flag.items():
        if ids & shared.keys():
            assert len(ids) == 1, flag
    ray = [d.option for d in declared(RayOptions)]
    for name in ("run", "submit", "resume", "serve"):
        assert [d.option for d in BY_NAME[name].options() if d.option in ray] == ray


def test_a_second_declaration_of_a_flag_is_refused() -> None:
    @dataclass(frozen=True)
    class Other:
        threads: int = field(default=1, metadata=opt("--threads", help="another"))

    with pytest.raises(ValueError, match="--threads is declared twice"):
        Command("x", "", "", (RunConfig, Other)).options()


def test_ray_options_need_the_ray_executor_everywhere(capsys: pytest.CaptureFixture) -> None:
    """One check, one message, for run, resume and serve (the server had its own)."""
    says = "--model-workers: Ray executor options; add --executor ray"
    with pytest.raises(ConfigError, match=says):
        ExecutorConfig(ray=RayOptions(model_workers=2))
    with pytest.raises(ConfigError, match=says):
        server_config(parse(["serve", "--model-workers", "2"]).typed)
    assert main(["resume", str(ROOT), "--model-workers", "2"]) == EXIT_BAD_INPUT
    assert says in capsys.readouterr().err


def test_a_run_builds_its_config_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """One ``run`` command line: each config of its tree built from what was typed once
    (the CLI used to build the executor's three times, throwing one away), and handed to
    the runner as built."""
    import vlmbatch.cli.model_commands as commands
    import vlmbatch.common.options as options
    from vlmbatch.cli.run import RunSummary
    from vlmbatch.engine.base import EngineSummary

    built: list[str] = []
    original = options.build

    def counted(cls: type, *args: Any, **kw: Any) -> Any:
        built.append(cls.__name__)
        return original(cls, *args, **kw)

    monkeypatch.setattr(options, "build", counted)  # its own recursion into sub-configs too
    monkeypatch.setattr(commands, "build", counted)
    ran: list[RunConfig] = []

    def run(cfg: RunConfig, hooks: object) -> RunSummary:
        ran.append(cfg)
        return RunSummary(0, 0, 0, 0, 1.0, EngineSummary(0, 0, 0.0))

    monkeypatch.setattr(commands, "run", run)
    assert main(["run", str(ROOT / "examples/manifest.jsonl"), "--cache-mib", "5",
                 "--no-progress"]) == 0
    assert sorted(built) == ["EmbedConfig", "EngineConfig", "ExecutorConfig", "ModelConfig",
                             "PrepareConfig", "RayOptions", "RunConfig"]
    (cfg,) = ran
    assert cfg.engine.cache_bytes == 5 << 20 and not cfg.progress


# issue 38, item 6: help and messages

def test_metavars_name_the_units_typed(capsys: pytest.CaptureFixture) -> None:
    for argv, shows in ((["run"], ("--cache-mib MIB", "--max-image-mib MIB",
                                   "--decode-timeout SECONDS")),
                        (["serve"], ("--batch-wait-ms MS", "--max-body-mib MIB"))):
        with pytest.raises(SystemExit):
            main([*argv, "--help"])
        out = capsys.readouterr().out
        assert all(s in out for s in shows), out
    for cmd in COMMANDS:
        for d in cmd.options():
            o = d.option
            if o.positional or o.action != "store":
                continue
            assert o.metavar is not None or o.choices is not None, o.name  # never a dest
            unit = {"-mib": "MIB", "-ms": "MS"}.get("-" + o.name.rsplit("-", 1)[-1])
            if unit is not None:
                assert o.metavar == unit, o.name
            if o.help.startswith("seconds"):
                assert o.metavar == "SECONDS", o.name


def test_a_misspelt_option_gets_its_commands_usage_and_a_suggestion(
        capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        main(["run", "m.jsonl", "--polcy", "p.yaml"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("usage: vlmbatch run ")
    assert "unrecognized arguments: --polcy p.yaml (did you mean --policy?)" in err
    with pytest.raises(SystemExit):
        main(["run", "m.jsonl", "--dtype", "flot32"])
    assert "(did you mean float32?)" in capsys.readouterr().err


def test_embed_help_lists_what_embed_uses(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["embed", "--help"])
    out = capsys.readouterr().out
    for answer_only in ("--yes", "--no ", "--choice-scoring", "--max-new-tokens",
                        "--ignore-eos", "--allowed-media-domains"):
        assert answer_only not in out
    model = out[out.index("  --model DIR"):out.index("  --device")]
    assert "(default: the built-in embedding model)" in " ".join(model.split())
    with pytest.raises(SystemExit):
        main(["embed", "x", "--yes", "si"])
    assert "unrecognized arguments: --yes si" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["run", str(ROOT / "examples/manifest.jsonl")],
                                  ["embed", "hello"]])
def test_a_hub_id_as_model_says_nothing_is_downloaded(argv: list[str],
                                                      capsys: pytest.CaptureFixture) -> None:
    assert main([*argv, "--model", "OpenGVLab/InternVL3-1B"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "downloads nothing" in err
    assert ("`huggingface-cli download OpenGVLab/InternVL3-1B --local-dir ./InternVL3-1B`, "
            "then pass --model ./InternVL3-1B") in err


# what main's code (before the command layer) serialised for RunConfig(manifest="m.jsonl",
# engine=EngineConfig(cache_bytes=3 << 20, yes_words=("si", "oui")),
# prepare=PrepareConfig(max_image_bytes=2 << 20)): job.json's config, version 6 (with
# --resize's "resize" and --max-video-seconds' "max_video_seconds" since; a file without
# them reads back with the defaults; "dtype" "auto" is
# the default since round 4: the job folder stores what it resolved to, jobs/folder.py)
JOB_JSON = (
    '{"manifest": "m.jsonl", "images": null, "dataset": null, "image_column": "image", '
    '"id_column": null, "questions_column": null, "policy": null, "out": null, '
    '"images_per_batch": 16, "threads": null, "progress": true, "model": {"path": null, '
    '"device": "cpu", "dtype": "auto", "max_tiles": null, "tiling": "reduced", '
    '"resize": "opencv", "upscale_limit": 1.0, "max_image_tokens": null, "llm_quant": "none", '
    '"quant": "none"}, '
    '"engine": {"engine": "torch", "vit_backend": "auto", "cuda_graphs": true, '
    '"max_batch_tokens": 8192, "max_batch_tiles": 64, "vit_max_batch": 32, "compile_llm": '
    'false, "prefix_cache": true, "block_size": 16, "cache_bytes": 3145728, '
    '"max_new_tokens": 0, "ignore_eos": false, "yes_words": ["si", "oui"], "no_words": '
    '["no", "No", "NO", "\\u5426"], "choice_scoring": "exact", "question_rows": "auto"}, '
    '"prepare": {"max_pixels": 100000000, "preprocess_threads": null, "decode_timeout": '
    '30.0, "fetch_concurrency": 32, '
    '"fetch_timeout": 30.0, "fetch_retries": 3, "max_image_bytes": 2097152, "media_guard": '
    'false, "allowed_media_domains": [], "max_video_seconds": 3600.0}, "executor": {"kind": '
    '"local", "ray": {"address": '
    'null, "preprocess_workers": 1, "model_workers": 1, "model_cpus": 1.0}}, "task": '
    '"answer", "embed": {"pooling": null, "dimensions": null, "force_dimensions": false, '
    '"multi_vector": null, "prompt": null, "query_prefix": "", "document_prefix": ""}}')


def test_a_job_json_reads_and_writes_as_before(tmp_path: Path) -> None:
    """The RunConfig a command line builds serialises as main's code did (job.json, version
    6: the same keys, order and values), and reads back equal."""
    from vlmbatch.jobs.config import from_json, to_json

    cfg = typed_run_config(parse(["submit", "m.jsonl", "--job", str(tmp_path), "--cache-mib", "3",
                            "--yes", "si,oui", "--max-image-mib", "2"]))
    assert json.dumps(to_json(cfg)) == JOB_JSON
    assert from_json(RunConfig, json.loads(JOB_JSON)) == cfg and RunConfig.VERSION == 6


def test_resize_mode_is_stored_and_older_job_files_read_the_default(tmp_path: Path) -> None:
    """--resize lands in job.json's model config and reads back; a job.json written before
    the option (no "resize" key) reads back with today's behaviour, opencv."""
    from vlmbatch.jobs.config import from_json, to_json

    cfg = typed_run_config(parse(["submit", "m.jsonl", "--job", str(tmp_path), "--resize",
                                  "reference"]))
    assert cfg.model.resize == "reference"
    assert from_json(RunConfig, json.loads(json.dumps(to_json(cfg)))) == cfg
    older = json.loads(JOB_JSON)
    del older["model"]["resize"]
    assert from_json(RunConfig, older).model.resize == "opencv"
    with pytest.raises(SystemExit):
        parse(["run", "m.jsonl", "--resize", "lanczos"])
