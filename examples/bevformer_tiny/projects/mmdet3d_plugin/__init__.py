"""BEVFormer-tiny for an OpenMMLab 2.x stack, as a ``projects/mmdet3d_plugin`` package.

Importing it registers the model classes in mmengine's ``MODELS``, the assigner in ``TASK_UTILS``,
the pipeline in ``TRANSFORMS``, the dataset in ``DATASETS`` and the collate function in ``FUNCTIONS``
(the config's ``custom_imports`` does it, as a BEVFormer config's ``plugin_dir`` does).
"""

from . import bevformer, core, datasets  # noqa: F401  (registration)
