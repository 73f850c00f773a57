// The math of the fused prologue (SPEC §1), as small policies a variant's traits select:
// Norm (RmsNorm: Gemma or plain), Rope (NeoX, GPT-J) and Quant (the model dtype, FP8 at a
// scale). A policy sees a thread's values of one head in registers, the dims its lanes
// hold (d0: the first dim of each 8-dim chunk, from the traits' lane map) and, where it
// needs one, a reduction over the head's lanes (Group); it never sees the memory schedule
// (fused_qknorm_rope_cache.cuh), which asks it what to load and when.
#pragma once

#include <type_traits>

#include "kvforge/hip_compat.h"

namespace kvf {

constexpr int kVec = 8;  // model-dtype elements per chunk (16 bytes); a lane holds two

enum class Scale { Unit, PerTensor, PerHead, PerTokenHead };

// ---- element packing -----------------------------------------------------------------
template <class M>
KVF_DEVICE void unpack8(const uint4& raw, float (&f)[kVec]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = M::to_float(w[i] & 0xffffu);
    f[2 * i + 1] = M::to_float(w[i] >> 16);
  }
}

template <class M>
KVF_DEVICE void pack_model(const float (&f)[kVec], uint32_t (&w)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = M::from_float(f[2 * i]) | (M::from_float(f[2 * i + 1]) << 16);
}

// A store's words, or zeros where its token has none to store (selected in place: into
// copies, they spilled).
template <int N>
KVF_DEVICE void zero_if(bool zero, uint32_t (&w)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j) w[j] = zero ? 0u : w[j];
}

// Division by a per-token scale s as AITER's per-token quantization divides (IEEE), without
// a division per value: q0 = f * r with r = 1 / s rounded, the residual q0 s - f by one
// fma and the correction by another (a multiply and two fmas a value). Markstein's theorem
// makes that the correctly rounded quotient wherever the residual is exact (s >= 2^-90:
// every quotient of 2^-13 or more; smaller ones are 0 in FP8 either way, so the FP8 codes
// equal IEEE division's). That fast path takes a whole head whose s lies in [2^-90, big),
// where big (the quantization's) keeps every value finite: an fp16 K rounded past 65504
// to +-inf would make the residual NaN. A head outside it (tiny values, a huge or infinite
// s) takes the careful path: values scaled by m = 2^64 first (exactly) where s < 2^-90,
// and a quotient f * r, uncorrected, where f or s is infinite or s is 0 (f / inf, inf / s,
// f / 0). A branch of the whole head, not a select per value, as the kernel issues
// instructions about two cycles in three (ncu, PERF.md s32). Made once per token and head.
struct Divisor {
  float s;          // the scale
  float m, r, sc;   // the values' factor (1 or 2^64), 1 / (s m) rounded, s m (0 for an infinite s)
  bool fast;        // the head's quotients take the fast path
  static KVF_HOST_DEVICE float factor(float s) { return s < 0x1p-90f ? 0x1p64f : 1.0f; }
  KVF_HOST_DEVICE Divisor(float scale, float big)
      : s(scale), m(factor(scale)), r(1.0f / (scale * factor(scale))) {
    const float sm = s * m;
    sc = sm <= 0x1p126f ? sm : 0.0f;  // 0 only for an infinite s
    fast = m == 1.0f && s < big;
  }
  template <int N>
  KVF_HOST_DEVICE void divide(float (&q)[N]) const {
    if (fast) {
#pragma unroll
      for (int j = 0; j < N; ++j) q[j] = quotient(q[j]);
    } else {
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const float x = q[j] * m;
        q[j] = sc > 0.0f && fabsf(x) <= 0x1.fffffep127f ? quotient(x) : x * r;
      }
    }
  }
  // The residual taken as q0 s - x, so a zero quotient keeps x's sign (-0 / s is -0).
  KVF_HOST_DEVICE float quotient(float x) const {
    const float q0 = x * r;
    return fmaf(-fmaf(q0, sc, -x), r, q0);
  }
};

// Values scaled as a store asks: times 1 / scale, or divided by a per-token scale.
template <int N>
KVF_DEVICE void scale_by(float (&q)[N], float inv) {
#pragma unroll
  for (int j = 0; j < N; ++j) q[j] *= inv;
}
template <int N>
KVF_DEVICE void scale_by(float (&q)[N], const Divisor& d) { d.divide(q); }

// Values already scaled, to FP8, saturating to the format's max or (passthrough) with
// out-of-range values as NaN.
template <Fp8 F, bool Saturate>
KVF_DEVICE void pack_fp8(const float (&q)[kVec], uint32_t (&w)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    w[i] = fp8x2_from_float<F, Saturate>(q[4 * i], q[4 * i + 1]) |
           (fp8x2_from_float<F, Saturate>(q[4 * i + 2], q[4 * i + 3]) << 16);
  }
}

// The largest magnitude of N values, as a tree of maxima (the values' order of
// comparison does not change a maximum).
template <int N>
KVF_DEVICE float abs_max(const float* v) {
  if constexpr (N == 1) return fabsf(v[0]);
  else return fmaxf(abs_max<N / 2>(v), abs_max<N - N / 2>(v + N / 2));
}

// ---- Norm -----------------------------------------------------------------------------
// RMSNorm of a head, fp32: x * rsqrt(mean(x^2) + eps) * factor(w). A lane sums its 16
// squares in sequence (one fma each, in its chunks' order), then `group` adds the lanes
// (runtime/reference.py: sum_of_squares, in the same order).
template <bool kGemma>
struct RmsNorm {
  static KVF_DEVICE float factor(float w) { return kGemma ? 1.0f + w : w; }

  // 1 / rms of the head whose chunks x[s][i] (chunk i of lane s) a thread holds.
  template <int kHeadDim, int kSub, class Group>
  static KVF_DEVICE float inv_rms(const float (&x)[kSub][2][kVec], const Group& group, float eps) {
    float ss[kSub];
#pragma unroll
    for (int s = 0; s < kSub; ++s) {
      ss[s] = 0.f;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) ss[s] = fmaf(x[s][i][j], x[s][i][j], ss[s]);
      }
    }
    return 1.0f / sqrtf(group.sum(ss) / float(kHeadDim) + eps);
  }

  // Lane s's chunks normalized in place (w.get(2s + i, f): chunk i's factors). Called lane
  // by lane just before the lane's rotation and stores: normalizing every lane first kept
  // more values live and made FP8 variants at two lanes per thread spill.
  template <class Factors>
  static KVF_DEVICE void apply(float (&x)[2][kVec], float inv, const Factors& w, int s) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float f[kVec];
      w.get(2 * s + i, f);
#pragma unroll
      for (int j = 0; j < kVec; ++j) x[i][j] = (x[i][j] * inv) * f[j];
    }
  }
};

// ---- Rope -----------------------------------------------------------------------------
// A policy rotates one lane's two chunks (Chunks: their first dims and whether they hold
// rotary dims, from the lane map) at a position whose cos/sin row it loaded ahead (Raw,
// left in flight until apply): Raw load(row, ch), apply(raw, row, lane, ch, n) in place.
// A row is [cos | sin], R values each half R/2. Each output is one fma of its first
// product (the reference rounds the same way).
struct Chunks {
  uint32_t d0[2];
  bool rot[2];
};

// N consecutive cos or sin values as loaded: 8 or 16 bytes for bf16/fp16 (N = 4, 8), 16
// or 32 for fp32, in the fewest vector loads.
template <class CS, int N>
struct CsRun {
  static constexpr int kWords = N * CS::kBytes / 4;
  uint32_t w[kWords];
  KVF_DEVICE void load(const char* p) {
    if constexpr (kWords % 4 == 0) {
#pragma unroll
      for (int i = 0; i < kWords / 4; ++i) {
        const uint4 v = reinterpret_cast<const uint4*>(p)[i];
        w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
      }
    } else {
      static_assert(kWords == 2, "cos/sin run");
      const uint2 v = *reinterpret_cast<const uint2*>(p);
      w[0] = v.x; w[1] = v.y;
    }
  }
  KVF_DEVICE float at(int j) const {
    if constexpr (CS::kBytes == 4) return bits_to_float(w[j]);
    else return CS::to_float(j % 2 ? w[j / 2] >> 16 : w[j / 2] & 0xffffu);
  }
};

struct NoCosSin {};  // a rotation that reads its cos/sin at apply

template <class CS>
KVF_DEVICE float cos_sin_at(const char* row, int i) {
  if constexpr (CS::kBytes == 4) return reinterpret_cast<const float*>(row)[i];
  else return CS::to_float(reinterpret_cast<const uint16_t*>(row)[i]);
}

// NeoX: y_i = n_i c_i - n_{i+h} s_i, y_{i+h} = n_{i+h} c_i + n_i s_i. Where the halves
// are 8-aligned the lane map gives a rotary lane a chunk and its partner (chunk 0 in the
// first half), so it rotates alone; otherwise (kExchange) lanes hold adjacent chunks and
// swap partners by shuffles, every lane of the head calling apply (one lane per thread).
template <class VT>
struct NeoxRope {
  using CS = typename VT::CosSin;
  static constexpr int R = VT::kRotaryDim, HALF = R / 2, LANES = VT::kHeadDim / (2 * kVec);
  static constexpr bool kExchange = VT::Lanes::kExchange;
  static_assert(kExchange == (HALF % kVec != 0), "codegen/lanes.py pairs NeoX partners in a lane when aligned");
  struct Halves {
    CsRun<CS, kVec> c, s;
  };
  using Raw = std::conditional_t<kExchange, NoCosSin, Halves>;

  static KVF_DEVICE Raw load(const char* row, const Chunks& ch) {
    Raw r;
    if constexpr (!kExchange) {
      if (ch.rot[0]) {
        r.c.load(row + ch.d0[0] * CS::kBytes);
        r.s.load(row + (HALF + ch.d0[0]) * CS::kBytes);
      }
    }
    return r;
  }
  static KVF_DEVICE void apply(const Raw& r, const char* row, int lane, const Chunks& ch,
                               float (&n)[2][kVec]) {
    if constexpr (!kExchange) {
      if (!ch.rot[0]) return;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float c = r.c.at(j), s = r.s.at(j), a = n[0][j], b = n[1][j];
        n[0][j] = fmaf(a, c, -(b * s));
        n[1][j] = fmaf(b, c, a * s);
      }
    } else {
      // Lane l holds dims [16l, 16l + 16). HALF = 16q + r: the partner of element j sits
      // q or q + 1 lanes away, at an element index known at compile time (one exchange
      // for each direction per element). Rare, so cos/sin are read here, value by value.
      constexpr int E = 2 * kVec, kQ = HALF / E, kR = HALF % E;
      auto clamp = [](int l) { return l < 0 ? 0 : (l >= LANES ? LANES - 1 : l); };
      float x[E];
#pragma unroll
      for (int j = 0; j < E; ++j) x[j] = n[j / kVec][j % kVec];
#pragma unroll
      for (int j = 0; j < E; ++j) {
        // Up: the partner of a first-half dim; down: of a second-half dim.
        const float up = shfl<LANES>(x[(j + kR) % E], clamp(j + kR < E ? lane + kQ : lane + kQ + 1));
        const float down = shfl<LANES>(x[(j - kR + E) % E], clamp(j >= kR ? lane - kQ : lane - kQ - 1));
        const int e = lane * E + j;
        float& out = n[j / kVec][j % kVec];
        if (e < HALF) out = fmaf(x[j], cos_sin_at<CS>(row, e), -(up * cos_sin_at<CS>(row, HALF + e)));
        else if (e < R) out = fmaf(x[j], cos_sin_at<CS>(row, e - HALF), down * cos_sin_at<CS>(row, e));
      }
    }
  }
};

// GPT-J: pairs (2i, 2i + 1) at c_i, s_i: y_2i = n_2i c_i - n_2i+1 s_i, y_2i+1 = n_2i+1 c_i
// + n_2i s_i. A pair never leaves its chunk, so each chunk rotates on its own, its 4 cos
// and 4 sin values loaded as two vectors. Chunk 1 of a rotary lane starts kRotaryStep dims
// after chunk 0 (the lane map), so all four loads take one address and constant offsets,
// and where a lane rotates both chunks or neither (kTogether), one test guards them, as
// NeoX's two. A rotary dim that is not a multiple of 8 ends inside a chunk and leaves the
// sin half unaligned: cos/sin then come value by value.
template <class VT>
struct GptjRope {
  using CS = typename VT::CosSin;
  using Lanes = typename VT::Lanes;
  static constexpr int R = VT::kRotaryDim, HALF = R / 2;
  static constexpr bool kVectors = R % kVec == 0;
  static constexpr bool kTogether = Lanes::rotary_lanes(0) == Lanes::rotary_lanes(1);
  static constexpr int kStepBytes = Lanes::kRotaryStep / 2 * CS::kBytes, kSinBytes = HALF * CS::kBytes;
  struct Pairs {
    CsRun<CS, kVec / 2> c[2], s[2];
  };
  using Raw = std::conditional_t<kVectors, Pairs, NoCosSin>;

  // Chunk i rotates: chunk 1 holds rotary dims only where chunk 0 does (they are a prefix).
  static KVF_DEVICE bool rotates(const Chunks& ch, int i) { return kTogether ? ch.rot[0] : ch.rot[i]; }

  static KVF_DEVICE Raw load(const char* row, const Chunks& ch) {
    Raw r{};
    if constexpr (kVectors) {
      const char* p = row + ch.d0[0] / 2 * CS::kBytes;
      if (ch.rot[0]) {
        r.c[0].load(p);
        r.s[0].load(p + kSinBytes);
        if (rotates(ch, 1)) {
          r.c[1].load(p + kStepBytes);
          r.s[1].load(p + kStepBytes + kSinBytes);
        }
      }
    }
    return r;
  }
  static KVF_DEVICE void apply(const Raw& r, const char* row, int, const Chunks& ch, float (&n)[2][kVec]) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (!rotates(ch, i)) continue;
#pragma unroll
      for (int k = 0; k < kVec / 2; ++k) {
        float c, s;
        if constexpr (kVectors) {
          c = r.c[i].at(k);
          s = r.s[i].at(k);
        } else {
          const int p = int(ch.d0[i]) / 2 + k;  // the pair's cos/sin index
          if (p >= HALF) break;
          c = cos_sin_at<CS>(row, p);
          s = cos_sin_at<CS>(row, HALF + p);
        }
        const float a = n[i][2 * k], b = n[i][2 * k + 1];
        n[i][2 * k] = fmaf(a, c, -(b * s));
        n[i][2 * k + 1] = fmaf(b, c, a * s);
      }
    }
  }
};

// ---- Quant ----------------------------------------------------------------------------
// How a chunk of values is stored: pack<kFromRounded>(y, bits, k, w) gives the words of
// its 8 elements (kBytes each) from the fp32 values y or, kFromRounded, from their
// model-dtype rounding `bits` (SPEC §1: round_before_quant), scaled by k (Factor): 1 /
// scale(...) or, for a per-token scale (kDynamic), the Divisor dynamic(amax) makes.

// The model dtype: the rounding itself.
template <class M>
struct AsModel {
  static constexpr int kBytes = 2;
  static constexpr bool kDynamic = false;
  using Factor = float;
  static KVF_DEVICE float scale(const float*, uint32_t) { return 1.0f; }
  template <bool kFromRounded>
  static KVF_DEVICE void pack(const float (&)[kVec], const uint32_t (&bits)[4], float, uint32_t (&w)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = bits[i];
  }
};

// FP8 at a scale of the call (per tensor: [1], per head: [nkv]) or 1 (Unit), saturating or
// (passthrough) with out-of-range values as NaN; or (kDynamic, PerTokenHead) at a scale per
// token and head that the schedule computes from the head's amax (`dynamic`: it reduces the
// amax over the head's lanes and writes the scale where the contract's scale cache says).
template <class M, Fp8 F, Scale S, bool kSaturate>
struct AsFp8 {
  static constexpr int kBytes = 1;
  static constexpr bool kDynamic = S == Scale::PerTokenHead;
  using Factor = std::conditional_t<kDynamic, Divisor, float>;
  static KVF_DEVICE float scale(const float* p, uint32_t h) {
    if constexpr (S == Scale::PerTensor) return p[0];
    else if constexpr (S == Scale::PerHead) return p[h];
    else return 1.0f;
  }
  // The scale of a (token, head) whose largest magnitude (of the fp32 values) is amax,
  // which its values are divided by: AITER's fused_qknorm_idxrqknorm, bit for bit (amax /
  // the format's max, 1 for an all-zero head). The quotient by Markstein's correction with
  // the constant 1 / max (exact for a normal amax of 2^-100 or more; else divided).
  // kBig: the scale of an amax of 65504, fp16's largest, past which a value rounded to
  // fp16 may be infinite (Divisor's careful path; bf16 heads that large take it too).
  static constexpr float kBig = 65504.0f / Fp8Format<F>::kMax;
  static KVF_HOST_DEVICE Divisor dynamic(float amax) {
    constexpr float kMax = Fp8Format<F>::kMax, kInv = 1.0f / kMax;
    if (amax >= 0x1p-100f && amax <= 0x1.fffffep127f) {
      const float q = amax * kInv;
      return Divisor(fmaf(fmaf(-q, kMax, amax), kInv, q), kBig);
    }
    return Divisor(amax > 0.0f ? amax / kMax : 1.0f, kBig);
  }
  template <bool kFromRounded>
  static KVF_DEVICE void pack(const float (&y)[kVec], const uint32_t (&bits)[4], const Factor& k,
                              uint32_t (&w)[2]) {
    float q[kVec];
    if constexpr (kFromRounded) {
      unpack8<M>(make_uint4(bits[0], bits[1], bits[2], bits[3]), q);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) q[j] = y[j];
    }
    scale_by(q, k);
    pack_fp8<F, kSaturate>(q, w);
  }
};

}  // namespace kvf
