"""The seed's prelude: runs loongkit_core's prelude (``loongkit_core/prelude/sitecustomize.py``), nothing more.

That prelude chains to the user's own sitecustomize exactly once and boots loongkit once (flag
``sys._loongkit_prelude_done``); it finds the user's file by skipping only its own directory. So this
directory is hidden from ``sys.path`` while it runs, or it would take this file for the user's. The
two orders in which both prelude directories can be on PYTHONPATH (the seed's recipe plus loongkit-run,
``import loongkit.all`` or a hand-written path):

* this one first: Python runs this file, which runs loongkit_core's;
* loongkit_core's first: its chain runs this file *as the user's sitecustomize*, after setting its flag.
  This file then runs it once more with the flag cleared and this directory hidden, so that the next
  sitecustomize (the user's) still runs exactly once; the boot is idempotent (``loongkit_core._boot``).

Stdlib only, like loongkit_core's: ``loongkit_core.prelude`` imports ``os`` alone.
"""


def _loongkit_seed_prelude() -> None:
    import os
    import sys

    if getattr(sys, "_loongkit_prelude_done", False):
        current = sys.modules.get("sitecustomize")
        chained = getattr(current, "__dict__", None) is globals() and "_loongkit_user_sitecustomize" not in sys.modules
        if not chained:
            return  # loaded again after the prelude ran (imported by name, a second copy): nothing to do
        sys._loongkit_prelude_done = False  # type: ignore[attr-defined]
    try:
        from loongkit_core.prelude import PATH
    except ImportError:  # loongkit-core was uninstalled: there is no prelude to run
        return
    import importlib.machinery  # ~0.1 ms, already loaded by the import system

    here = os.path.dirname(os.path.abspath(__file__))

    def ours(entry: str) -> bool:  # the same test loongkit_core's prelude applies to its own directory
        try:
            return os.path.realpath(entry or os.getcwd()) == os.path.realpath(here)
        except (OSError, ValueError):
            return False

    hidden = [(i, entry) for i, entry in enumerate(sys.path) if ours(entry)]
    for i, _ in reversed(hidden):
        del sys.path[i]
    try:
        path = os.path.join(PATH, "sitecustomize.py")
        loader = importlib.machinery.SourceFileLoader("sitecustomize", path)
        module = type(sys)("sitecustomize")
        module.__file__ = path  # it locates its own directory (and the user's file) from __file__
        module.__loader__ = loader
        loader.exec_module(module)
    finally:
        for i, entry in hidden:  # back where they were: only ever a directory of prelude files
            sys.path.insert(min(i, len(sys.path)), entry)


_loongkit_seed_prelude()
del _loongkit_seed_prelude
