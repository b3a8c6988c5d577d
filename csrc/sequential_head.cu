// DLite low-rank sequential head, greedy: K dependent steps of
//
//     s_i  = tanh(W_state s_{i-1} + W_in E(x_{t+i}))        rank r, s_{-1} = 0, fp32
//     h~_i = h_i + W_out s_i                                 fp32
//     X_i  = T(rmsnorm(h~_i) * norm_w)                       rounded to the lm_head dtype T
//     logits_i = float(T(lm_head @ X_i))                     [V], fp32 accumulate, T rounding
//     x_{t+i+1} = argmax(logits_i)                           first index among equal maxima
//
// Spec: vllm_dlite/ops/reference.py (sequential_head, temperature 0, no forced ids).
//
// ================================================================ design against the floor ====
// The floor is the lm_head read: every step must stream the whole [V, H] matrix once, and step
// i + 1 cannot start before step i's argmax (its embedding feeds s_{i+1}). Qwen3-8B: V = 151936,
// H = 4096, bf16 -> 1.245 GB per step, 8.7 GB per K = 7 round, i.e. 259 us per step at the
// H200's 4.8 TB/s datasheet rate (289 us at the ~4.3 TB/s a device copy reaches). Everything else
// per step is small: W_in + W_out + W_state = 8.9 MB (0.7 %), the B embedding rows, and the
// fp32 logits written (B * V * 4 B = 39 MB at B = 64, 3 %). So the design goal is: read lm_head
// exactly once per step for ALL B rows, at full bandwidth, and keep the rest off the critical path.
//
// Four launches per step (plus one memset per call and 64-row batch chunk), all graph-capturable,
// no host syncs:
//   1. state_step_kernel   argmax ids of step i-1 (already decoded) -> embedding gather ->
//                          W_in E(x) (tensor cores, split over H) + W_state s_{i-1} (FFMA) ->
//                          the last CTA of each row group (atomic ticket) sums the partials in a
//                          fixed order and applies tanh -> s_i.
//   2. hidden_step_kernel  h~_i = h_i + W_out s_i (FFMA, fp32 like the reference).
//   3. norm_step_kernel    one CTA per row: rms over H, X_i = T((h~ * rs) * norm_w).
//   4. lm_head_step_kernel the bandwidth-bound GEMM, below. Its epilogue writes the logits, does
//                          the argmax (CTA max in shared memory, then one 64-bit atomicMax per
//                          row into gmem), and the last CTA to finish (atomic ticket) decodes the
//                          step's ids into draft_ids, where step i + 1's state kernel reads them.
// Kernels 1-3 move ~9 MB and take a few microseconds each; with ~2 us launch gaps in a CUDA graph
// they add ~3-5 % to the ~290 us step. A single persistent cooperative kernel with grid syncs
// would save most of those gaps (3 grid barriers per step instead of 4 launches) at the price of
// co-residency constraints and harder debugging; this multi-kernel form is the first version.
//
// lm_head GEMM (C[V, B] = W[V, H] . X[B, H]^T, B <= 64 per chunk; larger batches are chunked):
//  * mma.sync m16n8k16 (bf16/fp16 -> fp32): V rows are the M side, the batch is N (1..8 n-tiles
//    of 8), so all B rows share every W tile read: W is read once per step whatever B is.
//    At B = 64 the step is 80 GFLOP, ~280 TFLOP/s at the floor: CUDA cores could not keep up.
//  * W goes straight from global memory into MMA A-fragments, no shared memory: each thread
//    loads 16 B (8 consecutive h) of rows g and g + 8 of a 16-row tile (g = lane / 4). The MMA's
//    k order is a permutation we choose (a dot product is order-free), so the 8 elements at
//    h0 + 8t .. +7 of thread t serve two k16 steps: logical k {2t, 2t+1, 2t+8, 2t+9} <- h0 + 8t +
//    4q + {0,1,2,3} for step q. The B operand (X, from shared memory) uses the same permutation.
//    Each warp load instruction covers 8 rows x 64 contiguous bytes: full 32 B sectors.
//  * Loads use ld.global.nc.L1::no_allocate (streamed, not kept in L1) and are double-buffered in
//    registers one sub-chunk ahead, so 32-64 KiB per SM are in flight (Little's law at 4.8 TB/s
//    and ~0.8 us latency needs ~29 KiB per SM on 132 SMs).
//  * X (the normalised hidden, [B, H] in T) is staged through shared memory in chunks of 256 h,
//    double-buffered with cp.async, and shared by the 8 warps of a CTA. Row stride 256 + 32
//    elements (576 B = 64 mod 128) makes the 16 B fragment reads of two rows per quarter-warp
//    conflict-free.
//  * Persistent grid: one CTA per SM (x occupancy); CTA c owns a contiguous, balanced range of
//    16-row m-tiles (~72 for Qwen3-8B on 132 SMs). It sweeps that range with "big" passes (each
//    warp MT = 2 or 4 m-tiles, i.e. 256-512 rows per CTA per pass over H, see BigTile) and
//    finishes the remainder with "small" passes (1 m-tile per warp, wider register prefetch so
//    the bytes in flight stay similar). This avoids the ~25 % tail that a 2.25-wave grid of
//    512-row CTAs would have, while X is re-read from L2 only once per 256-512 rows (X L2
//    traffic <= 25 % of the W bytes at B = 64, ~3 % at B = 8).
//  * Expected: the lm_head kernel near the copy bandwidth for B <= 32 (~85-90 %); at B = 64 the
//    tensor work (MMA issue + X fragment reads) overlaps less well (~70-80 %). Unmeasured here.
// ==============================================================================================
#include "dlite_common.cuh"
#include "dlite_kernels.h"

#include <algorithm>

namespace dlite {
namespace {

constexpr int kThreads = 256;                  // 8 warps per CTA in every head kernel
constexpr int kWarps = kThreads / 32;
constexpr int kMaxBatch = 64;                  // batch rows per chunk = 8 n-tiles of 8
constexpr int kChunk = 256;                    // h per X shared-memory stage (H % kChunk == 0)
constexpr int kXPad = 32;                      // +64 B per X row: stride = 64 mod 128 B
constexpr int kXStride = kChunk + kXPad;       // X smem row stride, elements
constexpr int kSmallU = 4;                     // 16 B W vectors per row per sub-chunk, small pass
constexpr int kStateRows = kWarps * 16;        // W_in / W_state rows per state CTA (1 m-tile/warp)
constexpr int kHiddenCols = 64;                // h~ columns per hidden CTA
constexpr int kBGroup = 8;                     // batch rows per CTA in the FFMA kernels
constexpr int kMaxRank = 1024;                 // FFMA kernels keep [kBGroup, r] fp32 in smem
constexpr uint32_t kAllLanes = 0xffffffffu;

// Big-pass warp tile: MT m-tiles (16 rows each) x U 16 B vectors per row per register stage.
// Registers: acc = MT * NT * 4 fp32, W double buffer = 2 * MT * 2 * U * 4; both must fit in 255
// with the addressing (ptxas -v: no spills). Bytes in flight per warp = MT * 2 * U * 512.
//   NT = 8: MT 2, U 2 -> 64 acc + 64 W regs, 4 KiB/warp in flight (MT 4 spilled at 255 regs)
//   NT = 4: MT 4, U 1 -> 64 acc + 64 W regs, 4 KiB/warp
//   NT <= 2: MT 4, U 2 -> <= 32 acc + 128 W regs, 8 KiB/warp
template <int NT>
struct BigTile {
  static constexpr int MT = NT >= 8 ? 2 : 4;
  static constexpr int U = NT == 4 ? 1 : 2;
};

// ------------------------------------------------------------------------- PTX wrappers
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// 16 B streaming load of weights: read-only, not allocated in L1, 256 B L2 prefetch.
__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

template <typename T>
struct Mma;
template <>
struct Mma<__nv_bfloat16> {
  __device__ __forceinline__ static void run(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint32_t b0, uint32_t b1) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    __trap();
#endif
  }
};
template <>
struct Mma<__half> {
  __device__ __forceinline__ static void run(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint32_t b0, uint32_t b1) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    __trap();
#endif
  }
};

// Orderable 64-bit argmax key: high word = float bits mapped to unsigned order, low word =
// ~index, so the max key is the max value and, among equal values, the smallest index
// (torch.argmax's choice). -0.0 is folded into +0.0 first (they compare equal in torch).
__device__ __forceinline__ unsigned long long argmax_key(float v, int64_t idx) {
  v += 0.0f;  // -0 -> +0 (not an identity under IEEE, so the compiler keeps it)
  uint32_t u = __float_as_uint(v);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (static_cast<unsigned long long>(u) << 32) |
         static_cast<unsigned long long>(0xffffffffu - static_cast<uint32_t>(idx));
}
__device__ __forceinline__ int64_t argmax_key_index(unsigned long long key) {
  return static_cast<int64_t>(0xffffffffu - static_cast<uint32_t>(key & 0xffffffffull));
}

// ------------------------------------------------------------------------- X staging
// xs: [NT * 8 rows][kXStride] in smem; rows[n] = &X[n][0] in gmem or nullptr (zero row).
template <typename T, int NT>
__device__ __forceinline__ void stage_x(T* xs, const T* const* rows, int h0) {
  constexpr int kVecPerRow = kChunk / 8;  // 16 B vectors of 8 elements per row
  for (int v = threadIdx.x; v < NT * 8 * kVecPerRow; v += kThreads) {
    const int n = v / kVecPerRow, c = (v % kVecPerRow) * 8;
    T* dst = xs + n * kXStride + c;
    const T* src = rows[n];
    if (src != nullptr) {
      cp_async16(dst, src + h0 + c);
    } else {
      *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// ------------------------------------------------------------------------- GEMM pass
// One warp computes acc[MT][NT][4] = A[row0 : row0 + 16 MT, k-range] . X[0 : 8 NT, k-range]^T
// with all warps of the CTA sweeping the same k-range in lockstep (X staged once per CTA).
// Fragment layout (m16n8k16, g = lane / 4, t = lane % 4):
//   acc[mi][j][0..1] -> row row0 + 16 mi + g,     batch cols 8 j + 2 t + {0, 1}
//   acc[mi][j][2..3] -> row row0 + 16 mi + g + 8, batch cols 8 j + 2 t + {0, 1}
// Rows >= n_rows are clamped for the loads (their results are discarded by the caller).
template <typename T, int NT, int MT, int U>
struct GemmPass {
  static constexpr int kSub = 32 * U;          // h per register stage (U x 16 B per row/thread)
  static constexpr int kNSub = kChunk / kSub;  // register stages per X chunk
  static_assert(kNSub % 2 == 0, "register double buffer needs an even number of sub-chunks");

  __device__ __forceinline__ static void load_w(uint4 (&w)[MT][2][U], const T* const (&wrow)[MT][2],
                                                int h) {
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf)
#pragma unroll
        for (int u = 0; u < U; ++u) w[mi][hf][u] = ld_stream(wrow[mi][hf] + h + 32 * u);
  }

  __device__ __forceinline__ static void mma_sub(float (&acc)[MT][NT][4],
                                                 const uint4 (&w)[MT][2][U], const T* xs,
                                                 int col0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        // X[8 j + g][col0 + 32 u + 8 t .. + 7]: the B fragments of both k16 steps
        const uint4 x =
            *reinterpret_cast<const uint4*>(xs + (j * 8 + g) * kXStride + col0 + 32 * u + 8 * t);
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) {
          const uint4& lo = w[mi][0][u];  // row g
          const uint4& hi = w[mi][1][u];  // row g + 8
          Mma<T>::run(acc[mi][j], lo.x, hi.x, lo.y, hi.y, x.x, x.y);  // k16 step q = 0
          Mma<T>::run(acc[mi][j], lo.z, hi.z, lo.w, hi.w, x.z, x.w);  // k16 step q = 1
        }
      }
    }
  }

  // k-range [k0, k0 + nchunks * kChunk); xs = 2 stages of [NT * 8][kXStride].
  __device__ __forceinline__ static void run(const T* __restrict__ A, int64_t n_rows, int lda,
                                             int64_t row0, bool active, int k0, int nchunks,
                                             T* xs, const T* const* xrows,
                                             float (&acc)[MT][NT][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const T* wrow[MT][2];
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int64_t r = min(row0 + 16 * mi + 8 * hf + g, n_rows - 1);
        wrow[mi][hf] = A + r * lda + 8 * t;
      }
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[mi][j][c] = 0.f;

    constexpr int kStage = NT * 8 * kXStride;  // elements per X stage
    const int k_end = k0 + nchunks * kChunk;
    uint4 w[2][MT][2][U];
    stage_x<T, NT>(xs, xrows, k0);
    cp_async_commit();
    if (active) load_w(w[0], wrow, k0);
    for (int c = 0; c < nchunks; ++c) {
      if (c + 1 < nchunks) stage_x<T, NT>(xs + ((c + 1) & 1) * kStage, xrows, k0 + (c + 1) * kChunk);
      cp_async_commit();  // possibly empty group: keeps the wait count uniform
      cp_async_wait<1>();  // chunk c has landed (only chunk c + 1 may be in flight)
      __syncthreads();
      const T* xc = xs + (c & 1) * kStage;
#pragma unroll
      for (int s = 0; s < kNSub; ++s) {
        const int h_next = k0 + c * kChunk + (s + 1) * kSub;
        if (active && h_next < k_end) load_w(w[(s + 1) & 1], wrow, h_next);  // prefetch
        if (active) mma_sub(acc, w[s & 1], xc, s * kSub);
      }
      __syncthreads();  // all warps are done with this stage before it is restaged
    }
  }
};

// ------------------------------------------------------------------------- FFMA dot helper
// Dot products of one weight row (n elements, T) with kBGroup fp32 rows ss[kBGroup][n] (smem).
// Lanes split n in 16 B vectors; a reduce-scatter butterfly (9 shuffles instead of 8 x 5) leaves
// the full dot with ss row (lane / 4) in every lane.
template <typename T>
__device__ __forceinline__ float dot_rows8(const T* __restrict__ wrow, const float* ss, int n) {
  const int lane = threadIdx.x & 31;
  float acc[kBGroup];
#pragma unroll
  for (int b = 0; b < kBGroup; ++b) acc[b] = 0.f;
  for (int k = 8 * lane; k < n; k += 8 * 32) {
    float wf[8];
    unpack8<T>(*reinterpret_cast<const uint4*>(wrow + k), wf);
#pragma unroll
    for (int b = 0; b < kBGroup; ++b) {
      const float4 s0 = *reinterpret_cast<const float4*>(ss + b * n + k);
      const float4 s1 = *reinterpret_cast<const float4*>(ss + b * n + k + 4);
      float a = acc[b];
      a = fmaf(wf[0], s0.x, a);
      a = fmaf(wf[1], s0.y, a);
      a = fmaf(wf[2], s0.z, a);
      a = fmaf(wf[3], s0.w, a);
      a = fmaf(wf[4], s1.x, a);
      a = fmaf(wf[5], s1.y, a);
      a = fmaf(wf[6], s1.z, a);
      a = fmaf(wf[7], s1.w, a);
      acc[b] = a;
    }
  }
  // halve the value set three times (lane bits 4, 3, 2 pick which half a lane keeps)
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const bool upper = lane & 16;
    const float send = upper ? acc[i] : acc[i + 4];
    acc[i] = (upper ? acc[i + 4] : acc[i]) + __shfl_xor_sync(kAllLanes, send, 16);
  }  // acc[i] now holds row i + 4 * bit4
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const bool upper = lane & 8;
    const float send = upper ? acc[i] : acc[i + 2];
    acc[i] = (upper ? acc[i + 2] : acc[i]) + __shfl_xor_sync(kAllLanes, send, 8);
  }  // acc[i] holds row i + 2 * bit3 + 4 * bit4
  {
    const bool upper = lane & 4;
    const float send = upper ? acc[0] : acc[1];
    acc[0] = (upper ? acc[1] : acc[0]) + __shfl_xor_sync(kAllLanes, send, 4);
  }  // acc[0] holds row bit2 + 2 * bit3 + 4 * bit4 = lane / 4
  acc[0] += __shfl_xor_sync(kAllLanes, acc[0], 2);
  acc[0] += __shfl_xor_sync(kAllLanes, acc[0], 1);
  return acc[0];
}

// ss[kBGroup][n] <- src rows b0 .. b0 + 7 (zeros past B); n % 4 == 0.
__device__ __forceinline__ void load_rows8(float* ss, const float* __restrict__ src, int b0, int B,
                                           int n) {
  for (int idx = threadIdx.x * 4; idx < kBGroup * n; idx += kThreads * 4) {
    const int b = idx / n;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (b0 + b < B) v = *reinterpret_cast<const float4*>(src + size_t(b0) * n + idx);
    *reinterpret_cast<float4*>(ss + idx) = v;
  }
}

// Workspace carve-up (per batch chunk of <= kMaxBatch rows; reused across chunks).
struct Workspace {
  unsigned long long* best;  // [K][kMaxBatch] argmax keys          (zeroed per chunk)
  unsigned* lm_count;        // [K] lm_head CTA tickets                (zeroed)
  unsigned* state_count;     // [K][n_rg] state CTA tickets            (zeroed)
  size_t zero_bytes;         // bytes of the zeroed prefix
  float* part_in;            // [H / kChunk][kMaxBatch][r]  W_in E partial sums
  float* part_st;            // [kMaxBatch][r]              W_state s partial
  float* state;              // [2][kMaxBatch][r]           s ping-pong
  float* htil;               // [kMaxBatch][H]              h~ (fp32)
  void* x;                   // [kMaxBatch][H]              normalised hidden (T)
  size_t total_bytes;
};

size_t align256(size_t x) { return (x + 255) & ~size_t(255); }

Workspace carve(void* base, int K, int H, int r) {  // base == nullptr: sizes only
  const int n_rg = (r + kStateRows - 1) / kStateRows;
  const uintptr_t p = reinterpret_cast<uintptr_t>(base);
  size_t off = 0;
  Workspace ws{};
  auto take = [&](size_t bytes) {
    void* q = reinterpret_cast<void*>(p + off);
    off = align256(off + bytes);
    return q;
  };
  ws.best = reinterpret_cast<unsigned long long*>(take(size_t(K) * kMaxBatch * sizeof(unsigned long long)));
  ws.lm_count = reinterpret_cast<unsigned*>(take(size_t(K) * sizeof(unsigned)));
  ws.state_count = reinterpret_cast<unsigned*>(take(size_t(K) * n_rg * sizeof(unsigned)));
  ws.zero_bytes = off;
  ws.part_in = reinterpret_cast<float*>(take(size_t(H / kChunk) * kMaxBatch * r * sizeof(float)));
  ws.part_st = reinterpret_cast<float*>(take(size_t(kMaxBatch) * r * sizeof(float)));
  ws.state = reinterpret_cast<float*>(take(size_t(2) * kMaxBatch * r * sizeof(float)));
  ws.htil = reinterpret_cast<float*>(take(size_t(kMaxBatch) * H * sizeof(float)));
  ws.x = take(size_t(kMaxBatch) * H * sizeof(__half));  // bf16 or fp16: 2 bytes
  ws.total_bytes = off;
  return ws;
}

// =============================================================== kernel 1: recurrent state s_i
// grid: n_rg * (S + n_st) CTAs; S = H / kChunk split-K slices of W_in E (tensor cores), n_st =
// ceil(B / 8) batch groups of W_state s_{i-1} (FFMA; 0 at step 0 where s_{-1} = 0).
// dynamic smem: max(2 X stages, kBGroup * r fp32).
template <typename T, int NT>
__global__ void __launch_bounds__(kThreads)
state_step_kernel(const T* __restrict__ embed, int64_t embed_rows,
                  const int64_t* __restrict__ anchor,  // [B]
                  const int64_t* __restrict__ ids,     // [B, K] drafted so far
                  const T* __restrict__ w_in,          // [r, H]
                  const T* __restrict__ w_state,       // [r, r]
                  int H, int r, int B, int K, int step, int n_st,
                  float* __restrict__ part_in,         // [S][kMaxBatch][r]
                  float* __restrict__ part_st,         // [kMaxBatch][r]
                  const float* __restrict__ s_prev,    // [kMaxBatch][r]
                  float* __restrict__ s_next,          // [kMaxBatch][r]
                  unsigned* __restrict__ tickets) {    // [n_rg]
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ const T* xrows[NT * 8];
  __shared__ bool is_last;
  const int S = H / kChunk;
  const int per_rg = S + n_st;
  const int rg = blockIdx.x / per_rg, role = blockIdx.x % per_rg;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int rows_begin = rg * kStateRows, rows_end = min(r, rows_begin + kStateRows);

  if (role < S) {
    // ---- W_in E(x): rows [rows_begin, +128) x h-slice [role * 256, +256), tensor cores
    if (threadIdx.x < NT * 8) {
      const int b = threadIdx.x;
      const T* p = nullptr;
      if (b < B) {
        int64_t id = step == 0 ? anchor[b] : ids[int64_t(b) * K + step - 1];
        id = id < 0 ? 0 : (id >= embed_rows ? embed_rows - 1 : id);  // F.embedding would raise
        p = embed + id * H;
      }
      xrows[b] = p;
    }
    __syncthreads();
    float acc[1][NT][4];
    const int row0 = rows_begin + warp * 16;
    const bool active = row0 < rows_end;  // r % 16 == 0: a started m-tile is whole
    GemmPass<T, NT, 1, kSmallU>::run(w_in, r, H, row0, active, role * kChunk, 1,
                                     reinterpret_cast<T*>(smem_raw), xrows, acc);
    if (active) {
      float* dst = part_in + size_t(role) * kMaxBatch * r;
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int b = j * 8 + 2 * t + (c & 1);
          const int row = row0 + g + 8 * (c >> 1);
          if (b < B) dst[size_t(b) * r + row] = acc[0][j][c];
        }
    }
  } else {
    // ---- W_state s_{i-1}: rows [rows_begin, +128) x batch rows [b0, b0 + 8), FFMA in fp32
    const int b0 = (role - S) * kBGroup;
    float* ss = reinterpret_cast<float*>(smem_raw);
    load_rows8(ss, s_prev, b0, B, r);
    __syncthreads();
    for (int row = rows_begin + warp; row < rows_end; row += kWarps) {
      const float v = dot_rows8<T>(w_state + size_t(row) * r, ss, r);
      if (t == 0 && b0 + g < B) part_st[size_t(b0 + g) * r + row] = v;
    }
  }

  // ---- ticket: the last CTA of this row group reduces the partials and applies tanh
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(&tickets[rg], 1u) == unsigned(per_rg - 1);
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  const int n_rows = rows_end - rows_begin;
  for (int idx = threadIdx.x; idx < n_rows * B; idx += kThreads) {
    const int b = idx / n_rows, row = rows_begin + idx % n_rows;
    float u = 0.f;
    for (int s = 0; s < S; ++s) u += __ldcg(part_in + (size_t(s) * kMaxBatch + b) * r + row);
    if (step > 0) u = __ldcg(part_st + size_t(b) * r + row) + u;  // W_state s + W_in E
    s_next[size_t(b) * r + row] = tanhf(u);
  }
}

// =============================================================== kernel 2: h~ = h + W_out s
// grid: (H / kHiddenCols, ceil(B / 8)); dynamic smem: kBGroup * r fp32.
template <typename T>
__global__ void __launch_bounds__(kThreads)
hidden_step_kernel(const T* __restrict__ h,        // [B, K, H]
                   const T* __restrict__ w_out,    // [H, r]
                   const float* __restrict__ s,    // [kMaxBatch][r]
                   float* __restrict__ htil,       // [kMaxBatch][H]
                   int B, int K, int H, int r, int step) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* ss = reinterpret_cast<float*>(smem_raw);
  const int b0 = blockIdx.y * kBGroup;
  load_rows8(ss, s, b0, B, r);
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int col_end = (blockIdx.x + 1) * kHiddenCols;
  for (int col = blockIdx.x * kHiddenCols + warp; col < col_end; col += kWarps) {
    const float v = dot_rows8<T>(w_out + size_t(col) * r, ss, r);
    const int b = b0 + g;
    if (t == 0 && b < B)
      htil[size_t(b) * H + col] = to_float(h[(size_t(b) * K + step) * H + col]) + v;
  }
}

// =============================================================== kernel 3: X = T(rmsnorm(h~) w)
// grid: B; one CTA per row (H fp32 = 16 KiB read, H T written).
template <typename T>
__global__ void __launch_bounds__(kThreads)
norm_step_kernel(const float* __restrict__ htil,  // [kMaxBatch][H]
                 const T* __restrict__ norm_w,    // [H]
                 T* __restrict__ x,               // [kMaxBatch][H]
                 int H, float eps) {
  __shared__ float warp_sums[kWarps];
  __shared__ float rs_shared;
  const float* row = htil + size_t(blockIdx.x) * H;
  float ss = 0.f;
  for (int c = threadIdx.x * 4; c < H; c += kThreads * 4) {
    const float4 v = *reinterpret_cast<const float4*>(row + c);
    ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
  }
  ss = warp_allreduce_sum(ss);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = ss;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.f;
    for (int w = 0; w < kWarps; ++w) total += warp_sums[w];
    rs_shared = 1.f / sqrtf(total / float(H) + eps);  // rsqrt(mean(x^2) + eps), IEEE
  }
  __syncthreads();
  const float rs = rs_shared;
  T* out = x + size_t(blockIdx.x) * H;
  for (int c = threadIdx.x; c < H; c += kThreads)
    out[c] = from_float<T>(__fmul_rn(__fmul_rn(row[c], rs), to_float(norm_w[c])));
}

// =============================================================== kernel 4: lm_head + argmax
template <typename T, int NT, int MT>
__device__ __forceinline__ void lm_head_epilogue(const float (&acc)[MT][NT][4], int64_t row0,
                                                 int64_t V, int B, int K, int step,
                                                 float* __restrict__ logits,
                                                 unsigned long long* sbest) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int b = j * 8 + 2 * t + e;
      float* out = logits + (int64_t(b) * K + step) * V;
      unsigned long long best = 0ull;
#pragma unroll
      for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int64_t v = row0 + 16 * mi + 8 * hf + g;
          const float val = round_through<T>(acc[mi][j][2 * hf + e]);
          if (v < V) {
            if (b < B) __stcs(out + v, val);  // streaming store: 4 rows x 32 B per instruction
            const unsigned long long key = argmax_key(val, v);
            best = key > best ? key : best;
          }
        }
#pragma unroll
      for (int m = 4; m < 32; m <<= 1) {  // max over g (lanes with the same t)
        const unsigned long long other = __shfl_xor_sync(kAllLanes, best, m);
        best = other > best ? other : best;
      }
      if (g == 0 && b < B) atomicMax(&sbest[b], best);
    }
  }
}

// grid: persistent, min(#SM * occupancy, ceil(m_tiles / 8)); dynamic smem: 2 X stages.
template <typename T, int NT>
__global__ void __launch_bounds__(kThreads, 1)
lm_head_step_kernel(const T* __restrict__ W,          // [V, H]
                    int64_t V, int H,
                    const T* __restrict__ x,          // [kMaxBatch][H] normalised hidden
                    int B, int K, int step,
                    float* __restrict__ logits,       // [B, K, V]
                    unsigned long long* __restrict__ best,  // [kMaxBatch] (this step)
                    unsigned* __restrict__ ticket,    // this step's CTA counter
                    int64_t* __restrict__ ids) {      // [B, K]
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ const T* xrows[NT * 8];
  __shared__ unsigned long long sbest[NT * 8];
  __shared__ bool is_last;
  if (threadIdx.x < NT * 8) {
    xrows[threadIdx.x] = threadIdx.x < B ? x + size_t(threadIdx.x) * H : nullptr;
    sbest[threadIdx.x] = 0ull;
  }
  __syncthreads();
  T* xs = reinterpret_cast<T*>(smem_raw);
  const int warp = threadIdx.x >> 5;
  const int64_t m_tiles = (V + 15) / 16;
  const int64_t tile_end = m_tiles * (blockIdx.x + 1) / gridDim.x;
  int64_t tile = m_tiles * blockIdx.x / gridDim.x;
  const int nchunks = H / kChunk;

  // big passes: 8 warps x MT m-tiles (256 or 512 rows) per sweep over H
  constexpr int MT = BigTile<NT>::MT;
  while (tile_end - tile >= int64_t(kWarps) * MT) {
    float acc[MT][NT][4];
    const int64_t row0 = (tile + int64_t(warp) * MT) * 16;
    GemmPass<T, NT, MT, BigTile<NT>::U>::run(W, V, H, row0, true, 0, nchunks, xs, xrows, acc);
    lm_head_epilogue<T, NT, MT>(acc, row0, V, B, K, step, logits, sbest);
    tile += int64_t(kWarps) * MT;
  }
  // small passes for the remainder: one m-tile per warp, wider prefetch
  while (tile < tile_end) {
    float acc[1][NT][4];
    const int64_t my_tile = tile + warp;
    const bool active = my_tile < tile_end;
    GemmPass<T, NT, 1, kSmallU>::run(W, V, H, my_tile * 16, active, 0, nchunks, xs, xrows, acc);
    if (active) lm_head_epilogue<T, NT, 1>(acc, my_tile * 16, V, B, K, step, logits, sbest);
    tile += kWarps;
  }

  // ---- publish this CTA's maxima; the last CTA decodes the step's ids
  __syncthreads();
  if (threadIdx.x < B) atomicMax(&best[threadIdx.x], sbest[threadIdx.x]);
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(ticket, 1u) == gridDim.x - 1;
  __syncthreads();
  if (is_last && threadIdx.x < B) {
    __threadfence();
    const unsigned long long key = atomicMax(&best[threadIdx.x], 0ull);  // coherent read
    ids[int64_t(threadIdx.x) * K + step] = argmax_key_index(key);
  }
}

// ------------------------------------------------------------------------- host side
template <typename Kernel>
cudaError_t allow_smem(Kernel kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;  // default dynamic shared memory limit
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
}

#define DLITE_TRY(expr)                         \
  do {                                          \
    const cudaError_t err_ = (expr);            \
    if (err_ != cudaSuccess) return err_;       \
  } while (0)

template <typename T, int NT>
cudaError_t run_chunk(const SequentialHeadArgs& a, int b_begin, int Bc, const Workspace& ws,
                      cudaStream_t stream) {
  const int K = a.K, H = a.H, r = a.r;
  const int64_t V = a.V;
  const int S = H / kChunk;
  const int n_rg = (r + kStateRows - 1) / kStateRows;
  const int n_bg = (Bc + kBGroup - 1) / kBGroup;

  const T* h = static_cast<const T*>(a.h) + size_t(b_begin) * K * H;
  const int64_t* anchor = a.anchor + b_begin;
  int64_t* ids = a.draft_ids + size_t(b_begin) * K;
  float* logits = a.logits + size_t(b_begin) * K * V;
  T* x = static_cast<T*>(ws.x);

  DLITE_TRY(cudaMemsetAsync(ws.best, 0, ws.zero_bytes, stream));
  if (a.poison_workspace)  // NaN everywhere a kernel must write before anything reads
    DLITE_TRY(cudaMemsetAsync(ws.part_in, 0xff,
                              ws.total_bytes - (reinterpret_cast<char*>(ws.part_in) -
                                                reinterpret_cast<char*>(ws.best)),
                              stream));

  int device = 0, n_sm = 0, occ = 0;
  DLITE_TRY(cudaGetDevice(&device));
  DLITE_TRY(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, device));
  const size_t x_smem = size_t(2) * NT * 8 * kXStride * sizeof(T);
  const size_t st_smem = size_t(kBGroup) * r * sizeof(float);
  const size_t state_smem = std::max(x_smem, st_smem);

  auto state_k = state_step_kernel<T, NT>;
  auto hidden_k = hidden_step_kernel<T>;
  auto norm_k = norm_step_kernel<T>;
  auto lm_k = lm_head_step_kernel<T, NT>;
  DLITE_TRY(allow_smem(state_k, state_smem));
  DLITE_TRY(allow_smem(hidden_k, st_smem));
  DLITE_TRY(allow_smem(lm_k, x_smem));
  DLITE_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, lm_k, kThreads, x_smem));
  const int64_t m_tiles = (V + 15) / 16;
  const int lm_grid = int(std::max<int64_t>(
      1, std::min<int64_t>(int64_t(n_sm) * std::max(occ, 1), (m_tiles + kWarps - 1) / kWarps)));

  for (int step = 0; step < K; ++step) {
    const int n_st = step == 0 ? 0 : n_bg;  // s_{-1} = 0: no W_state work at step 0
    const float* s_prev = ws.state + size_t((step + 1) & 1) * kMaxBatch * r;
    float* s_cur = ws.state + size_t(step & 1) * kMaxBatch * r;
    state_k<<<n_rg * (S + n_st), kThreads, state_smem, stream>>>(
        static_cast<const T*>(a.embed), a.embed_rows, anchor, ids,
        static_cast<const T*>(a.w_in), static_cast<const T*>(a.w_state), H, r, Bc, K, step, n_st,
        ws.part_in, ws.part_st, s_prev, s_cur, ws.state_count + size_t(step) * n_rg);
    DLITE_TRY(cudaGetLastError());
    hidden_k<<<dim3(H / kHiddenCols, n_bg), kThreads, st_smem, stream>>>(
        h, static_cast<const T*>(a.w_out), s_cur, ws.htil, Bc, K, H, r, step);
    DLITE_TRY(cudaGetLastError());
    norm_k<<<Bc, kThreads, 0, stream>>>(ws.htil, static_cast<const T*>(a.norm_w), x, H, a.eps);
    DLITE_TRY(cudaGetLastError());
    lm_k<<<lm_grid, kThreads, x_smem, stream>>>(
        static_cast<const T*>(a.lm_head), V, H, x, Bc, K, step, logits,
        ws.best + size_t(step) * kMaxBatch, ws.lm_count + step, ids);
    DLITE_TRY(cudaGetLastError());
  }
  return cudaSuccess;
}

template <typename T>
cudaError_t run_typed(const SequentialHeadArgs& a, cudaStream_t stream) {
  const Workspace ws = carve(a.workspace, a.K, a.H, a.r);
  for (int b0 = 0; b0 < a.B; b0 += kMaxBatch) {
    const int Bc = std::min(kMaxBatch, a.B - b0);
    cudaError_t err;
    if (Bc <= 8) err = run_chunk<T, 1>(a, b0, Bc, ws, stream);
    else if (Bc <= 16) err = run_chunk<T, 2>(a, b0, Bc, ws, stream);
    else if (Bc <= 32) err = run_chunk<T, 4>(a, b0, Bc, ws, stream);
    else err = run_chunk<T, 8>(a, b0, Bc, ws, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace

const char* sequential_head_unsupported(int H, int r, int64_t V, DType dtype) {
  if (dtype != DType::kBFloat16 && dtype != DType::kFloat16) return "lm_head dtype not bf16/fp16";
  if (H <= 0 || H % kChunk != 0) return "hidden size not a multiple of 256";
  if (r <= 0 || r % 16 != 0 || r > kMaxRank) return "rank not a multiple of 16 in [16, 1024]";
  if (V <= 0 || V >= (int64_t(1) << 31)) return "vocabulary size out of range";
  return nullptr;
}

size_t sequential_head_workspace_bytes(int K, int H, int r) {
  return carve(nullptr, K, H, r).total_bytes;
}

cudaError_t sequential_head_greedy_launch(const SequentialHeadArgs& a, cudaStream_t stream) {
  if (sequential_head_unsupported(a.H, a.r, a.V, a.dtype) != nullptr || a.K <= 0)
    return cudaErrorInvalidValue;
  if (a.B == 0) return cudaSuccess;
  int device = 0, major = 0;
  DLITE_TRY(cudaGetDevice(&device));
  DLITE_TRY(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  if (major < 8) return cudaErrorNotSupported;  // mma.sync bf16 and cp.async need sm_80+
  if (a.dtype == DType::kBFloat16) return run_typed<__nv_bfloat16>(a, stream);
  return run_typed<__half>(a, stream);
}

}  // namespace dlite
