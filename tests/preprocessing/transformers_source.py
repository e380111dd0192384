"""transformers' own video-processor methods, run without torchvision.

transformers' video processors import torchvision at module level, and no torchvision wheel
on PyPI runs beside our CPU torch build (0.28.0 from PyPI is built for CUDA torch: importing
it fails with ``operator torchvision::nms does not exist``). The methods the tests compare
with (``sample_frames``, ``patchify``, the Qwen3-VL ``smart_resize``) use only numpy, torch
and math, so they are taken from the installed transformers' source text, compiled as they
are (annotations dropped, which are not evaluated code) and called with a stand-in ``self``
holding the class defaults: transformers' code, not a copy of ours."""

from __future__ import annotations

import ast
import importlib.util
import logging
import math
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from transformers import image_utils

_CONSTANTS = {k: getattr(image_utils, k) for k in dir(image_utils)
              if k.endswith(("_MEAN", "_STD"))}


def _source(module: str) -> ast.Module:
    spec = importlib.util.find_spec("transformers")
    assert spec is not None and spec.origin is not None
    path = Path(spec.origin).parent / (module.replace(".", "/") + ".py")
    return ast.parse(path.read_text())


class _Strip(ast.NodeTransformer):
    def visit_arg(self, node: ast.arg) -> ast.arg:
        node.annotation = None
        return node

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.FunctionDef:
        node.returns = None
        self.generic_visit(node)
        return node


def _compile(node: ast.FunctionDef | ast.ClassDef, name: str) -> Any:
    mod = ast.Module(body=[_Strip().visit(node)], type_ignores=[])
    ast.fix_missing_locations(mod)
    ns: dict[str, Any] = {"math": math, "np": np, "torch": torch,
                          "logger": logging.getLogger("transformers-source")}
    exec(compile(mod, f"<transformers {name}>", "exec"), ns)  # noqa: S102
    return ns[node.name]


def function(module: str, name: str) -> Callable:
    """A module-level function of ``transformers.<module>``."""
    for node in _source(module).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return _compile(node, name)
    raise LookupError(f"{name} not in transformers.{module}")


def processor(module: str, cls: str, **overrides: Any) -> SimpleNamespace:
    """A stand-in for ``transformers.<module>.<cls>()``: its class attributes (literals), its
    own methods bound to it; ``overrides`` set attributes as ``__init__`` kwargs would."""
    for node in _source(module).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            break
    else:
        raise LookupError(f"{cls} not in transformers.{module}")
    self = SimpleNamespace(fps=None, num_frames=None)  # BaseVideoProcessor's defaults
    for item in node.body:
        if isinstance(item, ast.Assign) and isinstance(item.targets[0], ast.Name):
            try:  # literals, their arithmetic (128 * 32 * 32), the mean/std constants
                value = eval(compile(ast.Expression(item.value), cls, "eval"),  # noqa: S307
                             {"__builtins__": {}, **_CONSTANTS})
            except (NameError, AttributeError, TypeError):
                continue  # resample = PILImageResampling.BICUBIC, ...
            setattr(self, item.targets[0].id, value)
    for item in node.body:
        if isinstance(item, ast.FunctionDef) and item.name != "__init__":
            fn = _compile(item, f"{cls}.{item.name}")
            setattr(self, item.name, fn.__get__(self))
    for k, v in overrides.items():
        setattr(self, k, v)
    return self
