// Harness for the kernels' FP8 conversion (kvf::fp8x2_from_float in
// include/kvforge/hip_compat.h): reads float32 values from argv[2] and writes their codes
// to argv[3]: e4m3fn saturating, e4m3fn passthrough, e4m3fnuz saturating, e4m3fnuz
// passthrough, each for every value. Mode argv[1]: `host` (the software routine, which
// every target without a converter for a flavour runs) or `device` (on the GPU, the
// kernels' own path: the target's converter where it has one). Driven by tests/test_fp8.py.
#include <cstdio>
#include <cstring>
#include <vector>

#include "kvforge/hip_compat.h"

using kvf::Fp8;

// Values i and i + 1 (i even) as one pair: the high byte is the second value's code.
template <Fp8 F, bool Saturate>
KVF_HOST_DEVICE void convert_pair(const float* v, unsigned char* out, size_t n, size_t i) {
  const uint32_t r = kvf::fp8x2_from_float<F, Saturate>(v[i], i + 1 < n ? v[i + 1] : 0.0f);
  out[i] = static_cast<unsigned char>(r & 0xffu);
  if (i + 1 < n) out[i + 1] = static_cast<unsigned char>(r >> 8);
}

template <Fp8 F, bool Saturate>
__global__ void convert_pairs(const float* v, unsigned char* out, size_t n) {
  const size_t i = 2 * (size_t(blockIdx.x) * blockDim.x + threadIdx.x);
  if (i < n) convert_pair<F, Saturate>(v, out, n, i);
}

template <Fp8 F, bool Saturate>
static bool convert(bool device, const std::vector<float>& v, unsigned char* out) {
  const size_t n = v.size();
  if (!device) {
    for (size_t i = 0; i < n; i += 2) convert_pair<F, Saturate>(v.data(), out, n, i);
    return true;
  }
  float* dv = nullptr;
  unsigned char* dout = nullptr;
  if (cudaMalloc(&dv, n * sizeof(float)) != cudaSuccess || cudaMalloc(&dout, n) != cudaSuccess) return false;
  cudaMemcpy(dv, v.data(), n * sizeof(float), cudaMemcpyHostToDevice);
  const unsigned threads = 256, blocks = unsigned((n / 2 + threads) / threads);
  convert_pairs<F, Saturate><<<blocks, threads>>>(dv, dout, n);
  const bool ok = cudaMemcpy(out, dout, n, cudaMemcpyDeviceToHost) == cudaSuccess;
  cudaFree(dv);
  cudaFree(dout);
  return ok;
}

int main(int argc, char** argv) {
  if (argc != 4) return 2;
  const bool device = std::strcmp(argv[1], "device") == 0;
  if (!device && std::strcmp(argv[1], "host") != 0) return 2;
  FILE* in = std::fopen(argv[2], "rb");
  if (!in) return 3;
  std::vector<float> v;
  float x;
  while (std::fread(&x, sizeof x, 1, in) == 1) v.push_back(x);
  std::fclose(in);
  const size_t n = v.size();
  std::vector<unsigned char> out(4 * n);
  if (!convert<Fp8::E4M3FN, true>(device, v, &out[0]) || !convert<Fp8::E4M3FN, false>(device, v, &out[n]) ||
      !convert<Fp8::E4M3FNUZ, true>(device, v, &out[2 * n]) ||
      !convert<Fp8::E4M3FNUZ, false>(device, v, &out[3 * n]))
    return 6;
  FILE* o = std::fopen(argv[3], "wb");
  if (!o || std::fwrite(out.data(), 1, out.size(), o) != out.size()) return 4;
  return std::fclose(o) == 0 ? 0 : 5;
}
