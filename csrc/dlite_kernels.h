// Host API of the DLite CUDA kernels (format dlite_v1). Plain C++ + CUDA runtime: no torch
// headers, so the .cu files compile stand-alone (`nvcc -arch=sm_90 -c csrc/<file>.cu`) and the
// torch binding lives apart in binding.cpp. Semantics: vllm_dlite/ops/reference.py
// (draft_attention; sequential_head with temperature < GREEDY_EPS). All tensors are contiguous,
// row-major, on the current device.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace dlite {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// ------------------------------------------------------------------------------ draft attention
struct DraftAttentionArgs {
  const void* q;      // [B, Q, Hq, D]   dtype
  const void* k_ctx;  // [B, L, Hkv, D]  dtype, roped with cos/sin rows 0..L-1
  const void* v_ctx;  // [B, L, Hkv, D]  dtype
  const void* k_q;    // [B, Q, Hkv, D]  dtype, roped with cos/sin rows L..L+Q-1
  const void* v_q;    // [B, Q, Hkv, D]  dtype
  const float* cos;   // [L + Q, D] fp32 holding values already rounded to dtype (rotate-half)
  const float* sin;   // [L + Q, D]
  void* out;          // [B, Q, Hq, D]   dtype
  int B, Q, L, Hq, Hkv, D;
  float scale;        // softmax scale
  DType dtype;        // of q, k_*, v_*, out
};

// nullptr when the kernel handles these sizes, else a short reason (for the dispatcher's report).
const char* draft_attention_unsupported(int B, int Q, int L, int Hq, int Hkv, int D);
cudaError_t draft_attention_launch(const DraftAttentionArgs& args, cudaStream_t stream);

// ------------------------------------------------------------------------------ sequential head
// Greedy gated low-rank head, all steps in one cooperative launch per chunk of <= 64 rows.
struct SequentialHeadArgs {
  const void* d;            // [B, K, H]  dtype: mask-slot outputs (final-normed)
  const int64_t* anchor;    // [B]        x_a
  const int64_t* prime;     // [B]        x_{a-1}, or nullptr (zero initial state)
  const void* emb;          // [V, r]     dtype: prev_token_embedding P
  const void* w_s;          // [2r, 2r]   dtype: state_proj weight
  const void* b_s;          // [2r]       dtype
  const void* w_f;          // [r, r + H] dtype: state_hidden_mlp weight
  const void* b_f;          // [r]        dtype
  const void* w_o;          // [V, r]     dtype: output_proj weight
  int B, K, H, r, num_steps;
  int64_t V;
  DType dtype;              // kBFloat16 or kFloat16 (the MMA operand type)
  int64_t* draft_ids;       // [B, num_steps] out
  float* logits;            // [B, num_steps, V] out: fp32 values of the dtype-rounded logits
  void* workspace;          // sequential_head_workspace_bytes(H, r, num_steps) bytes, any content
  bool poison_workspace;    // fill scratch with NaN first (correctness checks)
};

const char* sequential_head_unsupported(int H, int r, int64_t V, DType dtype);
size_t sequential_head_workspace_bytes(int H, int r, int num_steps);
cudaError_t sequential_head_greedy_launch(const SequentialHeadArgs& args, cudaStream_t stream);

}  // namespace dlite
