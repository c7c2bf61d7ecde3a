"""loongkit's sitecustomize: run the user's own sitecustomize (if any), then boot loongkit.

Python imports exactly one module named ``sitecustomize``: the first on sys.path. When this prelude
directory is on PYTHONPATH that is this file, so it looks up the next one on sys.path, skipping every
loongkit prelude directory (this one, copies of it, the seed's ``loongkit/prelude/``: each holds a
``LOONGKIT_PRELUDE`` marker file), and executes it under the name ``sitecustomize``, exactly once.
The seed's prelude runs this file (``import loongkit_core.prelude.sitecustomize``) and nothing else.
Stdlib only until a LOONGKIT_* variable requests a feature.
"""


def _loongkit_prelude() -> None:
    import os
    import sys

    if getattr(sys, "_loongkit_prelude_done", False):  # idempotent: twice on PYTHONPATH, nested runs, seed + core
        return
    sys._loongkit_prelude_done = True  # type: ignore[attr-defined]
    here = os.path.dirname(os.path.abspath(__file__))
    exists = os.path.exists
    join = os.path.join

    import importlib.machinery  # not importlib.util, which pulls contextlib and more: only when needed below

    def prelude(entry: object) -> bool:
        # One stat, no realpath: a directory with the marker is a prelude whatever its spelling ("" is the cwd,
        # as for the import system); ``here`` by name too, should a checkout lack the marker.
        return entry == here or (isinstance(entry, str) and exists(join(entry, "LOONGKIT_PRELUDE")))

    search = [p for p in sys.path if not prelude(p)]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", search)
    if spec is not None and spec.loader is not None and spec.origin != __file__:
        import importlib.util  # pulls contextlib and friends: only when there is a user sitecustomize

        user = importlib.util.module_from_spec(spec)
        ours = sys.modules.get("sitecustomize")
        sys.modules["sitecustomize"] = user
        try:
            spec.loader.exec_module(user)
        except Exception as exc:  # same leniency as Python's own site.py
            sys.stderr.write(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(exc).__name__}: {exc}\n")
        finally:
            sys.modules["_loongkit_user_sitecustomize"] = user
            if ours is not None:
                sys.modules["sitecustomize"] = ours

    if not any(name.startswith("LOONGKIT_") for name in os.environ):
        return  # nothing configured: the common case costs one environ scan
    try:
        from loongkit_core import _boot
    except ImportError:  # the prelude outlived its package (uninstalled, other venv)
        return
    _boot.boot("prelude")


_loongkit_prelude()
del _loongkit_prelude
