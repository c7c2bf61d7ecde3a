"""The product's variable rules: bools, levels, log levels, and fallback with one warning."""

from __future__ import annotations

import pytest
from pydantic_settings import SettingsConfigDict

from loongkit_core.settings import CoreSettings, LkBool, LoongkitSettings, bool_or_none, load_settings, parse_bool


@pytest.mark.parametrize("word", ["1", "on", "yes", "ON", "Yes", " yes "])
def test_true_words(word: str) -> None:
    assert parse_bool(word) is True


@pytest.mark.parametrize("word", ["0", "off", "no", "OFF", "No"])
def test_false_words(word: str) -> None:
    assert parse_bool(word) is False


@pytest.mark.parametrize("word", ["true", "false", "2", "", "y", "n", "t", "enable", "１"])  # noqa: RUF001
def test_other_words_are_undefined(word: str) -> None:
    with pytest.raises(ValueError):
        parse_bool(word)


@pytest.mark.parametrize(("value", "expected"), [("0", 0), ("1", 1), ("2", 2), ("3", 3)])
def test_all_levels(value: str, expected: int) -> None:
    settings, warnings = load_settings(CoreSettings, environ={"LOONGKIT_ALL": value})
    assert settings.all == expected and warnings == []


@pytest.mark.parametrize("value", ["4", "-1", "x", "1.5", "99999999999999999999"])
def test_bad_all_reverts_to_zero_with_one_warning(value: str) -> None:
    settings, warnings = load_settings(CoreSettings, environ={"LOONGKIT_ALL": value})
    assert settings.all == 0
    assert len(warnings) == 1 and "LOONGKIT_ALL" in warnings[0]


@pytest.mark.parametrize(("value", "expected"),
                         [("debug", "debug"), ("INFO", "info"), ("Warning", "warning"), ("ERROR", "error"),
                          ("critical", "critical")])
def test_loglevel_case_insensitive(value: str, expected: str) -> None:
    settings, warnings = load_settings(CoreSettings, environ={"LOONGKIT_LOGLEVEL": value})
    assert settings.loglevel == expected and warnings == []


@pytest.mark.parametrize("value", ["verbose", "warn", "5", "trace"])
def test_bad_loglevel_is_warning(value: str) -> None:
    settings, warnings = load_settings(CoreSettings, environ={"LOONGKIT_LOGLEVEL": value})
    assert settings.loglevel == "warning"
    assert len(warnings) == 1 and "LOONGKIT_LOGLEVEL" in warnings[0]


def test_defaults() -> None:
    settings, warnings = load_settings(CoreSettings, environ={})
    assert (settings.all, settings.loglevel, settings.logdir, settings.strict) == (0, "warning", None, False)
    assert warnings == []


def test_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOONGKIT_ALL", "2")
    monkeypatch.setenv("LOONGKIT_STRICT", "maybe")
    settings, warnings = load_settings(CoreSettings)
    assert settings.all == 2 and settings.strict is False
    assert len(warnings) == 1 and "LOONGKIT_STRICT" in warnings[0]


class _Options(LoongkitSettings):
    model_config = SettingsConfigDict(env_prefix="LOONGKIT_DEMO_", extra="ignore")
    flag: LkBool = False
    size: int = 7


def test_each_field_falls_back_on_its_own() -> None:
    opts, warnings = load_settings(_Options, environ={"LOONGKIT_DEMO_FLAG": "yes", "LOONGKIT_DEMO_SIZE": "big"})
    assert opts.flag is True and opts.size == 7
    assert len(warnings) == 1 and "LOONGKIT_DEMO_SIZE" in warnings[0]


def test_policy_defaults_apply_only_where_unset_or_invalid() -> None:
    opts, _ = load_settings(_Options, defaults={"flag": True}, environ={})
    assert opts.flag is True
    opts, _ = load_settings(_Options, defaults={"flag": True}, environ={"LOONGKIT_DEMO_FLAG": "0"})
    assert opts.flag is False  # explicit beats policy
    opts, _ = load_settings(_Options, defaults={"flag": True}, environ={"LOONGKIT_DEMO_FLAG": "perhaps"})
    assert opts.flag is True  # invalid -> default, and the default is the policy's


def test_env_names() -> None:
    assert _Options.env_names() == ("LOONGKIT_DEMO_FLAG", "LOONGKIT_DEMO_SIZE")


class _Named(LoongkitSettings):
    model_config = SettingsConfigDict(env_prefix="LOONGKIT_DEMO_", extra="ignore")
    mode: str = "auto"
    limit: int = 3


_CORE_VALUED = ("LOONGKIT_ALL", "LOONGKIT_LOGLEVEL", "LOONGKIT_LOGDIR", "LOONGKIT_STRICT", "LOONGKIT_SUMMARY_JSON",
                "LOONGKIT_SYSFS_ROOT", "LOONGKIT_ACTIVATION_TIMEOUT", "LOONGKIT_DISABLE_PLUGINS")


@pytest.mark.parametrize("value", ["", "   "])
def test_empty_value_is_unset_everywhere(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One rule for core settings, feature switches and plugin options: empty means unset (the default,
    no warning), as it always did for LOONGKIT_LOGDIR."""
    defaults, _ = load_settings(CoreSettings, environ={})
    core, warnings = load_settings(CoreSettings, environ=dict.fromkeys(_CORE_VALUED, value))
    assert warnings == [] and core.model_dump() == defaults.model_dump()
    opts, warnings = load_settings(_Named, environ={"LOONGKIT_DEMO_MODE": value, "LOONGKIT_DEMO_LIMIT": value})
    assert warnings == [] and (opts.mode, opts.limit) == ("auto", 3)
    opts, _ = load_settings(_Named, defaults={"limit": 9}, environ={"LOONGKIT_DEMO_LIMIT": value})
    assert opts.limit == 9  # unset, so a hardware policy's default applies
    assert bool_or_none(value) == (None, False)  # a feature's switch
    for name in _CORE_VALUED:  # the os.environ path too
        monkeypatch.setenv(name, value)
    core, warnings = load_settings(CoreSettings)
    assert warnings == [] and core.model_dump() == defaults.model_dump()
