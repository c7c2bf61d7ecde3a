"""The kit's conformance check: every installed plugin and the example pass it; each check can fail."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from loongkit_core.feature import Category, Feature
from loongkit_core.hookspecs import ENTRY_POINT_GROUP
from loongkit_core.kit import PluginSpec
from loongkit_core.testing import install_fake_plugin
from loongkit_core.testing.conformance import assert_conforms, plugin_problems

ROOT = Path(__file__).resolve().parents[2]
# Under `nox -s plugin-<name>` only that plugin is installed, so only it is checked there.
INSTALLED = sorted({ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)})


@pytest.mark.parametrize("name", INSTALLED)
def test_installed_plugin_conforms(name: str) -> None:
    assert_conforms(name)


def test_every_first_party_plugin_installed_here_is_checked() -> None:
    """Each plugins/<distribution> installed here (all five in `nox -s tests`, the one of a `plugin-<name>`
    session there) has its entry points among those checked above (seam rules included)."""
    checked = []
    for directory in sorted(p for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").exists()):
        try:
            dist = importlib.metadata.distribution(directory.name)
        except importlib.metadata.PackageNotFoundError:
            continue
        names = {ep.name for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP}
        assert names and names <= set(INSTALLED), (directory.name, names, INSTALLED)
        checked.append(directory.name)
    assert checked, "no first-party plugin installed"


def test_example_plugin_conforms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "loongkit-plugin-example"))
    from loongkit_example.plugin import plugin

    assert_conforms(plugin)


def test_feature_is_declared_by_keyword_only() -> None:
    with pytest.raises(TypeError):
        Feature("x", "LOONGKIT_X", 1, Category.OTHER, "positional")  # type: ignore[misc]


BROKEN = '''
from pydantic_settings import SettingsConfigDict
from loongkit_core.feature import Category, Feature
from loongkit_core.kit import FeatureImpl, PluginSpec
from loongkit_core.settings import LoongkitSettings

plugin = PluginSpec("other_name", distribution="someone-else")

class Opts(LoongkitSettings):
    model_config = SettingsConfigDict(env_prefix="LOONGKIT_BROKEN_", extra="ignore")
    size: int = 3
    mode: int = "not an int"

class Impl(FeatureImpl):
    options = Opts

plugin.add(Feature(name="broken", env="LOONGKIT_BROKEN", level=1, category=Category.OTHER, description="d",
                   targets=("mmdet/models", "json"), requires=("torch>=2 ; python_version > '3'", "not a req!"),
                   depends_on=("nowhere",), options=("LOONGKIT_BROKEN_SIZE", "LOONGKIT_BROKEN_GONE")),
           impl="broken_impl:Impl")
plugin.add(Feature(name="typo", env="LOONGKIT_TYPO_X", level=1, category=Category.OTHER, description="d"),
           impl="broken_impl_typo:Impl")
'''
HEAVY_IMPL = "import wave  # stands in for torch\nfrom broken_plugin import Impl\n"


def test_each_check_can_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = install_fake_plugin(tmp_path / "site", "broken_plugin", BROKEN.replace('"broken_impl:Impl"',
                               '"heavy_impl:Impl"'), entry_point="broken_plugin:plugin")
    (site / "heavy_impl.py").write_text(HEAVY_IMPL)
    monkeypatch.syspath_prepend(str(site))
    problems = "\n".join(plugin_problems("broken_plugin", heavy=("wave",)))
    for expected in (
        "entry point 'broken_plugin' gives PluginSpec('other_name')",
        "PluginSpec(distribution='someone-else') but the entry point is registered by 'broken-plugin'",
        "target 'mmdet/models' is not a dotted module name",
        "markers and extras are not evaluated",
        "requirement 'not a req!' does not parse",
        "depends_on names 'nowhere'",
        "declares option LOONGKIT_BROKEN_GONE that its configure step does not read",
        "reads LOONGKIT_BROKEN_MODE but does not declare it",
        "with every variable unset, configure warns: LOONGKIT_BROKEN_MODE='not an int' is invalid",
        "typo: its impl does not import: ModuleNotFoundError",
        "impl module heavy_impl imports wave at its top level",
    ):
        assert expected in problems, f"{expected!r} missing from:\n{problems}"
    assert "LOONGKIT_BROKEN_SIZE" not in problems  # declared and read: fine
    with pytest.raises(AssertionError, match="does not conform"):
        assert_conforms("broken_plugin", imports=False)


def test_declaration_module_must_stay_light(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = "import wave\n" + BROKEN.replace('PluginSpec("other_name", distribution="someone-else")',
                                                 'PluginSpec("light")')
    site = install_fake_plugin(tmp_path / "site", "light", source, entry_point="light:plugin")
    (site / "broken_impl.py").write_text("from light import Impl\n")
    monkeypatch.syspath_prepend(str(site))
    problems = "\n".join(plugin_problems("light", heavy=("wave",)))
    assert "declaring light imports wave at its top level" in problems, problems
    assert "gives PluginSpec" not in problems and "distribution=" not in problems


def test_a_spec_object_without_entry_point() -> None:
    spec = PluginSpec("loose")
    assert plugin_problems(spec, imports=False) == ["loose: plugin 'loose' declares no feature"]
    assert plugin_problems("no_such_entry_point_xyz") == [
        "no entry point 'no_such_entry_point_xyz' in the 'loongkit' group: is it installed?"]
