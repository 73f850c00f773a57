// The same-bytes copy of benchmarks/bench.py: what a plain kernel takes to move a case's
// bytes at its size, launched as the op is (a dependent launch where the GPU has one).
// One 16-byte vector per thread over as many blocks as that takes: of 80 copies measured
// on the H200 at 40-323 MB (1-8 vectors per thread in flight; that grid or 2-16 blocks per
// SM striding; streaming or plain accesses; with or without the dependent launch) this
// shape was the fastest at every size (streaming or plain: neither at every size), and in
// this plain form 4-5% faster than torch's elementwise add at 46-84 MB (benchmarks/PERF.md,
// session 17).
#include "kvforge/hip_compat.h"

namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) copy16(const uint4* __restrict__ src, uint4* __restrict__ dst, int64_t n) {
  kvf::allow_next_grid();
  kvf::wait_prior_grid();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = src[i];
}

}  // namespace

// Copies n 16-byte vectors from src to dst on the stream; returns the launch's error code.
extern "C" int kvf_bench_copy16(const void* src, void* dst, int64_t n, void* stream) {
  if (n <= 0) return 0;
  int dev = 0;
  if (hipGetDevice(&dev) != hipSuccess) return int(hipGetLastError());
  const unsigned blocks = static_cast<unsigned>((n + kThreads - 1) / kThreads);
  return int(kvf::launch_kernel(copy16, blocks, kThreads, static_cast<hipStream_t>(stream),
                                kvf::dependent_launch_supported(dev), static_cast<const uint4*>(src),
                                static_cast<uint4*>(dst), n));
}
