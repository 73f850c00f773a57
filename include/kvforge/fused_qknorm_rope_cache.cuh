// The fused MiniMax-M3 attention prologue (SPEC §1-§3), written once for every variant.
//
// A generated source defines a traits struct (constants + the contract's cache offset
// functions) and instantiates `kvf::launch<Traits>`. Nothing in here knows a layout by
// name: cache addresses come from Traits::{K,V,Index}::offset, vector widths from the
// layout analysis in codegen/layout.py.
//
// Work split: a flat index space of 16-byte lanes. One head of D dims is D/8 adjacent
// lanes ("a group"); groups never straddle a warp or wave, so the RMSNorm reduction and
// the RoPE partner exchange are shuffles inside the group. Each thread keeps kUnroll
// independent 16-byte loads in flight. V of a layout that scatters one token's dims
// (SHUFFLE) is written by a second loop in which a lane owns `slot_vec` consecutive
// tokens of one dim chunk and transposes them in registers into whole 16-byte stores.
#pragma once

#include "kvforge/abi.h"
#include "kvforge/hip_compat.h"

namespace kvf {

enum class IndexMode { Full, Skip, None };
enum class Scale { None, Unit, PerTensor, PerHead };

constexpr int kVec = 8;       // model-dtype elements per lane (16 bytes)
constexpr int kBlock = 256;
constexpr int kUnroll = 4;    // independent items per thread per iteration

// n / d for n < 2^31 by multiply-high (set up on the host).
struct FastDiv {
  uint32_t mul, shift;
  KVF_DEVICE uint32_t div(uint32_t n) const { return (__umulhi(n, mul) + n) >> shift; }
};

inline FastDiv make_fastdiv(uint32_t d) {
  uint32_t shift = 0;
  while ((1ull << shift) < d) ++shift;
  const uint64_t mul = ((1ull << 32) * ((1ull << shift) - d)) / d + 1;
  return FastDiv{static_cast<uint32_t>(mul), shift};
}

struct Dims {
  FastDiv heads_div;          // item -> (token, head) in the main loop
  int32_t heads;              // heads per token handled by the main loop
  int64_t total_main;         // lanes in the main loop
  int64_t total_v;            // lanes in the transposed-V loop
  int64_t v_tokens;           // tokens that may write K/V: min(T, num_slots)
};

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

// Round every value to the model dtype (the unfused path's q_out / K / index_k).
template <class M>
KVF_DEVICE void round_to_model(const float (&f)[kVec], float (&r)[kVec], uint32_t (&w)[4]) {
  pack_model<M>(f, w);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    r[2 * i] = M::to_float(w[i] & 0xffffu);
    r[2 * i + 1] = M::to_float(w[i] >> 16);
  }
}

// value * inv_scale, clamped to the format's max when saturating, to FP8.
template <Fp8 F, bool Saturate>
KVF_DEVICE void pack_fp8(const float (&f)[kVec], float inv_scale, uint32_t (&w)[2]) {
  constexpr float kMax = Fp8Format<F>::kMax;
  float v[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    v[j] = f[j] * inv_scale;
    if constexpr (Saturate) v[j] = fminf(fmaxf(v[j], -kMax), kMax);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    w[i] = fp8x2_from_float<F, Saturate>(v[4 * i], v[4 * i + 1]) |
           (fp8x2_from_float<F, Saturate>(v[4 * i + 2], v[4 * i + 3]) << 16);
  }
}

// Element `j` (ElemBytes wide) of a packed word array.
template <int ElemBytes>
KVF_DEVICE uint32_t elem_of(const uint32_t* w, int j) {
  constexpr int kPerWord = 4 / ElemBytes;
  constexpr uint32_t kMask = ElemBytes == 1 ? 0xffu : 0xffffu;
  return (w[j / kPerWord] >> (8 * ElemBytes * (j % kPerWord))) & kMask;
}

// Store NB bytes taken from `w` at byte offset `at` (both compile-time after unrolling).
template <int NB>
KVF_DEVICE void store_bytes(void* p, const uint32_t* w, int at) {
  if constexpr (NB == 16) {
    *reinterpret_cast<uint4*>(p) = make_uint4(w[at / 4], w[at / 4 + 1], w[at / 4 + 2], w[at / 4 + 3]);
  } else if constexpr (NB == 8) {
    *reinterpret_cast<uint2*>(p) = make_uint2(w[at / 4], w[at / 4 + 1]);
  } else if constexpr (NB == 4) {
    *reinterpret_cast<uint32_t*>(p) = w[at / 4];
  } else if constexpr (NB == 2) {
    *reinterpret_cast<uint16_t*>(p) = static_cast<uint16_t>(elem_of<2>(w, at / 2));
  } else {
    static_assert(NB == 1, "store width");
    *reinterpret_cast<uint8_t*>(p) = static_cast<uint8_t>(elem_of<1>(w, at));
  }
}

// Write one lane's 8 dims [d0, d0+8) of one (slot, head) into a cache, in vectors of
// C::kDVec elements (the widest the layout keeps contiguous along d).
template <class C>
KVF_DEVICE void store_dims(const kvf_cache_t& c, int64_t slot, uint32_t h, uint32_t d0,
                           const uint32_t* w) {
  constexpr int kW = C::kDVec;
  constexpr int kNB = kW * C::kElemBytes;
  const int64_t page = slot / C::kPageSize;
  const uint32_t off = static_cast<uint32_t>(slot % C::kPageSize);
  char* base = static_cast<char*>(c.data);
#pragma unroll
  for (int m = 0; m < kVec / kW; ++m) {
    const int64_t e = C::offset(c, page, off, h, d0 + m * kW);
    store_bytes<kNB>(base + e * C::kElemBytes, w, m * kNB);
  }
}

template <class C>
KVF_DEVICE bool slot_ok(const kvf_cache_t& c, int64_t slot) {
  return slot >= 0 && slot < c.capacity;
}

template <class C, Scale S>
KVF_DEVICE float inv_scale(const float* scale, uint32_t h) {
  if constexpr (S == Scale::PerTensor) return 1.0f / scale[0];
  else if constexpr (S == Scale::PerHead) return 1.0f / scale[h];
  else return 1.0f;
}

template <class VT>
struct Fused {
  using M = typename VT::Model;
  using CS = typename VT::CosSin;
  static constexpr int D = VT::kHeadDim;
  static constexpr int LPH = D / kVec;             // lanes per head
  static constexpr int R = VT::kRotaryDim;
  static constexpr int HALF = R / 2;
  static constexpr int NKV = VT::kNumKvHeads;
  static constexpr bool kIndex = VT::kIndexMode == IndexMode::Full;
  static constexpr bool kRowHasIndex = VT::kIndexMode != IndexMode::None;
  static constexpr bool kKvFp8 = VT::kKvScale != Scale::None;
  static constexpr bool kVTransposed = VT::V::kDVec == 1 && VT::V::kSlotVec > 1;
  static_assert(LPH >= 2 && LPH <= 32 && (LPH & (LPH - 1)) == 0, "head_dim");
  static_assert(R % 2 == 0 && R <= D, "rotary_dim");

  enum Kind { kQ, kK, kV, kIQ, kIK };

  static int heads_main(int nq, int niq) {
    return nq + NKV + (kVTransposed ? 0 : NKV) + (kIndex ? niq + 1 : 0);
  }

  static KVF_DEVICE uint4 load16(const void* p) { return *reinterpret_cast<const uint4*>(p); }

  // 8 cos and 8 sin values for rotary index i0 (8-aligned) of position `pos`.
  static KVF_DEVICE void load_cos_sin(const void* cs, int64_t pos, int i0, float (&c)[kVec],
                                      float (&s)[kVec]) {
    if constexpr (CS::kBytes == 4) {
      const float* row = static_cast<const float*>(cs) + pos * R;
      const float4 c0 = *reinterpret_cast<const float4*>(row + i0);
      const float4 c1 = *reinterpret_cast<const float4*>(row + i0 + 4);
      const float4 s0 = *reinterpret_cast<const float4*>(row + HALF + i0);
      const float4 s1 = *reinterpret_cast<const float4*>(row + HALF + i0 + 4);
      const float cv[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
      const float sv[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
#pragma unroll
      for (int j = 0; j < kVec; ++j) { c[j] = cv[j]; s[j] = sv[j]; }
    } else {
      const uint16_t* row = static_cast<const uint16_t*>(cs) + pos * R;
      unpack8<CS>(load16(row + i0), c);
      unpack8<CS>(load16(row + HALF + i0), s);
    }
  }

  static KVF_DEVICE float cos_sin_at(const void* cs, int64_t pos, int i) {
    if constexpr (CS::kBytes == 4) return static_cast<const float*>(cs)[pos * R + i];
    else return CS::to_float(static_cast<const uint16_t*>(cs)[pos * R + i]);
  }

  // Partial NeoX rotation of one lane's dims [lane*8, lane*8+8) of a normalized head.
  // Dim e < HALF pairs with e + HALF. All lanes of the group must call this.
  static KVF_DEVICE void rope(const void* cs, int64_t pos, int lane, const float (&n)[kVec],
                              float (&y)[kVec]) {
    constexpr int kQ8 = HALF / kVec, kR8 = HALF % kVec;
    if constexpr (kR8 == 0) {
      // Partners sit exactly kQ8 lanes away: one exchange of 8 values.
      const bool first = lane < kQ8, rot = lane < 2 * kQ8;
      const int src = first ? lane + kQ8 : (rot ? lane - kQ8 : lane);
      float p[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) p[j] = shfl<LPH>(n[j], src);
      if (!rot) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) y[j] = n[j];
        return;
      }
      float c[kVec], s[kVec];
      load_cos_sin(cs, pos, (first ? lane : lane - kQ8) * kVec, c, s);
#pragma unroll
      for (int j = 0; j < kVec; ++j)
        y[j] = first ? n[j] * c[j] - p[j] * s[j] : n[j] * c[j] + p[j] * s[j];
    } else {
      // Rotary halves not aligned to 8 dims (e.g. rotary_dim 36): a partner may sit in
      // either of two lanes each way; which element is compile-time per j.
      auto clamp = [](int l) { return l < 0 ? 0 : (l >= LPH ? LPH - 1 : l); };
      float pa[kVec], pb[kVec], ma[kVec], mb[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        pa[j] = shfl<LPH>(n[j], clamp(lane + kQ8));
        pb[j] = shfl<LPH>(n[j], clamp(lane + kQ8 + 1));
        ma[j] = shfl<LPH>(n[j], clamp(lane - kQ8));
        mb[j] = shfl<LPH>(n[j], clamp(lane - kQ8 - 1));
      }
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const int e = lane * kVec + j;
        if (e < HALF) {
          const float p = j + kR8 < kVec ? pa[(j + kR8) % kVec] : pb[(j + kR8) % kVec];
          y[j] = n[j] * cos_sin_at(cs, pos, e) - p * cos_sin_at(cs, pos, HALF + e);
        } else if (e < R) {
          const float p = j >= kR8 ? ma[(j - kR8 + kVec) % kVec] : mb[(j - kR8 + kVec) % kVec];
          y[j] = n[j] * cos_sin_at(cs, pos, e - HALF) + p * cos_sin_at(cs, pos, e);
        } else {
          y[j] = n[j];
        }
      }
    }
  }

  // K or V values (fp32) of one lane into a KV cache, quantized as the variant says.
  template <class C, Scale S>
  static KVF_DEVICE void put_kv(const kvf_cache_t& c, const float* scale, int64_t slot, uint32_t h,
                                uint32_t d0, const float (&v)[kVec], const uint32_t (&model_bits)[4]) {
    if constexpr (kKvFp8) {
      uint32_t w[2];
      pack_fp8<VT::kFp8, VT::kSaturateKv>(v, inv_scale<C, S>(scale, h), w);
      store_dims<C>(c, slot, h, d0, w);
    } else {
      store_dims<C>(c, slot, h, d0, model_bits);
    }
  }

  static KVF_DEVICE void main_loop(const kvf_args_t& a, const Dims& dims) {
    const int64_t nthreads = int64_t(gridDim.x) * blockDim.x;
    const int64_t gt = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    const int lane = threadIdx.x % LPH;
    const int nq = a.num_heads, niq = a.num_index_heads;
    for (int64_t base = gt; base < dims.total_main; base += nthreads * kUnroll) {
      uint4 raw[kUnroll];
      int64_t tok[kUnroll], pos[kUnroll], slot[kUnroll];
      int kind[kUnroll], head[kUnroll];
      bool live[kUnroll];
      // Issue every load of the kUnroll items before any math.
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t idx = base + int64_t(u) * nthreads;
        live[u] = idx < dims.total_main;
        const uint32_t item = live[u] ? static_cast<uint32_t>(idx / LPH) : 0u;
        const uint32_t t = dims.heads_div.div(item);
        const int hm = static_cast<int>(item - t * static_cast<uint32_t>(dims.heads));
        int row_head = hm;
        if (hm < nq) { kind[u] = kQ; head[u] = hm; }
        else if (hm < nq + NKV) { kind[u] = kK; head[u] = hm - nq; }
        else if (!kVTransposed && hm < nq + 2 * NKV) { kind[u] = kV; head[u] = hm - nq - NKV; }
        else {
          const int j = hm - nq - NKV - (kVTransposed ? 0 : NKV);
          row_head = nq + 2 * NKV + j;
          kind[u] = j < niq ? kIQ : kIK;
          head[u] = j < niq ? j : 0;
        }
        tok[u] = t;
        const char* src = static_cast<const char*>(a.qkv) +
                          (int64_t(t) * a.qkv_row_stride + int64_t(row_head) * D + lane * kVec) * 2;
        raw[u] = live[u] ? load16(src) : make_uint4(0u, 0u, 0u, 0u);
        pos[u] = live[u] && kind[u] != kV ? a.positions[t] : 0;
        const bool kv = kind[u] == kK || kind[u] == kV;
        const int64_t* slots = kv ? a.slot_mapping : a.index_slot_mapping;
        const int64_t nslots = kv ? a.num_slots : a.num_index_slots;
        slot[u] = live[u] && (kv || kind[u] == kIK) && int64_t(t) < nslots ? slots[t] : -1;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) process(a, lane, live[u], kind[u], head[u], tok[u], pos[u],
                                                slot[u], raw[u]);
    }
  }

  static KVF_DEVICE void process(const kvf_args_t& a, int lane, bool live, int kind, int head,
                                 int64_t t, int64_t pos, int64_t slot, const uint4& raw) {
    const uint32_t d0 = lane * kVec;
    float f[kVec];
    unpack8<M>(raw, f);
    if (kind == kV) {
      if (!live || !slot_ok<typename VT::V>(a.v_cache, slot)) return;
      const uint32_t bits[4] = {raw.x, raw.y, raw.z, raw.w};
      put_kv<typename VT::V, VT::kKvScale>(a.v_cache, a.v_scale, slot, head, d0, f, bits);
      return;
    }
    // RMSNorm over the head: the group's lanes reduce by butterfly.
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < kVec; ++j) ss += f[j] * f[j];
#pragma unroll
    for (int m = LPH / 2; m >= 1; m /= 2) ss += shfl_xor<LPH>(ss, m);
    const float inv = 1.0f / sqrtf(ss / float(D) + a.eps);
    const void* wp = kind == kQ ? a.q_norm_weight : kind == kK ? a.k_norm_weight
                   : kind == kIQ ? a.index_q_norm_weight : a.index_k_norm_weight;
    float w[kVec], n[kVec], y[kVec];
    unpack8<M>(load16(static_cast<const uint16_t*>(wp) + d0), w);
#pragma unroll
    for (int j = 0; j < kVec; ++j) n[j] = (f[j] * inv) * (VT::kGemma ? 1.0f + w[j] : w[j]);
    // Positions outside the cos/sin table write nothing (checked mode raises instead).
    const bool pos_ok = pos >= 0 && pos < a.max_pos;
    rope(a.cos_sin, pos_ok ? pos : 0, lane, n, y);
    if (!live || !pos_ok) return;
    float r[kVec];
    uint32_t bits[4];
    round_to_model<M>(y, r, bits);
    if (kind == kQ) {
      char* dst = static_cast<char*>(a.q_out) + ((t * a.num_heads + head) * D + d0) * 2;
      store_bytes<16>(dst, bits, 0);
    } else if (kind == kK) {
      if (slot_ok<typename VT::K>(a.k_cache, slot))
        put_kv<typename VT::K, VT::kKvScale>(a.k_cache, a.k_scale, slot, head, d0,
                                             VT::kRoundBeforeQuant ? r : y, bits);
    } else if (kind == kIQ) {
      char* base = static_cast<char*>(a.index_q_out);
      const int64_t e = (t * a.num_index_heads + head) * D + d0;
      if constexpr (VT::kIndexFp8) {
        uint32_t q[2];
        pack_fp8<VT::kFp8, true>(y, 1.0f, q);  // straight from fp32
        store_bytes<8>(base + e, q, 0);
      } else {
        store_bytes<16>(base + e * 2, bits, 0);
      }
    } else if (slot_ok<typename VT::Index>(a.index_cache, slot)) {
      if constexpr (VT::kIndexFp8) {
        uint32_t q[2];
        pack_fp8<VT::kFp8, true>(VT::kRoundBeforeQuant ? r : y, 1.0f, q);
        store_dims<typename VT::Index>(a.index_cache, slot, 0, d0, q);
      } else {
        store_dims<typename VT::Index>(a.index_cache, slot, 0, d0, bits);
      }
    }
  }

  // V for layouts whose 16-byte runs span tokens: a lane owns TG consecutive tokens of
  // one 8-dim chunk. When those tokens sit on consecutive aligned slots of one page (a
  // prefill run), each dim's TG values leave as one store; otherwise (decode, padding,
  // shuffled slots) each value is stored alone.
  static KVF_DEVICE void v_loop(const kvf_args_t& a, const Dims& dims) {
    using C = typename VT::V;
    constexpr int TG = C::kSlotVec, EB = C::kElemBytes, NB = TG * EB;
    constexpr int kWords = kVec * EB / 4;                  // packed words per token
    const int64_t nthreads = int64_t(gridDim.x) * blockDim.x;
    const int lane = threadIdx.x % LPH;
    const uint32_t d0 = lane * kVec;
    for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < dims.total_v;
         idx += nthreads) {
      const int64_t item = idx / LPH;
      const uint32_t h = static_cast<uint32_t>(item % NKV);
      const int64_t t0 = (item / NKV) * TG;
      const int64_t col = int64_t(a.num_heads + NKV + h) * D + d0;
      uint4 raw[TG];
      int64_t slot[TG];
#pragma unroll
      for (int k = 0; k < TG; ++k) {
        const bool ok = t0 + k < dims.v_tokens;
        raw[k] = ok ? load16(static_cast<const char*>(a.qkv) + ((t0 + k) * a.qkv_row_stride + col) * 2)
                    : make_uint4(0u, 0u, 0u, 0u);
        slot[k] = ok ? a.slot_mapping[t0 + k] : -1;
      }
      uint32_t w[TG][kWords];
#pragma unroll
      for (int k = 0; k < TG; ++k) {
        if constexpr (kKvFp8) {
          float f[kVec];
          unpack8<M>(raw[k], f);
          uint32_t q[2];
          pack_fp8<VT::kFp8, VT::kSaturateKv>(f, inv_scale<C, VT::kKvScale>(a.v_scale, h), q);
          w[k][0] = q[0];
          w[k][1] = q[1];
        } else {
          w[k][0] = raw[k].x; w[k][1] = raw[k].y; w[k][2] = raw[k].z; w[k][3] = raw[k].w;
        }
      }
      bool run = slot[0] >= 0 && slot[0] % TG == 0 && slot[0] + TG <= a.v_cache.capacity;
#pragma unroll
      for (int k = 1; k < TG; ++k) run = run && slot[k] == slot[0] + k;
      char* base = static_cast<char*>(a.v_cache.data);
      if (run) {
        const int64_t page = slot[0] / C::kPageSize;
        const uint32_t off = static_cast<uint32_t>(slot[0] % C::kPageSize);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          uint32_t out[(NB + 3) / 4];
#pragma unroll
          for (int i = 0; i < (NB + 3) / 4; ++i) out[i] = 0u;
#pragma unroll
          for (int k = 0; k < TG; ++k)
            out[k * EB / 4] |= elem_of<EB>(w[k], j) << (8 * ((k * EB) % 4));
          store_bytes<NB>(base + C::offset(a.v_cache, page, off, h, d0 + j) * EB, out, 0);
        }
      } else {
#pragma unroll
        for (int k = 0; k < TG; ++k) {
          if (!slot_ok<C>(a.v_cache, slot[k])) continue;
          const int64_t page = slot[k] / C::kPageSize;
          const uint32_t off = static_cast<uint32_t>(slot[k] % C::kPageSize);
#pragma unroll
          for (int j = 0; j < kVec; ++j)
            store_bytes<EB>(base + C::offset(a.v_cache, page, off, h, d0 + j) * EB, w[k], j * EB);
        }
      }
    }
  }
};

template <class VT>
__global__ void __launch_bounds__(kBlock) fused_kernel(const KVF_GRID_CONSTANT kvf_args_t a,
                                                       const Dims dims) {
  Fused<VT>::main_loop(a, dims);
  if constexpr (Fused<VT>::kVTransposed) Fused<VT>::v_loop(a, dims);
}

template <class VT>
int launch(const kvf_args_t* a, void* stream) {
  using F = Fused<VT>;
  if (a->num_tokens <= 0) return 0;
  Dims dims;
  dims.heads = F::heads_main(a->num_heads, a->num_index_heads);
  dims.heads_div = make_fastdiv(static_cast<uint32_t>(dims.heads));
  dims.total_main = int64_t(a->num_tokens) * dims.heads * F::LPH;
  dims.v_tokens = a->num_slots < a->num_tokens ? a->num_slots : a->num_tokens;
  dims.total_v = 0;
  if constexpr (F::kVTransposed) {
    constexpr int TG = VT::V::kSlotVec;
    dims.total_v = (dims.v_tokens + TG - 1) / TG * F::NKV * F::LPH;
  }
  // Items are decoded in 32-bit arithmetic (FastDiv needs n < 2^31).
  if (dims.total_main / F::LPH >= (int64_t(1) << 31)) return int(hipErrorInvalidValue);
  const int64_t main_threads = (dims.total_main + kUnroll - 1) / kUnroll;
  const int64_t want = main_threads > dims.total_v ? main_threads : dims.total_v;
  int64_t blocks = (want + kBlock - 1) / kBlock;
  // At most one wave of resident blocks; the loops stride over the rest.
  static int sm_count[64] = {0};
  static int per_sm = 0;
  int dev = 0;
  if (hipGetDevice(&dev) != hipSuccess) return int(hipGetLastError());
  if (dev < 64 && sm_count[dev] == 0) {
    hipDeviceGetAttribute(&sm_count[dev], hipDeviceAttributeMultiprocessorCount, dev);
    if (per_sm == 0) hipOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fused_kernel<VT>, kBlock, 0);
  }
  const int64_t cap = int64_t(dev < 64 && sm_count[dev] ? sm_count[dev] : 132) * (per_sm > 0 ? per_sm : 1);
  if (blocks > cap) blocks = cap;
  fused_kernel<VT><<<static_cast<unsigned>(blocks), kBlock, 0, static_cast<hipStream_t>(stream)>>>(*a, dims);
  return int(hipGetLastError());
}

}  // namespace kvf
