"""The feature layer of loongkit-ops' kernel library: patches that put the fused ops under models."""
