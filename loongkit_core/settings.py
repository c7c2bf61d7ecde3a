"""LOONGKIT_* settings with the product's exact rules, on pydantic-settings.

Rules (from the product documentation):

* bools accept ``1``/``on``/``yes`` and ``0``/``off``/``no``, case-insensitively; any other value is
  "undefined" and reverts to the default (we also log one warning naming the variable);
* ``LOONGKIT_LOGLEVEL`` accepts debug/info/warning/error/critical case-insensitively, else warning;
* ``LOONGKIT_ALL`` is a level 0-3; anything else reverts to 0 with a warning;
* an empty (or all-blank) value means unset, for every variable (core settings, feature switches,
  plugin options): the default, and no warning. ``LOONGKIT_X=`` is how scripts clear a variable.

A bad value never raises out of loongkit: every field falls back to its own default on its own.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, TypeVar

from pydantic import BeforeValidator, Field, ValidationError, ValidatorFunctionWrapHandler, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# The value rules are stdlib-only (the fast path and a process reusing its job's resolution read
# switches without pydantic); re-exported here, where plugins have always found them.
from loongkit_core._boot import (  # noqa: F401
    CORE_VARIABLES,
    FALSE_WORDS,
    LOG_LEVELS,
    TRUE_WORDS,
    bool_or_none,
    is_unset,
    parse_bool,
)


def _parse_level(value: object) -> object:
    if isinstance(value, str):
        word = value.strip().lower()
        if word in LOG_LEVELS:
            return word
        raise ValueError(f"{value!r} is not one of {', '.join(LOG_LEVELS)}")
    return value


LkBool = Annotated[bool, BeforeValidator(parse_bool)]
"""A bool field with the seed's rule."""

# Models loaded through load_settings() while recording (loongkit_core.testing.conformance: which
# variables a feature's configure step really reads).
_loaded: contextvars.ContextVar[list[type[LoongkitSettings]] | None] = contextvars.ContextVar(
    "loongkit_settings_loaded", default=None)

# Set by load_settings(): build the model from the values it passes, not from pydantic-settings' sources.
_values_only: contextvars.ContextVar[bool] = contextvars.ContextVar("loongkit_settings_values_only", default=False)

# Warnings raised while loading a settings model, collected by load_settings().
_warnings: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("loongkit_settings_warnings",
                                                                               default=None)


def _raw(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "...'"


class LoongkitSettings(BaseSettings):
    """Base for every LOONGKIT_* settings model (core and per-feature options).

    Subclasses set ``model_config = SettingsConfigDict(env_prefix="LOONGKIT_<FEATURE>_")``. A field
    that fails validation takes its default and records one warning instead of raising.
    """

    # env_ignore_empty: a model built directly (``Options()``) treats ``LOONGKIT_X=`` as unset too.
    model_config = SettingsConfigDict(env_prefix="LOONGKIT_", extra="ignore", case_sensitive=False,
                                      env_ignore_empty=True)
    # Fields whose variable was set but invalid (they hold their default).
    invalid_fields: ClassVar[frozenset[str]] = frozenset()

    @field_validator("*", mode="wrap")
    @classmethod
    def _fallback_to_default(cls, value: Any, handler: ValidatorFunctionWrapHandler, info: Any) -> Any:
        try:
            return handler(value)
        except (ValidationError, ValueError) as exc:
            field = cls.model_fields[info.field_name]
            default = field.get_default(call_default_factory=True)
            var = cls.env_name(info.field_name)
            reason = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
            sink = _warnings.get()
            if sink is not None:
                sink.append(f"{var}={_raw(value)} is invalid ({reason}); using the default {default!r}")
                sink.append(f"\0invalid:{info.field_name}")
            return default

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: Any, env_settings: Any,
                                   dotenv_settings: Any, file_secret_settings: Any) -> tuple[Any, ...]:
        # load_settings() reads the variables itself and passes them in: pydantic-settings must not
        # add os.environ's on top (an explicit ``environ`` would otherwise leak the real environment).
        if _values_only.get():
            return (init_settings,)
        return (init_settings, env_settings, dotenv_settings, file_secret_settings)

    @classmethod
    def env_name(cls, field_name: str) -> str:
        field = cls.model_fields[field_name]
        if field.validation_alias and isinstance(field.validation_alias, str):
            return field.validation_alias.upper()
        return (str(cls.model_config.get("env_prefix", "")) + field_name).upper()

    @classmethod
    def env_names(cls) -> tuple[str, ...]:
        return tuple(cls.env_name(name) for name in cls.model_fields)


S = TypeVar("S", bound="LoongkitSettings")


def load_settings(
    cls: type[S], defaults: Mapping[str, object] | None = None, environ: Mapping[str, str] | None = None
) -> tuple[S, list[str]]:
    """Build ``cls`` from the environment; return it and the warnings for invalid values.

    ``defaults`` replace field defaults where the variable is unset or invalid (hardware policy).
    ``environ`` (tests, ``--info``) is read instead of ``os.environ``.
    """
    env = os.environ if environ is None else environ
    # Read the variables here rather than through pydantic-settings' own sources, so that os.environ
    # and an explicit mapping follow the same rules (names case-insensitive, empty = unset).
    names = {cls.env_name(name): name for name in cls.model_fields}
    values = {names[k.upper()]: v for k, v in env.items() if k.upper() in names and not is_unset(v)}
    sink: list[str] = []
    token, only = _warnings.set(sink), _values_only.set(True)
    try:
        settings = cls.model_validate(values)
    finally:
        _values_only.reset(only)
        _warnings.reset(token)
    invalid = {w.split(":", 1)[1] for w in sink if w.startswith("\0invalid:")}
    warnings = [w for w in sink if not w.startswith("\0")]
    if defaults:
        for name, value in defaults.items():
            if name in cls.model_fields and (name in invalid or name not in values):
                object.__setattr__(settings, name, value)
    loaded = _loaded.get()
    if loaded is not None:
        loaded.append(cls)
    return settings, warnings


class CoreSettings(LoongkitSettings):
    """The variables the core reads for itself."""

    model_config = SettingsConfigDict(env_prefix="LOONGKIT_", extra="ignore", case_sensitive=False,
                                      env_ignore_empty=True)

    all: int = Field(0, ge=0, le=3, description="Enable every feature up to this level (0-3).")
    loglevel: Annotated[str, BeforeValidator(_parse_level)] = Field(
        "warning", pattern="^(debug|info|warning|error|critical)$", description="Minimum log level."
    )
    logdir: str | None = Field(None, description="stdout, stderr or a directory for log files.")
    strict: LkBool = Field(False, description="Turn plugin and feature faults into errors (plugin CI).")
    summary_json: str | None = Field(None, description="Also write the Feature Summary as JSON here.")
    sysfs_root: str = Field("/", description="Root under which /sys and /proc are read (tests, dry runs).")
    activation_timeout: float = Field(
        30.0, gt=0, le=3600, description="Seconds a feature's activation may take before it is abandoned."
    )
    disable_plugins: str = Field("", description="Comma-separated plugin names not to load.")
    resolve_once: LkBool = Field(True, description="Reuse the job's resolution in its other processes "
                                                   "(loongkit_core.resolved); 0: every process resolves in full.")
