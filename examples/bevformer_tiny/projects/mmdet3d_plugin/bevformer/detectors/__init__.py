from .bevformer import BEVDataPreprocessor, BEVFormer

__all__ = ["BEVDataPreprocessor", "BEVFormer"]
