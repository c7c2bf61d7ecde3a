"""The prelude directory: put it on PYTHONPATH and every Python process loads loongkit.

It holds only ``sitecustomize.py``; ``python -m loongkit_core.prelude`` prints its path.
"""

import os

PATH = os.path.dirname(os.path.abspath(__file__))
