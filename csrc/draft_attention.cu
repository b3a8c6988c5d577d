// DLite draft attention: the K block queries of every request attend, non-causally, over that
// request's [L feature elements ; K block positions]. Spec: vllm_dlite/ops/reference.py
// (draft_attention). RoPE (rotate-half) is applied in-kernel on local positions: features at 0,
// block offset i at 1 + i. GQA: query head h reads kv head h / (Hq / Hkv). fp32 math throughout.
//
// Design. The problem is tiny and ragged-free: per (request, kv head) there are only L + K keys
// (14 + 7 = 21 for Qwen3-8B) and group * K query rows (4 * 7 = 28). One CTA stages the roped keys
// and the values of one (request, kv head) in shared memory as fp32 (2 * 21 * 128 * 4 B = 21 KiB),
// then each warp owns one query row: lane l holds head dims [l*E, l*E + E) (E = D / 32), so
// rotate_half is a single shuffle with lane ^ 16 (dims d and d +- D/2 live in lanes l and l ^ 16).
// Scores are warp all-reductions; softmax is exact two-pass (scores kept in shared memory), the
// weighted sum of V accumulates in registers. No KV cache, no padding: a request's rows are found
// from its index alone. The query rows of one (request, kv head) are split over ceil(28 / 8) = 4
// CTAs so that even batch 1 launches 32 CTAs; each re-stages the 21 KiB of K/V from L2.
//
// Cost at Qwen3-8B shapes: B * (21 KiB K/V + 56 KiB Q + 56 KiB out) of HBM traffic, i.e. ~8 MiB
// at B = 64: a few microseconds; the point of the kernel is one launch instead of the reference's
// ~10 (rope, cat, repeat_interleave, SDPA, casts) and no [B, L+K, Hq, D] intermediates.
#include "dlite_common.cuh"
#include "dlite_kernels.h"

namespace dlite {
namespace {

constexpr int kAttnWarps = 8;                       // query rows per CTA (one row per warp)
constexpr int kAttnThreads = kAttnWarps * 32;
constexpr float kLog2e = 1.4426950408889634f;       // softmax via exp2: e^x = 2^(x * log2 e)
constexpr size_t kMaxSmemPerBlock = 227 * 1024;     // sm_80 / sm_90 opt-in shared memory limit

size_t attention_smem_bytes(int K, int L, int D) {
  const size_t n = size_t(L) + size_t(K);
  return (2 * n * size_t(D) + size_t(kAttnWarps) * n) * sizeof(float);  // K, V, scores
}

// grid: (Hkv * qsplit, B), block: kAttnThreads, dynamic smem: attention_smem_bytes(K, L, D).
template <typename T, int E>
__global__ void __launch_bounds__(kAttnThreads)
draft_attention_kernel(const T* __restrict__ q,        // [B, K, Hq, D]
                       const T* __restrict__ k_feat,   // [B, L, Hkv, D]
                       const T* __restrict__ v_feat,   // [B, L, Hkv, D]
                       const T* __restrict__ k_block,  // [B, K, Hkv, D]
                       const T* __restrict__ v_block,  // [B, K, Hkv, D]
                       const float* __restrict__ cos,  // [K + 1, D]
                       const float* __restrict__ sin,  // [K + 1, D]
                       T* __restrict__ out,            // [B, K, Hq, D]
                       int K, int L, int Hq, int Hkv, int qsplit, float scale_log2) {
  constexpr int D = 32 * E;
  constexpr int kHalf = D / 2;
  extern __shared__ __align__(16) float smem[];
  const int n_keys = L + K;
  float* ks = smem;                        // [n_keys, D] roped keys (fp32)
  float* vs = ks + n_keys * D;             // [n_keys, D] values (fp32)
  float* scores = vs + n_keys * D;         // [kAttnWarps, n_keys] log2-scaled scores

  const int kvh = blockIdx.x / qsplit;
  const int split = blockIdx.x % qsplit;
  const int b = blockIdx.y;
  const int group = Hq / Hkv;

  // ---- stage [features ; block] keys (roped) and values of (b, kvh) as fp32
  for (int idx = threadIdx.x; idx < n_keys * D; idx += kAttnThreads) {
    const int j = idx / D, d = idx % D;
    const T* kp;
    const T* vp;
    int pos;
    if (j < L) {
      const size_t row = ((size_t(b) * L + j) * Hkv + kvh) * D;
      kp = k_feat + row;
      vp = v_feat + row;
      pos = 0;
    } else {
      const size_t row = ((size_t(b) * K + (j - L)) * Hkv + kvh) * D;
      kp = k_block + row;
      vp = v_block + row;
      pos = 1 + (j - L);
    }
    const float x = to_float(kp[d]);
    const float partner = to_float(kp[d ^ kHalf]);     // d +- D/2 (D is a power of two)
    const float rot = d < kHalf ? -partner : partner;  // rotate_half(x)[d]
    // x * cos + rotate_half(x) * sin with the reference's rounding (no FMA contraction)
    ks[idx] = __fadd_rn(__fmul_rn(x, cos[pos * D + d]), __fmul_rn(rot, sin[pos * D + d]));
    vs[idx] = to_float(vp[d]);
  }
  __syncthreads();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row = split * kAttnWarps + warp;  // query row within (b, kvh): head-major, then offset
  if (row >= group * K) return;               // no barrier below this point
  const int head = kvh * group + row / K;
  const int qi = row % K;                     // block offset -> local position 1 + qi
  const int d0 = lane * E;                    // this lane's head dims [d0, d0 + E)

  // ---- query: load, RoPE at position 1 + qi (partner dims live in lane ^ 16)
  float qv[E];
  load_vec<T, E>(q + ((size_t(b) * K + qi) * Hq + head) * D + d0, qv);
  {
    const float* c = cos + (1 + qi) * D + d0;
    const float* s = sin + (1 + qi) * D + d0;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const float partner = __shfl_xor_sync(0xffffffffu, qv[e], 16);
      const float rot = lane < 16 ? -partner : partner;
      qv[e] = __fadd_rn(__fmul_rn(qv[e], c[e]), __fmul_rn(rot, s[e]));
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
  store_vec<T, E>(out + ((size_t(b) * K + qi) * Hq + head) * D + d0, acc);
}

template <typename T, int E>
cudaError_t launch_typed(const DraftAttentionArgs& a, cudaStream_t stream) {
  const int group = a.Hq / a.Hkv;
  const int qsplit = (group * a.K + kAttnWarps - 1) / kAttnWarps;
  const size_t smem = attention_smem_bytes(a.K, a.L, a.D);
  auto kernel = draft_attention_kernel<T, E>;
  if (smem > 48 * 1024) {  // above the default dynamic limit: opt in (per launch; cheap)
    cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (err != cudaSuccess) return err;
  }
  dim3 grid(unsigned(a.Hkv * qsplit), unsigned(a.B));
  kernel<<<grid, kAttnThreads, smem, stream>>>(
      static_cast<const T*>(a.q), static_cast<const T*>(a.k_feat), static_cast<const T*>(a.v_feat),
      static_cast<const T*>(a.k_block), static_cast<const T*>(a.v_block), a.cos, a.sin,
      static_cast<T*>(a.out), a.K, a.L, a.Hq, a.Hkv, qsplit, a.scale * kLog2e);
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

const char* draft_attention_unsupported(int B, int K, int L, int Hq, int Hkv, int D) {
  if (D != 32 && D != 64 && D != 128 && D != 256) return "head_dim not in {32, 64, 128, 256}";
  if (Hkv <= 0 || Hq % Hkv != 0) return "Hq is not a multiple of Hkv";
  if (K <= 0 || L < 0) return "empty block";
  if (B > 65535) return "batch > 65535 (grid.y)";
  if (attention_smem_bytes(K, L, D) > kMaxSmemPerBlock) return "L + K too large for shared memory";
  return nullptr;
}

cudaError_t draft_attention_launch(const DraftAttentionArgs& a, cudaStream_t stream) {
  if (draft_attention_unsupported(a.B, a.K, a.L, a.Hq, a.Hkv, a.D) != nullptr)
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
