// Python bindings of loongkit-ops' CPU kernels. Tensors in, outputs preallocated by kernels/ops.py
// (which registers the torch.library custom ops around them). The GIL is released while computing.
#include <torch/extension.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.attr("ABI") = 1;
    namespace py = pybind11;
    auto nogil = py::call_guard<py::gil_scoped_release>();
    m.def("msda_forward", &loongkit::msda_forward, nogil);
    m.def("msda_backward", &loongkit::msda_backward, nogil);
    m.def("msda_fused_forward", &loongkit::msda_fused_forward, nogil);
    m.def("msda_fused_backward", &loongkit::msda_fused_backward, nogil);
    m.def("dice_stats_forward", &loongkit::dice_stats_forward, nogil);
    m.def("dice_stats_backward", &loongkit::dice_stats_backward, nogil);
    m.def("dice_class_stats_forward", &loongkit::dice_class_stats_forward, nogil);
    m.def("dice_class_stats_backward", &loongkit::dice_class_stats_backward, nogil);
    m.def("daf_forward", &loongkit::daf_forward, nogil);
    m.def("daf_backward", &loongkit::daf_backward, nogil);
    m.def("bev_pool_forward", &loongkit::bev_pool_forward, nogil);
    m.def("bev_pool_backward", &loongkit::bev_pool_backward, nogil);
    m.def("hard_voxelize", &loongkit::hard_voxelize, nogil);
    m.def("dynamic_voxelize", &loongkit::dynamic_voxelize, nogil);
}
