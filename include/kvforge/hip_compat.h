// kvforge portability layer: the kernels are written in the HIP dialect; this header
// maps it onto CUDA under nvcc and onto HIP under hipcc / clang -x hip. It exists
// because the HIP headers Debian ships are too old to build against CUDA 13.
//
// Everything the kernels need from the platform goes through a `kvf_` name here, so
// no vendor intrinsic appears in the kernel body.
#pragma once

#include <stdint.h>

#include <atomic>

#if defined(__HIPCC__) || defined(__HIP__) || defined(__HIP_PLATFORM_AMD__)
#define KVF_HIP 1
#include <hip/hip_runtime.h>
#define KVF_GRID_CONSTANT
#else
#define KVF_CUDA 1
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890
#include <cuda_fp8.h>
#endif
// The HIP runtime names the launcher uses.
typedef cudaStream_t hipStream_t;
typedef cudaError_t hipError_t;
#define hipSuccess cudaSuccess
#define hipErrorInvalidValue cudaErrorInvalidValue
#define hipGetLastError cudaGetLastError
#define hipGetErrorString cudaGetErrorString
#define hipGetDevice cudaGetDevice
#define hipDeviceGetAttribute cudaDeviceGetAttribute
#define hipDeviceAttributeMultiprocessorCount cudaDevAttrMultiProcessorCount
#define hipOccupancyMaxActiveBlocksPerMultiprocessor cudaOccupancyMaxActiveBlocksPerMultiprocessor
#define KVF_GRID_CONSTANT __grid_constant__
#endif

#define KVF_DEVICE __device__ __forceinline__
// Pure arithmetic helpers also compile for the host, so tests can run them on a CPU.
#define KVF_HOST_DEVICE __host__ __device__ __forceinline__

namespace kvf {

// ---- lanes ---------------------------------------------------------------------------
// Shuffles stay inside an aligned group of `Width` lanes (one head). The group's lanes
// always run together, so on CUDA the sync mask is just that group; AMD waves have no
// masks. Nothing here assumes a warp of 32: groups are at most 32 lanes and divide
// both 32 and 64.
template <int Width>
KVF_DEVICE unsigned group_mask() {
#ifdef KVF_CUDA
  if constexpr (Width == 32) {
    return 0xffffffffu;
  } else {
    const unsigned lane = threadIdx.x & 31u;
    return ((1u << Width) - 1u) << (lane & ~unsigned(Width - 1));
  }
#else
  return 0u;
#endif
}

template <int Width, class T>
KVF_DEVICE T shfl_xor(T v, int lane_mask) {
#ifdef KVF_CUDA
  return __shfl_xor_sync(group_mask<Width>(), v, lane_mask, Width);
#else
  return __shfl_xor(v, lane_mask, Width);
#endif
}

template <int Width, class T>
KVF_DEVICE T shfl(T v, int src_lane) {
#ifdef KVF_CUDA
  return __shfl_sync(group_mask<Width>(), v, src_lane, Width);
#else
  return __shfl(v, src_lane, Width);
#endif
}

// Waits for the group's lanes and orders their shared-memory writes before their reads
// of them. NVIDIA only: its callers (the kernel's V staging, put_v_by_dim and v_loop;
// see kStageV) are not instantiated for AMD.
template <int Width>
KVF_DEVICE void group_sync() {
#ifdef KVF_CUDA
  __syncwarp(group_mask<Width>());
#else
  static_assert(Width < 0, "group_sync is not defined for AMD");
#endif
}

// Ends the kernel with an error (its launch fails), for arguments the host never passes.
KVF_DEVICE void trap() {
#ifdef KVF_CUDA
  __trap();
#else
  __builtin_trap();
#endif
}

// ---- programmatic dependent launch (NVIDIA sm_90+) ------------------------------------
// A kernel launched with it may start while the previous kernel of the stream still runs.
// wait_prior_grid() returns once that kernel has finished and its writes are visible, so
// nothing read before it may be used (only prefetch_l2 / load_l2 below go out before it);
// allow_next_grid() lets the next kernel begin launching (it waits for this one in its
// own wait_prior_grid). Elsewhere both are no-ops and launches are plain.
KVF_DEVICE void wait_prior_grid() {
#if defined(KVF_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

KVF_DEVICE void allow_next_grid() {
#if defined(KVF_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Before wait_prior_grid() a kernel may only warm L2 for what it will read after it:
// prefetch_l2 asks for a line without keeping anything in the SM (L2 is coherent with
// the previous kernel's writes, L1 is not), and load_l2 reads through L2 only, for
// addresses of further prefetches (its value may be stale; nothing else may use it).
KVF_DEVICE void prefetch_l2(const void* p) {
#if defined(KVF_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#else
  (void)p;
#endif
}

KVF_DEVICE int64_t load_l2(const int64_t* p) {
#if defined(KVF_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return __ldcg(reinterpret_cast<const long long*>(p));
#else
  (void)p;
  return -1;
#endif
}

// Facts about a device that launches read on every call, queried once per device and
// cached in `cache` (0: not yet asked; -1: the query failed or gave nothing positive;
// threads that race on a first query store the same answer). Returns 0 where unknown, so
// callers keep their defaults; a failed query's error is cleared, or the next launch's
// hipGetLastError() would report it as its own.
constexpr int kMaxDevices = 64;
template <class Query>
int device_fact(std::atomic<int> (&cache)[kMaxDevices], int dev, Query query) {
  if (dev < 0 || dev >= kMaxDevices) return 0;
  int v = cache[dev].load(std::memory_order_relaxed);
  if (v == 0) {
    if (query(&v) != hipSuccess) {
      v = 0;
      (void)hipGetLastError();
    }
    v = v > 0 ? v : -1;
    cache[dev].store(v, std::memory_order_relaxed);
  }
  return v > 0 ? v : 0;
}

// The device's SM (CU) count; 0 where unknown.
inline int sm_count(int dev) {
  static std::atomic<int> count[kMaxDevices];
  return device_fact(count, dev, [dev](int* v) {
    return hipDeviceGetAttribute(v, hipDeviceAttributeMultiprocessorCount, dev);
  });
}

// Whether the current device can overlap launches so.
inline bool dependent_launch_supported(int dev) {
#ifdef KVF_CUDA
  static std::atomic<int> major[kMaxDevices];
  return device_fact(major, dev, [dev](int* v) {
           return cudaDeviceGetAttribute(v, cudaDevAttrComputeCapabilityMajor, dev);
         }) >= 9;
#else
  (void)dev;
  return false;
#endif
}

template <class... P, class... A>
hipError_t launch_kernel(void (*kernel)(P...), unsigned blocks, unsigned threads, hipStream_t stream,
                         bool dependent, A&&... args) {
#ifdef KVF_CUDA
  if (dependent) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(threads);
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cudaLaunchKernelEx(&cfg, kernel, static_cast<A&&>(args)...);
  }
#else
  (void)dependent;
#endif
  kernel<<<blocks, threads, 0, stream>>>(static_cast<A&&>(args)...);
  return hipGetLastError();
}

// ---- asynchronous copies into shared memory (NVIDIA sm_80+) ---------------------------
// KVF_ASYNC_COPY is 1 where they exist (an NVIDIA device pass for sm_80+), else 0 and the
// three functions are not defined: the kernel keeps its rows in registers there (AMD's
// copy into LDS is a load and then a store, so it would wait for each row).
// copy_async16 starts a 16-byte copy from global to shared memory that holds no register
// while in flight (cp.async, L1 bypassed: the rows are read once). async_commit() closes
// this thread's group of copies; async_wait<N>() returns once at most N of its groups
// are still in flight, and the thread may then read what the finished ones wrote.
// A build may set KVF_ASYNC_COPY=0 itself: the GPU tests run AMD's register pipeline so.
#ifndef KVF_ASYNC_COPY
#if defined(KVF_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define KVF_ASYNC_COPY 1
#else
#define KVF_ASYNC_COPY 0
#endif
#endif

#if KVF_ASYNC_COPY
KVF_DEVICE void copy_async16(void* dst_shared, const void* src) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(dst_shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

KVF_DEVICE void async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
KVF_DEVICE void async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
#endif

// ---- a block barrier met at different instructions (NVIDIA sm_70+) -------------------
// __syncthreads() is PTX's bar.sync, an *aligned* barrier: every thread of the block must
// meet it at one instruction, or the behaviour is undefined (a warp split between two of
// them hung the H200: benchmarks/PERF.md, session 25). barrier.sync without .aligned
// counts threads wherever they meet it, with the same memory ordering. KVF_SPLIT_BARRIER
// is 1 where it exists, and split_barrier() is defined only there; AMD's s_barrier counts
// waves, so kernels there keep one barrier every thread meets at one place.
#ifndef KVF_SPLIT_BARRIER
#if defined(KVF_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
#define KVF_SPLIT_BARRIER 1
#else
#define KVF_SPLIT_BARRIER 0
#endif
#endif

#if KVF_SPLIT_BARRIER
KVF_DEVICE void split_barrier() { asm volatile("barrier.sync 0;" ::: "memory"); }
#endif

// ---- bit casts -----------------------------------------------------------------------
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
KVF_HOST_DEVICE float bits_to_float(uint32_t u) { return __uint_as_float(u); }
KVF_HOST_DEVICE uint32_t float_to_bits(float f) { return __float_as_uint(f); }
#else
KVF_HOST_DEVICE float bits_to_float(uint32_t u) { float f; __builtin_memcpy(&f, &u, 4); return f; }
KVF_HOST_DEVICE uint32_t float_to_bits(float f) { uint32_t u; __builtin_memcpy(&u, &f, 4); return u; }
#endif

// ---- 16-bit float formats (held as raw bits so no vendor type leaks out) -------------
struct BF16 {
  static constexpr int kBytes = 2;
  static KVF_DEVICE float to_float(uint32_t bits16) { return bits_to_float(bits16 << 16); }
  // Round to nearest even; NaN stays NaN.
  static KVF_DEVICE uint32_t from_float(float f) {
#ifdef KVF_CUDA
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#else
    const uint32_t u = float_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return ((u >> 16) | 0x40u) & 0xffffu;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
#endif
  }
};

struct FP16 {
  static constexpr int kBytes = 2;
  static KVF_DEVICE float to_float(uint32_t bits16) {
#ifdef KVF_CUDA
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits16)));
#else
    return static_cast<float>(__builtin_bit_cast(_Float16, static_cast<uint16_t>(bits16)));
#endif
  }
  static KVF_DEVICE uint32_t from_float(float f) {
#ifdef KVF_CUDA
    return __half_as_ushort(__float2half_rn(f));
#else
    return __builtin_bit_cast(uint16_t, static_cast<_Float16>(f));
#endif
  }
};

struct F32 {
  static constexpr int kBytes = 4;
};

// ---- FP8 e4m3 -------------------------------------------------------------------------
// Both flavours are produced by one exact software routine (round to nearest even), so
// e4m3fnuz numerics are testable on NVIDIA. Callers clamp first when they saturate; an
// unclamped value past the format's range becomes its NaN.
//   e4m3fn:   bias 7, max 448, NaN 0x7f/0xff, signed zero.
//   e4m3fnuz: bias 8, max 240, NaN 0x80, no negative zero.
enum class Fp8 { E4M3FN, E4M3FNUZ };

template <Fp8 F>
struct Fp8Format {
  static constexpr int kBias = F == Fp8::E4M3FN ? 7 : 8;
  static constexpr float kMax = F == Fp8::E4M3FN ? 448.0f : 240.0f;
};

template <Fp8 F>
KVF_HOST_DEVICE uint32_t fp8_from_float_soft(float f) {
  constexpr int kBias = Fp8Format<F>::kBias;
  constexpr uint32_t kNan = F == Fp8::E4M3FN ? 0x7fu : 0x80u;
  const uint32_t u = float_to_bits(f);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t mag = u & 0x7fffffffu;
  // Magnitudes at or past the first value that rounds beyond the largest finite code.
  constexpr uint32_t kOverflow = F == Fp8::E4M3FN ? 0x43e80000u /* 464 */ : 0x43780000u /* 248 */;
  uint32_t code;
  if (mag > 0x7f800000u) {
    return kNan;
  } else if (mag > kOverflow || (mag == kOverflow && F == Fp8::E4M3FNUZ)) {
    // 464 is a tie between 448 (even) and an invalid code; 248 ties to 256 (even): NaN.
    return kNan | (F == Fp8::E4M3FN ? sign : 0u);
  } else if (mag < uint32_t(127 + 1 - kBias) << 23) {
    // Subnormal range: adding 2^(21 - bias) leaves the rounded multiple of the smallest
    // subnormal in the low mantissa bits (the FPU rounds to nearest even for us).
    const float magic = bits_to_float(uint32_t(127 + 21 - kBias) << 23);
    code = float_to_bits(bits_to_float(mag) + magic) - float_to_bits(magic);
  } else {
    // Normal: rebias the exponent, then round the 20 dropped mantissa bits to even.
    const uint32_t odd = (mag >> 20) & 1u;
    code = (mag + (uint32_t(kBias - 127) << 23) + 0x7ffffu + odd) >> 20;
  }
  if (F == Fp8::E4M3FNUZ && code == 0) return 0u;  // no negative zero
  return code | sign;
}

// The target's own converter, where it has one for flavour F: sm_89+ for e4m3fn,
// gfx942 for e4m3fnuz, gfx950 for e4m3fn (OCP).
#if defined(KVF_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
template <Fp8 F> constexpr bool kHardwareFp8 = F == Fp8::E4M3FN;
#elif defined(KVF_HIP) && defined(__gfx942__)
template <Fp8 F> constexpr bool kHardwareFp8 = F == Fp8::E4M3FNUZ;
#elif defined(KVF_HIP) && defined(__gfx950__)
template <Fp8 F> constexpr bool kHardwareFp8 = F == Fp8::E4M3FN;
#else
template <Fp8 F> constexpr bool kHardwareFp8 = false;
#endif

// Whether the converter itself saturates out-of-range input (NVIDIA's .satfinite does);
// otherwise input is clamped before it.
#if defined(KVF_CUDA)
constexpr bool kHardwareFp8Saturates = true;
#else
constexpr bool kHardwareFp8Saturates = false;
#endif

// Two values to FP8 with the hardware (in range, or any if it saturates); a in the low byte.
template <Fp8 F>
KVF_DEVICE uint32_t fp8x2_hardware(float a, float b) {
#if defined(KVF_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
#elif defined(KVF_HIP) && (defined(__gfx942__) || defined(__gfx950__))
  return static_cast<uint32_t>(__builtin_amdgcn_cvt_pk_fp8_f32(a, b, 0, false)) & 0xffffu;
#else
  return fp8_from_float_soft<F>(a) | (fp8_from_float_soft<F>(b) << 8);
#endif
}

// The code of v as the software routine gives it where v is NaN (0x7f, 0x80) or, in
// passthrough, past the rounding range (e4m3fn's keeps the sign: S.1111.111); else code.
template <Fp8 F, bool Saturate>
KVF_HOST_DEVICE uint32_t fp8_patch_nan(uint32_t code, float v) {
  const float mag = fabsf(v);
  if (mag != mag) return F == Fp8::E4M3FN ? 0x7fu : 0x80u;
  const bool over = !Saturate && (F == Fp8::E4M3FN ? mag > 464.0f : mag >= 248.0f);
  if (!over) return code;
  return F == Fp8::E4M3FN ? 0x7fu | ((float_to_bits(v) >> 24) & 0x80u) : 0x80u;
}

// v clamped to +-max; NaN stays NaN (torch's clamp), so it converts to the format's NaN.
template <Fp8 F>
KVF_HOST_DEVICE float fp8_clamp(float v) {
  constexpr float kMax = Fp8Format<F>::kMax;
  return v > kMax ? kMax : (v < -kMax ? -kMax : v);
}

// Two values at once (a in the low byte), saturating to +-max or (passthrough) with
// out-of-range values as NaN; a NaN becomes the format's NaN as in software (above).
// NVIDIA's converter saturates by itself (.satfinite: past the max and +-inf become
// +-max, NaN gives 0x7f), and an e4m3fn +-max code (S.1111.110) becomes that sign's NaN
// (S.1111.111) by setting its lowest bit: one test and one OR per value, where the
// byte-wise patch extracts, tests and reassembles each byte (PERF.md, v6.9). AMD's
// converters see input clamped by fminf/fmaxf (one v_med3) and are patched byte-wise.
// Host code (the tests' harness) takes the software routine.
template <Fp8 F, bool Saturate>
KVF_HOST_DEVICE uint32_t fp8x2_from_float(float a, float b) {
  if constexpr (kHardwareFp8<F> && kHardwareFp8Saturates) {
    static_assert(F == Fp8::E4M3FN, "the NaN patch below assumes e4m3fn codes");
    const uint32_t r = fp8x2_hardware<F>(a, b);
    if constexpr (Saturate) return r;
    return r | (fabsf(a) <= 464.0f ? 0u : 0x01u) | (fabsf(b) <= 464.0f ? 0u : 0x100u);
  } else if constexpr (kHardwareFp8<F>) {
    constexpr float kMax = Fp8Format<F>::kMax;
    const uint32_t r = fp8x2_hardware<F>(fminf(fmaxf(a, -kMax), kMax), fminf(fmaxf(b, -kMax), kMax));
    return fp8_patch_nan<F, Saturate>(r & 0xffu, a) | (fp8_patch_nan<F, Saturate>(r >> 8, b) << 8);
  } else if constexpr (Saturate) {
    return fp8_from_float_soft<F>(fp8_clamp<F>(a)) | (fp8_from_float_soft<F>(fp8_clamp<F>(b)) << 8);
  } else {
    return fp8_from_float_soft<F>(a) | (fp8_from_float_soft<F>(b) << 8);
  }
}

}  // namespace kvf
