"""The product's variable rules: bools, levels, log levels, and fallback with one warning."""

from __future__ import annotations

import pytest
from pydantic_settings import SettingsConfigDict

from loongkit_core.settings import CoreSettings, LkBool, LoongkitSettings, load_settings, parse_bool


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


@pytest.mark.parametrize("value", ["4", "-1", "x", "1.5", "", "99999999999999999999"])
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


@pytest.mark.parametrize("value", ["verbose", "warn", "", "5", "trace"])
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
