"""``python -m loongkit_data.kernels``: opt-in prebuild of the loongkit-data kernels."""

import sys

from loongkit_data.kernels import main

sys.exit(main())
