"""``pipeline/config.py`` holds names, not torch objects: its device check must accept
exactly the CPU and CUDA device strings ``torch.device`` reads (the reference), and its dtype
names must be the ones ``engine/loading.py`` resolves to torch dtypes; ``--dtype auto``
resolves by device and CPU flags (mocked both ways)."""

from __future__ import annotations

import random

import pytest
import torch

from vlmbatch.engine import config as engine_config
from vlmbatch.engine.config import DTYPES, ConfigError, ModelConfig, device_ok, resolve_dtype
from vlmbatch.engine.loading import TORCH_DTYPES, torch_dtype

CASES = ["cpu", "cuda", "cuda:0", "cuda:7", "cuda:12", "cpu:0", "cpu:3", "CUDA", "Cpu", "cuda:",
         "cpu:", "cuda:-1", "cuda:+1", "cuda:01", "cuda:00", "cuda: 0", " cuda", "cuda ",
         "cuda\n", "cuda:1\n", "cuda:0:0", "cuda:a", "cuda:0x1", "cuda:1_0", "cuda:\u0663",
         "cuda:\uff11", "", "mps", "meta", "xpu:0", "cuda:2147483647", "cuda:2147483648",
         "cuda:99999999999999999999"]


def torch_reads(device: object) -> bool:
    """The reference: torch.device parses it, as a CPU or CUDA device."""
    try:
        return torch.device(device).type in ("cpu", "cuda")  # type: ignore[call-overload]
    except (RuntimeError, TypeError):
        return False


def random_devices(n: int, seed: int = 0) -> list[str]:
    """Strings near the accepted ones: a prefix of cpu/cuda/other, then random characters
    from the alphabet the parser cares about."""
    rng = random.Random(seed)
    alphabet = "cpudam:0123456789 -+x_"
    heads = ["cpu", "cuda", "cuda:", "cpu:", "cud", "mps", ""]
    return [rng.choice(heads) + "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6)))
            for _ in range(n)]


def test_the_device_check_accepts_what_torch_reads() -> None:
    devices = CASES + random_devices(3000)
    assert sum(map(torch_reads, devices)) > 100  # the accepted region is exercised too
    wrong = [d for d in devices if device_ok(d) != torch_reads(d)]
    assert wrong == []
    for other in (None, 3, 0.0):
        assert device_ok(other) is torch_reads(other) is False
    assert not device_ok(b"cpu")  # torch reads bytes too; the field is a str


def test_a_bad_device_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="device 'cuda:01' not supported: use cpu, cuda or"):
        ModelConfig(device="cuda:01")
    assert ModelConfig(device="cuda:3").device == "cuda:3"  # checked where the model loads


def test_dtype_names_resolve_where_the_model_is_loaded() -> None:
    assert tuple(TORCH_DTYPES) == DTYPES
    assert [torch_dtype(n) for n in ("float32", "bfloat16", "float16")] == [
        torch.float32, torch.bfloat16, torch.float16]
    with pytest.raises(ConfigError, match=r"dtype 'float64' not one of \['auto', 'float32'"):
        ModelConfig(dtype="float64")


SAPPHIRE = frozenset({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})  # bf16 units
COOPER = frozenset({"avx512f", "avx512_bf16"})  # AVX512-BF16, no AMX
SKYLAKE = frozenset({"avx2", "avx512f", "avx512bw"})  # no bf16 unit


@pytest.mark.parametrize("flags, device, llm_quant, want", [
    (SAPPHIRE, "cpu", "none", "bfloat16"),
    (COOPER, "cpu", "none", "bfloat16"),
    (frozenset({"amx_bf16"}), "cpu", "none", "bfloat16"),
    (SKYLAKE, "cpu", "none", "float32"),
    (frozenset(), "cpu", "none", "float32"),  # no /proc/cpuinfo (macOS): float32
    (SAPPHIRE, "cpu", "int8-dynamic", "float32"),  # dynamic int8 linears are float32's
    (SKYLAKE, "cuda", "none", "bfloat16"),
    (frozenset(), "cuda:1", "none", "bfloat16"),
])
def test_auto_dtype_resolves_by_device_and_cpu_flags(flags: frozenset[str], device: str,
                                                     llm_quant: str, want: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(engine_config.AUTO_DTYPE_ENV)  # the suite's pin (tests/conftest.py)
    assert resolve_dtype("auto", device, llm_quant, flags) == want


def test_auto_reads_this_cpus_flags_and_a_named_dtype_stays(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    monkeypatch.delenv(engine_config.AUTO_DTYPE_ENV)
    for flags, want in ((COOPER, "bfloat16"), (SKYLAKE, "float32")):
        monkeypatch.setattr(engine_config, "cpu_flags", lambda flags=flags: flags)
        assert ModelConfig().dtype == "auto"  # the default
        assert ModelConfig().resolved_dtype == want
        assert ModelConfig(dtype="float32").resolved_dtype == "float32"
        assert ModelConfig(dtype="float16", device="cuda").resolved_dtype == "float16"


def test_cpu_flags_read_from_proc_cpuinfo() -> None:
    flags = engine_config.cpu_flags()
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        assert flags == frozenset()
        return
    assert "fpu" in flags and all(f in text for f in flags)


def test_the_suite_pins_auto_to_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ModelConfig().resolved_dtype == "float32"  # tests/conftest.py
    monkeypatch.setenv(engine_config.AUTO_DTYPE_ENV, "float64")
    with pytest.raises(ConfigError, match=r"VLMBATCH_AUTO_DTYPE='float64' is not one of"):
        resolve_dtype("auto", "cpu")
