// Host harness for the kernels' software FP8 conversion (include/kvforge/hip_compat.h):
// reads float32 values from argv[1], writes the e4m3fn codes then the e4m3fnuz codes to
// argv[2]. Driven by tests/test_fp8_soft.py.
#include <cstdio>
#include <vector>

#include "kvforge/hip_compat.h"

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  FILE* in = std::fopen(argv[1], "rb");
  if (!in) return 3;
  std::vector<float> v;
  float x;
  while (std::fread(&x, sizeof x, 1, in) == 1) v.push_back(x);
  std::fclose(in);
  std::vector<unsigned char> out(2 * v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    out[i] = static_cast<unsigned char>(kvf::fp8_from_float_soft<kvf::Fp8::E4M3FN>(v[i]));
    out[v.size() + i] = static_cast<unsigned char>(kvf::fp8_from_float_soft<kvf::Fp8::E4M3FNUZ>(v[i]));
  }
  FILE* o = std::fopen(argv[2], "wb");
  if (!o || std::fwrite(out.data(), 1, out.size(), o) != out.size()) return 4;
  return std::fclose(o) == 0 ? 0 : 5;
}
