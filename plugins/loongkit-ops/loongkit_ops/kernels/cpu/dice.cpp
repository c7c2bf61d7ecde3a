// DiceLoss statistics of mmseg 1.x (per sample) and 0.x (per sample and class, at the end of the file),
// fused (forward and backward); threads via lk::parallel_for (torch's OpenMP runtime and thread
// count), `omp simd` inner loops.
//
// mmseg >= 1.1 computes, per sample n over all kept classes and pixels together:
//   a = sum p*t,  b = sum p*p (naive: sum p),  c = sum t*t (= number of labelled pixels)
// where p is sigmoid/softmax/identity of the logits and t the one-hot of clamp(label, 0, C) with
// the extra class C dropped (labels >= C, e.g. 255, have an all-zero target row; negative labels
// clamp to class 0 exactly as upstream). A class equal to ignore_index is dropped from all sums.
// Upstream materialises probabilities, an int64 one-hot of C+1 classes, a permuted float copy and
// the products; here one pass over the logits produces (a, b, c), and the backward recomputes p
// from the logits (nothing saved but the inputs).
//
// Work is split into (sample, block of pixels) tasks. Softmax needs all classes of a pixel, which
// are strided by H*W, so a task walks the classes outer and its pixels inner (unit stride, vector
// friendly) over a small block buffer. Partial sums are kept per task in double and added in task
// order afterwards: deterministic and independent of the thread count.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels.h"

namespace loongkit::LK_ISA {
namespace {

constexpr int64_t kBlock = 256;

enum Activation : int64_t { kIdentity = 0, kSigmoid = 1, kSoftmax = 2 };

// Probabilities of one block of pixels for every class: prob[c * n + s]. Returns nothing else.
template <typename T>
inline void block_probs(const T* __restrict x, int64_t C, int64_t S, int64_t n, int64_t act, T* __restrict prob,
                        T* __restrict scratch) {
    if (act == kSoftmax) {
        T* __restrict mx = scratch;
        T* __restrict sum = scratch + n;
        std::fill(mx, mx + n, -std::numeric_limits<T>::infinity());
        std::fill(sum, sum + n, T(0));
        for (int64_t c = 0; c < C; ++c) {
            const T* __restrict xc = x + c * S;
            for (int64_t s = 0; s < n; ++s) mx[s] = std::max(mx[s], xc[s]);
        }
        for (int64_t c = 0; c < C; ++c) {
            const T* __restrict xc = x + c * S;
            T* __restrict pc = prob + c * n;
            for (int64_t s = 0; s < n; ++s) {
                pc[s] = std::exp(xc[s] - mx[s]);
                sum[s] += pc[s];
            }
        }
        for (int64_t s = 0; s < n; ++s) sum[s] = T(1) / sum[s];
        for (int64_t c = 0; c < C; ++c) {
            T* __restrict pc = prob + c * n;
            for (int64_t s = 0; s < n; ++s) pc[s] *= sum[s];
        }
    } else if (act == kSigmoid) {
        for (int64_t c = 0; c < C; ++c) {
            const T* __restrict xc = x + c * S;
            T* __restrict pc = prob + c * n;
            for (int64_t s = 0; s < n; ++s) pc[s] = T(1) / (T(1) + std::exp(-xc[s]));
        }
    } else {
        for (int64_t c = 0; c < C; ++c) std::copy(x + c * S, x + c * S + n, prob + c * n);
    }
}

void check_dice(const View& logits, const View& target) {
    LK_CHECK(logits.dim() == 3 && logits.is_contiguous(), "logits must be contiguous [N, C, S]");
    LK_CHECK(target.scalar_type() == lk::kLong && target.is_contiguous() && target.dim() == 2 &&
                    target.size(0) == logits.size(0) && target.size(1) == logits.size(2),
                "target must be contiguous int64 [N, S]");
}

template <typename T>
void stats_impl(const T* logits, const int64_t* target, int64_t N, int64_t C, int64_t S, int64_t act, int64_t drop,
                bool naive, T* stats) {
    const int64_t blocks = (S + kBlock - 1) / kBlock, tasks = N * blocks;
    std::vector<double> part(static_cast<size_t>(tasks * 3));
    lk::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
        std::vector<T> prob(static_cast<size_t>(C * kBlock)), scratch(2 * kBlock);
        for (int64_t t = begin; t < end; ++t) {
            const int64_t n = t / blocks, s0 = (t % blocks) * kBlock, len = std::min(kBlock, S - s0);
            const T* x = logits + n * C * S + s0;
            const int64_t* lab = target + n * S + s0;
            block_probs<T>(x, C, S, len, act, prob.data(), scratch.data());
            double a = 0, b = 0, cnt = 0;
            for (int64_t c = 0; c < C; ++c) {
                if (c == drop) continue;
                const T* __restrict pc = prob.data() + c * len;
                double acc = 0;  // fp32 sums of ~1e5 signed terms lose 1e-5 relative in float
                if (naive) {
#pragma omp simd reduction(+ : acc)
                    for (int64_t s = 0; s < len; ++s) acc += pc[s];
                } else {
#pragma omp simd reduction(+ : acc)
                    for (int64_t s = 0; s < len; ++s) acc += pc[s] * pc[s];
                }
                b += acc;
            }
            for (int64_t s = 0; s < len; ++s) {
                const int64_t k = std::clamp<int64_t>(lab[s], 0, C);  // upstream clamps before one_hot
                if (k < C && k != drop) {
                    a += prob[k * len + s];
                    cnt += 1;
                }
            }
            part[3 * t] = a;
            part[3 * t + 1] = b;
            part[3 * t + 2] = cnt;
        }
    });
    for (int64_t n = 0; n < N; ++n) {
        double acc[3] = {0, 0, 0};
        for (int64_t j = 0; j < blocks; ++j)
            for (int k = 0; k < 3; ++k) acc[k] += part[3 * (n * blocks + j) + k];
        for (int k = 0; k < 3; ++k) stats[3 * n + k] = static_cast<T>(acc[k]);
    }
}

template <typename T>
void stats_backward_impl(const T* logits, const int64_t* target, int64_t N, int64_t C, int64_t S, int64_t act,
                         int64_t drop, bool naive, const T* gstats, T* glogits) {
    const int64_t blocks = (S + kBlock - 1) / kBlock, tasks = N * blocks;
    lk::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
        std::vector<T> prob(static_cast<size_t>(C * kBlock)), scratch(2 * kBlock), gp(static_cast<size_t>(C * kBlock));
        std::vector<T> dot(kBlock);
        for (int64_t t = begin; t < end; ++t) {
            const int64_t n = t / blocks, s0 = (t % blocks) * kBlock, len = std::min(kBlock, S - s0);
            const T* x = logits + n * C * S + s0;
            const int64_t* lab = target + n * S + s0;
            T* gx = glogits + n * C * S + s0;
            const T ga = gstats[3 * n], gb = gstats[3 * n + 1];
            block_probs<T>(x, C, S, len, act, prob.data(), scratch.data());
            // d(stats)/dp: ga*t + gb*(2p | 1) on kept classes, 0 on the dropped one.
            for (int64_t c = 0; c < C; ++c) {
                const T* __restrict pc = prob.data() + c * len;
                T* __restrict gc = gp.data() + c * len;
                if (c == drop) {
                    std::fill(gc, gc + len, T(0));
                } else if (naive) {
                    std::fill(gc, gc + len, gb);
                } else {
                    const T g2 = T(2) * gb;
#pragma omp simd
                    for (int64_t s = 0; s < len; ++s) gc[s] = g2 * pc[s];
                }
            }
            for (int64_t s = 0; s < len; ++s) {
                const int64_t k = std::clamp<int64_t>(lab[s], 0, C);
                if (k < C && k != drop) gp[k * len + s] += ga;
            }
            if (act == kSoftmax) {
                std::fill(dot.begin(), dot.begin() + len, T(0));
                for (int64_t c = 0; c < C; ++c) {
                    const T* __restrict pc = prob.data() + c * len;
                    const T* __restrict gc = gp.data() + c * len;
                    T* __restrict d = dot.data();
#pragma omp simd
                    for (int64_t s = 0; s < len; ++s) d[s] += pc[s] * gc[s];
                }
                for (int64_t c = 0; c < C; ++c) {
                    const T* __restrict pc = prob.data() + c * len;
                    const T* __restrict gc = gp.data() + c * len;
                    const T* __restrict d = dot.data();
                    T* __restrict out = gx + c * S;
#pragma omp simd
                    for (int64_t s = 0; s < len; ++s) out[s] = pc[s] * (gc[s] - d[s]);
                }
            } else if (act == kSigmoid) {
                for (int64_t c = 0; c < C; ++c) {
                    const T* __restrict pc = prob.data() + c * len;
                    const T* __restrict gc = gp.data() + c * len;
                    T* __restrict out = gx + c * S;
#pragma omp simd
                    for (int64_t s = 0; s < len; ++s) out[s] = gc[s] * pc[s] * (T(1) - pc[s]);
                }
            } else {
                for (int64_t c = 0; c < C; ++c) std::copy(gp.data() + c * len, gp.data() + (c + 1) * len, gx + c * S);
            }
        }
    });
}


// ---------------------------------------------------------------------------------------------
// mmseg 0.x DiceLoss: per-(sample, class) sums over the pixels of one sample.
//   A[n,c] = sum_s p * t * valid,  B[n,c] = sum_s p^e,  T[n,c] = sum_s t^e (= count of t == 1, e > 0)
// p = softmax over C, t = one-hot of clamp(label, 0, C-1) (so an ignored 255 is class C-1 in T and in
// nothing else), valid = label != ignore_index; the mask applies to A only, as upstream.

enum PowMode : int { kPowGeneral = 0, kPowOne = 1, kPowTwo = 2 };

inline int pow_mode(double e) { return e == 1.0 ? kPowOne : (e == 2.0 ? kPowTwo : kPowGeneral); }

template <typename T>
void class_stats_impl(const T* logits, const int64_t* target, int64_t N, int64_t C, int64_t S, int64_t ignore,
                      double exponent, T* stats) {
    const int64_t blocks = (S + kBlock - 1) / kBlock, tasks = N * blocks;
    const int mode = pow_mode(exponent);
    const T e = static_cast<T>(exponent);
    std::vector<double> part(static_cast<size_t>(tasks * C * 3));
    lk::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
        std::vector<T> prob(static_cast<size_t>(C * kBlock)), scratch(2 * kBlock);
        for (int64_t t = begin; t < end; ++t) {
            const int64_t n = t / blocks, s0 = (t % blocks) * kBlock, len = std::min(kBlock, S - s0);
            const int64_t* lab = target + n * S + s0;
            block_probs<T>(logits + n * C * S + s0, C, S, len, kSoftmax, prob.data(), scratch.data());
            double* out = part.data() + t * C * 3;
            for (int64_t c = 0; c < C; ++c) {
                const T* __restrict pc = prob.data() + c * len;
                double acc = 0;  // fp32 sums of ~1e5 signed terms lose 1e-5 relative in float
                if (mode == kPowTwo) {
#pragma omp simd reduction(+ : acc)
                    for (int64_t s = 0; s < len; ++s) acc += pc[s] * pc[s];
                } else if (mode == kPowOne) {
#pragma omp simd reduction(+ : acc)
                    for (int64_t s = 0; s < len; ++s) acc += pc[s];
                } else {
                    for (int64_t s = 0; s < len; ++s) acc += static_cast<double>(std::pow(pc[s], e));
                }
                out[3 * c] = 0;
                out[3 * c + 1] = acc;
                out[3 * c + 2] = 0;
            }
            for (int64_t s = 0; s < len; ++s) {
                const int64_t k = std::clamp<int64_t>(lab[s], 0, C - 1);  // upstream clamps to C-1
                if (lab[s] != ignore) out[3 * k] += prob[k * len + s];
                out[3 * k + 2] += 1;
            }
        }
    });
    // Task order, not thread order: the result does not depend on the thread count.
    std::vector<double> acc(static_cast<size_t>(C * 3));
    for (int64_t n = 0; n < N; ++n) {
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t j = 0; j < blocks; ++j) {
            const double* p = part.data() + (n * blocks + j) * C * 3;
            for (int64_t k = 0; k < C * 3; ++k) acc[k] += p[k];
        }
        for (int64_t k = 0; k < C * 3; ++k) stats[n * C * 3 + k] = static_cast<T>(acc[k]);
    }
}

template <typename T>
void class_stats_backward_impl(const T* logits, const int64_t* target, int64_t N, int64_t C, int64_t S,
                               int64_t ignore, double exponent, const T* gstats, T* glogits) {
    const int64_t blocks = (S + kBlock - 1) / kBlock, tasks = N * blocks;
    const int mode = pow_mode(exponent);
    const T e = static_cast<T>(exponent), em1 = static_cast<T>(exponent - 1.0);
    lk::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
        std::vector<T> prob(static_cast<size_t>(C * kBlock)), scratch(2 * kBlock), gp(static_cast<size_t>(C * kBlock));
        std::vector<T> dot(kBlock);
        for (int64_t t = begin; t < end; ++t) {
            const int64_t n = t / blocks, s0 = (t % blocks) * kBlock, len = std::min(kBlock, S - s0);
            const int64_t* lab = target + n * S + s0;
            T* gx = glogits + n * C * S + s0;
            const T* g = gstats + n * C * 3;
            block_probs<T>(logits + n * C * S + s0, C, S, len, kSoftmax, prob.data(), scratch.data());
            // dB/dp = e * p^(e-1); dA/dp = t * valid.
            for (int64_t c = 0; c < C; ++c) {
                const T* __restrict pc = prob.data() + c * len;
                T* __restrict gc = gp.data() + c * len;
                const T gb = g[3 * c + 1];
                if (mode == kPowTwo) {
                    const T g2 = T(2) * gb;
#pragma omp simd
                    for (int64_t s = 0; s < len; ++s) gc[s] = g2 * pc[s];
                } else if (mode == kPowOne) {
                    std::fill(gc, gc + len, gb);
                } else {
                    for (int64_t s = 0; s < len; ++s) gc[s] = gb * e * std::pow(pc[s], em1);
                }
            }
            for (int64_t s = 0; s < len; ++s) {
                if (lab[s] == ignore) continue;
                const int64_t k = std::clamp<int64_t>(lab[s], 0, C - 1);
                gp[k * len + s] += g[3 * k];
            }
            std::fill(dot.begin(), dot.begin() + len, T(0));
            for (int64_t c = 0; c < C; ++c) {
                const T* __restrict pc = prob.data() + c * len;
                const T* __restrict gc = gp.data() + c * len;
                T* __restrict d = dot.data();
#pragma omp simd
                for (int64_t s = 0; s < len; ++s) d[s] += pc[s] * gc[s];
            }
            for (int64_t c = 0; c < C; ++c) {
                const T* __restrict pc = prob.data() + c * len;
                const T* __restrict gc = gp.data() + c * len;
                const T* __restrict d = dot.data();
                T* __restrict o = gx + c * S;
#pragma omp simd
                for (int64_t s = 0; s < len; ++s) o[s] = pc[s] * (gc[s] - d[s]);
            }
        }
    });
}

}  // namespace

void dice_stats_forward(const View& logits, const View& target, int64_t activation, int64_t drop_class,
                        bool naive, const View& stats) {
    check_dice(logits, target);
    LK_CHECK(activation >= 0 && activation <= 2, "activation must be 0, 1 or 2");
    LK_CHECK(stats.is_contiguous() && stats.numel() == 3 * logits.size(0) &&
                    stats.scalar_type() == logits.scalar_type(), "bad stats");
    LK_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "loongkit_dice_stats", [&] {
        stats_impl<scalar_t>(logits.data_ptr<scalar_t>(), target.data_ptr<int64_t>(), logits.size(0), logits.size(1),
                             logits.size(2), activation, drop_class, naive, stats.data_ptr<scalar_t>());
    });
}

void dice_stats_backward(const View& logits, const View& target, int64_t activation, int64_t drop_class,
                         bool naive, const View& grad_stats, const View& grad_logits) {
    check_dice(logits, target);
    LK_CHECK(activation >= 0 && activation <= 2, "activation must be 0, 1 or 2");
    LK_CHECK(grad_stats.is_contiguous() && grad_stats.numel() == 3 * logits.size(0) &&
                    grad_stats.scalar_type() == logits.scalar_type(), "bad grad_stats");
    LK_CHECK(grad_logits.is_contiguous() && grad_logits.sizes() == logits.sizes() &&
                    grad_logits.scalar_type() == logits.scalar_type(), "bad grad_logits");
    LK_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "loongkit_dice_stats_backward", [&] {
        stats_backward_impl<scalar_t>(logits.data_ptr<scalar_t>(), target.data_ptr<int64_t>(), logits.size(0),
                                      logits.size(1), logits.size(2), activation, drop_class, naive,
                                      grad_stats.data_ptr<scalar_t>(), grad_logits.data_ptr<scalar_t>());
    });
}

}  // namespace loongkit::LK_ISA

namespace loongkit::LK_ISA {

void dice_class_stats_forward(const View& logits, const View& target, int64_t ignore_index,
                              double exponent, const View& stats) {
    check_dice(logits, target);
    LK_CHECK(exponent > 0 && logits.size(1) > 0, "exponent must be > 0 and there must be a class");
    LK_CHECK(stats.is_contiguous() && stats.numel() == 3 * logits.size(0) * logits.size(1) &&
                    stats.scalar_type() == logits.scalar_type(), "bad stats");
    LK_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "loongkit_dice_class_stats", [&] {
        class_stats_impl<scalar_t>(logits.data_ptr<scalar_t>(), target.data_ptr<int64_t>(), logits.size(0),
                                   logits.size(1), logits.size(2), ignore_index, exponent,
                                   stats.data_ptr<scalar_t>());
    });
}

void dice_class_stats_backward(const View& logits, const View& target, int64_t ignore_index,
                               double exponent, const View& grad_stats, const View& grad_logits) {
    check_dice(logits, target);
    LK_CHECK(exponent > 0 && logits.size(1) > 0, "exponent must be > 0 and there must be a class");
    LK_CHECK(grad_stats.is_contiguous() && grad_stats.numel() == 3 * logits.size(0) * logits.size(1) &&
                    grad_stats.scalar_type() == logits.scalar_type(), "bad grad_stats");
    LK_CHECK(grad_logits.is_contiguous() && grad_logits.sizes() == logits.sizes() &&
                    grad_logits.scalar_type() == logits.scalar_type(), "bad grad_logits");
    LK_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "loongkit_dice_class_stats_backward", [&] {
        class_stats_backward_impl<scalar_t>(logits.data_ptr<scalar_t>(), target.data_ptr<int64_t>(),
                                            logits.size(0), logits.size(1), logits.size(2), ignore_index, exponent,
                                            grad_stats.data_ptr<scalar_t>(), grad_logits.data_ptr<scalar_t>());
    });
}

}  // namespace loongkit::LK_ISA
