"""``loongkit-run <command...>``: run a command with the prelude on PYTHONPATH.

The command is exec'd (same pid), so its exit code and signals are the launcher's own: torchrun,
``python -m``, scripts and shell entry points behave as if started directly. ``--info`` prints
the resolved configuration (features, levels, reasons) without running anything.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

from loongkit_core._boot import PRELUDE_DIR, _same_dir

USAGE = """usage: loongkit-run [--info] <command> [args...]

Runs <command> with loongkit loaded in every Python process it starts (PYTHONPATH prelude).
Features are chosen with LOONGKIT_* variables, e.g. LOONGKIT_ALL=1 loongkit-run torchrun train.py
  --info    print the resolved configuration for this environment and exit
"""


def child_environ(environ: dict[str, str]) -> dict[str, str]:
    """The environment for the command: the prelude first on PYTHONPATH, once (nested runs too)."""
    env = dict(environ)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    parts = [p for p in parts if not _same_dir(p, PRELUDE_DIR)]
    env["PYTHONPATH"] = os.pathsep.join([PRELUDE_DIR, *parts])
    return env


class LaunchStrictError(RuntimeError):
    """A plugin's ``loongkit_launch_environment`` failed under ``LOONGKIT_STRICT=1``."""


def plugin_environ(env: dict[str, str]) -> dict[str, str]:
    """Variables that enabled features need set before the command starts (``loongkit_launch_environment``).

    Only when a feature is requested: otherwise the launcher stays as cheap as a plain exec. The probe's
    boot reports nothing: the command boots the same plugins and logs their faults (an ``impl`` typo) in
    its own log and Summary, once. What only the launcher sees, a launch-environment hook's fault and the
    variables set, is logged where the command's log records go (the same file: ``exec`` keeps the pid).
    A fault leaves the command to run without that plugin's variables; under ``LOONGKIT_STRICT=1`` any
    fault (boot or hook) is logged here and stops the launch (exit 3), as the command's boot would.
    """
    from loongkit_core import _boot

    if not _boot.requested(env):
        return env
    try:
        from loongkit_core.runtime import LoongkitStrictError, Runtime
    except Exception as exc:  # a broken install: run the command as it is
        sys.stderr.write(f"loongkit-run: launch environment skipped ({type(exc).__name__}: {exc})\n")
        return env
    try:
        rt = Runtime(env, arm=False)
        rt.log_faults = False  # recorded (the features' states hold), not logged: the command logs its own
        rt.boot(configure_logging=False)
        booted = len(rt.manager.faults)
        out = dict(env)
        chosen: list[tuple[str, str, str]] = []
        for plugin, extra in rt.manager.call_each("loongkit_launch_environment", records=list(rt.records.values()),
                                                  environ=env):
            for key, value in dict(extra).items():
                if key == "LD_PRELOAD":
                    parts = [value, *[p for p in out.get(key, "").replace(" ", ":").split(":") if p and p != value]]
                    out[key] = ":".join(parts)
                elif key not in env:
                    out[key] = str(value)
                chosen.append((key, out.get(key, ""), plugin))
    except LoongkitStrictError as exc:
        _log_launch(rt, [], rt.manager.faults[-1:])
        raise LaunchStrictError(str(exc)) from None
    except Exception as exc:
        sys.stderr.write(f"loongkit-run: launch environment skipped ({type(exc).__name__}: {exc})\n")
        return env
    faults = rt.manager.faults[booted:]
    if chosen or faults:
        _log_launch(rt, chosen, faults)
    return out


def _log_launch(rt: Any, chosen: list[tuple[str, str, str]], faults: list[Any]) -> None:
    """Log what the launcher did to the command's log destination (LOONGKIT_LOGDIR, LOONGKIT_LOGLEVEL)."""
    from loongkit_core import log

    log.configure(rt.settings.loglevel, rt.settings.logdir, rt.process)
    logger = log.get_logger("loongkit.launcher")
    for key, value, plugin in chosen:
        logger.info("launch variable", variable=key, value=value, plugin=plugin)
    for fault in faults:
        logger.error("plugin fault", plugin=fault.plugin, where=fault.where, error=fault.error,
                     traceback=fault.traceback)
    log.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    info = False
    while args and args[0].startswith("-"):
        flag = args.pop(0)
        if flag == "--info":
            info = True
        elif flag in ("-h", "--help"):
            sys.stdout.write(USAGE)
            return 0
        elif flag == "--":
            break
        else:
            sys.stderr.write(f"loongkit-run: unknown option {flag}\n{USAGE}")
            return 2
    if info:
        from loongkit_core.cli import print_info

        return print_info(args)
    if not args:
        sys.stderr.write(USAGE)
        return 2
    try:
        env = plugin_environ(child_environ(dict(os.environ)))
    except LaunchStrictError as exc:
        sys.stderr.write(f"loongkit-run (LOONGKIT_STRICT=1): {exc}\n")
        return 3
    program = args[0]
    path = program if os.sep in program else shutil.which(program, path=env.get("PATH"))
    if path is None:
        sys.stderr.write(f"loongkit-run: command not found: {program}\n")
        return 127
    env["_LOONGKIT_LAUNCHED"] = str(os.getpid())  # the exec'd command keeps this pid (runtime.LAUNCHED_ENV)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(path, args, env)
    except OSError as exc:
        sys.stderr.write(f"loongkit-run: cannot run {program}: {exc}\n")
        return 126
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
