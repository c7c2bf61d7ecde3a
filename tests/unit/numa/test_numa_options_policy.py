"""LOONGKIT_NUMA_AFFINITY_* parsing, the CPU-vendor policy, and the plugin's declarations."""

from __future__ import annotations

from pathlib import Path

import pytest
from loongkit_numa.affinity import NumaAffinity
from loongkit_numa.options import NumaAffinityOptions
from loongkit_numa.plugin import plugin
from loongkit_numa.policy import vendor_policy
from numa_helpers import make_env

from loongkit_core.hardware import Hardware, detect
from loongkit_core.settings import load_settings
from loongkit_core.testing.topology import amd_2s_8gpu, intel_2s_8gpu

FIELDS = list(NumaAffinityOptions.model_fields)
PREFIX = "LOONGKIT_NUMA_AFFINITY_"


def test_every_declared_option_is_a_field() -> None:
    feature = next(f for f in plugin.loongkit_declare_features() if f.name == "numa_affinity")
    assert set(feature.options) == set(NumaAffinityOptions.env_names())
    assert len(FIELDS) == 7


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("bad", ["2", "maybe", "true!"])
def test_bad_value_falls_back_to_default_with_warning(field: str, bad: str) -> None:
    var = PREFIX + field.upper()
    options, warnings = load_settings(NumaAffinityOptions, environ={var: bad})
    assert getattr(options, field) is False
    assert len(warnings) == 1 and var in warnings[0] and "using the default False" in warnings[0]


@pytest.mark.parametrize("field", FIELDS)
def test_empty_value_is_unset(field: str) -> None:
    options, warnings = load_settings(NumaAffinityOptions, environ={PREFIX + field.upper(): ""})
    assert getattr(options, field) is False and warnings == []  # one rule for every variable


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize(("word", "value"), [("1", True), ("ON", True), ("yes", True), ("0", False), ("Off", False),
                                             ("no", False)])
def test_seed_bool_words(field: str, word: str, value: bool) -> None:
    options, warnings = load_settings(NumaAffinityOptions, environ={PREFIX + field.upper(): word})
    assert getattr(options, field) is value and warnings == []


def test_ignored_combinations_are_said() -> None:
    options, _ = load_settings(NumaAffinityOptions, environ={PREFIX + "DATA_WORKER_GPULESS_ONLY": "1",
                                                             PREFIX + "TRAIN_ON_GPULESS": "1"})
    said = options.consistency_warnings()
    assert any("DATA_WORKER_GPULESS_ONLY=1 is ignored" in w for w in said)
    assert any("TRAIN_ON_GPULESS" in w and "ALLOW_ASYMMETRIC=1" in w for w in said)
    clean, _ = load_settings(NumaAffinityOptions, environ={})
    assert clean.consistency_warnings() == []


def hw_of(vendor: str) -> Hardware:
    return Hardware(cpu_vendor=vendor)


@pytest.mark.parametrize(("vendor", "llc"), [("amd", True), ("hygon", True), ("intel", False)])
def test_vendor_policy(vendor: str, llc: bool) -> None:
    decisions = vendor_policy(hw_of(vendor), plugin.loongkit_declare_features())
    decision = decisions["numa_affinity"]
    assert decision.option_defaults == {"partition_per_llc": llc}
    assert decision.enabled_by_default is None  # the policy changes defaults, not enablement
    assert (vendor.capitalize() if vendor != "amd" else "AMD") in decision.reason


def test_vendor_policy_silent_for_unknown_vendor_or_other_features() -> None:
    features = plugin.loongkit_declare_features()
    assert vendor_policy(hw_of("unknown"), features) == {}
    assert vendor_policy(hw_of("amd"), [f for f in features if f.name != "numa_affinity"]) == {}


def test_policy_hook_through_the_plugin(tmp_path: Path) -> None:
    amd_2s_8gpu(tmp_path)
    decisions = plugin.loongkit_hardware_policy(detect(str(tmp_path)), plugin.loongkit_declare_features())
    assert decisions["numa_affinity"].option_defaults["partition_per_llc"] is True


@pytest.mark.parametrize(("explicit", "expected"), [(None, True), ("0", False), ("garbage", True)])
def test_configure_applies_policy_but_explicit_wins(tmp_path: Path, explicit: str | None, expected: bool) -> None:
    amd_2s_8gpu(tmp_path)
    environ = {} if explicit is None else {PREFIX + "PARTITION_PER_LLC": explicit}
    env = make_env(str(tmp_path), environ)
    feature = next(f for f in plugin.loongkit_declare_features() if f.name == "numa_affinity")
    policy = plugin.loongkit_hardware_policy(env.hardware, [feature])["numa_affinity"]
    options, warnings = NumaAffinity(feature).configure(env, policy)
    assert isinstance(options, NumaAffinityOptions)
    assert options.partition_per_llc is expected
    assert bool(warnings) is (explicit == "garbage")


def test_intel_policy_keeps_node_binding(tmp_path: Path) -> None:
    intel_2s_8gpu(tmp_path)
    env = make_env(str(tmp_path))
    feature = next(f for f in plugin.loongkit_declare_features() if f.name == "numa_affinity")
    policy = plugin.loongkit_hardware_policy(env.hardware, [feature])["numa_affinity"]
    options, _ = NumaAffinity(feature).configure(env, policy)
    assert options.partition_per_llc is False  # type: ignore[attr-defined]


def test_declarations() -> None:
    features = {f.name: f for f in plugin.loongkit_declare_features()}
    assert features["numa_affinity"].implemented and plugin.owns(features["numa_affinity"])
    assert isinstance(plugin.impl(features["numa_affinity"]), NumaAffinity)
    # SUBCGROUPS switches direct binding off (seed); the other features are tested with their own code.
    assert features["subcgroups"].disables == ("numa_affinity",)
