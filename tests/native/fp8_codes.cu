// Harness for the kernels' FP8 conversion (include/kvforge/hip_compat.h): reads float32
// values from argv[2] and writes their codes to argv[3]. Driven by tests/test_fp8.py.
//   soft:   fp8_from_float_soft on the host (passthrough), e4m3fn codes then e4m3fnuz
//   device: fp8x2_from_float on the GPU, the kernels' own path (the target's converter
//           where it has one), e4m3fn then e4m3fnuz, each saturating then passthrough
#include <cstdio>
#include <cstring>
#include <vector>

#include "kvforge/hip_compat.h"

using kvf::Fp8;

// Values 2i and 2i + 1 as one pair (the high byte is the second value's code).
template <Fp8 F, bool Saturate>
__global__ void convert_pairs(const float* v, unsigned char* out, size_t n) {
  const size_t i = 2 * (size_t(blockIdx.x) * blockDim.x + threadIdx.x);
  if (i >= n) return;
  const uint32_t r = kvf::fp8x2_from_float<F, Saturate>(v[i], i + 1 < n ? v[i + 1] : 0.0f);
  out[i] = static_cast<unsigned char>(r & 0xffu);
  if (i + 1 < n) out[i + 1] = static_cast<unsigned char>(r >> 8);
}

template <Fp8 F, bool Saturate>
static bool on_device(const std::vector<float>& v, unsigned char* host_out) {
  const size_t n = v.size();
  float* dv = nullptr;
  unsigned char* dout = nullptr;
  if (cudaMalloc(&dv, n * sizeof(float)) != cudaSuccess || cudaMalloc(&dout, n) != cudaSuccess) return false;
  cudaMemcpy(dv, v.data(), n * sizeof(float), cudaMemcpyHostToDevice);
  const unsigned threads = 256, blocks = unsigned((n / 2 + threads) / threads);
  convert_pairs<F, Saturate><<<blocks, threads>>>(dv, dout, n);
  const bool ok = cudaMemcpy(host_out, dout, n, cudaMemcpyDeviceToHost) == cudaSuccess;
  cudaFree(dv);
  cudaFree(dout);
  return ok;
}

int main(int argc, char** argv) {
  if (argc != 4) return 2;
  const bool device = std::strcmp(argv[1], "device") == 0;
  if (!device && std::strcmp(argv[1], "soft") != 0) return 2;
  FILE* in = std::fopen(argv[2], "rb");
  if (!in) return 3;
  std::vector<float> v;
  float x;
  while (std::fread(&x, sizeof x, 1, in) == 1) v.push_back(x);
  std::fclose(in);
  const size_t n = v.size();
  std::vector<unsigned char> out((device ? 4 : 2) * n);
  if (device) {
    if (!on_device<Fp8::E4M3FN, true>(v, &out[0]) || !on_device<Fp8::E4M3FN, false>(v, &out[n]) ||
        !on_device<Fp8::E4M3FNUZ, true>(v, &out[2 * n]) || !on_device<Fp8::E4M3FNUZ, false>(v, &out[3 * n]))
      return 6;
  } else {
    for (size_t i = 0; i < n; ++i) {
      out[i] = static_cast<unsigned char>(kvf::fp8_from_float_soft<Fp8::E4M3FN>(v[i]));
      out[n + i] = static_cast<unsigned char>(kvf::fp8_from_float_soft<Fp8::E4M3FNUZ>(v[i]));
    }
  }
  FILE* o = std::fopen(argv[3], "wb");
  if (!o || std::fwrite(out.data(), 1, out.size(), o) != out.size()) return 4;
  return std::fclose(o) == 0 ? 0 : 5;
}
