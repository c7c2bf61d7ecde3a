from .decoder import CustomMSDeformableAttention, DetectionTransformerDecoder
from .encoder import BEVFormerEncoder, BEVFormerLayer, MyCustomBaseTransformerLayer
from .spatial_cross_attention import MSDeformableAttention3D, SpatialCrossAttention
from .temporal_self_attention import TemporalSelfAttention
from .transformer import PerceptionTransformer

__all__ = ["BEVFormerEncoder", "BEVFormerLayer", "CustomMSDeformableAttention", "DetectionTransformerDecoder",
           "MSDeformableAttention3D", "MyCustomBaseTransformerLayer", "PerceptionTransformer",
           "SpatialCrossAttention", "TemporalSelfAttention"]
