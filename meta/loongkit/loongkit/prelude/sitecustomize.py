"""The seed's prelude: runs loongkit_core's prelude (``loongkit_core/prelude/sitecustomize.py``), nothing more.

That prelude chains to the user's own sitecustomize exactly once and boots loongkit once (flag
``sys._loongkit_prelude_done``). When it looks for the user's file it skips every directory holding a
``LOONGKIT_PRELUDE`` marker, this one included, so both prelude directories may be on PYTHONPATH in any
order (the seed's recipe plus loongkit-run, ``import loongkit.all`` or a hand-written path):

* this one first: Python runs this file, which imports loongkit_core's (once: the import is cached);
* loongkit_core's first: Python runs that one, and this file never runs.

Stdlib only, like loongkit_core's: ``loongkit_core`` and ``loongkit_core.prelude`` import ``os`` alone.
"""

try:
    import loongkit_core.prelude.sitecustomize  # noqa: F401  (it does its work on import)
except ModuleNotFoundError as exc:
    # loongkit-core was uninstalled: there is no prelude to run. Any other error is reported by site.py.
    if exc.name not in ("loongkit_core", "loongkit_core.prelude", "loongkit_core.prelude.sitecustomize"):
        raise
