// loongkit/kernel_main.h: the library's C entry points; included by exactly one translation unit
// (isa_baseline.cpp, after its table). loongkit_core.kernels calls them through ctypes:
//
//   int32_t lk_abi(void)                   LK_KERNEL_ABI
//   const char* lk_source_key(void)        hash of the sources it was built from (-DLK_SOURCE_KEY)
//   int32_t lk_isa_supported(int32_t isa)  0 baseline, 1 avx2, 2 avx512: compiled here and usable
//                                          on this CPU (and its OS: XSAVE state enabled)
//   const char* lk_functions(void)         "name:params:ret;..." in table order
//   int32_t lk_call(isa, fn, threads, ints, n_ints, doubles, n_doubles, int64_t* result)
//                                          0, or -1 with the message in lk_last_error()
//   const char* lk_last_error(void)        the calling thread's last error
#pragma once

#include <loongkit/kernel.h>

#ifndef LK_SOURCE_KEY
#define LK_SOURCE_KEY ""
#endif

#define LK_API extern "C" __attribute__((visibility("default")))

namespace lk_tables {
const ::lk::detail::Table& table_baseline();
const ::lk::detail::Table& table_avx2();
const ::lk::detail::Table& table_avx512();
}  // namespace lk_tables

namespace lk::detail {

inline std::string& last_error() {
    thread_local std::string message;
    return message;
}

inline const Table* table_of(int32_t isa) {
    switch (isa) {
        case 0: return &lk_tables::table_baseline();
        case 1: return &lk_tables::table_avx2();
        case 2: return &lk_tables::table_avx512();
        default: return nullptr;
    }
}

inline bool isa_supported(int32_t isa) {
    if (isa == 0) return true;
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    const bool v3 = __builtin_cpu_supports("avx") && __builtin_cpu_supports("avx2") &&
                    __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi") &&
                    __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt");
    if (isa == 1) return v3;
    if (isa == 2)
        return v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512vl");
#endif
    return false;
}

}  // namespace lk::detail

LK_API int32_t lk_abi(void) { return LK_KERNEL_ABI; }

LK_API const char* lk_source_key(void) { return LK_SOURCE_KEY; }

LK_API int32_t lk_isa_supported(int32_t isa) { return ::lk::detail::isa_supported(isa) ? 1 : 0; }

LK_API const char* lk_functions(void) {
    static const std::string list = [] {
        std::string s;
        const ::lk::detail::Table& t = lk_tables::table_baseline();
        for (int32_t i = 0; i < t.count; ++i) {
            std::string name = t.entries[i].name;
            const size_t colon = name.rfind("::");
            if (colon != std::string::npos) name = name.substr(colon + 2);
            s += name + ":" + t.entries[i].params + ":" + t.entries[i].ret + ";";
        }
        return s;
    }();
    return list.c_str();
}

LK_API int32_t lk_call(int32_t isa, int32_t fn, int32_t threads, const int64_t* ints, int64_t n_ints,
                       const double* doubles, int64_t n_doubles, int64_t* result) {
    try {
        LK_CHECK(::lk::detail::isa_supported(isa), "instruction set ", isa, " is not usable on this CPU");
        const ::lk::detail::Table* t = ::lk::detail::table_of(isa);
        LK_CHECK(t != nullptr && fn >= 0 && fn < t->count, "no function ", fn);
        ::lk::detail::Reader reader{ints, n_ints, doubles, n_doubles};
        ::lk::detail::call_threads() = threads > 0 ? threads : 1;
        t->entries[fn].fn(reader, result);
        return 0;
    } catch (const std::exception& e) {
        ::lk::detail::last_error() = e.what();
    } catch (...) {
        ::lk::detail::last_error() = "unknown C++ exception";
    }
    return -1;
}

LK_API const char* lk_last_error(void) { return ::lk::detail::last_error().c_str(); }
