"""The example's ``projects/`` tree: a BEVFormer-style plugin package for the OpenMMLab 2.x stack."""
