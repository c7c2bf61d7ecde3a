"""The compile features of loongkit-ops: ResNet stages, Llama decoder layers, pi0, mmdet modules, Accelerate."""
