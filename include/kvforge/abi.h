// The plain C ABI between runtime/abi.py (ctypes) and every generated kernel library.
// Bump KVF_ABI_VERSION on any change; the loader refuses a library of another version.
#pragma once

#include <stdint.h>

#define KVF_ABI_VERSION 7
#define KVF_MAX_DIMS 8
#define KVF_MAX_PIPELINE_DEPTH 2      // a library holds the main loop at depths 1..this (see pipeline_depth)
#define KVF_DEFAULT_PIPELINE_DEPTH 1  // the depth a call naming 0 gets
#define KVF_MAX_TOKENS_PER_TILE 4     // tokens whose head lanes a tile sets side by side: a power
                                      // of two up to this
#define KVF_DEFAULT_TOKENS_PER_TILE 2  // what a call naming 0 gets
#define KVF_MAX_LANES_PER_THREAD 2     // head lanes (32 bytes of a head per token each) a main-loop
                                       // thread holds: 1..this, where the variant has them
#define KVF_DEFAULT_LANES_PER_THREAD 1  // what a call naming 0 gets
// Where a transposed V (SHUFFLE) is written: by the main loop's lanes of each token, or by
// the V loop that runs after it (tokens grouped into 16-byte runs). A call naming
// KVF_V_LOOP_DEFAULT gets the V loop from KVF_V_LOOP_MIN_TOKENS tokens on.
#define KVF_V_LOOP_DEFAULT 0
#define KVF_V_LOOP_OFF 1
#define KVF_V_LOOP_ON 2
#define KVF_V_LOOP_MIN_TOKENS 256

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  void* data;
  int64_t capacity;                 // slots the tensor holds (pages * page_size)
  int64_t strides[KVF_MAX_DIMS];    // element strides; only the contract's free dims are read
} kvf_cache_t;

typedef struct {
  const void* qkv;                  // [T, row] model dtype, row stride below
  const int64_t* positions;         // [T]
  const void* cos_sin;              // [max_pos, rotary_dim]: cos | sin
  const int64_t* slot_mapping;      // [num_slots]
  const int64_t* index_slot_mapping;  // [num_index_slots]
  const void* q_norm_weight;
  const void* k_norm_weight;
  const void* index_q_norm_weight;
  const void* index_k_norm_weight;
  const float* k_scale;             // [1] or [nkv] when the variant has one
  const float* v_scale;
  void* q_out;                      // [T, nq, D] contiguous
  void* index_q_out;                // [T, niq, D] contiguous
  kvf_cache_t k_cache;
  kvf_cache_t v_cache;
  kvf_cache_t index_cache;
  int64_t qkv_row_stride;           // elements
  int64_t max_pos;
  int64_t num_slots;                // tokens past this write no K/V
  int64_t num_index_slots;
  int32_t num_tokens;
  int32_t num_heads;
  int32_t num_index_heads;
  float eps;
  int32_t pipeline_depth;           // 1..KVF_MAX_PIPELINE_DEPTH (0 = default): positions and slots
                                    // are loaded this many tokens ahead, cos/sin one fewer;
                                    // a call of one pass (a thread has one token) runs at 1
  int32_t tokens_per_tile;          // 1, 2 .. KVF_MAX_TOKENS_PER_TILE (powers of two); 0 = default.
                                    // A tile holds this many tokens times lanes_per_thread
  int32_t v_loop;                   // KVF_V_LOOP_*; ignored where V is not transposed
  int32_t lanes_per_thread;         // 1..KVF_MAX_LANES_PER_THREAD (0 = default), at most the
                                    // variant's Traits::kMaxLanesPerThread; else the launch fails
} kvf_args_t;

#ifdef __cplusplus
}
#endif
