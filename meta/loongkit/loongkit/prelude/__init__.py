"""The seed's prelude directory, ``<site-packages>/loongkit/prelude/``: on PYTHONPATH it loads loongkit.

Its ``sitecustomize.py`` runs loongkit_core's prelude (:mod:`loongkit_core.prelude`), which the launcher
uses; ``python -m loongkit.prelude`` prints this directory's path.
"""

import os

PATH = os.path.dirname(os.path.abspath(__file__))
