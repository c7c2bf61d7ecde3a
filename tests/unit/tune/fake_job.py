"""A synthetic training job with a fake training monitor, for tune's tests (no torch, no loongkit).

It honours the monitor's interface itself: stops after LOONGKIT_MONITOR_MAX_STEPS steps and writes
LOONGKIT_SUMMARY_JSON with a ``monitor`` row whose figures follow planted rules, so which candidate
is truly fastest is known. ``FAKE_RULES`` (JSON) is a list of
``{"when": {"VAR": "value", ...}, "step": s, "crash": bool, "hang": bool, "loss_shift": x}``: every
rule whose variables all match applies, later rules over earlier ones. ``FAKE_STEP`` is the default
step (seconds), ``FAKE_SLEEP`` real seconds spent per trial (for the budget), ``FAKE_JITTER`` the
relative run-to-run noise of the step, ``FAKE_WORKERS`` the job's own worker count, and
``FAKE_DATA_WAIT`` its data-wait share. A rule's ``"seq": [s1, s2, ...]`` gives the step of its
first, second, ... matching trial (the last one after that; counted in ``FAKE_STATE``, a directory):
a machine whose load changes between trials. ``FAKE_ACTIVE`` (JSON ``{"name": level}``) lists the
features whose code ran, as the Summary's rows say.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time


def main() -> int:
    rules = json.loads(os.environ.get("FAKE_RULES", "[]"))
    step = float(os.environ.get("FAKE_STEP", "0.100"))
    crash = hang = False
    shift = 0.0
    for index, rule in enumerate(rules):
        if all(os.environ.get(k) == v for k, v in rule.get("when", {}).items()):
            step = float(rule.get("step", step))
            if rule.get("seq"):
                counter = os.path.join(os.environ["FAKE_STATE"], f"rule-{index}")
                seen = os.path.getsize(counter) if os.path.exists(counter) else 0
                with open(counter, "a") as fh:
                    fh.write(".")
                step = float(rule["seq"][min(seen, len(rule["seq"]) - 1)])
            crash = bool(rule.get("crash", crash))
            hang = bool(rule.get("hang", hang))
            shift = float(rule.get("loss_shift", shift))
    jitter = float(os.environ.get("FAKE_JITTER", "0"))
    step *= 1 + random.uniform(-jitter, jitter)
    steps = int(os.environ.get("LOONGKIT_MONITOR_MAX_STEPS", "0") or 20)
    for i in range(steps):
        print(f"step {i} loss: {2.0 / (i + 1) + shift:.6f}", flush=True)
    if hang:
        time.sleep(3600)
    if crash:
        print("Traceback (most recent call last):\nRuntimeError: planted crash", file=sys.stderr, flush=True)
        return 1
    time.sleep(float(os.environ.get("FAKE_SLEEP", "0")))
    path = os.environ.get("LOONGKIT_SUMMARY_JSON")
    workers = int(os.environ.get("LOONGKIT_DATALOADER_WORKERS_COUNT") or os.environ.get("FAKE_WORKERS", "2"))
    if path:
        figures = {"steps": steps, "warm_steps": max(0, steps - 3), "step_median_s": step,
                   "step_p90_s": step * 1.05, "data_wait_share": float(os.environ.get("FAKE_DATA_WAIT", "0.3")),
                   "gpu_idle_share": None, "workers": workers, "worker_cpu_used": 1.0, "cpus_allowed": 4.0,
                   "rss_growth_bytes_per_worker": None, "stragglers": [], "recommendations": [],
                   "stopped_at_max_steps": True}
        active = json.loads(os.environ.get("FAKE_ACTIVE", "{}"))
        rows = [{"name": name, "level": level, "state": "active", "active": True} for name, level in active.items()]
        summary = {"version": 1, "features": [{"name": "monitor", "level": 1, "state": "active", "active": True,
                                               "details": {"monitor": figures}}, *rows]}
        with open(path, "w") as fh:
            json.dump(summary, fh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
