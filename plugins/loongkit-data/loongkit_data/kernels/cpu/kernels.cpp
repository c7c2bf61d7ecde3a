// The loongkit-data CPU kernels' entry points (declared, with their interface, in kernels.h).
#include "distortion.h"
#include "imnormalize.h"
#include "kernels.h"

#include <type_traits>

namespace loongkit::LK_ISA {
namespace {

using lk::View;

enum class Dtype { U8, F32 };

Dtype dtype_of(const View& b) {
    if (b.scalar_type() == lk::kByte) return Dtype::U8;
    if (b.scalar_type() == lk::kFloat) return Dtype::F32;
    throw lk::Error(std::string("unsupported dtype '") + lk::dtype_name(b.scalar_type()) + "'");
}

void check_hwc3(const View& b, const char* what) {
    LK_CHECK(b.dim() == 3 && b.size(2) == 3, what, " must be HxWx3");
}

bool pixel_contiguous(const View& b) {
    return b.byte_stride(2) == b.element_size() && b.byte_stride(1) == 3 * b.element_size();
}

float* out_f32(const View& d, const View& s) {
    check_hwc3(d, "dst");
    LK_CHECK(d.scalar_type() == lk::kFloat && d.writable(), "dst must be writable float32");
    LK_CHECK(d.size(0) == s.size(0) && d.size(1) == s.size(1), "dst shape differs");
    LK_CHECK(d.byte_stride(2) == 4 && d.byte_stride(1) == 12 && d.byte_stride(0) == 12 * d.size(1),
             "dst must be C-contiguous");
    return static_cast<float*>(d.data_ptr());
}

NormParams norm_params(const std::vector<double>& mean, const std::vector<double>& stdinv, int64_t product) {
    LK_CHECK(mean.size() == 3 && stdinv.size() == 3, "mean and stdinv take 3 values");
    LK_CHECK(product == 0 || product == 1, "product mode is 0 (widen to double) or 1 (float32)");
    NormParams p{};
    for (int c = 0; c < 3; ++c) {
        p.mean[c] = static_cast<float>(mean[c]);  // float32 values already (Python rounds them)
        p.stdinv[c] = stdinv[c];
        p.stdinv_f[c] = static_cast<float>(stdinv[c]);
    }
    p.f32 = product == 1;
    return p;
}

// Rows are independent; threads only when the caller asks for more than one (OpenCV's own thread
// count, as upstream would use). A data worker runs single-threaded and never enters OpenMP.
template <typename F>
void for_rows(std::ptrdiff_t rows, int64_t threads, F&& body) {
#ifdef _OPENMP
    if (threads > 1 && rows > 1) {
#pragma omp parallel for num_threads(static_cast<int>(threads)) schedule(static)
        for (std::ptrdiff_t y = 0; y < rows; ++y) body(y);
        return;
    }
#endif
    (void)threads;
    for (std::ptrdiff_t y = 0; y < rows; ++y) body(y);
}

}  // namespace

// imnormalize(src, dst, mean_f32[3], stdinv_f64[3], to_rgb, product, threads); src may be dst (imnormalize_);
// product: 0 widens (c - mean) * stdinv to double (OpenCV <= 5.0), 1 multiplies in float32 (5.1).
void imnormalize(const View& s, const View& d, const std::vector<double>& mean, const std::vector<double>& stdinv,
                 bool to_rgb, int64_t product, int64_t threads) {
    check_hwc3(s, "src");
    const Dtype dt = dtype_of(s);
    float* out = out_f32(d, s);
    const NormParams p = norm_params(mean, stdinv, product);
    const std::ptrdiff_t h = s.size(0), w = s.size(1);
    const auto* base = static_cast<const char*>(s.data_ptr());
    const std::ptrdiff_t sy = s.byte_stride(0), sx = s.byte_stride(1), sc = s.byte_stride(2);
    const bool inplace = s.data_ptr() == d.data_ptr();
    LK_CHECK(!inplace || (dt == Dtype::F32 && pixel_contiguous(s) && sy == 12 * w),
             "in-place normalize needs a C-contiguous float32 image");
    const bool fast = pixel_contiguous(s);
    NormVec n = norm_vec(p);
#ifdef LOONGKIT_AVX2
    n.split = fast && dt == Dtype::U8 && !p.f32 && norm_split_exact(n);  // ~1 us, per call: params vary
#endif
    auto rows = [&](auto f32) {
        constexpr bool kF32 = decltype(f32)::value;
        for_rows(h, threads, [&](std::ptrdiff_t y) {
            const char* row = base + y * sy;
            float* o = out + y * w * 3;
            if (fast && dt == Dtype::U8) {
                const auto* r = reinterpret_cast<const std::uint8_t*>(row);
                to_rgb ? normalize_row_fast<std::uint8_t, true, kF32>(r, o, w, p, n)
                       : normalize_row_fast<std::uint8_t, false, kF32>(r, o, w, p, n);
            } else if (fast) {  // in place too (row == o)
                const auto* r = reinterpret_cast<const float*>(row);
                to_rgb ? normalize_row_fast<float, true, kF32>(r, o, w, p, n)
                       : normalize_row_fast<float, false, kF32>(r, o, w, p, n);
            } else if (dt == Dtype::U8) {
                normalize_row_strided<std::uint8_t, kF32>(row, sx, sc, o, w, to_rgb, p);
            } else {
                normalize_row_strided<float, kF32>(row, sx, sc, o, w, to_rgb, p);
            }
        });
    };
    p.f32 ? rows(std::true_type{}) : rows(std::false_type{});
}

// imnormalize_split(mean_f32[3], stdinv_f64[3]) -> bool: whether uint8 input takes the float32-only
// product for these parameters (its exhaustive check passed); false in the baseline build.
bool imnormalize_split(const std::vector<double>& mean, const std::vector<double>& stdinv) {
    [[maybe_unused]] const NormParams p = norm_params(mean, stdinv, 0);
#ifdef LOONGKIT_AVX2
    return norm_split_exact(norm_vec(p));
#else
    return false;
#endif
}

// distort(src, dst, delta, alpha_pre, sat, clip_sat, hue, alpha_post, perm, mode, threads) -> bool.
// False (dst untouched or partly written) when a float input is outside what the kernel reproduces.
bool distort(const View& s, const View& d, float delta, float alpha_pre, float sat, bool clip_sat, float hue,
             float alpha_post, const std::vector<int64_t>& perm, const std::vector<int64_t>& mode, int64_t threads) {
    check_hwc3(s, "src");
    const Dtype dt = dtype_of(s);
    float* out = out_f32(d, s);
    LK_CHECK(pixel_contiguous(s), "src pixels must be contiguous");
    LK_CHECK(perm.size() == 3 && mode.size() == 5, "perm takes 3 values, mode 5");
    DistortParams p{delta, alpha_pre, sat, clip_sat, hue, alpha_post, {0, 1, 2}};
    for (int c = 0; c < 3; ++c) {
        LK_CHECK(perm[c] >= 0 && perm[c] <= 2, "perm must hold 0, 1, 2");
        p.perm[c] = static_cast<int>(perm[c]);
    }
    const HsvMode m{static_cast<int>(mode[0]), mode[1] != 0, mode[2] != 0, mode[3] != 0, mode[4] != 0};
    const RowFn fn = dt == Dtype::U8 ? pick_row<std::uint8_t>(m) : pick_row<float>(m);
    const std::ptrdiff_t h = s.size(0), w = s.size(1), sy = s.byte_stride(0);
    const auto* base = static_cast<const char*>(s.data_ptr());
    if (dt == Dtype::F32) {
        for (std::ptrdiff_t y = 0; y < h; ++y)
            if (!float_row_plain(reinterpret_cast<const float*>(base + y * sy), 3 * w)) return false;
    }
    for_rows(h, threads, [&](std::ptrdiff_t y) { fn(base + y * sy, out + y * w * 3, w, m.lanes, m.overlap, p); });
    return true;
}

}  // namespace loongkit::LK_ISA
