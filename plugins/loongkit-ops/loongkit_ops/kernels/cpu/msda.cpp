// Multi-scale deformable attention on the CPU (forward and backward), plain and fused.
//
// Threads: lk::parallel_for (at::parallel_for's scheme on torch's own libgomp, which the loader makes
// the process's only OpenMP runtime; torch.set_num_threads applies); inner loops are `omp simd`.
//
// Semantics: bilinear sampling with zero padding and align_corners=False, i.e. the pixel coordinate
// of a location u in [0, 1] on an axis of size S is u*S - 0.5 (grid_sample's convention with
// grid = 2u - 1). Every one of the four corners is checked on its own, exactly like grid_sample, so
// the gradient of a location whose sample straddles the border matches the pytorch path.
//
// Layout: value [bs, K, heads, C] -> one (key, head) row is C contiguous elements, so every inner
// loop runs over C with unit stride (vectorised by the compiler, `omp simd`). C == 32 (256 channels
// over 8 heads, every BEVFormer/UniAD config) is compiled with a constant trip count.
//
// Plain op (mmcv's maths): locations and attention weights are inputs.
// Fused op (BEVFormer's TemporalSelfAttention / MSDeformableAttention3D): the kernel takes the output of
// the modules' two query projections as one tensor [offsets | logits] (any row stride) and the
// reference points, and computes per sample what the modules compute with several tensor ops:
// location = reference + offset / (W_l, H_l), weights = softmax over (levels x points) per
// (query, head, queue entry); the output is the mean over `queue` value batches (TSA's [previous,
// current] BEV), value batch n*queue + t for query batch n. The reference point of (level l, point p)
// is ref[..., l] (per_level, TSA) or ref[..., p % R] (MSDA3D's Z anchors, anchor index fastest).
// The backward returns the gradient of that projection directly (softmax backward included), and
// writes every element of grad_value (the owner of a slice clears it first): no zero-filled inputs.
//
// Forward: one task per (batch, query, head); each writes only its own output row: no races.
// Backward: grad_value is a scatter (many queries sample the same pixels). Atomics on CPU floats are
// CAS loops (slow, and the summation order would change run to run), so the work is split by
// ownership instead: a task owns one (value batch, head) slice of grad_value and a contiguous range
// of queries. When the slices alone give every thread a task, tasks write straight into grad_value;
// when not, queries are split S ways and each split accumulates into a private [K, C] buffer that is
// reduced in split order afterwards. Either way the result is deterministic for a thread count,
// and the extra memory (S-1 copies of value at most) is bounded below. The per-sample outputs
// (grad of location/offset, weight/logit) of a (query, head, value batch) belong to one slice.
//
// Memory: a slice that fits the core's cache is staged into contiguous buffers (one head's rows are
// heads*C apart in value, and random rows that far apart thrash a few cache sets); on maps beyond the
// cache every sample of a query is located first and its rows prefetched (see visit_samples).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "bilinear.h"
#include "kernels.h"

namespace loongkit::LK_ISA {
namespace {


// f(std::integral_constant<int, NC>) with NC = C when it is a specialised width, else 0 (runtime C).
template <typename F>
void with_channels(int64_t C, F&& f) {
    if (C == 32) {
        f(std::integral_constant<int, 32>{});
    } else {
        f(std::integral_constant<int, 0>{});
    }
}

// o[0:n] += a * bilinear sample (four corners, invalid ones read the zero row).
template <typename T, int NC>
inline void sample_add(const Corners<T>& cs, const T* vl, int64_t rowstride, const T* zero, T a, T* __restrict o,
                       int64_t C) {
    const int64_t n = NC > 0 ? NC : C;
    const T* __restrict v0 = cs.off[0] >= 0 ? vl + cs.off[0] * rowstride : zero;
    const T* __restrict v1 = cs.off[1] >= 0 ? vl + cs.off[1] * rowstride : zero;
    const T* __restrict v2 = cs.off[2] >= 0 ? vl + cs.off[2] * rowstride : zero;
    const T* __restrict v3 = cs.off[3] >= 0 ? vl + cs.off[3] * rowstride : zero;
    const T w0 = a * cs.w[0], w1 = a * cs.w[1], w2 = a * cs.w[2], w3 = a * cs.w[3];
#pragma omp simd
    for (int64_t c = 0; c < n; ++c) o[c] += w0 * v0[c] + w1 * v1[c] + w2 * v2[c] + w3 * v3[c];
}

// Backward of one sample: corner rows of value (vl) and of its gradient (gl, row stride gstride).
template <typename T, int NC>
inline void sample_backward(const Corners<T>& cs, const T* vl, int64_t rowstride, T* gl, int64_t gstride,
                            const T* zero, T* dump, const T* g, T a, int64_t C, T& sa, T& sw, T& sh) {
    const T* vp[4];
    T* gp[4];
    for (int k = 0; k < 4; ++k) {
        vp[k] = cs.off[k] >= 0 ? vl + cs.off[k] * rowstride : zero;
        gp[k] = cs.off[k] >= 0 ? gl + cs.off[k] * gstride : dump + k * (NC > 0 ? NC : C);
    }
    corners_backward<T>(cs, vp, gp, g, NC > 0 ? NC : C, a, sa, sw, sh);
}

// Asks for the cache lines of the valid corner rows (n elements each) ahead of their use: random
// samples are latency-bound, so the loads of all samples of a query are put in flight first.
template <typename T>
inline void prefetch_rows(const Corners<T>& cs, const T* base, int64_t stride, int64_t n) {
    constexpr int64_t per_line = 64 / sizeof(T);
    for (int k = 0; k < 4; ++k) {
        if (cs.off[k] < 0) continue;
        const T* row = base + cs.off[k] * stride;
        for (int64_t c = 0; c < n; c += per_line) __builtin_prefetch(row + c);
    }
}

// Visits the samples (l, p) of one (query, head) in order: visit(l, lp, corners). With `ahead`, all
// corners are located first and the rows they read (vb, vstride apart) and write (gb, gstride apart;
// none when null) prefetched: random samples of maps beyond the cache are latency-bound, this puts
// them all in flight at once. Without it (maps in cache) the extra pass costs more than it saves.
template <typename T, typename Locate, typename Visit>
inline void visit_samples(int64_t L, int64_t P, const int64_t* starts, bool ahead, Corners<T>* cs, const T* vb,
                          int64_t vstride, const T* gb, int64_t gstride, int64_t C, Locate&& locate, Visit&& visit) {
    if (ahead) {
        for (int64_t l = 0; l < L; ++l) {
            for (int64_t p = 0; p < P; ++p) {
                Corners<T>& c = cs[l * P + p];
                c = locate(l, p);
                if (!c.any) continue;
                prefetch_rows(c, vb + starts[l] * vstride, vstride, C);
                if (gb != nullptr) prefetch_rows(c, gb + starts[l] * gstride, gstride, C);
            }
        }
    }
    for (int64_t l = 0; l < L; ++l) {
        for (int64_t p = 0; p < P; ++p) visit(l, l * P + p, ahead ? cs[l * P + p] : locate(l, p));
    }
}

// Whether one value batch ([K, heads, C]) is beyond the caches a core can count on.
template <typename T>
inline bool beyond_cache(int64_t K, int64_t rowstride) {
    return K * rowstride * static_cast<int64_t>(sizeof(T)) > (int64_t(8) << 20);
}

// Numerically stable softmax of n logits (torch's: exp(x - max), times 1 / sum).
template <typename T>
inline void softmax(const T* x, T* a, int64_t n) {
    T m = x[0];
    for (int64_t i = 1; i < n; ++i) m = std::max(m, x[i]);
    T s = T(0);
    for (int64_t i = 0; i < n; ++i) {
        a[i] = std::exp(x[i] - m);
        s += a[i];
    }
    const T r = T(1) / s;
    for (int64_t i = 0; i < n; ++i) a[i] *= r;
}

// Runs body(slice, q_lo, q_hi, vb, vstride, gb, gstride, zero, dump) over tasks that own a (value batch,
// head) slice of grad_value [NV, K, H, C] and a range of the Lq queries (see the file comment). vb/gb
// point at the slice's rows of value / of its gradient, vstride/gstride apart. A slice that fits the
// core's cache is staged into contiguous buffers: in value the rows of one head lie heads*C apart, so
// randomly sampled rows of one head map to few cache sets and evict each other.
template <typename T, typename Body>
void owned_slices(int64_t NV, int64_t K, int64_t H, int64_t C, int64_t Lq, const T* value, T* gvalue, bool clear,
                  Body&& body) {
    const int64_t rowstride = H * C, slices = NV * H;
    const int64_t threads = std::max<int64_t>(1, lk::num_threads());
    int64_t splits = std::min<int64_t>(std::max<int64_t>(1, (threads + slices - 1) / slices), std::max<int64_t>(1, Lq));
    // Private buffers cost (splits - 1) x value; cap them at 1 GiB beyond value itself.
    const int64_t value_bytes = std::max<int64_t>(1, NV * K * rowstride * static_cast<int64_t>(sizeof(T)));
    splits = std::max<int64_t>(1, std::min<int64_t>(splits, 1 + (int64_t(1) << 30) / value_bytes));
    const bool stage = H > 1 && 2 * K * C * static_cast<int64_t>(sizeof(T)) <= (int64_t(768) << 10);
    std::vector<T> priv;
    if (splits > 1) priv.assign(static_cast<size_t>(slices * splits * K * C), T(0));
    lk::parallel_for(0, slices * splits, 1, [&](int64_t begin, int64_t end) {
    // Corners outside the map read a zero row and scatter into scratch rows (one per corner, so the
    // four destination rows never alias): one branch-free pass.
    std::vector<T> zero(static_cast<size_t>(C), T(0)), dump(static_cast<size_t>(4 * C));
    std::vector<T> vbuf, gbuf;
    if (stage) vbuf.resize(static_cast<size_t>(K * C));
    if (stage && splits == 1) gbuf.resize(static_cast<size_t>(K * C));
    for (int64_t t = begin; t < end; ++t) {
        const int64_t slice = t / splits, s = t % splits;
        const int64_t q_lo = Lq * s / splits, q_hi = Lq * (s + 1) / splits;
        const T* vsrc = value + (slice / H) * K * rowstride + (slice % H) * C;
        T* gdst = gvalue + (slice / H) * K * rowstride + (slice % H) * C;
        const T* vb = vsrc;
        int64_t vstride = rowstride;
        if (stage) {
            for (int64_t k = 0; k < K; ++k) std::copy(vsrc + k * rowstride, vsrc + k * rowstride + C, vbuf.data() + k * C);
            vb = vbuf.data();
            vstride = C;
        }
        T* gb = gdst;
        int64_t gstride = rowstride;
        if (splits > 1) {
            gb = priv.data() + t * K * C;
            gstride = C;
        } else if (stage) {
            std::fill(gbuf.begin(), gbuf.end(), T(0));
            gb = gbuf.data();
            gstride = C;
        } else if (clear) {
            for (int64_t k = 0; k < K; ++k) std::fill(gdst + k * rowstride, gdst + k * rowstride + C, T(0));
        }
        body(slice, q_lo, q_hi, vb, vstride, gb, gstride, zero.data(), dump.data());
        if (splits == 1 && stage) {
            for (int64_t k = 0; k < K; ++k) std::copy(gb + k * C, gb + k * C + C, gdst + k * rowstride);
        }
    }
    });
    if (splits > 1) {
        // Fixed split order: the sum does not depend on which thread ran which split.
        lk::parallel_for(0, NV * K * H, 16, [&](int64_t r_begin, int64_t r_end) {
        for (int64_t r = r_begin; r < r_end; ++r) {
            const int64_t b = r / (K * H), k = (r / H) % K, h = r % H;
            T* __restrict dst = gvalue + r * C;
            if (clear) std::fill(dst, dst + C, T(0));
            for (int64_t s = 0; s < splits; ++s) {
                const T* __restrict src = priv.data() + (((b * H + h) * splits + s) * K + k) * C;
#pragma omp simd
                for (int64_t c = 0; c < C; ++c) dst[c] += src[c];
            }
        }
        });
    }
}

void check_levels(const View& shapes, const View& starts, int64_t L, int64_t K) {
    LK_CHECK(shapes.scalar_type() == lk::kLong && shapes.is_contiguous() && shapes.dim() == 2 &&
                    shapes.size(0) == L && shapes.size(1) == 2, "spatial_shapes must be int64 [L, 2]");
    LK_CHECK(starts.scalar_type() == lk::kLong && starts.is_contiguous() && starts.numel() == L,
                "level_start_index must be int64 [L]");
    const int64_t* s = shapes.data_ptr<int64_t>();
    const int64_t* st = starts.data_ptr<int64_t>();
    for (int64_t l = 0; l < L; ++l) {
        LK_CHECK(s[2 * l] >= 0 && s[2 * l + 1] >= 0 && st[l] >= 0 && st[l] + s[2 * l] * s[2 * l + 1] <= K,
                    "level ", l, " lies outside value");
    }
}

// ------------------------------------------------------------------------------------------------
// Plain op

struct Dims {
    int64_t bs, K, H, C, Lq, L, P;
};

Dims check_msda(const View& value, const View& shapes, const View& starts, const View& loc,
           const View& attn) {
    LK_CHECK(value.dim() == 4 && value.is_contiguous(), "value must be contiguous [bs, K, heads, C]");
    LK_CHECK(loc.dim() == 6 && loc.size(5) == 2 && loc.is_contiguous(), "bad sampling_locations");
    LK_CHECK(attn.dim() == 5 && attn.is_contiguous(), "bad attention_weights");
    LK_CHECK(loc.scalar_type() == value.scalar_type() && attn.scalar_type() == value.scalar_type(),
                "dtypes differ");
    Dims d{value.size(0), value.size(1), value.size(2), value.size(3), loc.size(1), loc.size(3), loc.size(4)};
    LK_CHECK(loc.size(0) == d.bs && loc.size(2) == d.H, "sampling_locations shape");
    LK_CHECK(attn.size(0) == d.bs && attn.size(1) == d.Lq && attn.size(2) == d.H && attn.size(3) == d.L &&
                    attn.size(4) == d.P, "attention_weights shape");
    check_levels(shapes, starts, d.L, d.K);
    return d;
}

template <typename T, int NC>
void forward_impl(const Dims& d, const T* __restrict value, const int64_t* shapes, const int64_t* starts,
                  const T* __restrict loc, const T* __restrict attn, T* __restrict out) {
    const int64_t tasks = d.bs * d.Lq * d.H, C = NC > 0 ? NC : d.C, rowstride = d.H * C;
    const std::vector<T> zero(static_cast<size_t>(C), T(0));  // stands in for corners outside the map
    const bool ahead = beyond_cache<T>(d.K, rowstride);
    lk::parallel_for(0, tasks, 64, [&](int64_t begin, int64_t end) {
    std::vector<Corners<T>> cs(static_cast<size_t>(d.L * d.P));
    for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / (d.Lq * d.H), h = i % d.H;
        const T* vb = value + b * d.K * rowstride + h * C;
        const T* li = loc + i * d.L * d.P * 2;
        const T* ai = attn + i * d.L * d.P;
        T* __restrict o = out + i * C;
        std::fill(o, o + C, T(0));
        visit_samples<T>(d.L, d.P, starts, ahead, cs.data(), vb, rowstride, nullptr, 0, C,
            [&](int64_t l, int64_t p) {
                const int64_t lp = l * d.P + p;
                return corners<T>(li[2 * lp], li[2 * lp + 1], shapes[2 * l], shapes[2 * l + 1]);
            },
            [&](int64_t l, int64_t lp, const Corners<T>& c) {
                if (c.any) sample_add<T, NC>(c, vb + starts[l] * rowstride, rowstride, zero.data(), ai[lp], o, C);
            });
    }
    });
}

template <typename T, int NC>
void backward_impl(const Dims& d, const T* __restrict value, const int64_t* shapes, const int64_t* starts,
                   const T* __restrict loc, const T* __restrict attn, const T* __restrict gout,
                   T* __restrict gvalue, T* __restrict gloc, T* __restrict gattn) {
    const int64_t C = NC > 0 ? NC : d.C;
    owned_slices<T>(d.bs, d.K, d.H, C, d.Lq, value, gvalue, false,
                    [&](int64_t slice, int64_t q_lo, int64_t q_hi, const T* vb, int64_t vstride, T* gb, int64_t gstride,
                        const T* zero, T* dump) {
        const int64_t b = slice / d.H, h = slice % d.H;
        const bool ahead = beyond_cache<T>(d.K, vstride);  // not staged (see owned_slices) and large
        std::vector<Corners<T>> cs(static_cast<size_t>(d.L * d.P));
        for (int64_t q = q_lo; q < q_hi; ++q) {
            const int64_t i = (b * d.Lq + q) * d.H + h;
            const T* li = loc + i * d.L * d.P * 2;
            const T* ai = attn + i * d.L * d.P;
            const T* g = gout + i * C;
            T* gl = gloc + i * d.L * d.P * 2;
            T* ga = gattn + i * d.L * d.P;
            visit_samples<T>(d.L, d.P, starts, ahead, cs.data(), vb, vstride, gb, gstride, C,
                [&](int64_t l, int64_t p) {
                    const int64_t lp = l * d.P + p;
                    return corners<T>(li[2 * lp], li[2 * lp + 1], shapes[2 * l], shapes[2 * l + 1]);
                },
                [&](int64_t l, int64_t lp, const Corners<T>& c) {
                    if (!c.any) {
                        gl[2 * lp] = gl[2 * lp + 1] = ga[lp] = T(0);
                        return;
                    }
                    const T a = ai[lp];
                    T sa, sw, sh;
                    sample_backward<T, NC>(c, vb + starts[l] * vstride, vstride, gb + starts[l] * gstride, gstride,
                                           zero, dump, g, a, C, sa, sw, sh);
                    ga[lp] = sa;
                    gl[2 * lp] = a * static_cast<T>(shapes[2 * l + 1]) * sw;
                    gl[2 * lp + 1] = a * static_cast<T>(shapes[2 * l]) * sh;
                });
        }
    });
}

// ------------------------------------------------------------------------------------------------
// Fused op

struct FusedDims {
    int64_t NQ, T, Q, H, C, L, P, R, K;
    bool per_level;
    int64_t ps0, ps1, nlg;  // row strides of the projection [NQ, Q, features]; where its logits start
};

FusedDims check_fused(const View& value, const View& shapes, const View& starts,
                      const View& ref, const View& proj, bool per_level, int64_t queue) {
    LK_CHECK(value.dim() == 4 && value.is_contiguous(), "value must be contiguous [NV, K, heads, C]");
    LK_CHECK(queue >= 1 && value.size(0) % queue == 0, "value batches must be a multiple of queue");
    LK_CHECK(ref.dim() == 4 && ref.size(3) == 2 && ref.is_contiguous(), "reference points must be [NV, Q, R, 2]");
    LK_CHECK(proj.dim() == 3 && proj.stride(2) == 1, "projection must be [NQ, Q, features] with unit stride in features");
    const auto dt = value.scalar_type();
    LK_CHECK(ref.scalar_type() == dt && proj.scalar_type() == dt, "dtypes differ");
    FusedDims d{};
    d.T = queue;
    d.NQ = value.size(0) / queue;
    d.K = value.size(1);
    d.H = value.size(2);
    d.C = value.size(3);
    d.Q = proj.size(1);
    d.L = shapes.dim() == 2 ? shapes.size(0) : 0;
    d.R = ref.size(2);
    d.per_level = per_level;
    LK_CHECK(d.L > 0 && d.H > 0, "no levels or heads");
    const int64_t per_point = d.H * d.T * d.L;
    LK_CHECK(proj.size(2) % (per_point * 3) == 0, "projection features must be heads*queue*levels*points*3");
    d.P = proj.size(2) / (per_point * 3);
    d.nlg = per_point * d.P * 2;
    LK_CHECK(d.P > 0 && proj.size(0) == d.NQ, "projection shape");
    LK_CHECK(ref.size(0) == d.NQ * d.T && ref.size(1) == d.Q, "reference points shape");
    LK_CHECK(per_level ? d.R == d.L : (d.R > 0 && d.P % d.R == 0),
                "reference points: one per level, or a number of anchors dividing the points");
    d.ps0 = proj.stride(0);
    d.ps1 = proj.stride(1);
    check_levels(shapes, starts, d.L, d.K);
    return d;
}

// Corners of sample (l, p) of one (query, head, queue entry): reference point + offset / (W_l, H_l).
template <typename T>
inline Corners<T> locate(const FusedDims& d, const int64_t* shapes, const T* rq, const T* oq, int64_t l, int64_t p) {
    const int64_t lp = l * d.P + p, r = d.per_level ? l : p % d.R;
    const int64_t Hl = shapes[2 * l], Wl = shapes[2 * l + 1];
    return corners<T>(rq[2 * r] + oq[2 * lp] / static_cast<T>(Wl), rq[2 * r + 1] + oq[2 * lp + 1] / static_cast<T>(Hl),
                      Hl, Wl);
}

template <typename T, int NC>
void fused_forward_impl(const FusedDims& d, const T* __restrict value, const int64_t* shapes, const int64_t* starts,
                        const T* __restrict ref, const T* proj, T* __restrict out) {
    const int64_t C = NC > 0 ? NC : d.C, rowstride = d.H * C, LP = d.L * d.P;
    const std::vector<T> zero(static_cast<size_t>(C), T(0));
    const T inv_queue = T(1) / static_cast<T>(d.T);
    const bool ahead = beyond_cache<T>(d.K, rowstride);
    lk::parallel_for(0, d.NQ * d.Q * d.H, 16, [&](int64_t begin, int64_t end) {
    std::vector<T> a(static_cast<size_t>(LP));
    std::vector<Corners<T>> cs(static_cast<size_t>(LP));
    for (int64_t i = begin; i < end; ++i) {
        const int64_t n = i / (d.Q * d.H), q = (i / d.H) % d.Q, h = i % d.H;
        T* __restrict o = out + i * C;
        std::fill(o, o + C, T(0));
        for (int64_t t = 0; t < d.T; ++t) {
            const int64_t v = n * d.T + t, ht = h * d.T + t;
            const T* pq = proj + n * d.ps0 + q * d.ps1;
            const T* oq = pq + ht * LP * 2;
            softmax(pq + d.nlg + ht * LP, a.data(), LP);
            const T* rq = ref + (v * d.Q + q) * d.R * 2;
            const T* vb = value + v * d.K * rowstride + h * C;
            visit_samples<T>(d.L, d.P, starts, ahead, cs.data(), vb, rowstride, nullptr, 0, C,
                [&](int64_t l, int64_t p) { return locate(d, shapes, rq, oq, l, p); },
                [&](int64_t l, int64_t lp, const Corners<T>& c) {
                    if (c.any) sample_add<T, NC>(c, vb + starts[l] * rowstride, rowstride, zero.data(), a[lp], o, C);
                });
        }
        if (d.T > 1) {
#pragma omp simd
            for (int64_t c = 0; c < C; ++c) o[c] *= inv_queue;
        }
    }
    });
}

template <typename T, int NC>
void fused_backward_impl(const FusedDims& d, const T* __restrict value, const int64_t* shapes, const int64_t* starts,
                         const T* __restrict ref, const T* proj, const T* __restrict gout, T* __restrict gvalue,
                         T* __restrict gproj) {
    const int64_t C = NC > 0 ? NC : d.C, LP = d.L * d.P;
    const T inv_queue = T(1) / static_cast<T>(d.T);
    owned_slices<T>(d.NQ * d.T, d.K, d.H, C, d.Q, value, gvalue, true,
                    [&](int64_t slice, int64_t q_lo, int64_t q_hi, const T* vb, int64_t vstride, T* gb, int64_t gstride,
                        const T* zero, T* dump) {
        const int64_t v = slice / d.H, h = slice % d.H, n = v / d.T, t = v % d.T, ht = h * d.T + t;
        std::vector<T> a(static_cast<size_t>(LP)), ga(static_cast<size_t>(LP));
        std::vector<Corners<T>> cs(static_cast<size_t>(LP));
        const bool ahead = beyond_cache<T>(d.K, vstride);  // not staged (see owned_slices) and large
        for (int64_t q = q_lo; q < q_hi; ++q) {
            const int64_t row = n * d.Q + q;  // [NQ, Q] row of the output and of the offset/logit grads
            const T* g = gout + (row * d.H + h) * C;
            const T* pq = proj + n * d.ps0 + q * d.ps1;
            const T* oq = pq + ht * LP * 2;
            softmax(pq + d.nlg + ht * LP, a.data(), LP);
            const T* rq = ref + (v * d.Q + q) * d.R * 2;
            T* go = gproj + row * 3 * d.nlg / 2 + ht * LP * 2;  // gproj is contiguous [NQ, Q, 3 * nlg / 2]
            T* gl = gproj + row * 3 * d.nlg / 2 + d.nlg + ht * LP;
            T dot = T(0);
            visit_samples<T>(d.L, d.P, starts, ahead, cs.data(), vb, vstride, gb, gstride, C,
                [&](int64_t l, int64_t p) { return locate(d, shapes, rq, oq, l, p); },
                [&](int64_t l, int64_t lp, const Corners<T>& c) {
                    if (!c.any) {
                        go[2 * lp] = go[2 * lp + 1] = ga[lp] = T(0);
                        return;
                    }
                    const T aq = a[lp] * inv_queue;
                    T sa, sw, sh;
                    sample_backward<T, NC>(c, vb + starts[l] * vstride, vstride, gb + starts[l] * gstride, gstride,
                                           zero, dump, g, aq, C, sa, sw, sh);
                    ga[lp] = sa * inv_queue;  // d out / d weight
                    dot += a[lp] * ga[lp];
                    // d loc / d offset = 1 / (W, H) cancels the pixel scale of d sample / d loc.
                    go[2 * lp] = aq * sw;
                    go[2 * lp + 1] = aq * sh;
                });
            for (int64_t lp = 0; lp < LP; ++lp) gl[lp] = a[lp] * (ga[lp] - dot);  // softmax backward
        }
    });
}

}  // namespace

void msda_forward(const View& value, const View& spatial_shapes, const View& level_start,
                  const View& loc, const View& attn, const View& out) {
    const Dims d = check_msda(value, spatial_shapes, level_start, loc, attn);
    LK_CHECK(out.is_contiguous() && out.numel() == d.bs * d.Lq * d.H * d.C &&
                    out.scalar_type() == value.scalar_type(), "bad output");
    LK_DISPATCH_FLOATING_TYPES(value.scalar_type(), "loongkit_msda_forward", [&] {
        with_channels(d.C, [&](auto nc) {
            forward_impl<scalar_t, decltype(nc)::value>(
                d, value.data_ptr<scalar_t>(), spatial_shapes.data_ptr<int64_t>(), level_start.data_ptr<int64_t>(),
                loc.data_ptr<scalar_t>(), attn.data_ptr<scalar_t>(), out.data_ptr<scalar_t>());
        });
    });
}

void msda_backward(const View& value, const View& spatial_shapes, const View& level_start,
                   const View& loc, const View& attn, const View& grad_out,
                   const View& grad_value, const View& grad_loc, const View& grad_attn) {
    const Dims d = check_msda(value, spatial_shapes, level_start, loc, attn);
    LK_CHECK(grad_out.is_contiguous() && grad_out.numel() == d.bs * d.Lq * d.H * d.C &&
                    grad_out.scalar_type() == value.scalar_type(), "bad grad_output");
    LK_CHECK(grad_value.is_contiguous() && grad_value.sizes() == value.sizes() &&
                    grad_value.scalar_type() == value.scalar_type(), "bad grad_value");
    LK_CHECK(grad_loc.is_contiguous() && grad_loc.sizes() == loc.sizes() &&
                    grad_loc.scalar_type() == value.scalar_type(), "bad grad_loc");
    LK_CHECK(grad_attn.is_contiguous() && grad_attn.sizes() == attn.sizes() &&
                    grad_attn.scalar_type() == value.scalar_type(), "bad grad_attn");
    LK_DISPATCH_FLOATING_TYPES(value.scalar_type(), "loongkit_msda_backward", [&] {
        with_channels(d.C, [&](auto nc) {
            backward_impl<scalar_t, decltype(nc)::value>(
                d, value.data_ptr<scalar_t>(), spatial_shapes.data_ptr<int64_t>(), level_start.data_ptr<int64_t>(),
                loc.data_ptr<scalar_t>(), attn.data_ptr<scalar_t>(), grad_out.data_ptr<scalar_t>(),
                grad_value.data_ptr<scalar_t>(), grad_loc.data_ptr<scalar_t>(), grad_attn.data_ptr<scalar_t>());
        });
    });
}

void msda_fused_forward(const View& value, const View& spatial_shapes, const View& level_start,
                        const View& ref, const View& proj, bool per_level, int64_t queue, const View& out) {
    const FusedDims d = check_fused(value, spatial_shapes, level_start, ref, proj, per_level, queue);
    LK_CHECK(out.is_contiguous() && out.numel() == d.NQ * d.Q * d.H * d.C &&
                    out.scalar_type() == value.scalar_type(), "bad output");
    LK_DISPATCH_FLOATING_TYPES(value.scalar_type(), "loongkit_msda_fused_forward", [&] {
        with_channels(d.C, [&](auto nc) {
            fused_forward_impl<scalar_t, decltype(nc)::value>(
                d, value.data_ptr<scalar_t>(), spatial_shapes.data_ptr<int64_t>(), level_start.data_ptr<int64_t>(),
                ref.data_ptr<scalar_t>(), proj.data_ptr<scalar_t>(), out.data_ptr<scalar_t>());
        });
    });
}

void msda_fused_backward(const View& value, const View& spatial_shapes, const View& level_start,
                         const View& ref, const View& proj, bool per_level, int64_t queue,
                         const View& grad_out, const View& grad_value, const View& grad_proj) {
    const FusedDims d = check_fused(value, spatial_shapes, level_start, ref, proj, per_level, queue);
    const auto dt = value.scalar_type();
    LK_CHECK(grad_out.is_contiguous() && grad_out.numel() == d.NQ * d.Q * d.H * d.C && grad_out.scalar_type() == dt,
                "bad grad_output");
    LK_CHECK(grad_value.is_contiguous() && grad_value.sizes() == value.sizes() && grad_value.scalar_type() == dt,
                "bad grad_value");
    LK_CHECK(grad_proj.is_contiguous() && grad_proj.sizes() == proj.sizes() && grad_proj.scalar_type() == dt,
                "bad grad_projection");
    LK_DISPATCH_FLOATING_TYPES(dt, "loongkit_msda_fused_backward", [&] {
        with_channels(d.C, [&](auto nc) {
            fused_backward_impl<scalar_t, decltype(nc)::value>(
                d, value.data_ptr<scalar_t>(), spatial_shapes.data_ptr<int64_t>(), level_start.data_ptr<int64_t>(),
                ref.data_ptr<scalar_t>(), proj.data_ptr<scalar_t>(), grad_out.data_ptr<scalar_t>(),
                grad_value.data_ptr<scalar_t>(), grad_proj.data_ptr<scalar_t>());
        });
    });
}

}  // namespace loongkit::LK_ISA
