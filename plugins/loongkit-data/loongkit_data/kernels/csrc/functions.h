// The functions loongkit_data.kernels sees, in table order (the same for every ISA build). Included
// by each isa_<isa>.cpp after its ISA region: the table is read on every CPU, so it is baseline code.
LK_TABLE_BEGIN
LK_FUNCTION(loongkit::LK_ISA::imnormalize)
LK_FUNCTION(loongkit::LK_ISA::imnormalize_split)
LK_FUNCTION(loongkit::LK_ISA::distort)
LK_TABLE_END
