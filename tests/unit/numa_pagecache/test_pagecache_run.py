"""LOONGKIT_PAGE_CACHE_LIMIT end to end (fresh interpreters) on fake cgroup trees via LOONGKIT_SYSFS_ROOT."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from loongkit_numa.fake_cgroups import write_cgroup_tree

G = 1 << 30
READ_FILES = """
import sys, time
mem = sys.argv[1]
for name in ("enable", "size", "sync"):
    print(name, open(f"{mem}/memory.pagecache_limit.{name}").read().strip())
print("switch", open(sys.argv[2]).read().strip())
"""


def test_alibaba_cloud_linux_limit_written_and_restored(tmp_path: Path, run_loongkit: Any) -> None:
    root = tmp_path / "root"
    mem = write_cgroup_tree(root, version=2, group="/pod", memory_max=str(8 * G), memory_reclaim=True,
                            pagecache_limit={"enable": "0", "size": "0", "sync": "0"}, global_switch="0")
    switch = root / "sys/kernel/mm/pagecache_limit/enabled"
    script = tmp_path / "read.py"
    script.write_text(READ_FILES)
    env = {"LOONGKIT_PAGE_CACHE_LIMIT": "1", "LOONGKIT_PAGE_CACHE_LIMIT_SYNC": "yes", "LOONGKIT_SYSFS_ROOT": str(root)}
    r = run_loongkit(env=env, argv=[sys.executable, str(script), str(mem), str(switch)])
    assert r.returncode == 0, r.stderr
    assert f"enable 1\nsize {4 * G}\nsync 1\nswitch 1" in r.stdout  # 50% of the 8G memory.max
    row = r.feature("page_cache_limit")
    assert row["active"] and row["config"]["mechanism"] == "pagecache_limit"
    assert row["config"]["limit_bytes"] == 4 * G
    # The previous values are back after the run.
    assert (mem / "memory.pagecache_limit.enable").read_text().strip() == "0"
    assert switch.read_text().strip() == "0"


RECLAIM = """
import sys, time
deadline = time.time() + 20
while time.time() < deadline and not open(sys.argv[1]).read():
    time.sleep(0.05)
print("reclaim", open(sys.argv[1]).read())
"""


def test_reclaimer_on_stock_v2(tmp_path: Path, run_loongkit: Any) -> None:
    root = tmp_path / "root"
    mem = write_cgroup_tree(root, version=2, memory_max=str(4 * G), memory_reclaim=True,
                            memory_stat=f"anon 100\nfile {3 * G}\n")
    script = tmp_path / "wait.py"
    script.write_text(RECLAIM)
    env = {"LOONGKIT_PAGE_CACHE_LIMIT": "1", "LOONGKIT_PAGE_CACHE_LIMIT_SIZE": "1g", "LOONGKIT_SYSFS_ROOT": str(root)}
    r = run_loongkit(env=env, argv=[sys.executable, str(script), str(mem / "memory.reclaim")])
    assert r.returncode == 0, r.stderr
    assert f"reclaim {3 * G - int(G * 0.95)}" in r.stdout
    row = r.feature("page_cache_limit")
    assert row["active"] and row["config"] == {"size": "1G", "limit_bytes": G, "sync": False,
                                               "mechanism": "memory.reclaim", "cgroup": str(mem)}
    assert row["details"]["reclaims"] >= 1


def test_other_local_ranks_leave_it_to_rank_zero(tmp_path: Path, run_loongkit: Any) -> None:
    root = tmp_path / "root"
    write_cgroup_tree(root, version=2, memory_reclaim=True, memory_stat=f"file {3 * G}\n")
    env = {"LOONGKIT_PAGE_CACHE_LIMIT": "1", "LOONGKIT_SYSFS_ROOT": str(root), "LOCAL_RANK": "1",
           "LOCAL_WORLD_SIZE": "2", "RANK": "1"}
    r = run_loongkit("import threading; print(sorted(t.name for t in threading.enumerate()))", env=env)
    assert r.returncode == 0, r.stderr
    assert "loongkit-pagecache" not in r.stdout
    summary = json.loads((r.summary_path.parent / "summary.rank1.json").read_text())
    row = next(f for f in summary["features"] if f["name"] == "page_cache_limit")
    assert not row["active"] and "local rank 0" in row["reason"]


def test_not_applicable_on_v1_without_pagecache_limit_and_bad_size(tmp_path: Path, run_loongkit: Any) -> None:
    root = tmp_path / "root"
    write_cgroup_tree(root, version=1)
    env = {"LOONGKIT_PAGE_CACHE_LIMIT": "1", "LOONGKIT_PAGE_CACHE_LIMIT_SIZE": "lots", "LOONGKIT_SYSFS_ROOT": str(root)}
    r = run_loongkit("print('trained')", env=env)
    assert r.returncode == 0 and "trained" in r.stdout
    row = r.feature("page_cache_limit")
    assert row["state"] == "not applicable" and "cgroup v1 memory controller" in row["reason"]


def test_bad_size_falls_back_to_default_with_warning(tmp_path: Path, run_loongkit: Any) -> None:
    root = tmp_path / "root"
    write_cgroup_tree(root, version=2, memory_max=str(2 * G), memory_reclaim=True)
    env = {"LOONGKIT_PAGE_CACHE_LIMIT": "1", "LOONGKIT_PAGE_CACHE_LIMIT_SIZE": "8GB", "LOONGKIT_SYSFS_ROOT": str(root)}
    r = run_loongkit("print('trained')", env=env)
    assert r.returncode == 0 and "trained" in r.stdout
    assert "LOONGKIT_PAGE_CACHE_LIMIT_SIZE='8GB' is invalid" in r.logs()
    assert r.feature("page_cache_limit")["config"]["limit_bytes"] == G  # the default 50% of 2G


def test_broken_tree_never_crashes(tmp_path: Path, run_loongkit: Any) -> None:
    root = tmp_path / "root"
    mem = write_cgroup_tree(root, version=2, memory_reclaim=True, memory_stat="\x00garbage", memory_max="junk",
                            mem_total_kb=None)
    (mem / "memory.max").write_text("junk")
    env = {"LOONGKIT_PAGE_CACHE_LIMIT": "1", "LOONGKIT_SYSFS_ROOT": str(root)}
    r = run_loongkit("print('trained')", env=env)
    assert r.returncode == 0 and "trained" in r.stdout
    row = r.feature("page_cache_limit")
    assert row["state"] == "not applicable" and "memory size is unknown" in row["reason"]
