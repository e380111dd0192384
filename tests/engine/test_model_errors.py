"""A broken model folder is a ``ModelError`` (a clean ``vlmbatch: error:`` line), not a
traceback: each test breaks a copy of the built-in model one way."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from vlmbatch.cli.main import main
from vlmbatch.cli.quantize import quantize_model
from vlmbatch.engine.config import ConfigError
from vlmbatch.engine.loading import load_model
from vlmbatch.inputs.manifest import read_manifest
from vlmbatch.models.config_io import ModelError
from vlmbatch.models.paths import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "examples/manifest.jsonl"


def model_copy(tmp_path: Path) -> Path:
    return Path(shutil.copytree(DEFAULT_MODEL, tmp_path / "model"))


def edit_config(path: Path, **text: int) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"].update(text)
    (path / "config.json").write_text(json.dumps(cfg))


def test_malformed_config_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    m = model_copy(tmp_path)
    (m / "config.json").write_text('{"model_type": "internvl",\n')
    with pytest.raises(ModelError, match=r"config\.json is not valid JSON"):
        load_model(m)
    rc = main(["run", str(MANIFEST), "--model", str(m), "--no-progress"])
    assert rc == 2
    assert capsys.readouterr().err.startswith(f"vlmbatch: error: {m / 'config.json'}")


@pytest.mark.parametrize(("remove", "message"), [
    (("tokenizer_config.json",), "lacks InternVL's image tokens.*context_image_token"),
    (("tokenizer_config.json", "tokenizer.json"), "lacks InternVL's image tokens"),
    (("chat_template.jinja",), "has no chat template; copy the checkpoint's")])
def test_tokenizer_files_missing(tmp_path: Path, remove: tuple[str, ...], message: str) -> None:
    m = model_copy(tmp_path)
    for f in remove:
        (m / f).unlink()
    with pytest.raises(ModelError, match=message):
        load_model(m)


def test_truncated_safetensors(tmp_path: Path) -> None:
    m = model_copy(tmp_path)
    w = m / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    with pytest.raises(ModelError, match=r"model\.safetensors cannot be read.*truncated"):
        load_model(m)


@pytest.mark.parametrize(("edit", "message"), [
    ({"hidden_size": 256},
     r"multi_modal_projector\.linear_1\.weight has shape \(128, 384\).*tensor a \(256\)"),
    ({"intermediate_size": 512},
     r"language_model\.layers\.0\.mlp\.gate_proj\.weight has shape \(384, 128\).*"
     r"tensor a \(512\)"),
    ({"num_hidden_layers": 5}, r"lacks language-model weights.*language_model\.layers\.4\.")])
def test_config_disagrees_with_weights(tmp_path: Path, edit: dict, message: str) -> None:
    m = model_copy(tmp_path)
    edit_config(m, **edit)
    with pytest.raises(ModelError, match=message):
        load_model(m)


def test_quantize_a_quantized_model(tmp_path: Path) -> None:
    items = read_manifest(MANIFEST)
    q = quantize_model(None, tmp_path / "q", "rtn", items, samples=2, progress=False).out
    with pytest.raises(ModelError, match="already quantised.*original float checkpoint"):
        quantize_model(q, tmp_path / "q2", "rtn", items, samples=2, progress=False)


@pytest.mark.parametrize("group_size", [0, 4, -8])
def test_quantize_bad_group_size(tmp_path: Path, group_size: int) -> None:
    items = read_manifest(MANIFEST)
    with pytest.raises(ConfigError, match=f"--group-size {group_size} must be a positive "
                       "multiple of 8"):
        quantize_model(None, tmp_path / "q", "rtn", items, samples=2, group_size=group_size,
                       progress=False)


def _truncate(m: Path) -> Path:
    w = m / "model.safetensors"
    w.write_bytes(w.read_bytes()[:6])  # shorter than the 8-byte header length
    return w


def _drop_field(m: Path) -> Path:
    cfg = json.loads((m / "config.json").read_text())
    del cfg["text_config"]["num_attention_heads"]
    (m / "config.json").write_text(json.dumps(cfg))
    return m / "config.json"


COMMANDS = {
    "run": ["run", str(MANIFEST), "--no-progress"],
    "eval": ["eval", str(ROOT / "examples/labelled/manifest.jsonl"), "--no-progress"],
    "embed": ["embed", "a red circle"],
    "submit": ["submit", str(MANIFEST), "--job", "JOB", "--wait", "--no-progress"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize(("breakage", "message"), [
    (_truncate, r"model\.safetensors cannot be read \(.*\): the file is truncated or corrupt; "
                r"copy or download it again"),
    (_drop_field, r"config\.json: no field 'num_attention_heads', which a 'internvl' checkpoint "
                  r"needs: the file is incomplete; restore the checkpoint's original "
                  r"config\.json")])
def test_every_command_that_loads_a_model_says_which_file_and_what_to_do(
        tmp_path: Path, capsys: pytest.CaptureFixture, command: str,
        breakage: object, message: str) -> None:
    """One loading path: a cut weights file and a config.json missing a field read the same
    in every command (one ``vlmbatch: error:`` line naming the file, exit 2), never a
    safetensors or KeyError traceback."""
    m = model_copy(tmp_path)
    bad = breakage(m)  # type: ignore[operator]
    args = [a.replace("JOB", str(tmp_path / "job")) for a in COMMANDS[command]]
    assert main([*args, "--model", str(m)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"vlmbatch: error: {bad}"), err
    assert re.search(message, err[0]), err[0]
