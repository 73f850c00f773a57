// The fused MiniMax-M3 attention prologue (SPEC §1-§3): one memory schedule for every
// variant, its math the policies its traits select (policies.cuh: Norm, Rope, Quant).
//
// A generated source defines a traits struct (constants, the policies, the lane map and
// the contract's cache offset functions) and instantiates `kvf::launch<Traits>`. Nothing in
// here knows a layout or a rotary style by name: cache addresses come from
// Traits::{K,V,Index}::offset, vector widths from codegen/layout.py, which dims a lane
// holds from codegen/lanes.py (Traits::Lanes).
//
// Work split: a main-loop lane holds two 16-byte chunks of one head, so one head of D dims
// is D/16 lanes, held by as many adjacent threads ("a group") or, at two lanes per thread
// (tuned), half as many; groups never straddle a warp or wave, so a reduction over the head
// is a shuffle butterfly inside the group. Tokens go to threads in tiles of one, two or
// four (tuned; twice that at two lanes), the tile's groups of each head side by side. A
// main-loop thread keeps its head lanes for every token it visits and requests the next
// token's rows (RowPipe) while computing the current; in calls of several passes a
// main-loop K/V head with per-token scales has several groups (kvf_args_t::kv_groups,
// tuned) taking turns at the passes' tokens (Fused::kSplitKv). V of a layout that scatters
// one token's dims (SHUFFLE) goes, in long calls (kvf_args_t::v_loop), to a second loop
// every thread runs after the main one, in which a lane owns up to 8 consecutive tokens of
// one dim chunk and, for prefill runs, transposes them in registers into vector stores
// (whole 16-byte runs are staged in shared memory, where rows come by cp.async, so a store
// instruction writes adjacent vectors); other calls write it in the main loop (a head's row
// staged the same way). AMD stages neither: registers and LDS (see kStageV).
#pragma once

#include <type_traits>

#include "kvforge/abi.h"
#include "kvforge/hip_compat.h"
#include "kvforge/policies.cuh"

namespace kvf {

enum class IndexMode { Full, Skip, None };

// Head lanes per block: a kernel whose threads hold kSub lanes each (1 or 2, see
// Fused::main_loop) has kBlock / kSub threads, so its shared memory is the same.
constexpr int kBlock = 256;
template <int kSub>
constexpr int kThreadsOf = kBlock / kSub;
// Resident blocks per SM the register cap keeps. One lane per thread: three of 256
// threads (80 registers) at every pipeline depth: a thread has few bytes in flight, so the
// SM needs many threads; the cap spills a few words (FP8 KV at head_dim 128: 12-24 bytes;
// more at depth 2 with fp32 cos/sin, where the tuner keeps depth 1), yet two blocks (128
// registers) were slower there (benchmarks/PERF.md, v6.1). Two lanes per thread: four blocks of
// 128 threads (128 registers): 512 threads of two lanes beat 768 of one in a loop of q's
// math (v6.17). HIP reads the bound as waves per SIMD: 2 there is the same 512 threads per
// CU (256 VGPRs); 4 and 3 spilled AMD's row FIFO to scratch on gfx942.
#ifdef KVF_CUDA
constexpr int kMinBlocksTwoLanes = 4;
#else
constexpr int kMinBlocksTwoLanes = 2;
#endif
template <int kSub>
constexpr int kMinBlocksOf = kSub == 1 ? 3 : kMinBlocksTwoLanes;
constexpr int cmin(int a, int b) { return a < b ? a : b; }
// Whether v is 0 or a power of two up to max (launch fields whose 0 means the default).
constexpr bool pow2_upto(int v, int max) { return v >= 0 && v <= max && (v & (v - 1)) == 0; }
// A transposed V (SHUFFLE) goes to the V loop as kvf_args_t::v_loop says (tuned per
// shape), by default from KVF_V_LOOP_MIN_TOKENS tokens on. Decodes have scattered slots,
// where every V value is its own store, best spread over the main loop's many lanes than
// over the V loop's few; a prefill of a few thousand tokens at one kv head finishes sooner
// in one loop than in two (each a dependent trip to memory). benchmarks/PERF.md.

struct Dims {
  int32_t main_kv_heads;      // K and V heads per token in the main loop: 2 nkv, or nkv when V is the V loop's
  int32_t lanes_per_token;    // main loop: threads per token, heads handled * a head's threads
  int32_t tile;               // tokens whose groups of a head sit side by side: tokens_per_tile * lanes (1..8)
  int64_t tokens_per_pass;    // tokens the main loop's threads cover at once (whole tiles)
  int64_t v_tokens;           // tokens that may write K/V: min(T, num_slots)
  int64_t v_groups;           // groups of kVGroup tokens the V loop writes (the last may be partial)
  int32_t kv_copies;          // groups per main-loop K/V head, each taking every kv_copies-th pass's
                              // token (kvf_args_t::kv_groups where Fused::kSplitKv and the call
                              // takes several passes, else 1)
};

// ---- stores ------------------------------------------------------------------------
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

// Whether a slot is in cache c (unsigned, with unsigned pages, FP8 SHUFFLE spilled more: PERF.md s36).
template <class C>
KVF_DEVICE bool slot_ok(const kvf_cache_t& c, int64_t slot) {
  return slot >= 0 && slot < c.capacity;
}

// Element (slot, h, d)'s index in cache C, for a slot slot_ok accepted.
template <class C>
struct SlotAt {
  int64_t page;
  uint32_t off;
  KVF_DEVICE explicit SlotAt(int64_t slot) : page(slot / C::kPageSize), off(uint32_t(slot % C::kPageSize)) {}
  KVF_DEVICE int64_t offset(const kvf_cache_t& c, uint32_t h, uint32_t d) const {
    return C::offset(c, page, off, h, d);
  }
};

// Write one chunk's 8 dims [d0, d0+8) of one (slot, head) into a cache, in vectors of
// C::kDVec elements (the widest the layout keeps contiguous along d).
template <class C>
KVF_DEVICE void store_dims(const kvf_cache_t& c, int64_t slot, uint32_t h, uint32_t d0,
                           const uint32_t* w) {
  constexpr int kW = C::kDVec;
  constexpr int kNB = kW * C::kElemBytes;
  const SlotAt<C> at(slot);
#pragma unroll
  for (int m = 0; m < kVec / kW; ++m)
    store_bytes<kNB>(static_cast<char*>(c.data) + at.offset(c, h, d0 + m * kW) * C::kElemBytes, w, m * kNB);
}

// A thread's 16-byte row chunks per token (two per head lane), requested one token ahead
// of its math (two ahead gained nothing, PERF.md v6.8): fill(k, ...) loads those of the
// token k steps ahead (the prologue's 0, then 1 in each iteration) and close() ends every
// token's request; front() gives the token being computed, pop() ends its iteration.
// With asynchronous copies (NVIDIA sm_80+) the chunks wait in a shared-memory ring of two
// stages, no registers in flight; a stage is refilled one iteration after its reads were
// consumed (the norm's shuffles, the stores) or never used: no copy overtakes a read.
// Elsewhere (AMD, whose copy into LDS is a load and then a store, so it would wait for
// each row) they wait in registers, a FIFO shifted at pop(): a load stays in flight
// through one token's math.
template <int kSub>
struct RowPipe {
  static constexpr int kChunks = 2 * kSub;  // a thread's chunks per token
#if KVF_ASYNC_COPY
  // [stage][chunk * threads + thread]: a warp's copies of one chunk land side by side (no
  // bank conflicts); the same bytes at every kSub (kBlock lanes of two chunks).
  using Ring = uint4[2][2 * kBlock];
  Ring& ring;
  int put = 0, get = 0;

  KVF_DEVICE void fill(int, const char* p, const int (&at)[kChunks]) {
#pragma unroll
    for (int c = 0; c < kChunks; ++c) copy_async16(&ring[put][c * kThreadsOf<kSub> + threadIdx.x], p + at[c]);
  }
  KVF_DEVICE void close() {
    async_commit();  // one group per token, filled or not, so the waits count tokens
    put ^= 1;
  }
  template <bool kSync>  // a sync of the active threads first: see main_loop
  KVF_DEVICE void front(uint4 (&x)[kChunks]) {
    if constexpr (kSync) __syncwarp(__activemask());
    async_wait<1>();  // this token's group has landed
#pragma unroll
    for (int c = 0; c < kChunks; ++c) x[c] = ring[get][c * kThreadsOf<kSub> + threadIdx.x];
  }
  KVF_DEVICE void pop() { get ^= 1; }
#else
  uint4 fifo[2][kChunks];  // fifo[k]: the token k steps ahead of the one computed

  KVF_DEVICE void fill(int k, const char* p, const int (&at)[kChunks]) {
#pragma unroll
    for (int c = 0; c < kChunks; ++c) fifo[k][c] = *reinterpret_cast<const uint4*>(p + at[c]);
  }
  KVF_DEVICE void close() {}
  template <bool>
  KVF_DEVICE void front(uint4 (&x)[kChunks]) {
#pragma unroll
    for (int c = 0; c < kChunks; ++c) x[c] = fifo[0][c];
  }
  KVF_DEVICE void pop() {
#pragma unroll
    for (int c = 0; c < kChunks; ++c) fifo[0][c] = fifo[1][c];
  }
#endif
};

// The sum over a head's lanes of a value each thread holds per sub-lane: sub-lanes s and
// s + kSub / 2 (the lanes LANES / 2 apart, which the butterfly would add first) by the
// thread itself, then a shuffle butterfly over the LN threads of the group, so the sum
// is the same at every kSub, in the same order.
template <int kSub, int LN>
struct HeadGroup {
  KVF_DEVICE float sum(float (&v)[kSub]) const {
    return reduce(v, [](float x, float y) { return x + y; });
  }
  KVF_DEVICE float max(float (&v)[kSub]) const {
    return reduce(v, [](float x, float y) { return fmaxf(x, y); });
  }
  template <class Op>
  KVF_DEVICE float reduce(float (&v)[kSub], Op op) const {
#pragma unroll
    for (int h = kSub / 2; h >= 1; h /= 2) {
#pragma unroll
      for (int s = 0; s < h; ++s) v[s] = op(v[s], v[s + h]);
    }
    float total = v[0];
#pragma unroll
    for (int sh = LN / 2; sh >= 1; sh /= 2) total = op(total, shfl_xor<LN>(total, sh));
    return total;
  }
};

// Write a per-token scale into scale cache C (one fp32 per slot and head) if the slot is in it.
template <class C>
KVF_DEVICE void put_scale(const kvf_cache_t& c, int64_t slot, uint32_t h, float scale) {
  if (slot_ok<C>(c, slot)) static_cast<float*>(c.data)[SlotAt<C>(slot).offset(c, h, 0)] = scale;
}

// A variant's traits for calls with (kKOuts) or without k_out and index_k_out (drop-ins' K in place).
template <class VT, bool kWithKOuts>
struct AsCalled : VT {
  static constexpr bool kKOuts = kWithKOuts;
};

template <class VT>
struct Fused {
  using M = typename VT::Model;
  using Norm = typename VT::Norm;
  using Rope = typename VT::Rope;
  using KvQuant = typename VT::KvQuant;        // K and V
  using IndexQuant = typename VT::IndexQuant;  // index_q_out and the index cache
  using QQuant = typename VT::QQuant;          // q_fp8_out (AsModel: the variant has none)
  using KvFactor = typename KvQuant::Factor;   // what K's and V's stores scale by
  using Lanes = typename VT::Lanes;            // codegen/lanes.py
  static constexpr int D = VT::kHeadDim;
  static constexpr int LPH = D / kVec;             // 8-dim chunks per head (V loop lanes)
  static constexpr int R = VT::kRotaryDim;
  static constexpr int NKV = VT::kNumKvHeads;
  static constexpr bool kIndex = VT::kIndexMode == IndexMode::Full;
  static constexpr bool kKvFp8 = KvQuant::kBytes == 1;
  static constexpr bool kQFp8 = QQuant::kBytes == 1;
  static constexpr bool kVTransposed = VT::V::kTransposed;
  static_assert(LPH >= 2 && pow2_upto(LPH, 32), "head_dim");
  static_assert(R % 2 == 0 && R <= D, "rotary_dim");

  enum Kind { kQ, kK, kV, kIQ, kIK };

  // Whether a main-loop K/V head may have several groups (Dims::kv_copies). Threads all
  // take the same tokens, so the longest path per token sets the loop's time: with
  // per-token scales K's and V's is (amax, its reduction, a reciprocal, a division per
  // value; their warps ran on after q's: ncu, PERF.md s33). n groups of such a head take
  // turns at the passes' tokens, 1/n each; how many pays depends on the shape (tuned:
  // four where V has its own loop at one kv head, PERF.md s55).
  static constexpr bool kSplitKv = KvQuant::kDynamic;

  static int heads_main(int nq, int niq, int main_kv, int copies) {
    return nq + copies * main_kv + (kIndex ? niq + 1 : 0);
  }

  static KVF_DEVICE uint4 load16(const void* p) { return *reinterpret_cast<const uint4*>(p); }

  // Position pos's row of the cos/sin cache.
  static KVF_DEVICE const char* cos_sin_row(const void* cs, int64_t pos) {
    return static_cast<const char*>(cs) + pos * R * VT::CosSin::kBytes;
  }

  // ---- main loop: a lane holds two 8-dim chunks of one head -------------------------
  // Lane l holds chunks Lanes::chunk(l, 0) and (l, 1) and sums their squares in that
  // order. A main-loop thread holds kSub of its head's lanes (kvf_args_t::
  // lanes_per_thread, tuned, at most Lanes::kMaxSub): thread lane l of the head's
  // LN = LANES / kSub holds lanes l + s * LN, s < kSub (HeadGroup adds them in the
  // butterfly's order). Per token, a thread's addresses, position, slot, reciprocal and
  // loop then serve twice the bytes, for half the threads in flight: which pays depends
  // on the shape (PERF.md, v6.17).
  static constexpr int LANES = D / (2 * kVec);  // main-loop lanes per head
  static constexpr int kMaxSub = Lanes::kMaxSub;
  static_assert(LANES >= 1 && pow2_upto(LANES, 32), "head_dim");
  static_assert(kMaxSub == 1 || (kMaxSub == 2 && LANES >= 2 && !Lanes::kExchange), "lanes per thread");
  template <int kSub>
  static constexpr int LN = LANES / kSub;  // thread lanes per head

  // Whether chunk i of sub-lane s of a thread (its thread lane: `lane`) holds rotary dims.
  // The lane map puts those on a head's first lanes, so where all lanes of the sub-lane do
  // or none does this is known at compile time; else it is asked of the lane (not kept:
  // held across the loop, such flags made FP8 variants spill).
  template <int kSub>
  static KVF_DEVICE bool rotates(int s, int i, int lane) {
    constexpr int ln = LN<kSub>;
    const int first = Lanes::rotary_lanes(i);
    if ((s + 1) * ln <= first) return true;
    if (s * ln >= first) return false;
    return lane + s * ln < first;
  }
  template <int kSub>
  static KVF_DEVICE Chunks chunks_of(const uint32_t (&d0)[2 * kSub], int s, int lane) {
    return Chunks{{d0[2 * s], d0[2 * s + 1]}, {rotates<kSub>(s, 0, lane), rotates<kSub>(s, 1, lane)}};
  }

  // A scattered V head goes through shared memory (put_v_by_dim) where rows come by
  // asynchronous copies. With the register pipeline (AMD) the next rows wait in registers
  // across this code: on gfx942 staging took ~38 more VGPRs (130 -> 168, the cap for
  // three blocks) and spilled, so there the lanes store directly (speed unmeasured).
  static constexpr bool kStageV = kVTransposed && KVF_ASYNC_COPY;
  static constexpr int kStageBytes = D * VT::V::kElemBytes + 16;  // a group's row, padded: the
                                                                  // warp's groups read other banks

  // One token's V head into a layout that keeps no two of its dims together (SHUFFLE:
  // each value is its own store, its dims a vector apart). Written as held, a store
  // instruction's lanes would land a chunk (8 vectors) apart, each in its own line; the
  // group instead stages the head's row in shared memory and its lanes write adjacent
  // dims, so each instruction fills whole lines (PERF.md, v6.4). All threads of the group
  // call this (one token, one slot).
  template <int kSub>
  static KVF_DEVICE void put_v_by_dim(const kvf_cache_t& c, const KvFactor& k, int64_t slot, uint32_t h, int lane,
                                      const uint32_t (&d0)[2 * kSub], const uint4 (&x)[2 * kSub],
                                      const float (&f)[kSub][2][kVec]) {
    using C = typename VT::V;
    constexpr int EB = C::kElemBytes, LN = Fused::LN<kSub>;
    __shared__ __align__(16) unsigned char rows[kBlock / LANES][kStageBytes];  // a row per head group
    unsigned char* row = rows[threadIdx.x / LN];
#pragma unroll
    for (int c = 0; c < 2 * kSub; ++c) {
      const uint32_t bits[4] = {x[c].x, x[c].y, x[c].z, x[c].w};
      uint32_t w[2 * EB];
      KvQuant::template pack<false>(f[c / 2][c % 2], bits, k, w);
      store_bytes<8 * EB>(row + d0[c] * EB, w, 0);
    }
    group_sync<LN>();
    const SlotAt<C> at(slot);
    char* base = static_cast<char*>(c.data);
#pragma unroll
    for (int s = 0; s < D / LN; ++s) {
      const uint32_t d = s * LN + lane;
      uint32_t v[1];
      v[0] = EB == 1 ? row[d] : *reinterpret_cast<const uint16_t*>(row + 2 * d);
      store_bytes<EB>(base + at.offset(c, h, d) * EB, v, 0);
    }
    group_sync<LN>();  // every read done before the group's next token overwrites the row
  }

  // What a main-loop thread is: its lanes of one head of the row, the same for every
  // token it visits, so its role, dims and branches are settled once.
  struct Role {
    int kind, head;
  };

  // Output o's chunk at dims d0.. of head `head`'s row at token t: o is the role whose
  // output it is (q_out, k_out, index_q_out, index_k_out) or kQ8 (q_fp8_out). Only k_out,
  // index_k_out and (beside q_fp8_out) q_out may be absent. Base and stride are read from
  // the arguments (constant memory) per store, the offset one widening 32-bit product
  // (validate: row strides whole 16 bytes, under 2^31 elements): held across the loop, or
  // as 64-bit products, they took registers the 80-register cap lacks (PERF.md s32).
  static constexpr int kQ8 = kIK + 1;
  template <int o>
  static KVF_DEVICE void put_row(const kvf_args_t& a, int head, int64_t t, uint32_t d0, const uint32_t* w) {
    constexpr int eb = o == kIQ ? IndexQuant::kBytes : o == kQ8 ? 1 : 2;
    void* const base = o == kQ ? a.q_out : o == kK ? a.k_out : o == kIQ ? a.index_q_out
                     : o == kIK ? a.index_k_out : a.q_fp8_out;
    const int64_t stride = o == kQ ? a.q_out_row_stride : o == kK ? a.k_out_row_stride
                         : o == kIQ ? a.index_q_out_row_stride : o == kIK ? a.index_k_out_row_stride
                                                                          : a.q_fp8_out_row_stride;
    if ((o == kK || o == kIK) && !VT::kKOuts) return;  // the call gives neither (AsCalled)
    if ((o == kK || o == kIK || (o == kQ && kQFp8)) && !base) return;
    const int64_t e = int64_t(int32_t(t)) * int32_t(stride) + ((o == kIK ? 0 : head) * D + d0);
    store_bytes<kVec * eb>(static_cast<char*>(base) + e * eb, w, 0);
  }

  // Main-loop head hm where K/V heads have `copies` groups (the q heads, the K and V heads
  // `copies` times, the index heads): its head with one group each, and its group (`copy`).
  static KVF_DEVICE int one_group(int hm, int nq, int main_kv, int copies, int& copy) {
    copy = 0;
    if constexpr (kSplitKv) {
      const int j = hm - nq;
      if (j >= copies * main_kv) return hm - (copies - 1) * main_kv;
      if (j >= main_kv) {
        copy = j / main_kv;
        return nq + j % main_kv;
      }
    }
    return hm;
  }

  static KVF_DEVICE Role role_of(int hm, int nq, int niq, int main_kv) {
    if (hm < nq) return Role{kQ, hm};
    if (hm < nq + NKV) return Role{kK, hm - nq};
    if (hm < nq + main_kv) return Role{kV, hm - nq - NKV};
    const int j = hm - nq - main_kv;
    return j < niq ? Role{kIQ, j} : Role{kIK, 0};
  }

  // The head of the qkv row that main-loop head hm reads (a row holds q, k, v, index_q,
  // index_k heads in that order).
  static KVF_DEVICE int row_head_of(int hm, int nq, int main_kv) {
    return hm < nq + main_kv ? hm : hm + 2 * NKV - main_kv;
  }

  // Norm weight k of the call (0 q, 1 k, 2 index_q, 3 index_k; none without an index).
  static KVF_DEVICE const char* norm_weight(const kvf_args_t& a, int k) {
    const void* w = k == 0 ? a.q_norm_weight : k == 1 ? a.k_norm_weight
                  : !kIndex ? nullptr : k == 2 ? a.index_q_norm_weight : a.index_k_norm_weight;
    return static_cast<const char*>(w);
  }
  // The 16 bytes of a norm weight at byte `at`, raw (zeros where there is no weight).
  static KVF_DEVICE uint4 weight_chunk(const char* w, int64_t at) {
    return w ? load16(w + at) : make_uint4(0u, 0u, 0u, 0u);
  }
  // Where a thread finds the norm factors (Norm::factor of the weight) of its chunk c,
  // dims d0[c] .. d0[c] + 7: the block's copy in shared memory, or its weight in global
  // memory (calls of one pass, see main_loop).
  template <int N>
  struct SharedFactors {
    const float* f;  // the thread's norm's factors
    uint32_t d0[N];
    KVF_DEVICE void get(int c, float (&w)[kVec]) const {
#pragma unroll
      for (int j = 0; j < kVec; ++j) w[j] = f[d0[c] + j];
    }
  };
  template <int N>
  struct GlobalFactors {
    uint4 raw[N];  // the thread's chunks of its norm weight, loaded when made
    KVF_DEVICE GlobalFactors(const char* weight, const uint32_t (&d0)[N]) {
#pragma unroll
      for (int c = 0; c < N; ++c) raw[c] = weight_chunk(weight, d0[c] * 2);
    }
    KVF_DEVICE void get(int c, float (&w)[kVec]) const {
      unpack8<M>(raw[c], w);
#pragma unroll
      for (int j = 0; j < kVec; ++j) w[j] = Norm::factor(w[j]);
    }
  };

  // One token's position, slot and cos/sin (Rope::Raw, one per sub-lane) for a thread, as
  // loaded (its row chunks are in RowPipe).
  template <int kSub>
  struct Meta {
    typename Rope::Raw cs[kSub];
    int64_t pos, slot;
  };

  // Tokens per V-loop group (v_loop); its slots are one per lane of the head, so at most LPH.
  static constexpr int kVGroup = cmin(cmin(VT::V::kSlotVec, 8), LPH);
  static constexpr int kVRunBytes = kVGroup * VT::V::kElemBytes;  // one dim of a group's run

  // A prefill run's V through shared memory. A lane holds the group's vectors of its 8
  // dims; stored as held, one store instruction's lanes land 8 vectors apart, each in its
  // own line. Staged, lane l of a run's groups stores dims s * P * LPH + half * LPH + l:
  // adjacent vectors, whole lines (PERF.md, v6.5). Only whole 16-byte vectors: an FP8
  // group holds half of one (8 of a run's 16 tokens), so two groups of a warp take one
  // run's halves (kVPair: unpaired, FP8's runs went unstaged and prefills of 8k-64k
  // tokens were 4-9% slower, PERF.md s30; staged alone, half vectors were no faster). A
  // bf16/fp16 group is half a vector only at head_dim 32, which no variant lists: pairs are
  // FP8's alone. Not on AMD (kStageV): 32 KB a block leaves a gfx942 CU (64 KB) one block.
  static constexpr int kVPair =
      VT::V::kElemBytes == 1 && VT::V::kSlotVec == 2 * kVGroup && 2 * LPH <= 32 ? 2 : 1;
  static constexpr bool kStageVLoop = kStageV && kVRunBytes * kVPair == 16;
  // The stage keeps dim d in row d / 8 at column (d % 8) ^ (row % 8), so a quarter warp
  // writing column j of 8 rows in 16-byte vectors meets in no bank (FP8's pairs write
  // 8-byte halves: two ways at head_dim 128); the reads (8 adjacent dims of a row per
  // quarter warp) would not either way.
  static KVF_DEVICE uint32_t v_stage_pos(uint32_t d) { return (d & ~7u) | ((d ^ (d >> 3)) & 7u); }

  // A block's shared memory: the main loop's norm factors and row ring, the V loop's
  // stage, and the count of the block's V-loop runs taken. The stage has bytes of its own
  // where all fits in static shared memory (FP8 KV: 39 KB), so a warp starts on the V loop
  // when its main loop ends; else (bf16/fp16 V: 59 KB) it reuses the main loop's bytes
  // after a block barrier, where the warps that finish first wait. (Apart, FP8's long calls
  // ran faster, and spilled 20 bytes at depth 2, not 208: PERF.md, v6.10.) No stage (the
  // register pipeline, as on AMD; FP8 at head_dim 256), no barrier. 39 KB leaves three
  // blocks per SM on sm_90's 228 KB, two on sm_86/89's 100 KB; a block of 128 threads of
  // two lanes has the same bytes (the stage, sized for 256 threads, half used): four per SM
  // on sm_90, two on sm_86/89.
  struct MainSmem {
    float norm_factors[4][D];
#if KVF_ASYNC_COPY
    RowPipe<1>::Ring ring;  // the same at every kSub
#endif
  };
  static constexpr int kStageVecs = kStageVLoop ? kBlock / LPH / kVPair * D : 1;  // [run][dim], v_stage_pos order
  static constexpr int kPutVBytes = kStageV ? kBlock / LANES * kStageBytes : 0;    // put_v_by_dim's rows
  struct Apart {
    MainSmem main;
    uint4 v_stage[kStageVecs];
  };
  union Shared {
    MainSmem main;
    uint4 v_stage[kStageVecs];
  };
  template <class U>
  struct SmemOf {
    U u;
    int v_taken;
  };
  static constexpr bool kStageApart = sizeof(SmemOf<Apart>) + kPutVBytes <= 48 * 1024;
  using Smem = SmemOf<std::conditional_t<kStageApart, Apart, Shared>>;
  static constexpr bool kClaimRuns = kVTransposed && kStageApart;  // v_loop: runs taken as warps come free
  static_assert(sizeof(Smem) + kPutVBytes <= 48 * 1024, "static shared memory");

  // A thread's tokens go through a pipeline of kDepth stages (the tuned pipeline depth);
  // it holds kSub lanes of one head (Sub). Its row chunks (the bulk of the bytes) are
  // requested one token ahead of its math (RowPipe: on NVIDIA into a ring in shared
  // memory, by copies that hold no registers in flight); positions and slots come into
  // registers kDepth tokens ahead, and the cos/sin rows, which wait on the position,
  // kDepth - 1 ahead. Depth 2 takes that second round trip off each token's path (PERF.md,
  // v6.8) for registers (spills with fp32 cos/sin, or FP8 KV at 4 kv
  // heads) and a longer start: the best depth depends on the shape.
  template <int kDepth, int kSub>
  static KVF_DEVICE void main_loop(const kvf_args_t& a, const Dims& dims, int block, Smem& smem) {
    constexpr int kMeta = kDepth;
    constexpr int kCsAhead = kDepth - 1;
    constexpr int LN = Fused::LN<kSub>, kChunks = 2 * kSub;
    float (&norm_factors)[4][D] = smem.u.main.norm_factors;
#if KVF_ASYNC_COPY
    RowPipe<kSub> pipe{smem.u.main.ring};
#else
    RowPipe<kSub> pipe;
#endif
    const int64_t gid = int64_t(block) * blockDim.x + threadIdx.x;
    const int64_t tpp = dims.tokens_per_pass;
    const int copies = kSplitKv ? dims.kv_copies : 1;
    const bool idle = gid >= tpp * dims.lanes_per_token;  // whole head groups idle together
    // Threads take tokens in tiles of dims.tile (1, 2 or 4 times the lanes per thread): a
    // head's groups of a tile's tokens sit side by side, so one store instruction writes
    // the head's vectors of them all: whole sectors where a layout puts consecutive slots'
    // vectors next to each other (SHUFFLE's K, 16 bytes each), nearby lines elsewhere
    // (PERF.md, v6.3). At 4 (8 at two lanes) and head_dim 128 a warp is one head of the
    // tile's tokens, so no warp runs two roles one after the other (K's path, then V's;
    // PERF.md, v6.13-v6.14); short calls at TP1 are faster with smaller tiles (tuned).
    const int64_t tile_lanes = int64_t(dims.tile) * dims.lanes_per_token;
    const int in_tile = static_cast<int>(gid % tile_lanes);
    const int within = in_tile / (dims.tile * LN) * LN + in_tile % LN;  // thread lane of the token's row
    const int lane = within % LN;
    int copy;
    const int hm = one_group(within / LN, a.num_heads, dims.main_kv_heads, copies, copy);
    const Role r = role_of(hm, a.num_heads, a.num_index_heads, dims.main_kv_heads);
    const int row_head = row_head_of(hm, a.num_heads, dims.main_kv_heads);
    uint32_t d0[kChunks];  // chunk 2s + i: chunk i of sub-lane s, its first dim
    int at[kChunks];       // its bytes from the first
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      d0[c] = uint32_t(Lanes::chunk(lane + c / 2 * LN, c % 2) * kVec);
      at[c] = int(d0[c] - d0[0]) * 2;
    }
    const bool kv = r.kind == kK || r.kind == kV;
    const int64_t stride = kv ? copies * tpp : tpp;  // between the thread's tokens
    const int64_t* slots = kv ? a.slot_mapping : a.index_slot_mapping;
    const int64_t nslots = kv ? a.num_slots : a.num_index_slots;
    const bool has_slot = kv || r.kind == kIK;
    auto needs_cs = [&](int s) { return r.kind != kV && (rotates<kSub>(s, 0, lane) || rotates<kSub>(s, 1, lane)); };
    const char* row0 = static_cast<const char*>(a.qkv) + (int64_t(row_head) * D + d0[0]) * 2;
    const int64_t first = dims.tile * (gid / tile_lanes) + in_tile / LN % dims.tile + copy * tpp;  // its first token
    // Copies into shared memory go out only for tokens the loop processes, so none is
    // still in flight when the thread returns (the V loop's stage then reuses the ring).
    int64_t t_req = first;
    auto request_rows = [&](int k) {
#if KVF_ASYNC_COPY
      if (!idle && t_req < a.num_tokens) pipe.fill(k, row0 + t_req * a.qkv_row_stride * 2, at);
#else
      // Register rows load every time (the last row again past the end): with a fixed
      // count of loads behind it, AMD's in-order wait for the cos/sin leaves them in flight.
      pipe.fill(k, row0 + (t_req < a.num_tokens ? t_req : a.num_tokens - 1) * a.qkv_row_stride * 2, at);
#endif
      pipe.close();
      t_req += stride;
    };
    auto fetch = [&](Meta<kSub>& m, int64_t t) {
      const bool live = !idle && t < a.num_tokens;
      m.pos = live ? a.positions[t] : 0;  // V lanes too: a token without a cos/sin row writes no V
      m.slot = live && has_slot && t < nslots ? slots[t] : -1;
    };
    auto fetch_cos_sin = [&](Meta<kSub>& m) {
      m.pos = m.pos >= 0 && m.pos < a.max_pos ? m.pos : -1;  // no cos/sin row: no cache write
      m.slot = m.pos >= 0 ? m.slot : -1;
#pragma unroll
      for (int s = 0; s < kSub; ++s)
        m.cs[s] = needs_cs(s) && m.pos >= 0 ? Rope::load(cos_sin_row(a.cos_sin, m.pos), chunks_of<kSub>(d0, s, lane))
                                            : typename Rope::Raw{};
    };
    // While the previous kernel runs, warm L2 with what the first token needs: its row
    // chunks, position and slot, the cos/sin row at the position as read now (the
    // previous kernel may still change it: then this only wastes a prefetch), and the
    // norm weights (one block asks for those shared lines). Rows in DRAM come sooner
    // after the wait (PERF.md, v6.4); nothing read here is used.
    if (!idle && first < a.num_tokens) {
#pragma unroll
      for (int c = 0; c < kChunks; ++c) prefetch_l2(row0 + first * a.qkv_row_stride * 2 + at[c]);
      prefetch_l2(a.positions + first);
      if (has_slot && first < nslots) prefetch_l2(slots + first);
      // The whole cos/sin row (whichever runs the Rope reads: a sector left out came from DRAM
      // after the wait, PERF.md s44), a 32-byte sector a lane, an unaligned row's last byte too.
      constexpr int kRowBytes = R * VT::CosSin::kBytes, kSectors = kRowBytes / 32 + (kRowBytes % 32 ? 2 : 0);
      if (r.kind != kV && lane < kSectors) {
        const int64_t p = load_l2(a.positions + first);
        if (p >= 0 && p < a.max_pos) {
#pragma unroll
          for (int k = 0; k * LN < kSectors; ++k)
            if (const int j = lane + k * LN; j < kSectors)
              prefetch_l2(cos_sin_row(a.cos_sin, p) + (kRowBytes % 32 && j * 32 >= kRowBytes ? kRowBytes - 1 : j * 32));
        }
      }
    }
    constexpr int kWeightLines = (D * 2 + 127) / 128;  // 128-byte lines per norm weight
    if (block == 0 && threadIdx.x < 4 * kWeightLines) {
      const int k = threadIdx.x / kWeightLines;
      const char* w = norm_weight(a, k);
      if (w) prefetch_l2(w + threadIdx.x % kWeightLines * 128);
    }
    check_args(a);
    // Launched as a dependent of the previous kernel (see fused_kernel): past this, its
    // writes are visible; all above (arguments, L2 prefetches) overlaps its tail.
    wait_prior_grid();
    request_rows(0);
    Meta<kSub> q[kMeta + 1];  // q[k]: the token k steps ahead of the one being computed
#pragma unroll
    for (int k = 0; k < kMeta; ++k) fetch(q[k], first + k * stride);
    // The scale the thread's stores divide by (its head is fixed: K's, V's or, with an FP8
    // query output, q's), in flight beside the rows.
    const float kv_scale = idle                  ? 1.0f
                         : r.kind == kK         ? KvQuant::scale(a.k_scale, r.head)
                         : r.kind == kV         ? KvQuant::scale(a.v_scale, r.head)
                         : kQFp8 && r.kind == kQ ? QQuant::scale(a.q_fp8_scale, 0)
                                                : 1.0f;
    const int wk = r.kind - (r.kind > kV);  // the thread's norm (V lanes have none: unused)
    auto step = [&](int64_t t, const auto& factors, bool meet_barrier = false) {
      // Register rows go out after the loads this token waits for: AMD retires loads in
      // order, so waiting for the cos/sin would otherwise wait for the next rows too.
      if constexpr (KVF_ASYNC_COPY) request_rows(1);
      fetch(q[kMeta], t + kMeta * stride);
      fetch_cos_sin(q[kCsAhead]);
      if constexpr (!KVF_ASYNC_COPY) request_rows(1);
#if KVF_SPLIT_BARRIER
      if (meet_barrier) split_barrier();  // the norm factors' (see the loop)
#endif
      // The scale's reciprocal (loop-invariant, hoisted) after the loads in source order:
      // ahead, it held the cos/sin back; in process it was slower (PERF.md, v6.13).
      const float kv_inv = 1.0f / kv_scale;
      uint4 x[kChunks];
      // A warp sync (no other effect) ptxas moves no load past: without it SHUFFLE's GPT-J put
      // a weight load in the position's scoreboard (PERF.md s45); FP8 gained nothing (s46).
      pipe.template front<!kKvFp8>(x);
      process<kSub, kDepth == 1>(a, lane, r, d0, factors, kv_inv, t, x, q[0]);
#pragma unroll
      for (int k = 0; k < kMeta; ++k) q[k] = q[k + 1];
      pipe.pop();
    };
    if (kClaimRuns && threadIdx.x == 0) smem.v_taken = 0;
    // A call of one pass (a thread has one token at most; launch_at_depth runs these at
    // depth 1, the one kernel with this branch): a lane reads its norm weight from global
    // memory, so no barrier waits for the threads that load the block's copy (PERF.md,
    // v6.12). GlobalFactors issues those loads when made, before the rows' wait in source
    // order: after it, a compiler barrier, they went out once the rows had landed (v6.13).
    // Longer calls keep the shared copy: reading the weights every token costs each token
    // two loads and their conversions, and lost in long calls. (In the depth-2 kernel too,
    // FP8 spilled more there and lost in long calls; in a kernel of its own, with fewer
    // registers, more blocks fit an SM and a one-wave grid spread unevenly.)
    if constexpr (kDepth == 1) {
      if (tpp >= a.num_tokens) {
        if (kClaimRuns && dims.v_groups) __syncthreads();  // v_taken, before any claim
        if (!idle && first < a.num_tokens) {
          const GlobalFactors<kChunks> g(r.kind == kV ? nullptr : norm_weight(a, wk), d0);
          step(first, g);
        }
        return;
      }
    }
    // The norms' per-dim factors of q, k, index_q and index_k, shared by the block (in
    // registers they would cost residency), each thread of 4 * D / 8 loading one 16-byte
    // vector (a loop of 2-byte values, each stored before the next load went out, took two
    // trips at head_dim 128: PERF.md, v6.11). A loop still, though it runs once at every
    // head_dim: written as a branch, ptxas spilled more (FP8 SHUFFLE at depth 2: 20 -> 64
    // bytes).
    for (int i = threadIdx.x; i < 4 * LPH; i += blockDim.x) {
      const char* w = norm_weight(a, i / LPH);
      float f[kVec];
      unpack8<M>(weight_chunk(w, i % LPH * 16), f);
#pragma unroll
      for (int j = 0; j < kVec; ++j) norm_factors[i / LPH][i % LPH * kVec + j] = Norm::factor(f[j]);
    }
    // The barrier after which the norm factors are in shared memory. Where a thread may
    // meet it at another instruction than its neighbours (KVF_SPLIT_BARRIER), a thread
    // with a token meets it in its first step, once that step's trips (the next rows,
    // depth 1's cos/sin) are out, so they overlap the wait; one without meets it here.
#if KVF_SPLIT_BARRIER
    if (idle || first >= a.num_tokens) {
      split_barrier();
      return;
    }
#else
    __syncthreads();
    if (idle) return;
#endif
    // Depth 2's first cos/sin (a thread that meets a split barrier meets it in its first
    // step, after these are out; before the barrier's wait they measured the same).
#pragma unroll
    for (int k = 0; k < kCsAhead; ++k) fetch_cos_sin(q[k]);
    SharedFactors<kChunks> shared{r.kind == kV ? nullptr : norm_factors[wk], {}};
#pragma unroll
    for (int c = 0; c < kChunks; ++c) shared.d0[c] = d0[c];
    for (int64_t t = first; t < a.num_tokens; t += stride) step(t, shared, KVF_SPLIT_BARRIER && t == first);
  }

  // The arguments are in the constant bank, which an SM caches a line at a time where it
  // first reads one: a line first read after the wait is a round trip on the token's path
  // (per-token scale caches' descriptors, read after the amax: PERF.md s53). So before the
  // wait every thread reads the lines the schedule reads late, the caches' descriptors and
  // the q outputs, in a check of what the host never passes (a cache with slots but no
  // memory, q written nowhere): unused, ptxas would drop the reads.
  static KVF_DEVICE void check_args(const kvf_args_t& a) {
    auto broken = [](const kvf_cache_t& c) { return c.capacity > 0 && c.data == nullptr; };
    bool bad = false;
    if constexpr (KvQuant::kDynamic) bad = broken(a.k_scale_cache) || broken(a.v_scale_cache);
    bad = bad || broken(a.k_cache) || broken(a.v_cache) || broken(a.index_cache) ||
          (a.q_out == nullptr && a.q_fp8_out == nullptr);
    if (bad) trap();
  }

  // One token of a thread: its chunks x (chunk 2s + i: chunk i of sub-lane s, dims d0).
  // kv_inv: 1 / the thread's store scale (K, V or q's FP8 output); with per-token scales
  // (KvQuant::kDynamic) K's and V's divisors come from the head's amax instead.
  // A token without a cos/sin row (SPEC §1) writes zeros to its outputs, no cache (slot -1):
  // kZeroBySelect (depth 1), by the same stores, words selected to zero (as a branch, decodes
  // ran up to 6% slower); at depth 2 by that branch (selects spilled 48 -> 224 B; PERF.md s41).
  template <int kSub, bool kZeroBySelect, class Factors>
  static KVF_DEVICE void process(const kvf_args_t& a, int lane, const Role& role, const uint32_t (&d0)[2 * kSub],
                                 const Factors& factors, float kv_inv, int64_t t,
                                 const uint4 (&x)[2 * kSub], const Meta<kSub>& m) {
    const int kind = role.kind, head = role.head;
    float f[kSub][2][kVec];
#pragma unroll
    for (int c = 0; c < 2 * kSub; ++c) unpack8<M>(x[c], f[c / 2][c % 2]);
    if (kind == kV) {
      if (!slot_ok<typename VT::V>(a.v_cache, m.slot)) return;
      const KvFactor k = [&] {
        if constexpr (KvQuant::kDynamic) return token_scale<typename VT::VScale, kSub>(a.v_scale_cache, m.slot, head, lane, f);
        else return kv_inv;
      }();
      if constexpr (kStageV) {
        put_v_by_dim<kSub>(a.v_cache, k, m.slot, head, lane, d0, x, f);
      } else {
#pragma unroll
        for (int c = 0; c < 2 * kSub; ++c) {
          const uint32_t bits[4] = {x[c].x, x[c].y, x[c].z, x[c].w};
          store_chunk<KvQuant, false, typename VT::V>(a.v_cache, m.slot, head, d0[c], f[c / 2][c % 2], bits, k);
        }
      }
      return;
    }
    const float inv = Norm::template inv_rms<D, kSub>(f, HeadGroup<kSub, LN<kSub>>{}, a.eps);
    const char* cs_row = cos_sin_row(a.cos_sin, m.pos >= 0 ? m.pos : 0);
    // A per-token scale needs the whole head rotated before its first store; otherwise
    // each lane is normalized, rotated and stored in turn (fewer values live).
    constexpr bool kWholeHead = KvQuant::kDynamic;
    auto rotate = [&](int s) {
      Norm::apply(f[s], inv, factors, s);
      Rope::apply(m.cs[s], cs_row, lane, chunks_of<kSub>(d0, s, lane), f[s]);
    };
    auto store = [&](int s, const KvFactor& k) {  // false: the token writes nothing more
      if (!kZeroBySelect && m.pos < 0) {
#pragma unroll
        for (int s2 = 0; s2 < kSub; ++s2)
          store_normed(a, kind, head, -1, true, kv_inv, k, t, chunks_of<kSub>(d0, s2, lane).d0, f[s2]);
        return false;
      }
      const bool zero = kZeroBySelect && m.pos < 0;
      store_normed(a, kind, head, m.slot, zero, kv_inv, k, t, chunks_of<kSub>(d0, s, lane).d0, f[s]);
      return true;
    };
#pragma unroll
    for (int s = 0; s < kSub; ++s) {
      rotate(s);
      if constexpr (!kWholeHead) {
        if (!store(s, kv_inv)) return;
      }
    }
    if constexpr (kWholeHead) {
      KvFactor k = KvQuant::dynamic(0.0f);  // K's (a placeholder elsewhere: no other role's store reads it)
      if (kind == kK && slot_ok<typename VT::K>(a.k_cache, m.slot))
        k = token_scale<typename VT::KScale, kSub>(a.k_scale_cache, m.slot, head, lane, f);
#pragma unroll
      for (int s = 0; s < kSub; ++s)
        if (!store(s, k)) return;
    }
  }

  // A per-token scale (KvQuant::kDynamic) of the head whose fp32 values y a group holds:
  // their amax reduced over the group, its scale written once (thread lane 0) into the
  // scale cache C at the slot. Returns its Divisor (what KvQuant::pack divides by).
  template <class C, int kSub>
  static KVF_DEVICE KvFactor token_scale(const kvf_cache_t& c, int64_t slot, uint32_t h, int lane,
                                         const float (&y)[kSub][2][kVec]) {
    float amax[kSub];
#pragma unroll
    for (int s = 0; s < kSub; ++s) amax[s] = fmaxf(abs_max<kVec>(y[s][0]), abs_max<kVec>(y[s][1]));
    const KvFactor k = KvQuant::dynamic(HeadGroup<kSub, LN<kSub>>{}.max(amax));
    if (lane == 0) put_scale<C>(c, slot, h, k.s);
    return k;
  }

  // Chunk values y (fp32; `bits`: their model-dtype rounding) of one (slot, head) into a
  // cache, as Q stores them (quantized from the rounding where kFromRounded).
  template <class Q, bool kFromRounded, class C>
  static KVF_DEVICE void store_chunk(const kvf_cache_t& c, int64_t slot, uint32_t h, uint32_t d0,
                                     const float (&y)[kVec], const uint32_t (&bits)[4],
                                     const typename Q::Factor& k) {
    uint32_t w[2 * Q::kBytes];
    Q::template pack<kFromRounded>(y, bits, k, w);
    store_dims<C>(c, slot, h, d0, w);
  }

  // One lane's rotated values y (dims d0[i] ..) to its outputs (zeros where `zero`) and
  // caches: q to q_out and q_fp8_out, index_q to index_q_out, K and index_k to their caches
  // as the variant quantizes them (and, where asked, to k_out and index_k_out).
  static KVF_DEVICE void store_normed(const kvf_args_t& a, int kind, int head, int64_t slot, bool zero, float q_inv,
                                      const KvFactor& k, int64_t t, const uint32_t (&d0)[2],
                                      const float (&y)[2][kVec]) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      // The model-dtype rounding (q_out, and K and index_k where the contract quantizes
      // it). Unpacked only in the stores that use it: shared, it made the compiler round
      // every lane's values one by one (F2F, a slow pipe) instead of in pairs (FP8 SHUFFLE;
      // PERF.md, v6.9).
      uint32_t bits[4];
      pack_model<M>(y[i], bits);
      zero_if(zero, bits);
      if (kind == kQ) {
        put_row<kQ>(a, head, t, d0[i], bits);
        if constexpr (kQFp8) {  // SPEC §1: from the rounded q, saturating
          uint32_t w[2];
          QQuant::template pack<true>(y[i], bits, q_inv, w);
          zero_if(zero, w);  // whatever the scale
          put_row<kQ8>(a, head, t, d0[i], w);
        }
      } else if (kind == kK) {
        put_row<kK>(a, head, t, d0[i], bits);
        if (slot_ok<typename VT::K>(a.k_cache, slot))
          store_chunk<KvQuant, VT::kRoundBeforeQuant, typename VT::K>(a.k_cache, slot, head, d0[i], y[i], bits, k);
      } else if (kind == kIQ) {
        constexpr int EB = IndexQuant::kBytes;
        uint32_t w[2 * EB];
        IndexQuant::template pack<false>(y[i], bits, 1.0f, w);  // SPEC §1: FP8 straight from fp32
        zero_if(zero, w);
        put_row<kIQ>(a, head, t, d0[i], w);
      } else {
        put_row<kIK>(a, head, t, d0[i], bits);
        if (slot_ok<typename VT::Index>(a.index_cache, slot))
          store_chunk<IndexQuant, VT::kRoundBeforeQuant, typename VT::Index>(a.index_cache, slot, 0, d0[i], y[i], bits,
                                                                             1.0f);
      }
    }
  }

  // V for layouts whose 16-byte runs span tokens (SHUFFLE), all of it: a lane owns
  // kVGroup consecutive tokens of one head's 8-dim chunk. When their slots are one
  // aligned run (a prefill), each dim's values leave as one store of kVGroup elements;
  // otherwise (decode, a partial last group) value by value. Groups are at most 8
  // tokens, half a vector for FP8 (16 tokens per vector): a lane then waits for memory
  // once, and twice as many lanes share the loop (PERF.md, v6.2).
  // A run's vectors go through shared memory where kStageVLoop.
  static KVF_DEVICE void v_loop(const kvf_args_t& a, const Dims& dims, int block, int nblocks, Smem& smem) {
    using C = typename VT::V;
    constexpr int G = kVGroup, EB = C::kElemBytes, NB = kVRunBytes;  // bytes per store
    constexpr int kWords = kVec * EB / 4;                             // packed words per token
    constexpr int P = kStageVLoop ? kVPair : 1;                       // groups per run
    const int lane = threadIdx.x % LPH, group = threadIdx.x / LPH, half = group % P;
    const uint32_t d0 = lane * kVec;
    // Runs (P groups) go round-robin over the blocks, so few tokens still spread over the
    // GPU. In a block, where no barrier lines its warps up before this loop (kStageApart),
    // to its groups as they come free: FP8's K and index warps finish the main loop last,
    // and the others take more runs. After the barrier, in a fixed order: a claim is a
    // shared-memory round trip per run, which lost there (PERF.md, v6.10).
    // (Claims are unmeasured where there is no stage: AMD and FP8 at head_dim 256.)
    const int64_t runs = (dims.v_groups + P - 1) / P * NKV;
    const int per_block = blockDim.x / LPH / P;
    char* base = static_cast<char*>(a.v_cache.data);
    for (int i = 0;; ++i) {
      const int k = kClaimRuns ? shfl<P * LPH>(lane == 0 && half == 0 ? atomicAdd(&smem.v_taken, 1) : 0, 0)
                                : group / P + i * per_block;
      const int64_t item = block + int64_t(k) * nblocks;
      if (item >= runs) break;  // the same for the run's groups
      const uint32_t h = static_cast<uint32_t>(item % NKV);
      const int64_t t0 = item / NKV * (P * G) + half * G;
      const int64_t left = dims.v_tokens - t0;
      const int n = left < G ? (left > 0 ? static_cast<int>(left) : 0) : G;  // its tokens
      const int64_t col = int64_t(a.num_heads + NKV + h) * D + d0;
      // The group's slots, lane l holding token l's, and whether they are one aligned
      // run; these loads and the rows' go out together.
      // A token whose position has no cos/sin row writes no V (SPEC §1): its slot counts as
      // none, which also breaks the run it would have been part of.
      const int64_t slot_of = lane < n ? a.slot_mapping[t0 + lane] : -1;
      const int64_t pos = lane < n ? a.positions[t0 + lane] : 0;
      const int64_t slot = pos >= 0 && pos < a.max_pos ? slot_of : -1;
      const int64_t s0 = n > 0 ? a.slot_mapping[t0] : -1;
      uint4 raw[G];
#pragma unroll
      for (int k2 = 0; k2 < G; ++k2)
        raw[k2] = k2 < n ? load16(static_cast<const char*>(a.qkv) + ((t0 + k2) * a.qkv_row_stride + col) * 2)
                         : make_uint4(0u, 0u, 0u, 0u);
      int run = n == G && s0 >= 0 && s0 % G == 0 && s0 + G <= a.v_cache.capacity &&
                (lane >= G || slot == s0 + lane);
#pragma unroll
      for (int sh = LPH / 2; sh >= 1; sh /= 2) run &= shfl_xor<LPH>(run, sh);
      // Paired, the two groups stage their vector together only when both are runs, the
      // first starting a vector and the second continuing it; else each stores its half.
      int whole = run;
      int64_t run_s0 = s0;  // the vector's first slot
      if constexpr (P == 2) {
        run_s0 = shfl<2 * LPH>(s0, 0);
        whole = run && (half == 0 ? s0 % (2 * G) == 0 : s0 == run_s0 + G);
        whole &= shfl_xor<2 * LPH>(whole, LPH);
      }
      const float inv = 1.0f / KvQuant::scale(a.v_scale, h);
      float scale = 0.0f;  // per-token scales: that of the lane's token, written below
      uint32_t w[G][kWords];
#pragma unroll
      for (int k2 = 0; k2 < G; ++k2) {
        const uint32_t bits[4] = {raw[k2].x, raw[k2].y, raw[k2].z, raw[k2].w};
        float f[kVec];
        if constexpr (kKvFp8) unpack8<M>(raw[k2], f);
        if constexpr (KvQuant::kDynamic) {  // token k2's amax over the group's lanes (8 dims each)
          float amax = abs_max<kVec>(f);
#pragma unroll
          for (int sh = LPH / 2; sh >= 1; sh /= 2) amax = fmaxf(amax, shfl_xor<LPH>(amax, sh));
          const KvFactor k = KvQuant::dynamic(amax);
          if (lane == k2) scale = k.s;
          KvQuant::template pack<false>(f, bits, k, w[k2]);
        } else {
          KvQuant::template pack<false>(f, bits, inv, w[k2]);
        }
      }
      if constexpr (KvQuant::kDynamic) {
        if (lane < n) put_scale<typename VT::VScale>(a.v_scale_cache, slot, h, scale);
      }
      if (run) {
        constexpr int kOut = (NB + 3) / 4;
        uint32_t out[kVec][kOut];  // dim d0 + j: the group's G values, one store
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
#pragma unroll
          for (int i = 0; i < kOut; ++i) out[j][i] = 0u;
#pragma unroll
          for (int k2 = 0; k2 < G; ++k2) out[j][k2 * EB / 4] |= elem_of<EB>(w[k2], j) << (8 * ((k2 * EB) % 4));
        }
        if constexpr (kStageVLoop) {
          if (whole) {
            static_assert(NB * P == 16, "staged runs are whole 16-byte vectors");
            const SlotAt<C> at(run_s0);
            uint4* stage = smem.u.v_stage + group / P * D;
#pragma unroll
            for (int j = 0; j < kVec; ++j)
              store_bytes<NB>(reinterpret_cast<char*>(stage + v_stage_pos(d0 + j)) + half * NB, out[j], 0);
            group_sync<P * LPH>();
#pragma unroll
            for (int s = 0; s < kVec / P; ++s) {
              const uint32_t d = s * P * LPH + half * LPH + lane;
              *reinterpret_cast<uint4*>(base + at.offset(a.v_cache, h, d) * EB) = stage[v_stage_pos(d)];
            }
            group_sync<P * LPH>();  // the reads done before the run's next item writes the stage
            continue;
          }
        }
        const SlotAt<C> at(s0);
#pragma unroll
        for (int j = 0; j < kVec; ++j)
          store_bytes<NB>(base + at.offset(a.v_cache, h, d0 + j) * EB, out[j], 0);
      } else {
#pragma unroll
        for (int k2 = 0; k2 < G; ++k2) {
          if (k2 >= n) break;  // the same for the head's lanes
          const int64_t s = shfl<LPH>(slot, k2);
          if (!slot_ok<C>(a.v_cache, s)) continue;
          const SlotAt<C> at(s);
#pragma unroll
          for (int j = 0; j < kVec; ++j)
            store_bytes<EB>(base + at.offset(a.v_cache, h, d0 + j) * EB, w[k2], j * EB);
        }
      }
    }
  }
};

template <class VT, int kDepth, int kSub>
__global__ void __launch_bounds__(kThreadsOf<kSub>, kMinBlocksOf<kSub>)
    fused_kernel(const KVF_GRID_CONSTANT kvf_args_t a, const Dims dims) {
  // Launched as a dependent of the previous kernel: main_loop calls wait_prior_grid()
  // before it reads anything (every thread, before the V loop too). The next
  // launch may begin now; it waits for this grid.
  allow_next_grid();
  using F = Fused<VT>;
  __shared__ typename F::Smem smem;
  const int block = static_cast<int>(blockIdx.x);
  F::template main_loop<kDepth, kSub>(a, dims, block, smem);
  // Every thread then takes its share of the V loop, so that work (a few percent of
  // the bytes, but more instructions and round trips per byte) has the whole GPU and
  // starts wherever the main loop finishes first. (Blocks of its own, sized by bytes,
  // finished last: benchmarks/PERF.md, v6.) Calls whose V the main loop writes (decodes, as
  // tuned) skip it and its claims.
  if constexpr (F::kVTransposed) {
    if (dims.v_groups) {
      if (F::kStageVLoop && !F::kStageApart) __syncthreads();  // its stage reuses the main loop's bytes
      F::v_loop(a, dims, block, static_cast<int>(gridDim.x), smem);
    }
  }
}

// Resident blocks per SM of fused_kernel<VT, kDepth, kSub> at kThreads threads; 0 where unknown.
template <class VT, int kDepth, int kSub, int kThreads>
int resident_blocks(int dev) {
  static std::atomic<int> count[kMaxDevices];
  return device_fact(count, dev, [](int* v) {
    return hipOccupancyMaxActiveBlocksPerMultiprocessor(v, fused_kernel<VT, kDepth, kSub>, kThreads, 0);
  });
}

template <class VT, int kDepth>
int launch_at_depth(const kvf_args_t* a, void* stream, int lanes) {
  using F = Fused<VT>;
  Dims dims;
  const bool v_loop = F::kVTransposed && (a->v_loop == KVF_V_LOOP_DEFAULT ? a->num_tokens >= KVF_V_LOOP_MIN_TOKENS
                                                                           : a->v_loop == KVF_V_LOOP_ON);
  dims.main_kv_heads = v_loop ? F::NKV : 2 * F::NKV;
  dims.kv_copies = 1;
  dims.v_tokens = a->num_slots < a->num_tokens ? a->num_slots : a->num_tokens;
  dims.v_groups = v_loop ? (dims.v_tokens + F::kVGroup - 1) / F::kVGroup : 0;
  // A tile of tokens_per_tile * lanes tokens: a head's threads of it are as many at either
  // lane count (at 4 and head_dim 128, a warp is one head). At two lanes, tiles of t put
  // two heads in a warp, so K's and V's paths ran one after the other again (PERF.md,
  // v6.17).
  dims.tile = (a->tokens_per_tile ? a->tokens_per_tile : KVF_DEFAULT_TOKENS_PER_TILE) * lanes;
  const auto lanes_per_token = [&](int copies) {
    return F::heads_main(a->num_heads, a->num_index_heads, dims.main_kv_heads, copies) * (F::LANES / lanes);
  };
  dims.lanes_per_token = lanes_per_token(1);
  int dev = 0;
  if (hipGetDevice(&dev) != hipSuccess) return int(hipGetLastError());
  const int n_sms = sm_count(dev);
  const int64_t sms = n_sms ? n_sms : 132;
  const int64_t tile_lanes = int64_t(dims.tile) * dims.lanes_per_token;
  const int64_t total_main = (int64_t(a->num_tokens) + dims.tile - 1) / dims.tile * tile_lanes;
  const auto blocks_of = [total_main](int threads) { return (total_main + threads - 1) / threads; };
  // `blocks` of `threads` (at most one wave of resident blocks, `per_sm` each: the main
  // loop's threads then stride over the tokens), at least one tile's worth of threads; a
  // call of one pass has no pipeline to deepen, so it runs at depth 1 (see main_loop).
  using Kernel = decltype(&fused_kernel<VT, 1, 1>);
  const auto go = [&](int threads, int per_sm, Kernel one_pass, Kernel loop) {
    int64_t blocks = blocks_of(threads);
    if (per_sm && blocks > sms * per_sm) blocks = sms * per_sm;
    const int64_t min_blocks = (tile_lanes + threads - 1) / threads;
    if (blocks < min_blocks) blocks = min_blocks;
    dims.tokens_per_pass = blocks * threads / tile_lanes * dims.tile;
    if (F::kSplitKv && dims.tokens_per_pass < a->num_tokens) {
      // More than one pass (so the grid is a whole wave): K/V heads in kv_groups groups
      // where the grid still holds a tile of them.
      Dims d = dims;
      d.kv_copies = a->kv_groups ? a->kv_groups : KVF_DEFAULT_KV_GROUPS;
      d.lanes_per_token = lanes_per_token(d.kv_copies);
      const int64_t lanes_of_tile = int64_t(d.tile) * d.lanes_per_token;
      if (blocks * threads >= lanes_of_tile) {
        d.tokens_per_pass = blocks * threads / lanes_of_tile * d.tile;
        dims = d;
      }
    }
    return int(launch_kernel(dims.tokens_per_pass >= a->num_tokens ? one_pass : loop, static_cast<unsigned>(blocks),
                             threads, static_cast<hipStream_t>(stream), dependent_launch_supported(dev), *a, dims));
  };
  if constexpr (F::kMaxSub == 2) {
    if (lanes == 2) {
      constexpr int kThreads = kThreadsOf<2>;
      const int resident = resident_blocks<VT, kDepth, 2, kThreads>(dev);
      return go(kThreads, resident ? resident : 1, fused_kernel<VT, 1, 2>, fused_kernel<VT, kDepth, 2>);
    }
  }
  // Smaller blocks reach more SMs where a call has few lanes (TP1, 16 decode tokens: 39
  // blocks of 256): kBlock / 2 where that grid has at most one block per SM (past that it
  // lost: TP4, 128 tokens, 80 blocks of 256 or 160 of 128), then kBlock / 4 where the
  // kBlock / 2 grid leaves SMs idle and the smaller blocks all stay resident (each keeps
  // the shared memory sized for kBlock). PERF.md, v6.15, v6.16. Such a call is one pass,
  // so it runs the depth-1 kernel.
  int threads = kBlock;
  if (blocks_of(kBlock / 2) <= sms) {
    threads = kBlock / 2;
    if (blocks_of(threads) < sms && blocks_of(kBlock / 4) <= sms * resident_blocks<VT, 1, 1, kBlock / 4>(dev))
      threads = kBlock / 4;
  }
  const int resident = threads == kBlock ? resident_blocks<VT, kDepth, 1, kBlock>(dev) : 0;
  return go(threads, threads == kBlock ? (resident ? resident : 1) : 0, fused_kernel<VT, 1, 1>,
            fused_kernel<VT, kDepth, 1>);
}

template <class VT, int kDepth = 1>
int launch_depth(const kvf_args_t* a, void* stream, int depth, int lanes) {
  if constexpr (kDepth > KVF_MAX_PIPELINE_DEPTH) {
    return int(hipErrorInvalidValue);
  } else {
    return depth == kDepth ? launch_at_depth<VT, kDepth>(a, stream, lanes)
                           : launch_depth<VT, kDepth + 1>(a, stream, depth, lanes);
  }
}

static_assert(pow2_upto(KVF_MAX_TOKENS_PER_TILE, KVF_MAX_TOKENS_PER_TILE) &&
                  pow2_upto(KVF_MAX_KV_GROUPS, KVF_MAX_KV_GROUPS),
              "launch() takes the powers of two up to KVF_MAX_TOKENS_PER_TILE and KVF_MAX_KV_GROUPS");

template <class VT>
int launch(const kvf_args_t* a, void* stream) {
  if (a->num_tokens <= 0) return 0;
  if (!pow2_upto(a->tokens_per_tile, KVF_MAX_TOKENS_PER_TILE)) return int(hipErrorInvalidValue);
  if (a->v_loop < KVF_V_LOOP_DEFAULT || a->v_loop > KVF_V_LOOP_ON) return int(hipErrorInvalidValue);
  if (!pow2_upto(a->kv_groups, KVF_MAX_KV_GROUPS)) return int(hipErrorInvalidValue);
  const int lanes = a->lanes_per_thread ? a->lanes_per_thread : KVF_DEFAULT_LANES_PER_THREAD;
  if (lanes < 1 || lanes > Fused<VT>::kMaxSub) return int(hipErrorInvalidValue);
  const int depth = a->pipeline_depth ? a->pipeline_depth : KVF_DEFAULT_PIPELINE_DEPTH;
#ifdef KVF_CUDA  // AMD, whose speed is unmeasured, builds one set (its compile check took twice as long)
  if (!a->k_out && !a->index_k_out) return launch_depth<AsCalled<VT, false>>(a, stream, depth, lanes);
#endif
  return launch_depth<AsCalled<VT, true>>(a, stream, depth, lanes);
}

}  // namespace kvf
