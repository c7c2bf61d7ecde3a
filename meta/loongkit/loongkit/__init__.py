"""The names the seed product documents, for users migrating from it.

``loongkit_core`` is the primary name (its plugins: ``loongkit_data``, ``loongkit_ops``, ...). This package
only maps the seed's Quick Start onto it:

* ``import loongkit.all`` is ``import loongkit_core.all``;
* ``PYTHONPATH=<site-packages>/loongkit/prelude/:$PYTHONPATH`` runs loongkit_core's prelude;
* ``loongkit-run`` is loongkit-core's own launcher (installed with it).

Importing ``loongkit`` imports nothing else: it may be on the path of every process.
"""

__version__ = "0.1.0"
