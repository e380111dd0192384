"""Start-up is part of the interface: the modules under the CLI's light paths (``--help``,
``status``, ``cancel``, ``results``) import neither torch, transformers nor fastapi (nor
OpenCV), and listing a registry's names imports none of its implementations.

Each check imports in a fresh interpreter, which prints the names in ``sys.modules`` at its
end; ``tests/cli/test_startup.py`` runs the CLI itself that way.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vlmbatch.common.registry import Registry
from vlmbatch.engine.config import ENGINES
from vlmbatch.models.registry import FAMILIES
from vlmbatch.vit_trt import RUNNERS

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "fastapi", "cv2")
LIGHT = ["vlmbatch.common.registry", "vlmbatch.pipeline.config", "vlmbatch.engine.config",
         "vlmbatch.engine.build",
         "vlmbatch.models", "vlmbatch.vit_trt", "vlmbatch.jobs.config", "vlmbatch.jobs.folder",
         "vlmbatch.jobs.store", "vlmbatch.jobs.lock", "vlmbatch.outputs.export",
         "vlmbatch.outputs.sinks", "vlmbatch.inputs.manifest", "vlmbatch.inputs.errors",
         "vlmbatch.inputs.openai_embeddings", "vlmbatch.outputs.embed_sinks",
         "vlmbatch.cli.bench.config"]
# each registry and the package its entries must come from
REGISTRIES: list[tuple[Registry, str]] = [(ENGINES, "vlmbatch.engine"),
                                          (RUNNERS, "vlmbatch.vit_trt"),
                                          (FAMILIES, "vlmbatch.models")]
IMPLEMENTATIONS = ["vlmbatch.engine.torch_engine", "vlmbatch.engine.lmdeploy_engine",
                   "vlmbatch.vit_trt.base", "vlmbatch.vit_trt.torch_runner",
                   "vlmbatch.vit_trt.onnx_runner", "vlmbatch.vit_trt.tensorrt_runner",
                   "vlmbatch.vit_trt.compile_runner", "vlmbatch.models.base",
                   "vlmbatch.models.internvl.family", "vlmbatch.models.qwen_vl.family"]


def loaded_after(code: str) -> tuple[set[str], str]:
    """(every module name in ``sys.modules`` after ``code`` ran in a fresh interpreter,
    what ``code`` printed before them)."""
    report = "\nimport json as _j, sys as _s\nprint(_j.dumps(sorted(_s.modules)))"
    out = subprocess.run([sys.executable, "-c", code + report], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    *printed, modules = out.stdout.splitlines()
    return set(json.loads(modules)), "\n".join(printed)


@pytest.mark.parametrize("module", LIGHT)
def test_a_light_module_imports_nothing_heavy(module: str) -> None:
    modules, _ = loaded_after(f"import {module}")
    assert module in modules
    assert [m for m in HEAVY if m in modules] == []


def test_listing_the_registries_imports_no_implementation() -> None:
    code = ("from vlmbatch.engine.build import ENGINES\nfrom vlmbatch.vit_trt import RUNNERS\n"
            "from vlmbatch.models.registry import FAMILIES, REFUSED\n"
            "from vlmbatch.engine.config import vit_backends\n"
            "print(ENGINES.names(), RUNNERS.names(), FAMILIES.names(), sorted(REFUSED), "
            "vit_backends(), 'torch' in ENGINES, 'nope' in RUNNERS)")
    modules, printed = loaded_after(code)
    assert "'torch'" in printed and "'internvl'" in printed and "'qwen3_vl_moe'" in printed
    assert [m for m in [*HEAVY, *IMPLEMENTATIONS] if m in modules] == []


def test_an_unknown_name_lists_the_known_ones_without_importing_them(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llava"}')
    code = ("from pathlib import Path\nfrom vlmbatch.engine.build import build_engine\n"
            "from vlmbatch.engine.config import ConfigError, EngineConfig, ModelConfig\n"
            "from vlmbatch.models import family_for\n"
            "from vlmbatch.models.config_io import ModelError\n"
            "try:\n    build_engine(ModelConfig(), EngineConfig(engine='nope'))\n"
            "except ConfigError as e:\n    print(e)\n"
            f"try:\n    family_for(Path({str(tmp_path)!r}))\n"
            "except ModelError as e:\n    print(e)\n")
    modules, printed = loaded_after(code)
    engine, family = printed.splitlines()
    assert engine == "unknown engine 'nope'; one of: torch, lmdeploy"
    assert "model_type 'llava' is not supported" in family
    assert ("'internvl', 'internvl_chat', 'qwen2_vl', 'qwen2_5_vl', 'qwen3_vl', 'qwen3_5', "
            "'colqwen2'" in family)
    assert [m for m in ["torch", *IMPLEMENTATIONS] if m in modules] == []


@pytest.mark.parametrize("registry,package", REGISTRIES, ids=lambda x: getattr(x, "kind", x))
def test_every_entry_comes_from_its_registrys_package(registry: Registry, package: str) -> None:
    """The layer test reads import statements, not these strings: an entry must name an
    object of the registry's own package."""
    for name in registry.names():
        assert registry.get(name).__module__.startswith(package + "."), name


def test_the_entries_are_the_implementations_they_name() -> None:
    from vlmbatch.engine import lmdeploy_engine, torch_engine
    from vlmbatch.models.internvl.family import INTERNVL, InternVL
    from vlmbatch.models.qwen_vl.family import ColQwen2, QwenVL
    from vlmbatch.models.qwen_vl.spec import KINDS
    from vlmbatch.vit_trt import compile_runner, onnx_runner, tensorrt_runner, torch_runner

    assert ENGINES.get("torch") is torch_engine.build_torch_engine
    assert ENGINES.get("lmdeploy") is lmdeploy_engine.build_lmdeploy
    assert [RUNNERS.get(n) for n in ("torch", "compile", "onnxruntime", "onnxruntime-int8",
                                     "tensorrt")] == [
        torch_runner.build_torch_runner, compile_runner.build_compiled, onnx_runner.build_ort,
        onnx_runner.build_ort_int8, tensorrt_runner.build_tensorrt]
    assert FAMILIES.get("internvl") is INTERNVL and isinstance(INTERNVL, InternVL)
    assert set(KINDS) < set(FAMILIES.names())
    assert all(type(FAMILIES.get(k)) is QwenVL for k in KINDS)
    assert isinstance(FAMILIES.get("colqwen2"), ColQwen2)

