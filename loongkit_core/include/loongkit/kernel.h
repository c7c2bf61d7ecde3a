// loongkit/kernel.h: what a plugin's C++ CPU kernels are written against (no libtorch, no Python).
//
// A kernel library is a plain shared object with a C entry point table (kernel_main.h), loaded by
// loongkit_core.kernels through ctypes. Its functions take `lk::View` (a strided array: pointer,
// dtype, sizes, byte strides), integers, doubles, bools and lists of doubles or integers; results
// are preallocated by the Python side. Nothing of libtorch's C++ ABI or of CPython's is used, so one
// binary serves every torch and every Python version (see docs/architecture.md, "Kernel ABI").
//
// SIMD: every kernel source is compiled once per instruction set (isa_<isa>.cpp including
// kernel_isa_begin.h, the sources, kernel_isa_end.h) into namespace `<yours>::LK_ISA`; the entry
// points pick the table of the best ISA the CPU supports, at run time. This header is included
// before any target region on purpose: every standard-library template and inline function below
// is then compiled for the baseline ISA in every translation unit, so the linker may merge them
// without an AVX-512 instantiation ever being reachable on a CPU without it.
//
// Threads: lk::parallel_for is at::parallel_for's OpenMP scheme (same chunking, same nesting rule)
// on the process's OpenMP runtime, torch's libgomp (the library does not link one of its own), with
// torch.get_num_threads() passed in by the Python side on every call (lk::num_threads()).
#pragma once

#ifndef __cplusplus
#error "loongkit/kernel.h is C++17"
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <new>
#include <numeric>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

// Version of the calling convention below (lk_call's argument encoding); loongkit_core.kernels
// refuses a library built for another one.
#define LK_KERNEL_ABI 1

#define LK_STR2(x) #x
#define LK_STR(x) LK_STR2(x)
#define LK_CAT2(a, b) a##b
#define LK_CAT(a, b) LK_CAT2(a, b)

namespace lk {

// Element types; the codes are part of the ABI (loongkit_core.kernels._DTYPES).
enum class Dtype : int32_t {
    Float = 1,
    Double = 2,
    Half = 3,
    BFloat16 = 4,
    Char = 5,
    Byte = 6,
    Short = 7,
    Int = 8,
    Long = 9,
    Bool = 10,
};
constexpr Dtype kFloat = Dtype::Float, kDouble = Dtype::Double, kHalf = Dtype::Half, kByte = Dtype::Byte,
                kInt = Dtype::Int, kLong = Dtype::Long, kBool = Dtype::Bool;

inline int64_t itemsize(Dtype t) {
    switch (t) {
        case Dtype::Float: case Dtype::Int: return 4;
        case Dtype::Double: case Dtype::Long: return 8;
        case Dtype::Half: case Dtype::BFloat16: case Dtype::Short: return 2;
        default: return 1;
    }
}

inline const char* dtype_name(Dtype t) {
    switch (t) {
        case Dtype::Float: return "float32";
        case Dtype::Double: return "float64";
        case Dtype::Half: return "float16";
        case Dtype::BFloat16: return "bfloat16";
        case Dtype::Char: return "int8";
        case Dtype::Byte: return "uint8";
        case Dtype::Short: return "int16";
        case Dtype::Int: return "int32";
        case Dtype::Long: return "int64";
        case Dtype::Bool: return "bool";
    }
    return "unknown";
}

// IEEE binary16 storage with exact conversion to float (what at::Half does; no F16C needed).
struct Half {
    uint16_t x;
    Half() = default;
    explicit Half(float f) : x(from_float(f)) {}
    explicit Half(int v) : Half(static_cast<float>(v)) {}
    operator float() const { return to_float(x); }

    static float to_float(uint16_t h) {
        const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
        uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
        if (exp == 0x1f) {
            bits = sign | 0x7f800000u | (man << 13);  // inf, NaN (payload kept)
        } else if (exp != 0) {
            bits = sign | ((exp + 112) << 23) | (man << 13);
        } else if (man == 0) {
            bits = sign;
        } else {  // subnormal: normalise
            exp = 113;
            while (!(man & 0x400u)) {
                man <<= 1;
                --exp;
            }
            bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
        }
        float f;
        std::memcpy(&f, &bits, 4);
        return f;
    }
    // Round to nearest even.
    static uint16_t from_float(float f) {
        uint32_t b;
        std::memcpy(&b, &f, 4);
        const uint16_t sign = static_cast<uint16_t>((b >> 16) & 0x8000u);
        const uint32_t a = b & 0x7fffffffu;
        if (a >= 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0u));
        if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
        if (a < 0x38800000u) {  // subnormal or zero in half
            if (a < 0x33000000u) return sign;
            const uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u, shift = 126 - e;
            uint32_t r = m >> (shift - 10 + 13);
            const uint32_t rem = m & ((1u << (shift + 3)) - 1), halfway = 1u << (shift + 2);
            if (rem > halfway || (rem == halfway && (r & 1u))) ++r;
            return static_cast<uint16_t>(sign | r);
        }
        uint32_t r = ((a - 0x38000000u) >> 13);
        const uint32_t rem = a & 0x1fffu;
        if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
        return static_cast<uint16_t>(sign | r);
    }
};

template <typename T> struct DtypeOf;
template <> struct DtypeOf<float> { static constexpr Dtype value = Dtype::Float; };
template <> struct DtypeOf<double> { static constexpr Dtype value = Dtype::Double; };
template <> struct DtypeOf<Half> { static constexpr Dtype value = Dtype::Half; };
template <> struct DtypeOf<int8_t> { static constexpr Dtype value = Dtype::Char; };
template <> struct DtypeOf<uint8_t> { static constexpr Dtype value = Dtype::Byte; };
template <> struct DtypeOf<int16_t> { static constexpr Dtype value = Dtype::Short; };
template <> struct DtypeOf<int32_t> { static constexpr Dtype value = Dtype::Int; };
template <> struct DtypeOf<int64_t> { static constexpr Dtype value = Dtype::Long; };
template <> struct DtypeOf<bool> { static constexpr Dtype value = Dtype::Bool; };

// What a failed LK_CHECK throws; lk_call turns it into a RuntimeError on the Python side.
class Error : public std::runtime_error {
   public:
    using std::runtime_error::runtime_error;
};

namespace detail {
// Message text without iostreams (which would drag the locale machinery into every library).
inline void put(std::string& s, const char* v) { s += v; }
inline void put(std::string& s, const std::string& v) { s += v; }
inline void put(std::string& s, char v) { s += v; }
inline void put(std::string& s, bool v) { s += v ? "true" : "false"; }
template <typename V>
inline std::enable_if_t<std::is_integral_v<V>> put(std::string& s, V v) {
    s += std::to_string(v);
}
template <typename V>
inline std::enable_if_t<std::is_floating_point_v<V>> put(std::string& s, V v) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.9g", static_cast<double>(v));
    s += buf;
}
template <typename... A>
std::string cat(const A&... a) {
    std::string s;
    (put(s, a), ...);
    return s;
}
}  // namespace detail

#define LK_CHECK(cond, ...)                                                     \
    do {                                                                        \
        if (!(cond)) throw ::lk::Error(::lk::detail::cat(__VA_ARGS__));         \
    } while (0)

constexpr int kMaxDims = 8;

struct Sizes {
    int32_t ndim = 0;
    int64_t v[kMaxDims] = {};
    bool operator==(const Sizes& o) const {
        if (ndim != o.ndim) return false;
        for (int i = 0; i < ndim; ++i)
            if (v[i] != o.v[i]) return false;
        return true;
    }
    bool operator!=(const Sizes& o) const { return !(*this == o); }
};

// A strided array handed over by the Python side (a CPU torch.Tensor or a numpy array). The method
// names follow at::Tensor's where they mean the same; strides are in elements, byte_stride in bytes.
class View {
   public:
    View() = default;
    View(void* data, Dtype dtype, bool writable, int32_t ndim, const int64_t* sizes, const int64_t* byte_strides)
        : data_(data), dtype_(dtype), writable_(writable), ndim_(ndim) {
        for (int i = 0; i < ndim; ++i) {
            size_[i] = sizes[i];
            bstride_[i] = byte_strides[i];
        }
    }
    int64_t dim() const { return ndim_; }
    int64_t size(int64_t i) const { return size_[wrap(i)]; }
    int64_t byte_stride(int64_t i) const { return bstride_[wrap(i)]; }
    int64_t stride(int64_t i) const { return bstride_[wrap(i)] / itemsize(dtype_); }
    Dtype scalar_type() const { return dtype_; }
    int64_t element_size() const { return itemsize(dtype_); }
    bool writable() const { return writable_; }
    int64_t numel() const {
        int64_t n = 1;
        for (int i = 0; i < ndim_; ++i) n *= size_[i];
        return n;
    }
    Sizes sizes() const {
        Sizes s;
        s.ndim = ndim_;
        for (int i = 0; i < ndim_; ++i) s.v[i] = size_[i];
        return s;
    }
    // at::Tensor::is_contiguous: C order, dimensions of size 1 (and empty arrays) ignored.
    bool is_contiguous() const {
        int64_t expected = itemsize(dtype_);
        for (int i = ndim_ - 1; i >= 0; --i) {
            if (size_[i] == 0) return true;
            if (size_[i] != 1 && bstride_[i] != expected) return false;
            expected *= size_[i];
        }
        return true;
    }
    void* data_ptr() const { return data_; }
    template <typename T>
    T* data_ptr() const {
        LK_CHECK(DtypeOf<std::remove_cv_t<T>>::value == dtype_, "expected a ",
                 dtype_name(DtypeOf<std::remove_cv_t<T>>::value), " array, got ", dtype_name(dtype_));
        return static_cast<T*>(data_);
    }

   private:
    int wrap(int64_t i) const {
        const int64_t j = i < 0 ? i + ndim_ : i;
        LK_CHECK(j >= 0 && j < ndim_, "dimension ", i, " out of range for a ", ndim_, "-d array");
        return static_cast<int>(j);
    }
    void* data_ = nullptr;
    Dtype dtype_ = Dtype::Float;
    bool writable_ = true;
    int32_t ndim_ = 0;
    int64_t size_[kMaxDims] = {};
    int64_t bstride_[kMaxDims] = {};
};

// AT_DISPATCH_FLOATING_TYPES(_AND_HALF): the body sees `scalar_t`.
#define LK_DISPATCH_CASE(enum_value, type, ...) \
    case enum_value: {                          \
        using scalar_t = type;                  \
        __VA_ARGS__();                          \
        break;                                  \
    }
#define LK_DISPATCH_FLOATING_TYPES(dtype, name, ...)                                               \
    [&] {                                                                                          \
        switch (dtype) {                                                                           \
            LK_DISPATCH_CASE(::lk::Dtype::Float, float, __VA_ARGS__)                               \
            LK_DISPATCH_CASE(::lk::Dtype::Double, double, __VA_ARGS__)                             \
            default: throw ::lk::Error(::lk::detail::cat(name, ": no kernel for ", ::lk::dtype_name(dtype))); \
        }                                                                                          \
    }()
#define LK_DISPATCH_FLOATING_TYPES_AND_HALF(dtype, name, ...)                                      \
    [&] {                                                                                          \
        switch (dtype) {                                                                           \
            LK_DISPATCH_CASE(::lk::Dtype::Float, float, __VA_ARGS__)                               \
            LK_DISPATCH_CASE(::lk::Dtype::Double, double, __VA_ARGS__)                             \
            LK_DISPATCH_CASE(::lk::Dtype::Half, ::lk::Half, __VA_ARGS__)                           \
            default: throw ::lk::Error(::lk::detail::cat(name, ": no kernel for ", ::lk::dtype_name(dtype))); \
        }                                                                                          \
    }()

// ------------------------------------------------------------------------------------------------
// Threads

namespace detail {
inline int& call_threads() {
    thread_local int n = 1;
    return n;
}
}  // namespace detail

// torch.get_num_threads() of the calling Python thread (1 for libraries that pass no thread count).
inline int64_t num_threads() { return detail::call_threads(); }

inline bool in_parallel_region() {
#if defined(_OPENMP)
    return omp_in_parallel() != 0;
#else
    return false;
#endif
}

// at::parallel_for: f(b, e) over [begin, end) cut into at most num_threads() contiguous chunks of
// at least `grain` iterations; inline when the range is small, one thread is asked for, or inside a
// parallel region already. An exception in a chunk is rethrown after the region.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
    if (begin >= end) return;
    const int64_t n = end - begin, threads = num_threads();
    if (n <= grain || n == 1 || threads <= 1 || in_parallel_region()) {
        f(begin, end);
        return;
    }
#if defined(_OPENMP)
    std::exception_ptr error;
    std::atomic_flag failed = ATOMIC_FLAG_INIT;
#pragma omp parallel num_threads(static_cast<int>(threads))
    {
        int64_t team = omp_get_num_threads();
        if (grain > 0) team = std::min(team, (n + grain - 1) / grain);
        const int64_t tid = omp_get_thread_num(), chunk = (n + team - 1) / team, b = begin + tid * chunk;
        if (tid < team && b < end) {
            try {
                f(b, std::min(end, b + chunk));
            } catch (...) {
                if (!failed.test_and_set()) error = std::current_exception();
            }
        }
    }
    if (error) std::rethrow_exception(error);
#else
    f(begin, end);
#endif
}

// ------------------------------------------------------------------------------------------------
// The calling convention (bindings are generated from the C++ signatures)
//
// lk_call(isa, fn, threads, ints, n_ints, doubles, n_doubles, &result): the arguments of function
// `fn`, left to right, are read from two flat arrays:
//   View       'T'  ints: data pointer, dtype code, flags (1 writable, 2 strides in elements, else
//                    in bytes), ndim, sizes[ndim], strides[ndim]
//   int64_t    'i'  ints: value (int: range-checked)
//   bool       'b'  ints: 0 or 1
//   double     'd'  doubles: value (float: rounded)
//   vector<double>   'D'  ints: count; doubles: values
//   vector<int64_t>  'I'  ints: count, values
// The return value (void 'v', bool 'b', int64_t 'i') lands in *result.

namespace detail {

struct Reader {
    const int64_t* ints;
    int64_t n_ints;
    const double* dbls;
    int64_t n_dbls;
    int64_t pi = 0, pd = 0;
    int64_t next_int() {
        LK_CHECK(pi < n_ints, "argument list too short (integers)");
        return ints[pi++];
    }
    double next_double() {
        LK_CHECK(pd < n_dbls, "argument list too short (doubles)");
        return dbls[pd++];
    }
};

template <typename T> struct Arg;
template <> struct Arg<View> {
    static constexpr char sig = 'T';
    static View get(Reader& r) {
        void* data = reinterpret_cast<void*>(static_cast<intptr_t>(r.next_int()));
        const int64_t code = r.next_int();
        LK_CHECK(code >= 1 && code <= 10, "unknown dtype code ", code);
        const int64_t flags = r.next_int();  // 1: writable, 2: strides in elements (else bytes)
        const int64_t ndim = r.next_int();
        LK_CHECK(ndim >= 0 && ndim <= kMaxDims, "arrays of ", ndim, " dimensions are not supported");
        LK_CHECK(r.pi + 2 * ndim <= r.n_ints, "argument list too short (array shape)");
        const int64_t* sizes = r.ints + r.pi;
        int64_t strides[kMaxDims];
        const int64_t scale = (flags & 2) ? itemsize(static_cast<Dtype>(code)) : 1;
        for (int64_t i = 0; i < ndim; ++i) strides[i] = sizes[ndim + i] * scale;
        r.pi += 2 * ndim;
        return View(data, static_cast<Dtype>(code), (flags & 1) != 0, static_cast<int32_t>(ndim), sizes, strides);
    }
};
template <> struct Arg<int64_t> {
    static constexpr char sig = 'i';
    static int64_t get(Reader& r) { return r.next_int(); }
};
template <> struct Arg<int> {
    static constexpr char sig = 'i';
    static int get(Reader& r) {
        const int64_t v = r.next_int();
        LK_CHECK(v >= INT_MIN && v <= INT_MAX, "integer argument out of range: ", v);
        return static_cast<int>(v);
    }
};
template <> struct Arg<bool> {
    static constexpr char sig = 'b';
    static bool get(Reader& r) { return r.next_int() != 0; }
};
template <> struct Arg<double> {
    static constexpr char sig = 'd';
    static double get(Reader& r) { return r.next_double(); }
};
template <> struct Arg<float> {
    static constexpr char sig = 'd';
    static float get(Reader& r) { return static_cast<float>(r.next_double()); }
};
template <> struct Arg<std::vector<double>> {
    static constexpr char sig = 'D';
    static std::vector<double> get(Reader& r) {
        const int64_t n = r.next_int();
        LK_CHECK(n >= 0 && r.pd + n <= r.n_dbls, "argument list too short (double list)");
        std::vector<double> v(r.dbls + r.pd, r.dbls + r.pd + n);
        r.pd += n;
        return v;
    }
};
template <> struct Arg<std::vector<int64_t>> {
    static constexpr char sig = 'I';
    static std::vector<int64_t> get(Reader& r) {
        const int64_t n = r.next_int();
        LK_CHECK(n >= 0 && r.pi + n <= r.n_ints, "argument list too short (integer list)");
        std::vector<int64_t> v(r.ints + r.pi, r.ints + r.pi + n);
        r.pi += n;
        return v;
    }
};

template <typename R> struct Ret;
template <> struct Ret<void> { static constexpr char sig = 'v'; };
template <> struct Ret<bool> { static constexpr char sig = 'b'; };
template <> struct Ret<int64_t> { static constexpr char sig = 'i'; };

using Thunk = void (*)(Reader&, int64_t*);

struct Entry {
    const char* name;    // the C++ name (qualified); Python sees what follows the last "::"
    const char* params;  // one character per parameter (see above)
    char ret;
    Thunk fn;
};

struct Table {
    const Entry* entries;
    int32_t count;
};

template <auto F> struct Bind;
template <typename R, typename... P, R (*F)(P...)>
struct Bind<F> {
    static constexpr char params[] = {Arg<std::decay_t<P>>::sig..., '\0'};
    static void call(Reader& r, int64_t* result) {
        // Braced initialisation reads the arguments left to right.
        std::tuple<std::decay_t<P>...> args{Arg<std::decay_t<P>>::get(r)...};
        LK_CHECK(r.pi == r.n_ints && r.pd == r.n_dbls, "argument list too long");
        if constexpr (std::is_void_v<R>) {
            std::apply(F, args);
            *result = 0;
        } else {
            *result = static_cast<int64_t>(std::apply(F, args));
        }
    }
};

}  // namespace detail
}  // namespace lk

// A library's function list, in its functions file, included by every isa_<isa>.cpp after
// kernel_isa_end.h (the table itself is baseline code: it is read on every CPU):
//
//   LK_TABLE_BEGIN
//   LK_FUNCTION(mylib::LK_ISA::my_kernel)
//   LK_TABLE_END
#define LK_TABLE_BEGIN                                                                  \
    namespace lk_tables {                                                               \
    const ::lk::detail::Table& LK_CAT(table_, LK_ISA)() {                               \
        static const ::lk::detail::Entry entries[] = {
#define LK_FUNCTION(f) {LK_STR(f), ::lk::detail::Bind<&f>::params, ::lk::detail::RetOf<&f>::sig, &::lk::detail::Bind<&f>::call},
#define LK_TABLE_END                                                                    \
        };                                                                              \
        static const ::lk::detail::Table table{entries, static_cast<int32_t>(sizeof(entries) / sizeof(entries[0]))}; \
        return table;                                                                   \
    }                                                                                   \
    }

namespace lk::detail {
template <auto F> struct RetOf;
template <typename R, typename... P, R (*F)(P...)>
struct RetOf<F> {
    static constexpr char sig = Ret<R>::sig;
};
}  // namespace lk::detail
