"""Write fake cgroup v1/v2 trees (and the procfs bits they need) under a root, for tests and dry runs.

Point ``LOONGKIT_SYSFS_ROOT`` at the root. Every file is generated from the arguments, so a test
states its machine in one call: ``write_cgroup_tree(tmp, version=2, cpu_max="150000 100000")``.
"""

from __future__ import annotations

from pathlib import Path


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def write_cgroup_tree(
    root: str | Path,
    *,
    version: int = 2,
    group: str = "/",
    cpus: str = "0-1",
    cpu_max: str | None = None,
    cfs_quota_us: str | None = None,
    cfs_period_us: str | None = "100000",
    parent_cpu_max: str | None = None,
    memory_max: str | None = None,
    memory_stat: str | None = "file 0\nanon 0\n",
    memory_reclaim: bool = False,
    pagecache_limit: dict[str, str] | None = None,
    global_switch: str | None = None,
    mem_total_kb: int | None = 16 * 1024 * 1024,
) -> Path:
    """Build the tree; ``group`` is this process's cgroup path (as /proc/self/cgroup names it).

    ``parent_cpu_max`` goes on the mount root (v2) when ``group`` is a child, to test the lineage.
    ``pagecache_limit`` writes ``memory.pagecache_limit.<key>`` files (Alibaba Cloud Linux).
    """
    base = Path(root)
    rel = group.strip("/")
    _write(base / "proc/self/status", f"Name:\tpython\nCpus_allowed_list:\t{cpus}\nMems_allowed_list:\t0\n")
    _write(base / "sys/devices/system/cpu/online", cpus + "\n")
    if mem_total_kb is not None:
        _write(base / "proc/meminfo", f"MemTotal:       {mem_total_kb} kB\nMemFree:        1000 kB\n")
    mount = base / "sys/fs/cgroup"
    if version == 2:
        _write(base / "proc/self/cgroup", f"0::/{rel}\n")
        _write(mount / "cgroup.controllers", "cpuset cpu io memory pids\n")
        cpu_dir = mem_dir = mount / rel if rel else mount
        if parent_cpu_max is not None:
            _write(mount / "cpu.max", parent_cpu_max + "\n")
        if cpu_max is not None:
            _write(cpu_dir / "cpu.max", cpu_max + "\n")
        if memory_max is not None:
            _write(mem_dir / "memory.max", memory_max + "\n")
        if memory_reclaim:
            _write(mem_dir / "memory.reclaim", "")
    else:
        _write(base / "proc/self/cgroup",
               f"5:memory:/{rel}\n4:cpu,cpuacct:/{rel}\n3:cpuset:/\n0::/\n")
        (mount / "unified").mkdir(parents=True, exist_ok=True)  # a hybrid host, like most v1 machines
        cpu_dir = mount / "cpu,cpuacct" / rel
        mem_dir = mount / "memory" / rel
        cpu_dir.mkdir(parents=True, exist_ok=True)
        if cfs_quota_us is not None:
            _write(cpu_dir / "cpu.cfs_quota_us", cfs_quota_us + "\n")
            if cfs_period_us is not None:
                _write(cpu_dir / "cpu.cfs_period_us", cfs_period_us + "\n")
        if memory_max is not None:
            _write(mem_dir / "memory.limit_in_bytes", memory_max + "\n")
    mem_dir.mkdir(parents=True, exist_ok=True)
    if memory_stat is not None:
        _write(mem_dir / "memory.stat", memory_stat)
    for key, value in (pagecache_limit or {}).items():
        _write(mem_dir / f"memory.pagecache_limit.{key}", value + "\n")
    if global_switch is not None:
        _write(base / "sys/kernel/mm/pagecache_limit/enabled", global_switch + "\n")
    return mem_dir
