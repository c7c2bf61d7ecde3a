"""testing.fake_distribution: a requires gate sees the faked version, in process and in children."""

from __future__ import annotations

import os
from pathlib import Path

from loongkit_core import requirements
from loongkit_core.context import Environment
from loongkit_core.testing import install_fake_plugin


def test_requires_sees_the_faked_version(fake_distribution) -> None:  # type: ignore[no-untyped-def]
    fake_distribution("mmseg", "0.30.0")
    found = requirements.installed("mmseg")
    assert found is not None and (found.distribution, found.version) == ("mmsegmentation", "0.30.0")
    assert requirements.check("mmseg>=0.12,<=1.0") is None
    assert requirements.check("mmseg>=1.1") == "mmseg 0.30.0 outside >=1.1"
    assert Environment.version("mmseg") == "0.30.0"
    fake_distribution("mmseg", "1.2.2")  # again: replaces the version
    assert requirements.check("mmseg>=1.1") is None and requirements.check("mmseg<=1.0") is not None


GATED = '''
from loongkit_core.feature import Category, Feature
from loongkit_core.kit import FeatureImpl, PluginSpec

plugin = PluginSpec("gated")

class Mark(FeatureImpl):
    def activate(self, ctx, target):
        ctx.count()

for name, req in (("gated_new", "fakelib_xyz>=2"), ("gated_newer", "fakelib_xyz>=3")):
    plugin.add(Feature(name=name, env=f"LOONGKIT_{name.upper()}", level=1, category=Category.OTHER,
                       description="needs fakelib", requires=(req,), targets=("fakelib_xyz",)),
               impl="gated_plugin:Mark")
'''


def test_a_child_process_sees_it_too(fake_distribution, run_loongkit, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    site = install_fake_plugin(tmp_path / "site", "gated_plugin", GATED, entry_point="gated_plugin:plugin")
    fake_distribution("fakelib_xyz", "2.5", modules={"fakelib_xyz/__init__.py": "VERSION = '2.5'\n"})
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ["PYTHONPATH"]]),
           "LOONGKIT_GATED_NEW": "1", "LOONGKIT_GATED_NEWER": "1"}
    r = run_loongkit("import fakelib_xyz; print(fakelib_xyz.VERSION)", env)
    assert r.returncode == 0 and "2.5" in r.stdout, r.stderr
    assert r.feature("gated_new")["active"]
    newer = r.feature("gated_newer")
    assert newer["state"] == "not applicable" and newer["reason"] == "fakelib_xyz 2.5 outside >=3"


def test_skip_outside_declaration_reads_the_features_own_requires(fake_distribution) -> None:  # type: ignore[no-untyped-def]
    import pytest

    from loongkit_core.feature import Category, Feature
    from loongkit_core.testing import skip_outside_declaration

    feature = Feature(name="needs_new_fakelib", env="LOONGKIT_NEEDS_NEW_FAKELIB", level=1, category=Category.OTHER,
                      description="", requires=("fakelib_xyz>=2.0", "otherlib_xyz>=1.0"))
    fake_distribution("fakelib_xyz", "2.1.0")
    skip_outside_declaration(feature, "fakelib_xyz")  # inside: the test goes on; otherlib (absent) not asked
    fake_distribution("fakelib_xyz", "1.5.0")
    with pytest.raises(pytest.skip.Exception, match=r"needs_new_fakelib declares fakelib_xyz>=2.0: "
                                                    r"fakelib_xyz 1.5.0 outside >=2.0 \(not applicable there\)"):
        skip_outside_declaration(feature, "fakelib_xyz")
    with pytest.raises(pytest.skip.Exception, match="otherlib_xyz not installed"):
        skip_outside_declaration(feature, "OtherLib_XYZ")
