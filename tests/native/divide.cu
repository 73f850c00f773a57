// Harness for the kernels' per-token FP8 division (kvf::AsFp8<..., PerTokenHead>::dynamic
// and kvf::Divisor in include/kvforge/policies.cuh), built for the host: reads records of
// two float32 values (a head's amax, one of its values x) from argv[1] and writes four
// float32 per record to argv[2]: the scale dynamic(amax) gives and x divided by it, for
// e4m3fn and then e4m3fnuz. Driven by tests/test_fp8.py.
#include <cstdio>
#include <vector>

#include "kvforge/policies.cuh"

template <kvf::Fp8 F>
static void divide(float amax, float x, float* out) {
  const kvf::Divisor d = kvf::AsFp8<kvf::BF16, F, kvf::Scale::PerTokenHead, true>::dynamic(amax);
  float q[1] = {x};
  d.divide(q);
  out[0] = d.s;
  out[1] = q[0];
}

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  FILE* in = std::fopen(argv[1], "rb");
  if (!in) return 3;
  std::vector<float> v;
  float r[2];
  while (std::fread(r, sizeof r, 1, in) == 1) v.insert(v.end(), r, r + 2);
  std::fclose(in);
  std::vector<float> out(2 * v.size());
  for (size_t i = 0; i < v.size(); i += 2) {
    divide<kvf::Fp8::E4M3FN>(v[i], v[i + 1], &out[2 * i]);
    divide<kvf::Fp8::E4M3FNUZ>(v[i], v[i + 1], &out[2 * i + 2]);
  }
  FILE* o = std::fopen(argv[2], "wb");
  if (!o || std::fwrite(out.data(), sizeof(float), out.size(), o) != out.size()) return 4;
  return std::fclose(o) == 0 ? 0 : 5;
}
