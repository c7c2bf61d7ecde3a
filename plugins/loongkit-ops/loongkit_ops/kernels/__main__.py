"""``python -m loongkit_ops.kernels``: opt-in prebuild of the loongkit-ops CPU kernels."""

import sys

from loongkit_ops.kernels import main

sys.exit(main())
