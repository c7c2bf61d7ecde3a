"""loongkit_core.resolution: which declared features are enabled, applicable, configured, then armed."""

from __future__ import annotations

from typing import Any

from loongkit_core.feature import PolicyDecision, State


def test_its_variable_then_loongkit_all_decide_enabled(booted: Any, feature: Any) -> None:
    rt = booted({"LOONGKIT_ALL": "1"}, {"LOONGKIT_C": "1", "LOONGKIT_D": "0"},
                (feature("a"), feature("b", level=2), feature("c", level=3), feature("d")))
    rt.resolve()
    a, b, c, d = (rt.records[n] for n in "abcd")
    assert (a.enabled, a.explicit, a.state) == (True, False, State.ARMED)
    assert (b.enabled, b.state) == (False, State.DISABLED)
    assert (c.enabled, c.explicit, c.state) == (True, True, State.ARMED)
    assert (d.enabled, d.state) == (False, State.DISABLED)  # =0 wins over LOONGKIT_ALL
    assert rt.owner_calls == [("loongkit_detect", "a"), ("loongkit_configure", "a"),  # type: ignore[attr-defined]
                              ("loongkit_detect", "c"), ("loongkit_configure", "c")]


def test_an_invalid_value_warns_and_counts_as_unset(booted: Any, feature: Any) -> None:
    rt = booted({}, {"LOONGKIT_A": "maybe"}, (feature("a"),))
    rt.resolve()
    assert not rt.records["a"].enabled
    assert any(w.startswith("LOONGKIT_A='maybe' is invalid") for w in rt.warnings)


def test_configure_gives_the_config_and_its_warnings(booted: Any, feature: Any) -> None:
    def owner(hook: str, **kwargs: Any) -> Any:
        return ({"size": 4}, ["size rounded to 4"]) if hook == "loongkit_configure" else None

    rt = booted({}, {"LOONGKIT_A": "1"}, (feature("a"),), owner)
    rt.resolve()
    assert rt.records["a"].config == {"size": 4} and rt.records["a"].state == State.ARMED
    assert "size rounded to 4" in rt.warnings


def test_a_hardware_policy_turns_a_default_off_but_not_an_explicit_one(booted: Any, feature: Any) -> None:
    rt = booted({"LOONGKIT_ALL": "1"}, {"LOONGKIT_B": "1"}, (feature("a"), feature("b")))
    policy = PolicyDecision("no GPU found", enabled_by_default=False)
    rt.manager.call_each = lambda hook, **kwargs: (  # type: ignore[method-assign]
        [("planted", {"a": policy, "b": policy})] if hook == "loongkit_hardware_policy" else [])
    rt.resolve()
    a, b = rt.records["a"], rt.records["b"]
    assert not a.enabled and a.reason == "off by hardware policy: no GPU found" and a.policy == "no GPU found"
    assert b.enabled and b.explicit and b.state == State.ARMED and b.policy == "no GPU found"
    assert rt.policies == {"a": policy, "b": policy}


def test_not_implemented_not_applicable_and_a_failing_detect(booted: Any, feature: Any) -> None:
    def owner(hook: str, **kwargs: Any) -> Any:
        name = kwargs["feature"].name
        if hook == "loongkit_detect" and name == "b":
            return "no device"
        if hook == "loongkit_detect" and name == "c":
            raise OSError("sysfs vanished")
        return None

    on = {"LOONGKIT_A": "1", "LOONGKIT_B": "1", "LOONGKIT_C": "1"}
    rt = booted({}, on, (feature("a", implemented=False), feature("b"), feature("c")), owner)
    rt.resolve()
    a, b, c = (rt.records[n] for n in "abc")
    assert a.state == State.NOT_IMPLEMENTED
    assert (b.state, b.reason) == (State.NOT_APPLICABLE, "no device")
    assert c.state == State.FAILED and c.reason == "loongkit_detect: OSError: sysfs vanished"
    assert [f.feature for f in rt.manager.faults] == ["c"]


def test_disables_and_depends_on(booted: Any, feature: Any) -> None:
    features = (feature("a", disables=("b",)), feature("b"), feature("c", depends_on=("x",)),
                feature("d", depends_on=("a",)))
    rt = booted({"LOONGKIT_ALL": "1"}, {}, features)
    rt.resolve()
    assert rt.records["a"].state == State.ARMED
    assert (rt.records["b"].state, rt.records["b"].reason) == (State.NOT_APPLICABLE, "switched off by LOONGKIT_A")
    assert (rt.records["c"].state, rt.records["c"].reason) == (State.NOT_APPLICABLE, "needs x enabled and applicable")
    assert rt.records["d"].state == State.ARMED


def test_an_unread_variable_gets_a_did_you_mean(booted: Any, feature: Any) -> None:
    rt = booted({}, {"LOONGKIT_ALPAH": "1"}, (feature("alpha"),))
    assert "LOONGKIT_ALPAH" in rt.unread_variables()
    rt.manager.disabled, rt.manager.disabled_unmatched = {}, []
    assert rt.check_unknown_variables() == ["unknown variable LOONGKIT_ALPAH; did you mean LOONGKIT_ALPHA?"]


def test_with_a_plugin_disabled_an_unread_variable_is_named_without_a_guess(booted: Any, feature: Any) -> None:
    rt = booted({}, {"LOONGKIT_ALPAH": "1"}, (feature("alpha"),))
    warnings = rt.check_unknown_variables()
    assert warnings[0].startswith("read by no loaded plugin: LOONGKIT_ALPAH (plugin ")
    assert "did you mean" not in warnings[0]
