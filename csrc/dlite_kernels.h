// Host API of the DLite CUDA kernels. Plain C++ + CUDA runtime: no torch headers, so the .cu files
// compile stand-alone (`nvcc -arch=sm_90 -c csrc/<file>.cu`) and the torch binding lives apart in
// binding.cpp. Semantics: vllm_dlite/ops/reference.py (draft_attention, sequential_head with
// temperature 0 and no forced_ids). All tensors are contiguous, row-major, on the current device.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace dlite {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// ------------------------------------------------------------------------------ draft attention
struct DraftAttentionArgs {
  const void* q;        // [B, K, Hq, D]   dtype
  const void* k_feat;   // [B, L, Hkv, D]  dtype, local position 0
  const void* v_feat;   // [B, L, Hkv, D]  dtype
  const void* k_block;  // [B, K, Hkv, D]  dtype, block offset i at local position 1 + i
  const void* v_block;  // [B, K, Hkv, D]  dtype
  const float* cos;     // [K + 1, D] fp32 RoPE table (rotate-half convention)
  const float* sin;     // [K + 1, D] fp32
  void* out;            // [B, K, Hq, D]   dtype
  int B, K, L, Hq, Hkv, D;
  float scale;          // softmax scale
  DType dtype;          // of q, k_*, v_*, out
};

// nullptr when the kernel handles these sizes, else a short reason (for the dispatcher's report).
const char* draft_attention_unsupported(int B, int K, int L, int Hq, int Hkv, int D);
cudaError_t draft_attention_launch(const DraftAttentionArgs& args, cudaStream_t stream);

// ------------------------------------------------------------------------------ sequential head
struct SequentialHeadArgs {
  const void* h;            // [B, K, H]  dtype, backbone output (pre final norm)
  const int64_t* anchor;    // [B]
  const void* embed;        // [embed_rows, H] dtype
  int64_t embed_rows;
  const void* w_in;         // [r, H] dtype
  const void* w_state;      // [r, r] dtype
  const void* w_out;        // [H, r] dtype
  const void* norm_w;       // [H]    dtype
  const void* lm_head;      // [V, H] dtype
  int B, K, H, r;
  int64_t V;
  float eps;
  DType dtype;              // kBFloat16 or kFloat16 (the MMA operand type)
  int64_t* draft_ids;       // [B, K] out: greedy ids
  float* logits;            // [B, K, V] out: fp32 logits, rounded to dtype like F.linear
  void* workspace;          // sequential_head_workspace_bytes(K, H, r) bytes, any content
  bool poison_workspace;    // fill scratch with NaN first (correctness checks)
};

const char* sequential_head_unsupported(int H, int r, int64_t V, DType dtype);
size_t sequential_head_workspace_bytes(int K, int H, int r);
cudaError_t sequential_head_greedy_launch(const SequentialHeadArgs& args, cudaStream_t stream);

}  // namespace dlite
