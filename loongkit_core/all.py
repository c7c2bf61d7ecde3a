"""``import loongkit_core.all`` at the top of a training script loads loongkit (the third loader).

Set LOONGKIT_* variables before this import (os.environ or the job's YAML). Modules imported before
it (torch, mmcv) are patched at once; later ones when they are imported. Child processes started
afterwards (spawn workers, torchrun ranks) get the prelude on PYTHONPATH.
"""

from loongkit_core import _boot

_boot.export_prelude_for_children()
runtime = _boot.boot("all")
