from .bevformer_head import BEVFormerHead

__all__ = ["BEVFormerHead"]
