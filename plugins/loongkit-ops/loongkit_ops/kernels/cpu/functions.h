// The functions loongkit_ops.kernels sees, in table order (the same for every ISA build). Included
// by each isa_<isa>.cpp after its ISA region: the table is read on every CPU, so it is baseline code.
LK_TABLE_BEGIN
LK_FUNCTION(loongkit::LK_ISA::msda_forward)
LK_FUNCTION(loongkit::LK_ISA::msda_backward)
LK_FUNCTION(loongkit::LK_ISA::msda_fused_forward)
LK_FUNCTION(loongkit::LK_ISA::msda_fused_backward)
LK_FUNCTION(loongkit::LK_ISA::dice_stats_forward)
LK_FUNCTION(loongkit::LK_ISA::dice_stats_backward)
LK_FUNCTION(loongkit::LK_ISA::dice_class_stats_forward)
LK_FUNCTION(loongkit::LK_ISA::dice_class_stats_backward)
LK_FUNCTION(loongkit::LK_ISA::daf_forward)
LK_FUNCTION(loongkit::LK_ISA::daf_backward)
LK_FUNCTION(loongkit::LK_ISA::bev_pool_forward)
LK_FUNCTION(loongkit::LK_ISA::bev_pool_backward)
LK_FUNCTION(loongkit::LK_ISA::hard_voxelize_plan)
LK_FUNCTION(loongkit::LK_ISA::hard_voxelize_voxels)
LK_FUNCTION(loongkit::LK_ISA::hard_voxelize_fill)
LK_FUNCTION(loongkit::LK_ISA::hard_voxelize_discard)
LK_FUNCTION(loongkit::LK_ISA::dynamic_voxelize_into)
LK_TABLE_END
