"""The ``vlmbatch`` command line, derived from the config roots' option declarations.

``COMMANDS`` lists each command with its help and the config roots it builds
(``cli/config.py``); its parser takes every option declared on those roots and their
sub-configs (``common/options.py``), less the ones the command does not use (``omit``), so
an option is written once, next to the field it fills. ``parse`` returns what was typed (a
``CommandLine``: the command and each typed option's value, nothing for options left out);
the command builds its config root from that, once (``common.options.build``), and every
cross-option check is that root's ``__post_init__``.

A misspelt option is reported with the command's own usage and the closest option
(``--polcy`` -> ``--policy``), a misspelt choice or command with the closest choice. Light:
it imports no torch, no model code and no server, so ``--help`` costs only the interpreter
and the config modules.
"""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

from vlmbatch.cli.bench.config import BenchConfig
from vlmbatch.cli.config import (
    CalibrateConfig,
    EmbedCommandConfig,
    EvalConfig,
    ExportVitConfig,
    JobConfig,
    QuantizeConfig,
    ReportConfig,
    ResultsConfig,
    ResumeConfig,
    ReviewConfig,
    SubmitConfig,
)
from vlmbatch.common.options import Declared, Option, declared
from vlmbatch.engine.config import EngineConfig
from vlmbatch.jobs.config import RunConfig
from vlmbatch.server.config import ServerConfig

SHORT_USAGE = 16  # a command with more options gets a short usage line (``_usage``)
SERVE_ONLY = ("prepare.allowed_media_domains",)  # the server's SSRF guard
ANSWER_ONLY = tuple(f"engine.{n}" for n in EngineConfig.ANSWER_ONLY)  # not embed's


@dataclass(frozen=True)
class Command:
    """One command: its help, the config roots it builds, and the dotted paths of those
    roots' declared fields (or sub-configs: all their fields) it does not take."""
    name: str
    help: str
    description: str
    roots: tuple[type, ...]
    omit: tuple[str, ...] = ()

    def options(self) -> list[Declared]:
        """Its options, in the roots' field order, each declaration once (a field of a later
        root taking the same option as an earlier one adds nothing). ValueError if two
        declarations share a flag: one flag, one declaration."""
        out: list[Declared] = []
        seen: set[int] = set()  # the declarations taken (by identity)
        by_flag: dict[str, Option] = {}
        for root in self.roots:
            for d in declared(root):
                if self.omits(d.path) or id(d.option) in seen:
                    continue
                seen.add(id(d.option))
                for flag in d.option.flags:
                    if by_flag.setdefault(flag, d.option) is not d.option:
                        raise ValueError(f"`{self.name}`: {flag} is declared twice "
                                         f"({d.path} and another field)")
                out.append(d)
        return out

    def omits(self, path: str) -> bool:
        return any(path == o or path.startswith(o + ".") for o in self.omit)


COMMANDS: tuple[Command, ...] = (
    Command("run", "answer a manifest's (or a folder's) questions -> JSONL; or run a "
            "submitted job",
            "Answer every question about every image; one JSONL line per (image, question) "
            "with answer, p_yes and error. Given a job folder (from `submit`), run its pending "
            "items instead: with a job only --threads, --preprocess-threads, --decode-timeout, "
            "the fetching options (default: as submitted), --retry-failed and the executor "
            "options may be given; the rest was fixed at submit.",
            (RunConfig, ResumeConfig), ("task", "embed", "job", *SERVE_ONLY)),
    Command("submit", "create a resumable job (SQLite store) from a manifest",
            "Validate the input and create a job folder: config + a store of every item. Run "
            "it with `vlmbatch run JOB` (or --wait).",
            (RunConfig, SubmitConfig), ("out", *SERVE_ONLY)),
    Command("status", "counts, QPM and ETA of a job", "counts, QPM and ETA of a job",
            (JobConfig,)),
    Command("cancel", "stop a running job after its batch",
            "stop a running job after its batch", (JobConfig,), ("json",)),
    Command("resume", "continue an interrupted job", "continue an interrupted job",
            (ResumeConfig,)),
    Command("results", "export a job's results as JSONL, CSV or Parquet",
            "Every recorded result line of a job, in manifest order.", (ResultsConfig,)),
    Command("eval", "accuracy on easy-vqa's test split (yes/no questions), or metrics on your "
            "own labelled manifest",
            "Without MANIFEST: accuracy of a model on easy-vqa's yes/no questions. With "
            "MANIFEST (questions carrying \"expected\"): ask its labelled questions and print "
            "accuracy and, per question, precision, recall, F1, AUROC and expected calibration "
            "error (10 bins), with a confusion matrix for label-set questions; --json for "
            "scripts. With --policy, at the policy's thresholds: calibrate on one labelled "
            "set, check the written policy on another.", (EvalConfig,), SERVE_ONLY),
    Command("calibrate", "thresholds from your labels: per yes/no question, the P(yes) "
            "threshold meeting a precision, recall or false-positive target",
            "Join result lines with your labels and choose, per yes/no question, the "
            "threshold (yes when p_yes >= it) that meets the target with the best other "
            "side: --precision P the highest recall at precision >= P, --recall R the highest "
            "precision at recall >= R, --max-fpr F the highest recall at a false-positive "
            "rate <= F, --f1 the best F1. Prints a table (threshold, precision, recall, "
            "support, whether the target is reachable; an unreachable one gets the closest "
            "point); --plots DIR writes PR and ROC curves, --write-policy a policy with the "
            "thresholds.", (CalibrateConfig,)),
    Command("report", "one self-contained HTML page about a job: counts, errors, P(yes) "
            "histograms, borderline images, right and wrong answers",
            "Write one HTML file (no outside resources: thumbnails embedded) with the job's "
            "counts, QPM and failed images by error kind; per question its yes-rate and "
            "P(yes) histogram on a log-odds axis (a label-set question: its label "
            "distribution), a contact sheet of its borderline images (log-odds within 1 of the "
            "threshold's; a label set: its top two choices within a factor e), or a line "
            "saying none is near; when the manifest's questions carried \"expected\", each "
            "answer shown marked right or wrong, the counts of each and a sheet of the most "
            "confident wrong answers.",
            (ReportConfig,)),
    Command("review", "people in the loop: a job's answers as Label Studio tasks (export), "
            "their decisions as labels (import)",
            "export JOB: one Label Studio task per image with the model's answers as "
            "predictions (model_version: the model's fingerprint; score: the log-odds distance "
            "to the nearest threshold, so Label Studio's lowest-first order shows the most "
            "borderline first) and, with --config-out, the labelling configuration; --url "
            "imports them into a project. import EXPORT: a JSON or JSON_MIN export (or --url) "
            "as the labels file `calibrate --labels` and `eval` read: cancelled annotations "
            "skipped, the latest per image and question kept, disagreements reported. "
            "docs/labels.md.", (ReviewConfig,)),
    Command("quantize", "write a W4A16 (AWQ/GPTQ) copy of a model, calibrated on your images",
            "Quantise the language model's decoder linears to 4-bit weights (symmetric, per "
            "group) with AWQ or GPTQ, calibrated on the questions of a manifest, and write a "
            "compressed-tensors checkpoint that `vlmbatch run --model OUT` serves. The vision "
            "encoder stays as it is (see --vit-backend onnxruntime-int8). Calibration runs in "
            "float32 on --device.", (QuantizeConfig,)),
    Command("export-vit", "export the vision encoder to ONNX and check it",
            "ONNX of the vision encoder (uint8 tiles in, embeddings out, dynamic batch), "
            "checked with onnxruntime against torch. `run --vit-backend onnxruntime` exports "
            "on the fly; this file is for other runtimes, TensorRT's builder (docs/vision.md) "
            "or inspection.", (ExportVitConfig,)),
    Command("serve", "an OpenAI-compatible server: chat completions with P(yes), embeddings, "
            "files and batches (docs/server.md)",
            "Serve the model over HTTP: /v1/chat/completions (yes/no with P(yes) in logprobs), "
            "/v1/embeddings (--embed-model), /v1/files + /v1/batches of either (each batch a "
            "resumable job), /v1/models, /health. --images-per-batch is a batch job's group, "
            "the most an interactive request waits behind.", (ServerConfig,)),
    Command("embed", "texts, images or a manifest -> embeddings (JSONL, Parquet, .npy), -sim, "
            "--maxsim, --eval",
            "Unit vectors for texts (arguments, else standard input, one per line), image "
            "files (--images) or a JSONL manifest of {\"id\", \"image\"?, \"text\"?} "
            "(--manifest); default model: the built-in embedding model. docs/embeddings.md.",
            (EmbedCommandConfig,), (*ANSWER_ONLY, *SERVE_ONLY)),
    Command("bench", "QPM of your model on your device and images, over a sweep of engine "
            "options (docs/bench.md)",
            "Time the engine answering yes/no questions (generated shape scenes, or a "
            "manifest or folder of your images, K questions each): one row per combination "
            "of --sweep values, each warmed up untimed, then timed --rounds times (rows "
            "interleaved, best kept); prints QPM, images/s, LLM tokens prefilled per "
            "question, the prefix cache's hit rate and peak memory; --baseline transformers "
            "adds the batched transformers row, --json FILE the machine, versions and "
            "options.", (BenchConfig,)),
)
BY_NAME = {c.name: c for c in COMMANDS}


@dataclass(frozen=True)
class CommandLine:
    """One parsed command line: the command and what it typed (``Option.key`` -> value;
    an option not typed is absent, so its field keeps its default)."""
    command: str
    typed: Mapping[str, Any] = field(default_factory=dict)

    def names(self, keys: Iterator[str] | set[str]) -> list[str]:
        """The options of ``keys`` as the user knows them (``--out``), sorted."""
        opts = {d.option.key: d.option.name for d in BY_NAME[self.command].options()}
        return sorted(opts[k] for k in keys)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors suggest the closest choice (``--dtype flot32``, a
    misspelt command)."""

    def error(self, message: str) -> NoReturn:
        super().error(message + _did_you_mean(message))


def _unrecognized(top: argparse.ArgumentParser, command: str | None, extras: list[str]
                  ) -> NoReturn:
    """Exit 2 with the usage of the command the unknown arguments were given to (not the
    top level's) and the closest option to each misspelt one (``--polcy``: ``--policy``)."""
    sub: argparse.ArgumentParser = _subparsers(top).choices.get(command or "", top)
    options = [s for s in sub._option_string_actions if s.startswith("--")]
    guess = [m for x in extras if x.startswith("-")
             for m in difflib.get_close_matches(x.split("=", 1)[0], options, 1, 0.6)]
    hint = f" (did you mean {' or '.join(dict.fromkeys(guess))}?)" if guess else ""
    argparse.ArgumentParser.error(sub, f"unrecognized arguments: {' '.join(extras)}{hint}")


def _did_you_mean(message: str) -> str:
    """`` (did you mean X?)`` for argparse's "invalid choice: 'x' (choose from ...)"."""
    m = re.search(r"invalid choice: '(.*?)' \(choose from (.*)\)$", message)
    if m is None:
        return ""
    choices = re.findall(r"'([^']*)'", m[2])
    close = difflib.get_close_matches(m[1], choices, 1, 0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _subparsers(p: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))


def _help(d: Declared) -> str:
    """The option's help with its default written in (a phrase after a colon: "(default:
    as submitted)"; a value without: "(default 32)")."""
    if d.hidden:
        return argparse.SUPPRESS
    text = d.option.help
    if " " in d.default:
        text = text.replace("(default %(default)s", "(default: %(default)s")
    return text.replace("%(default)s", d.default.replace("%", "%%"))


def _add(container: Any, d: Declared) -> None:
    """``d``'s argument; nothing is stored unless it is typed (``default=SUPPRESS``)."""
    o = d.option
    kw: dict[str, Any] = {"help": _help(d), "default": argparse.SUPPRESS}
    if o.positional:
        # argparse converts an optional positional's default too: SUPPRESS passes unchanged
        # (the very object: argparse tests it by identity), so nothing is stored
        parse = o.parse
        convert = None if parse is None else (
            lambda t: t if t is argparse.SUPPRESS else parse(t))
        container.add_argument(o.flags[0], nargs=o.nargs, type=convert, metavar=o.metavar,
                               **kw)
        return
    if o.action in ("true", "false"):
        kw["action"] = f"store_{o.action}"
    elif o.action == "both":
        kw["action"] = argparse.BooleanOptionalAction
    elif o.action == "append":  # repeated: each value parsed, the list stored
        kw.update(action="append", type=o.parse, metavar=o.metavar)
    else:
        kw.update(type=o.parse, choices=o.choices, nargs=o.nargs, metavar=o.metavar)
        if o.exclusive is None:
            kw["required"] = o.required
    container.add_argument(*o.flags, dest=o.key, **kw)


def _usage(options: list[Declared]) -> str | None:
    """A short usage line for a command of many options (its error messages then fit on a
    screen; ``--help`` lists them all): its required options and positional arguments;
    None: argparse's own, every option listed."""
    if len(options) <= SHORT_USAGE:
        return None
    parts = ["%(prog)s [options]"]
    for o in (d.option for d in options if d.option.required and not d.option.positional):
        choices = "{" + ",".join(map(str, o.choices or ())) + "}"
        parts.append(f"{o.name} {o.metavar or choices}")
    for o in (d.option for d in options if d.option.positional):
        name = o.metavar or o.name
        parts.append({"?": f"[{name}]", "*": f"[{name} ...]",
                      "+": f"{name} [{name} ...]"}.get(str(o.nargs), str(name)))
    return " ".join(parts)


def add_command(sub: argparse._SubParsersAction, cmd: Command, whole: bool = True
                ) -> argparse.ArgumentParser:
    """``cmd``'s parser: its options in the help sections their declarations name (not
    ``whole``: its name and help only, for the list of commands)."""
    if not whole:
        return sub.add_parser(cmd.name, help=cmd.help)
    options = cmd.options()
    p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.description,
                       usage=_usage(options))
    sections: dict[str | None, Any] = {None: p}
    exclusive: dict[str, Any] = {}
    for d in options:
        if d.group not in sections:
            sections[d.group] = p.add_argument_group(d.group)
        where = sections[d.group]
        if d.option.exclusive is not None:
            if d.option.exclusive not in exclusive:
                exclusive[d.option.exclusive] = where.add_mutually_exclusive_group(
                    required=d.option.required)
            where = exclusive[d.option.exclusive]
        _add(where, d)
    return p


def build_parser(only: str | None = None) -> Parser:
    """The parser of every command (``only``: of that one, the others listed by name; what a
    command line needs, since only its command's options can follow)."""
    p = Parser(prog="vlmbatch", description="Ask a vision-language model yes/no questions "
               "about many images, fast.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           parser_class=Parser)
    for cmd in COMMANDS:
        add_command(sub, cmd, only is None or cmd.name == only)
    return p


def parse(argv: list[str]) -> CommandLine:
    """``argv`` parsed (SystemExit 2 with a usage message for a bad command line). Only the
    parser of the command named is built (the first argument that is not an option)."""
    parser = build_parser(next((a for a in argv if not a.startswith("-")), ""))
    ns, extras = parser.parse_known_args(argv)
    typed = vars(ns)
    command = typed.pop("command")
    if extras:
        _unrecognized(parser, command, extras)
    return CommandLine(command, typed)
