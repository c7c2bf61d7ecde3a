from .assigner import HungarianAssigner3D
from .util import denormalize_bbox, normalize_bbox

__all__ = ["HungarianAssigner3D", "denormalize_bbox", "normalize_bbox"]
