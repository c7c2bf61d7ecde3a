"""Property-based: any LOONGKIT_* environment never raises out of loongkit, and every invalid value
falls back to its default with exactly one warning."""

from __future__ import annotations

import string

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loongkit_core.runtime import Runtime
from loongkit_core.settings import CoreSettings, load_settings

FEATURE_VARS = ["LOONGKIT_ALLOW_TF32", "LOONGKIT_FUSED_ADAMW", "LOONGKIT_NUMA_AFFINITY", "LOONGKIT_PYTORCH",
                "LOONGKIT_DONATED_BUFFER_FIX", "LOONGKIT_NUMA_AFFINITY_ALLOW_INDEX", "LOONGKIT_PAGE_CACHE_LIMIT_SIZE"]
CORE_VARS = ["LOONGKIT_ALL", "LOONGKIT_LOGLEVEL", "LOONGKIT_STRICT", "LOONGKIT_ACTIVATION_TIMEOUT"]

values = st.one_of(
    st.sampled_from(["0", "1", "2", "3", "on", "off", "yes", "no", "YES", "", " ", "debug", "INFO", "8G", "50%"]),
    st.text(max_size=40),
    st.integers(min_value=-10**30, max_value=10**30).map(str),
    st.text(alphabet="\u00e9\u4e2d\U0001f600\u200b\ufeff", max_size=8),
)
names = st.one_of(
    st.sampled_from(FEATURE_VARS + CORE_VARS),
    st.text(alphabet=string.ascii_uppercase + "_0123456789", min_size=1, max_size=30).map(lambda s: "LOONGKIT_" + s),
)
environments = st.dictionaries(names, values.filter(lambda v: "\x00" not in v), max_size=8)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(environments)
def test_core_settings_never_raise(env: dict[str, str]) -> None:
    settings_, warnings = load_settings(CoreSettings, environ=env)
    assert 0 <= settings_.all <= 3
    assert settings_.loglevel in ("debug", "info", "warning", "error", "critical")
    for var in CORE_VARS:
        if var in env:
            mentioned = [w for w in warnings if w.startswith(var + "=")]
            assert len(mentioned) <= 1  # at most one warning per variable


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(environments)
def test_full_resolution_never_raises(env: dict[str, str]) -> None:
    env = {**env, "LOONGKIT_STRICT": "0"}
    rt = Runtime(env, arm=False)
    rt.boot(configure_logging=False)
    assert rt.manager.faults == [], [f.error for f in rt.manager.faults]
    for record in rt.records.values():
        if env.get(record.feature.env, "").strip().lower() in ("0", "off", "no"):
            assert not record.enabled
