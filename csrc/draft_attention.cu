// DLite draft attention, format dlite_v1: the Q query slots of every request attend,
// bidirectionally (no mask), over that request's [L context slots ; Q query slots].
// Spec: vllm_dlite/ops/reference.py (draft_attention).
//
//   keys   = RoPE([k_ctx ; k_q], cos, sin)         rows 0..L-1 -> cos/sin rows 0..L-1 (context)
//                                                   rows L..L+Q-1 -> cos/sin rows L..L+Q-1 (query)
//   q_rot  = RoPE(q, cos[L:], sin[L:])
//   out    = softmax(q_rot keys^T * scale) [v_ctx ; v_q]        GQA: head h reads kv head h / group
//
// The cos/sin rows are taken as given (the drafter puts every context row at max(g-2, 0) and the
// query rows at 0..Q-1), so the kernel has no notion of positions.
//
// Rounding. The reference runs RoPE in the activation dtype T with cos/sin cast to T first
// (HF semantics): each of x*cos, rotate_half(x)*sin and their sum is rounded to T. The binding
// passes cos/sin already cast to T (then widened to fp32), and the kernel rounds the two products
// and the sum through T, which reproduces the reference's roped q and keys bit for bit (products
// of two 8/11-bit mantissas are exact in fp32). Scores, softmax and the weighted sum of values run
// in fp32 (the reference's SDPA kernels also accumulate in fp32); the output is rounded to T.
//
// Design. Per (request, kv head) there are only L + Q keys (14 + 8 or 14 + 9 for Qwen3-8B) and
// group * Q query rows (4 * 8 = 32). One CTA stages the roped keys and the values of one
// (request, kv head) in shared memory as fp32 (2 * 23 * 128 * 4 B = 23 KiB), then each warp owns
// one query row: lane l holds head dims [l*E, l*E + E) (E = D / 32), so rotate_half is a single
// shuffle with lane ^ 16 (dims d and d +- D/2 live in lanes l and l ^ 16). Scores are warp
// all-reductions; softmax is exact two-pass (scores kept in shared memory), the weighted sum of V
// accumulates in registers. The query rows of one (request, kv head) are split over
// ceil(group * Q / 8) CTAs so that batch 1 still launches 32-40 CTAs; each re-stages K/V from L2.
//
// Cost at Qwen3-8B shapes: b * (23 KiB K/V + 72 KiB Q + 72 KiB out) of HBM traffic, ~11 MiB at
// b = 64: a few microseconds; the point of the kernel is one launch instead of the reference's ~12
// (rope x2, cat x2, repeat_interleave x2, SDPA, transposes, casts) and no [b, L+Q, h_q, D]
// intermediates.
#include "dlite_common.cuh"
#include "dlite_kernels.h"

namespace dlite {
namespace {

constexpr int kAttnWarps = 8;                       // query rows per CTA (one row per warp)
constexpr int kAttnThreads = kAttnWarps * 32;
constexpr float kLog2e = 1.4426950408889634f;       // softmax via exp2: e^x = 2^(x * log2 e)
constexpr size_t kMaxSmemPerBlock = 227 * 1024;     // sm_80 / sm_90 opt-in shared memory limit

size_t attention_smem_bytes(int Q, int L, int D) {
  const size_t n = size_t(L) + size_t(Q);
  return (2 * n * size_t(D) + size_t(kAttnWarps) * n) * sizeof(float);  // K, V, scores
}

// rope(x)[d] = T(T(x * c) + T(rot * s)) with the reference's rounding (no FMA contraction).
template <typename T>
__device__ __forceinline__ float rope_rounded(float x, float rot, float c, float s) {
  return round_through<T>(
      __fadd_rn(round_through<T>(__fmul_rn(x, c)), round_through<T>(__fmul_rn(rot, s))));
}

// grid: (Hkv * qsplit, b), block: kAttnThreads, dynamic smem: attention_smem_bytes(Q, L, D).
template <typename T, int E>
__global__ void __launch_bounds__(kAttnThreads)
draft_attention_kernel(const T* __restrict__ q,        // [b, Q, Hq, D]
                       const T* __restrict__ k_ctx,    // [b, L, Hkv, D]
                       const T* __restrict__ v_ctx,    // [b, L, Hkv, D]
                       const T* __restrict__ k_q,      // [b, Q, Hkv, D]
                       const T* __restrict__ v_q,      // [b, Q, Hkv, D]
                       const float* __restrict__ cos,  // [L + Q, D] (values of dtype T)
                       const float* __restrict__ sin,  // [L + Q, D]
                       T* __restrict__ out,            // [b, Q, Hq, D]
                       int Q, int L, int Hq, int Hkv, int qsplit, float scale_log2) {
  constexpr int D = 32 * E;
  constexpr int kHalf = D / 2;
  extern __shared__ __align__(16) float smem[];
  const int n_keys = L + Q;
  float* ks = smem;                        // [n_keys, D] roped keys (fp32 holding T values)
  float* vs = ks + n_keys * D;             // [n_keys, D] values (fp32)
  float* scores = vs + n_keys * D;         // [kAttnWarps, n_keys] log2-scaled scores

  const int kvh = blockIdx.x / qsplit;
  const int split = blockIdx.x % qsplit;
  const int b = blockIdx.y;
  const int group = Hq / Hkv;

  // ---- stage [context ; query] keys (roped with cos/sin row j) and values of (b, kvh)
  for (int idx = threadIdx.x; idx < n_keys * D; idx += kAttnThreads) {
    const int j = idx / D, d = idx % D;
    const T* kp;
    const T* vp;
    if (j < L) {
      const size_t row = ((size_t(b) * L + j) * Hkv + kvh) * D;
      kp = k_ctx + row;
      vp = v_ctx + row;
    } else {
      const size_t row = ((size_t(b) * Q + (j - L)) * Hkv + kvh) * D;
      kp = k_q + row;
      vp = v_q + row;
    }
    const float x = to_float(kp[d]);
    const float partner = to_float(kp[d ^ kHalf]);     // d +- D/2 (D is a power of two)
    const float rot = d < kHalf ? -partner : partner;  // rotate_half(x)[d]
    ks[idx] = rope_rounded<T>(x, rot, cos[j * D + d], sin[j * D + d]);
    vs[idx] = to_float(vp[d]);
  }
  __syncthreads();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row = split * kAttnWarps + warp;  // query row within (b, kvh): head-major, then slot
  if (row >= group * Q) return;               // no barrier below this point
  const int head = kvh * group + row / Q;
  const int qi = row % Q;                     // query slot -> cos/sin row L + qi
  const int d0 = lane * E;                    // this lane's head dims [d0, d0 + E)

  // ---- query: load, RoPE with row L + qi (partner dims live in lane ^ 16)
  float qv[E];
  load_vec<T, E>(q + ((size_t(b) * Q + qi) * Hq + head) * D + d0, qv);
  {
    const float* c = cos + (L + qi) * D + d0;
    const float* s = sin + (L + qi) * D + d0;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const float partner = __shfl_xor_sync(0xffffffffu, qv[e], 16);
      const float rot = lane < 16 ? -partner : partner;
      qv[e] = rope_rounded<T>(qv[e], rot, c[e], s[e]);
    }
  }

  // ---- scores (log2 domain) and their max
  float* my_scores = scores + warp * n_keys;
  float m = -INFINITY;
#pragma unroll 4
  for (int j = 0; j < n_keys; ++j) {
    const float* kr = ks + j * D + d0;
    float part = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) part = fmaf(qv[e], kr[e], part);
    const float sc = warp_allreduce_sum(part) * scale_log2;
    m = fmaxf(m, sc);
    if (lane == 0) my_scores[j] = sc;
  }
  __syncwarp();

  // ---- softmax-weighted sum of values
  float acc[E];
#pragma unroll
  for (int e = 0; e < E; ++e) acc[e] = 0.f;
  float denom = 0.f;
  for (int j = 0; j < n_keys; ++j) {
    const float p = exp2f(my_scores[j] - m);
    denom += p;
    const float* vr = vs + j * D + d0;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] = fmaf(p, vr[e], acc[e]);
  }
  const float inv = 1.f / denom;
#pragma unroll
  for (int e = 0; e < E; ++e) acc[e] *= inv;
  store_vec<T, E>(out + ((size_t(b) * Q + qi) * Hq + head) * D + d0, acc);
}

template <typename T, int E>
cudaError_t launch_typed(const DraftAttentionArgs& a, cudaStream_t stream) {
  const int group = a.Hq / a.Hkv;
  const int qsplit = (group * a.Q + kAttnWarps - 1) / kAttnWarps;
  const size_t smem = attention_smem_bytes(a.Q, a.L, a.D);
  auto kernel = draft_attention_kernel<T, E>;
  if (smem > 48 * 1024) {  // above the default dynamic limit: opt in (per launch; cheap)
    cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (err != cudaSuccess) return err;
  }
  dim3 grid(unsigned(a.Hkv * qsplit), unsigned(a.B));
  kernel<<<grid, kAttnThreads, smem, stream>>>(
      static_cast<const T*>(a.q), static_cast<const T*>(a.k_ctx), static_cast<const T*>(a.v_ctx),
      static_cast<const T*>(a.k_q), static_cast<const T*>(a.v_q), a.cos, a.sin,
      static_cast<T*>(a.out), a.Q, a.L, a.Hq, a.Hkv, qsplit, a.scale * kLog2e);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_dim(const DraftAttentionArgs& a, cudaStream_t stream) {
  switch (a.D) {
    case 32: return launch_typed<T, 1>(a, stream);
    case 64: return launch_typed<T, 2>(a, stream);
    case 128: return launch_typed<T, 4>(a, stream);
    case 256: return launch_typed<T, 8>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

const char* draft_attention_unsupported(int B, int Q, int L, int Hq, int Hkv, int D) {
  if (D != 32 && D != 64 && D != 128 && D != 256) return "head_dim not in {32, 64, 128, 256}";
  if (Hkv <= 0 || Hq % Hkv != 0) return "h_q is not a multiple of h_kv";
  if (Q <= 0 || L < 0) return "no query slots";
  if (B > 65535) return "batch > 65535 (grid.y)";
  if (attention_smem_bytes(Q, L, D) > kMaxSmemPerBlock) return "L + Q too large for shared memory";
  return nullptr;
}

cudaError_t draft_attention_launch(const DraftAttentionArgs& a, cudaStream_t stream) {
  if (draft_attention_unsupported(a.B, a.Q, a.L, a.Hq, a.Hkv, a.D) != nullptr)
    return cudaErrorInvalidValue;
  if (a.B == 0) return cudaSuccess;
  switch (a.dtype) {
    case DType::kFloat32: return launch_dim<float>(a, stream);
    case DType::kFloat16: return launch_dim<__half>(a, stream);
    case DType::kBFloat16: return launch_dim<__nv_bfloat16>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace dlite
