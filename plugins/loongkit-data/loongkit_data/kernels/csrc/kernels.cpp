// Python bindings of the loongkit-data CPU kernels.
//
// Interface: plain pybind11 over the buffer protocol (numpy arrays in, numpy arrays out). mmcv and
// mmdet hand numpy HWC images around, so the kernels take any strided numpy view directly (crops and
// flipped views included, which torch.from_numpy refuses for negative strides), the Python side
// allocates the output with numpy (same type and flags as upstream's result) and no tensor wrapping
// happens per call. The GIL is released while pixels are processed.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "distortion.hpp"
#include "imnormalize.hpp"

namespace py = pybind11;
using loongkit::NormParams;

namespace {

enum class Dtype { U8, F32 };

Dtype dtype_of(const py::buffer_info& b) {
    if (b.itemsize == 1 && (b.format == "B")) return Dtype::U8;
    if (b.itemsize == 4 && (b.format == "f")) return Dtype::F32;
    throw std::invalid_argument("unsupported dtype '" + b.format + "'");
}

void check_hwc3(const py::buffer_info& b, const char* what) {
    if (b.ndim != 3 || b.shape[2] != 3) throw std::invalid_argument(std::string(what) + " must be HxWx3");
}

bool pixel_contiguous(const py::buffer_info& b) {
    return b.strides[2] == b.itemsize && b.strides[1] == 3 * b.itemsize;
}

float* out_f32(const py::buffer_info& d, const py::buffer_info& s) {
    check_hwc3(d, "dst");
    if (d.format != "f" || d.itemsize != 4 || d.readonly) throw std::invalid_argument("dst must be writable float32");
    if (d.shape[0] != s.shape[0] || d.shape[1] != s.shape[1]) throw std::invalid_argument("dst shape differs");
    if (d.strides[2] != 4 || d.strides[1] != 12 || d.strides[0] != 12 * d.shape[1])
        throw std::invalid_argument("dst must be C-contiguous");
    return static_cast<float*>(d.ptr);
}

// Rows are independent; threads only when the caller asks for more than one (OpenCV's own thread
// count, as upstream would use). A data worker runs single-threaded and never enters OpenMP.
template <typename F>
void for_rows(std::ptrdiff_t rows, int threads, F&& body) {
#ifdef _OPENMP
    if (threads > 1 && rows > 1) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (std::ptrdiff_t y = 0; y < rows; ++y) body(y);
        return;
    }
#endif
    (void)threads;
    for (std::ptrdiff_t y = 0; y < rows; ++y) body(y);
}

// imnormalize(src, dst, mean_f32[3], stdinv_f64[3], to_rgb, threads); src may be dst (imnormalize_).
void imnormalize(py::buffer src, py::buffer dst, py::tuple mean, py::tuple stdinv, bool to_rgb, int threads) {
    py::buffer_info s = src.request();
    py::buffer_info d = dst.request(true);
    check_hwc3(s, "src");
    const Dtype dt = dtype_of(s);
    float* out = out_f32(d, s);
    NormParams p{};
    for (int c = 0; c < 3; ++c) {
        p.mean[c] = mean[c].cast<float>();
        p.stdinv[c] = stdinv[c].cast<double>();
    }
    const std::ptrdiff_t h = s.shape[0], w = s.shape[1];
    const auto* base = static_cast<const char*>(s.ptr);
    const std::ptrdiff_t sy = s.strides[0], sx = s.strides[1], sc = s.strides[2];
    const bool inplace = s.ptr == d.ptr;
    if (inplace && (dt != Dtype::F32 || !pixel_contiguous(s) || sy != 12 * w))
        throw std::invalid_argument("in-place normalize needs a C-contiguous float32 image");
    const bool fast = pixel_contiguous(s);
    loongkit::NormVec n = loongkit::norm_vec(p);
#ifdef LOONGKIT_AVX2
    n.split = fast && dt == Dtype::U8 && loongkit::norm_split_exact(n);  // ~1 us, per call: params vary
#endif
    py::gil_scoped_release nogil;
    for_rows(h, threads, [&](std::ptrdiff_t y) {
        const char* row = base + y * sy;
        float* o = out + y * w * 3;
        if (fast && dt == Dtype::U8) {
            const auto* r = reinterpret_cast<const std::uint8_t*>(row);
            to_rgb ? loongkit::normalize_row_fast<std::uint8_t, true>(r, o, w, p, n)
                   : loongkit::normalize_row_fast<std::uint8_t, false>(r, o, w, p, n);
        } else if (fast) {  // in place too (row == o)
            const auto* r = reinterpret_cast<const float*>(row);
            to_rgb ? loongkit::normalize_row_fast<float, true>(r, o, w, p, n)
                   : loongkit::normalize_row_fast<float, false>(r, o, w, p, n);
        } else if (dt == Dtype::U8) {
            loongkit::normalize_row_strided<std::uint8_t>(row, sx, sc, o, w, to_rgb, p);
        } else {
            loongkit::normalize_row_strided<float>(row, sx, sc, o, w, to_rgb, p);
        }
    });
}

// imnormalize_split(mean_f32[3], stdinv_f64[3]) -> bool: whether uint8 input takes the float32-only
// product for these parameters (its exhaustive check passed); False on builds without the SIMD path.
bool imnormalize_split(py::tuple mean, py::tuple stdinv) {
    NormParams p{};
    for (int c = 0; c < 3; ++c) {
        p.mean[c] = mean[c].cast<float>();
        p.stdinv[c] = stdinv[c].cast<double>();
    }
#ifdef LOONGKIT_AVX2
    return loongkit::norm_split_exact(loongkit::norm_vec(p));
#else
    return false;
#endif
}

// distort(src, dst, delta, alpha_pre, sat, clip_sat, hue, alpha_post, perm, mode, threads) -> bool.
// False (dst untouched or partly written) when a float input is outside what the kernel reproduces.
bool distort(py::buffer src, py::buffer dst, float delta, float alpha_pre, float sat, bool clip_sat, float hue,
             float alpha_post, py::tuple perm, py::tuple mode, int threads) {
    py::buffer_info s = src.request();
    py::buffer_info d = dst.request(true);
    check_hwc3(s, "src");
    const Dtype dt = dtype_of(s);
    float* out = out_f32(d, s);
    if (!pixel_contiguous(s)) throw std::invalid_argument("src pixels must be contiguous");
    loongkit::DistortParams p{delta, alpha_pre, sat, clip_sat, hue, alpha_post, {0, 1, 2}};
    for (int c = 0; c < 3; ++c) {
        p.perm[c] = perm[c].cast<int>();
        if (p.perm[c] < 0 || p.perm[c] > 2) throw std::invalid_argument("perm must hold 0, 1, 2");
    }
    loongkit::HsvMode m{mode[0].cast<int>(), mode[1].cast<bool>(), mode[2].cast<bool>(), mode[3].cast<bool>()};
    const loongkit::RowFn fn = dt == Dtype::U8 ? loongkit::pick_row<std::uint8_t>(m) : loongkit::pick_row<float>(m);
    const std::ptrdiff_t h = s.shape[0], w = s.shape[1], sy = s.strides[0];
    const auto* base = static_cast<const char*>(s.ptr);
    py::gil_scoped_release nogil;
    if (dt == Dtype::F32) {
        for (std::ptrdiff_t y = 0; y < h; ++y)
            if (!loongkit::float_row_plain(reinterpret_cast<const float*>(base + y * sy), 3 * w)) return false;
    }
    for_rows(h, threads, [&](std::ptrdiff_t y) { fn(base + y * sy, out + y * w * 3, w, m.lanes, p); });
    return true;
}

}  // namespace

namespace loongkit {
void register_distortion(py::module_& m) {
    m.def("distort", &distort, py::arg("src"), py::arg("dst"), py::arg("delta"), py::arg("alpha_pre"),
          py::arg("sat"), py::arg("clip_sat"), py::arg("hue"), py::arg("alpha_post"), py::arg("perm"),
          py::arg("mode"), py::arg("threads") = 1);
}
}  // namespace loongkit

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "loongkit-data CPU kernels (bit-exact mmcv imnormalize, mmdet PhotoMetricDistortion)";
    m.attr("ABI") = 1;
    m.def("imnormalize", &imnormalize, py::arg("src"), py::arg("dst"), py::arg("mean"), py::arg("stdinv"),
          py::arg("to_rgb"), py::arg("threads") = 1);
    m.def("imnormalize_split", &imnormalize_split, py::arg("mean"), py::arg("stdinv"));
    loongkit::register_distortion(m);
}
