"""Put this directory's helper module, and the numa tests' (numa_helpers: what this torch can tell the
NUMA plan), on the import path for the sub-cgroups tests."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.normpath(os.path.join(os.path.dirname(__file__), os.pardir, "numa")))
sys.path.insert(0, os.path.dirname(__file__))
