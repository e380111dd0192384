"""``common/registry.py``: entries given as ``"module:attr"`` are imported on the first
``get`` and never by ``names()``; objects are registered as before; an unknown name lists
every known one, imported or not."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from vlmbatch.common.registry import Registry, UnknownName


@pytest.fixture()
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module nobody has imported, on sys.path: ``VALUE`` and ``other``."""
    name = f"registry_plugin_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text("VALUE = object()\n\ndef other() -> int:\n"
                                         "    return 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_a_lazy_entry_is_imported_on_first_get_only(plugin: str) -> None:
    reg: Registry[object] = Registry("thing", {"v": f"{plugin}:VALUE", "o": f"{plugin}:other"})
    assert reg.names() == ("v", "o") and "v" in reg and "w" not in reg
    assert plugin not in sys.modules  # listing, membership: nothing imported
    value = reg.get("v")
    assert plugin in sys.modules and value is sys.modules[plugin].VALUE
    assert reg.get("o")() == 7  # type: ignore[operator]


def test_get_reads_the_module_attribute_as_it_is_now(plugin: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """No stale copy: a test that patches the module's attribute patches the registry's."""
    reg: Registry[object] = Registry("thing", {"v": f"{plugin}:VALUE"})
    first = reg.get("v")
    replacement = object()
    monkeypatch.setattr(sys.modules[plugin], "VALUE", replacement)
    assert reg.get("v") is replacement and first is not replacement


def test_objects_register_beside_lazy_entries_and_names_keep_their_order() -> None:
    reg: Registry[object] = Registry("thing", {"a": "json:dumps"})

    @reg.register("b", "c")
    def b() -> None: ...

    assert reg.names() == ("a", "b", "c") and reg.get("c") is b
    with pytest.raises(ValueError, match="thing 'a' is registered twice"):
        reg.register("a")(object())


def test_an_unknown_name_lists_the_known_ones_imported_or_not(plugin: str) -> None:
    reg: Registry[object] = Registry("vision backend", {"x": f"{plugin}:VALUE"})
    reg.register("y")(object())
    with pytest.raises(UnknownName) as e:
        reg.get("z")
    assert str(e.value) == "unknown vision backend 'z'; one of: x, y"
    assert plugin not in sys.modules


@pytest.mark.parametrize("target", ["json", "json:", ":dumps", "json:dumps:x", ""])
def test_a_target_must_be_module_colon_attr(target: str) -> None:
    with pytest.raises(ValueError, match="not a 'module:attr' string"):
        Registry("thing", {"a": target})


def test_a_wrong_target_fails_when_got_not_when_listed() -> None:
    reg: Registry[object] = Registry("thing", {"gone": "json:no_such_name",
                                               "absent": "no_such_module_here:x"})
    assert reg.names() == ("gone", "absent")
    with pytest.raises(AttributeError):
        reg.get("gone")
    with pytest.raises(ModuleNotFoundError):
        reg.get("absent")
