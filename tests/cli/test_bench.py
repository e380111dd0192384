"""``vlmbatch bench``: a tiny sweep on the built-in model (rows per sweep value, positive QPM,
the prefix cache prefilling fewer tokens per question than no cache, the JSON's machine,
versions and options), and the sweep's parsing, checked before any model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlmbatch.cli.bench.config import BenchConfig, make_sweep, parse_sizes, sweep_text
from vlmbatch.cli.main import EXIT_BAD_INPUT, EXIT_OK, main
from vlmbatch.common.options import BadValue
from vlmbatch.engine.config import ConfigError


def test_bench_sweep_rows_and_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "bench.json"
    rc = main(["bench", "--count", "3", "--questions", "3", "--scene-sizes", "224x112",
               "--sweep", "prefix_cache=on,off", "--rounds", "1", "--threads", "1",
               "--dtype", "float32", "--json", str(out)])
    assert rc == EXIT_OK
    text = capsys.readouterr().out
    assert "prefix_cache=on" in text and "prefix_cache=off" in text
    d = json.loads(out.read_text())
    rows = {r["row"]: r for r in d["rows"]}
    assert set(rows) == {"prefix_cache=on", "prefix_cache=off"}
    assert [r["swept"] for r in d["rows"]] == [{"prefix_cache": True}, {"prefix_cache": False}]
    on, off = rows["prefix_cache=on"], rows["prefix_cache=off"]
    assert on["qpm"] > 0 and off["qpm"] > 0 and on["images_per_s"] > 0
    assert on["dtype"] == off["dtype"] == "float32"
    # with the cache an image's prefix is prefilled once for its 3 questions
    assert on["prefill_tokens_per_question"] < off["prefill_tokens_per_question"]
    assert on["hit_rate"] > 0 and off["hit_rate"] is None
    assert on["peak_rss_mib"] > 0
    assert d["machine"]["cores"] >= 1 and len(d["machine"]["load_average_before"]) == 3
    assert {"vlmbatch", "torch", "transformers"} <= set(d["versions"])
    assert d["options"]["sweep"] == [["prefix_cache", ["on", "off"]]]
    assert "3 shape scenes (224x112), 9 questions" in text


def test_sweep_values_read_as_their_options() -> None:
    assert make_sweep("prefix_cache", ("on", "off")).values == (True, False)
    assert make_sweep("max_batch_tokens", ("4096",)).values == (4096,)
    s = make_sweep("dtype", ("float32", "bfloat16"))
    assert (s.where, s.values) == ("model", ("float32", "bfloat16"))
    assert make_sweep("images_per_batch", ("8", "16")).where == "run"
    cfg = BenchConfig(sweep=(sweep_text("images_per_batch=8,16"),
                             sweep_text("prefix-cache=on,off")))
    names = [v.name for v in cfg.variants()]
    assert names == ["images_per_batch=8 prefix_cache=on", "images_per_batch=8 prefix_cache=off",
                     "images_per_batch=16 prefix_cache=on", "images_per_batch=16 prefix_cache=off"]
    assert [v.images_per_batch for v in cfg.variants()] == [8, 8, 16, 16]


@pytest.mark.parametrize("sweep, says", [
    (("no_such_field", ("1",)), "not a model or engine field"),
    (("prefix_cache", ("maybe",)), "not on or off"),
    (("dtype", ("float64",)), "dtype 'float64' not one of"),
    (("max_batch_tokens", ("many",)), "not an integer"),
])
def test_bad_sweep_refused_before_loading(sweep: tuple, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        BenchConfig(sweep=(sweep,))


def test_bad_sweep_text_and_sizes() -> None:
    with pytest.raises(BadValue, match="FIELD=VALUE"):
        sweep_text("prefix_cache")
    with pytest.raises(BadValue, match="WIDTHxHEIGHT"):
        parse_sizes("448")
    assert parse_sizes("448x448,896x672") == ((448, 448), (896, 672))


def test_bench_cli_error_exit(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "--sweep", "prefix_cache=maybe"]) == EXIT_BAD_INPUT
    assert "--sweep prefix_cache" in capsys.readouterr().err
