// DLite sequential head, format dlite_v1, greedy: all steps of a round in ONE cooperative launch
// (per chunk of <= 64 requests). Spec: vllm_dlite/ops/reference.py (sequential_head with
// temperature < GREEDY_EPS). T = bf16 or fp16 (the head's dtype); every matrix product runs on
// tensor cores (mma.sync m16n8k16, T operands, fp32 accumulation) and every value the reference
// keeps in T is rounded to T at the same point:
//
//   Phi(s, t):  e = P[t]                                   P = prev_token_embedding [V, r]
//               zc = T(W_s [s ; e] + b_s)                  W_s [2r, 2r], b_s [2r]
//               g = T(sigmoid(z)),  h = T(tanh(c))         z = zc[:r], c = zc[r:]
//               s' = T( T(g * s) + T( T(1 - g) * h ) )     (PyTorch's per-op rounding)
//   s_0 = 0, or Phi(0, x_{a-1}) when prime ids are given (G > 1)
//   step k = 0..num_steps-1:
//               s_{k+1} = Phi(s_k, t_k)                    t_0 = x_a, t_k = id drafted at k-1
//               o = T(W_f [s_{k+1} ; T(d_k)] + b_f)        W_f [r, r + H], b_f [r]
//               logits_k = float(T(W_o o))                 W_o = output_proj [V, r]
//               t_{k+1} = argmax(logits_k)                 first index among equal maxima
//
// ================================================================ design against the floor ====
// Bytes per step: W_o = V * r * 2 (155.6 MB at Qwen3-8B: V 151936, r 512), W_f = r (r + H) * 2
// (4.7 MB), W_s = 4 r^2 * 2 (2.1 MB), b P rows, and the fp32 logits written (b * V * 4: 0.6 MB at
// b = 1, 38.9 MB at b = 64). Step k + 1 needs t_k, the argmax over ALL of step k's logits, so W_o
// cannot be shared between steps: the floor is num_steps full reads of W_o, ~37 us per step /
// 0.26 ms per K = 7 round at the H200's ~4.2 TB/s copy bandwidth (b = 1). The design goal: read
// W_o once per step for all b rows at full bandwidth, and keep the small phases short.
//
// One persistent kernel (grid = SMs x occupancy, launched cooperatively so all CTAs are resident)
// runs three phases per step, separated by grid barriers (a global counter, no host sync):
//   1. STATE    W_s [s ; P[t]] split over (64 z-rows + the matching 64 c-rows) x k-slices; every
//               CTA writes fp32 partials, and the LAST CTA of each row group (atomic ticket) sums
//               the slices in a fixed order (deterministic), adds b_s and applies the gated update.
//               t comes from the anchor / prime ids or from step k-1's argmax keys.
//   2. READOUT  W_f [s' ; d_k] split the same way over 128-row groups x k-slices; the last CTA of a
//               group adds b_f and rounds o to T.
//   3. LOGITS   the bandwidth-bound part: o (b x r, T) is staged whole in shared memory (row stride
//               r + 32 elements = 64 mod 128 B: conflict-free fragment reads); the V / 16 row tiles
//               of W_o are split in contiguous balanced ranges over all warps of the grid (mean
//               and max differ by < 1 tile: no tail wave). Each thread streams 16 B vectors of
//               rows g and g + 8 straight into MMA A-fragments (ld.global.nc.L1::no_allocate,
//               register double buffer one sub-stage ahead, across tile boundaries); the k order
//               of the MMA is permuted so one 16 B load feeds two k16 steps (same permutation on
//               the o side). Batch rows are the MMA's N side (1-8 n-tiles), so W_o is read once
//               per step whatever b is. Epilogue: logits rounded through T and streamed out; the
//               argmax key (order-preserving float bits << 32 | ~index) is reduced per thread,
//               warp (shuffles), CTA (shared atomicMax) and grid (one 64-bit atomicMax per CTA and
//               row): deterministic, ties -> smallest index like torch.argmax.
// 3 grid barriers per step (+1 for priming): ~1-2 us each on an H200, ~5-15 % of the floor.
// Data produced inside the kernel is read with ld.global.cg (L2), never through L1.
// ==============================================================================================
#include "dlite_common.cuh"
#include "dlite_kernels.h"

#include <algorithm>

namespace dlite {
namespace {

constexpr int kThreads = 256;             // 8 warps per CTA
constexpr int kWarps = kThreads / 32;
constexpr int kMaxBatch = 64;             // batch rows per launch = 8 n-tiles of 8
constexpr int kPad = 32;                  // +64 B per staged row: stride = 64 mod 128 B
constexpr int kMaxSlice = 256;            // k elements per STATE / READOUT work unit (max)
constexpr int kStateRows = 64;            // z rows per STATE row group (+ the 64 matching c rows)
constexpr int kReadRows = kWarps * 16;    // o rows per READOUT row group
constexpr int kMaxRank = 1024;
constexpr uint32_t kAllLanes = 0xffffffffu;

// ------------------------------------------------------------------------- PTX wrappers
// 16 B streaming load of weights: read-only, not allocated in L1, 256 B L2 prefetch.
__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// 16 B shared-memory load kept in program order with the (volatile) MMAs, so the compiler does not
// hoist all of a stage's operand loads ahead of the MMAs (that costs ~100 registers at NT = 8).
__device__ __forceinline__ uint4 ld_shared16(const void* p) {
  uint4 v;
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(a));
  return v;
}

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
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

// Both k16 steps of one 16 B vector pair: thread (g, t) holds elements 8t .. 8t+7 of rows g
// (lo) and g + 8 (hi) and of batch column g of X (x). Logical k {2t, 2t+1, 2t+8, 2t+9} of step
// q <- physical 8t + 4q + {0, 1, 2, 3}: the same permutation on both operands, so the dot product
// is unchanged.
template <typename T>
__device__ __forceinline__ void mma_pair(float (&c)[4], const uint4& lo, const uint4& hi,
                                         const uint4& x) {
  Mma<T>::run(c, lo.x, hi.x, lo.y, hi.y, x.x, x.y);
  Mma<T>::run(c, lo.z, hi.z, lo.w, hi.w, x.z, x.w);
}

// Orderable 64-bit argmax key: high word = float bits mapped to unsigned order, low word =
// ~index, so the max key is the max value and, among equal values, the smallest index
// (torch.argmax's choice). -0.0 is folded into +0.0 first (they compare equal in torch).
__device__ __forceinline__ unsigned long long argmax_key(float v, int64_t idx) {
  v += 0.0f;  // -0 -> +0
  uint32_t u = __float_as_uint(v);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (static_cast<unsigned long long>(u) << 32) |
         static_cast<unsigned long long>(0xffffffffu - static_cast<uint32_t>(idx));
}
__device__ __forceinline__ int64_t argmax_key_index(unsigned long long key) {
  return static_cast<int64_t>(0xffffffffu - static_cast<uint32_t>(key & 0xffffffffull));
}

template <typename T>
__device__ __forceinline__ T ldcg_t(const T* p) {  // one 16-bit element through L2
  const unsigned short u = __ldcg(reinterpret_cast<const unsigned short*>(p));
  T out;
  *reinterpret_cast<unsigned short*>(&out) = u;
  return out;
}

// ------------------------------------------------------------------------- parameters
template <typename T>
struct HeadParams {
  const T* d;            // [b, K, H] (chunk base)
  const int64_t* anchor; // [b]
  const int64_t* prime;  // [b] or nullptr
  const T* emb;          // [V, r]
  const T* w_s;          // [2r, 2r]
  const T* b_s;          // [2r]
  const T* w_f;          // [r, r + H]
  const T* b_f;          // [r]
  const T* w_o;          // [V, r]
  int64_t* ids;          // [b, num_steps] (chunk base)
  float* logits;         // [b, num_steps, V] (chunk base)
  int B;                 // rows of this chunk (<= 64)
  int K, H, r, num_steps, slice;
  int64_t V;
  // workspace
  unsigned* barrier;            // [1]                  zeroed per launch
  unsigned* tickets_s;          // [r / 64]             zeroed per launch, reset by their user
  unsigned* tickets_f;          // [ceil(r / 128)]      "
  unsigned long long* best;     // [num_steps][64]      zeroed per launch
  float* part;                  // [slices][64][rows]   split-k partial sums
  T* sbuf;                      // [2][64][r]           state ping-pong (T, like the reference)
  T* obuf;                      // [64][r]              readout o (T)
};

struct Workspace {
  size_t barrier, tickets_s, tickets_f, best, zero_bytes, part, sbuf, obuf, total;
};

size_t align256(size_t x) { return (x + 255) & ~size_t(255); }

int slice_for(int H, int r) {  // largest k-slice that divides both segments of every product
  for (int s = kMaxSlice; s >= 64; s /= 2)
    if (r % s == 0 && H % s == 0) return s;
  return 64;
}

Workspace carve(int H, int r, int num_steps) {
  Workspace w{};
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off = align256(off + bytes);
    return at;
  };
  const int s = slice_for(H, r);
  w.barrier = take(sizeof(unsigned));
  w.tickets_s = take(size_t(r / kStateRows) * sizeof(unsigned));
  w.tickets_f = take(size_t((r + kReadRows - 1) / kReadRows) * sizeof(unsigned));
  w.best = take(size_t(std::max(num_steps, 1)) * kMaxBatch * sizeof(unsigned long long));
  w.zero_bytes = off;
  const size_t part_state = size_t(2 * r / s) * kMaxBatch * 2 * r;
  const size_t part_read = size_t((r + H) / s) * kMaxBatch * r;
  w.part = take(std::max(part_state, part_read) * sizeof(float));
  w.sbuf = take(size_t(2) * kMaxBatch * r * 2);
  w.obuf = take(size_t(kMaxBatch) * r * 2);
  w.total = off;
  return w;
}

// ------------------------------------------------------------------------- grid barrier
// All CTAs are co-resident (cooperative launch), the counter starts at 0 (memset per launch) and
// only grows: barrier n waits until it reaches n * gridDim.x.
__device__ __forceinline__ void grid_barrier(unsigned* counter, unsigned& target) {
  target += gridDim.x;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(counter, 1u);
    while (ld_acquire(counter) < target) __nanosleep(64);
    __threadfence();
  }
  __syncthreads();
}

// ------------------------------------------------------------------------- X staging
// xs[n][0 .. slice) <- row n of X over k in [k0, k0 + slice), where X = [seg0 (split wide) ;
// seg1] and the slice lies in one segment; rows n >= B (and a null seg0: the zero state) are 0.
template <typename T, int NT>
__device__ __forceinline__ void stage_slice(T* xs, int xstride, const T* const* seg0,
                                            const T* const* seg1, int split, int k0, int slice) {
  const int vec_per_row = slice / 8;
  for (int v = threadIdx.x; v < NT * 8 * vec_per_row; v += kThreads) {
    const int n = v / vec_per_row, c = (v % vec_per_row) * 8;
    const T* src = k0 < split ? seg0[n] : seg1[n];
    const int kk = k0 < split ? k0 : k0 - split;
    uint4 val = make_uint4(0u, 0u, 0u, 0u);
    if (src != nullptr) val = __ldcg(reinterpret_cast<const uint4*>(src + kk + c));
    *reinterpret_cast<uint4*>(xs + n * xstride + c) = val;
  }
}

// One warp: acc[NT][4] = A[row0 .. row0 + 16, k0 .. k0 + 32 nsub) . xs[0 .. 8 NT, 0 .. 32 nsub)^T
// (rows clamped to n_rows - 1 for the loads; the caller drops them). W is loaded in groups of
// kGroup sub-stages (kGroup x 2 x 16 B per thread in flight), the next group prefetched while the
// current one feeds the MMAs. The first group is requested BEFORE stage() fills xs (followed by a
// CTA barrier), so the W latency and the X staging latency overlap. Called by the whole CTA.
template <typename T, int NT, typename StageFn>
__device__ __forceinline__ void unit_gemm(const T* __restrict__ A, int lda, int n_rows, int row0,
                                          int k0, int nsub, const T* xs, int xstride,
                                          float (&acc)[NT][4], StageFn stage) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const T* lo_row = A + size_t(min(row0 + g, n_rows - 1)) * lda + k0 + 8 * t;
  const T* hi_row = A + size_t(min(row0 + g + 8, n_rows - 1)) * lda + k0 + 8 * t;
  constexpr int kGroup = NT <= 4 ? 4 : 2;  // register budget: NT = 8 keeps 2
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[j][c] = 0.f;
  uint4 lo[2][kGroup], hi[2][kGroup];
#pragma unroll
  for (int s = 0; s < kGroup; ++s) {
    if (s < nsub) {
      lo[0][s] = ld_stream(lo_row + 32 * s);
      hi[0][s] = ld_stream(hi_row + 32 * s);
    }
  }
  stage();
  __syncthreads();
  // two groups per trip: constant buffer indices
#pragma unroll 1
  for (int s0 = 0; s0 < nsub; s0 += 2 * kGroup) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int sg = s0 + h * kGroup;
      if (sg < nsub) {
#pragma unroll
        for (int s = 0; s < kGroup; ++s) {
          if (sg + kGroup + s < nsub) {
            lo[h ^ 1][s] = ld_stream(lo_row + 32 * (sg + kGroup + s));
            hi[h ^ 1][s] = ld_stream(hi_row + 32 * (sg + kGroup + s));
          }
        }
#pragma unroll
        for (int s = 0; s < kGroup; ++s) {
          if (sg + s < nsub) {
#pragma unroll
            for (int j = 0; j < NT; ++j) {
              const uint4 x = ld_shared16(xs + (8 * j + g) * xstride + 32 * (sg + s) + 8 * t);
              mma_pair<T>(acc[j], lo[h][s], hi[h][s], x);
            }
          }
        }
      }
    }
  }
}

// Partials of one warp's 16 rows: part[(b) * row_stride + row] for b < B.
template <int NT>
__device__ __forceinline__ void store_partials(float* part, int row_stride, int row0, int n_rows,
                                               int B, const float (&acc)[NT][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int col = 8 * j + 2 * t + (c & 1);
      const int row = row0 + g + 8 * (c >> 1);
      if (col < B && row < n_rows) __stcg(part + size_t(col) * row_stride + row, acc[j][c]);
    }
}

// Last-arriver ticket: true in every thread of the CTA that completed the group.
__device__ __forceinline__ bool last_of_group(unsigned* ticket, unsigned n, bool* flag) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) *flag = atomicAdd(ticket, 1u) == n - 1;
  __syncthreads();
  const bool last = *flag;
  if (last) __threadfence();
  return last;
}

// ------------------------------------------------------------------------- phase 1: STATE
// mode 0: ids = prime, 1: ids = anchor, 2: ids = argmax of step `step - 1`.
template <typename T, int NT>
__device__ void state_phase(const HeadParams<T>& p, int mode, int step, const T* s_prev, T* s_out,
                            T* xs, const T** seg0, const T** seg1, bool* flag) {
  const int r = p.r, two_r = 2 * r;
  __syncthreads();
  if (threadIdx.x < NT * 8) {
    const int b = threadIdx.x;
    int64_t id = 0;
    if (b < p.B) {
      if (mode == 0) id = p.prime[b];
      else if (mode == 1) id = p.anchor[b];
      else id = argmax_key_index(__ldcg(p.best + size_t(step - 1) * kMaxBatch + b));
      id = min(max(id, int64_t(0)), p.V - 1);  // out-of-range ids are clamped (no fault)
    }
    seg0[b] = (b < p.B && s_prev != nullptr) ? s_prev + size_t(b) * r : nullptr;
    seg1[b] = b < p.B ? p.emb + size_t(id) * r : nullptr;
  }
  const int n_slices = two_r / p.slice, n_groups = r / kStateRows;
  const int warp = threadIdx.x >> 5;
  const int xstride = p.slice + kPad;
  for (int u = blockIdx.x; u < n_groups * n_slices; u += gridDim.x) {
    const int rg = u / n_slices, ks = u % n_slices;
    __syncthreads();  // seg pointers ready; previous unit done with xs
    const int row0 = warp < 4 ? rg * kStateRows + 16 * warp : r + rg * kStateRows + 16 * (warp - 4);
    float acc[NT][4];
    unit_gemm<T, NT>(p.w_s, two_r, two_r, row0, ks * p.slice, p.slice / 32, xs, xstride, acc,
                     [&] { stage_slice<T, NT>(xs, xstride, seg0, seg1, r, ks * p.slice, p.slice); });
    store_partials<NT>(p.part + size_t(ks) * kMaxBatch * two_r, two_r, row0, two_r, p.B, acc);
    if (last_of_group(p.tickets_s + rg, unsigned(n_slices), flag)) {
      for (int i = threadIdx.x; i < p.B * kStateRows; i += kThreads) {
        const int b = i / kStateRows, j = rg * kStateRows + i % kStateRows;
        float z = 0.f, c = 0.f;
        for (int q = 0; q < n_slices; ++q) {  // fixed order: deterministic
          const float* pb = p.part + (size_t(q) * kMaxBatch + b) * two_r;
          z += __ldcg(pb + j);
          c += __ldcg(pb + r + j);
        }
        const float zt = round_through<T>(z + to_float(p.b_s[j]));
        const float ct = round_through<T>(c + to_float(p.b_s[r + j]));
        const float gate = round_through<T>(1.f / (1.f + expf(-zt)));
        const float th = round_through<T>(tanhf(ct));
        const float sp = s_prev != nullptr ? to_float(ldcg_t(s_prev + size_t(b) * r + j)) : 0.f;
        const float keep = round_through<T>(gate * sp);
        const float one_minus = round_through<T>(1.f - gate);
        const float upd = round_through<T>(one_minus * th);
        s_out[size_t(b) * r + j] = from_float<T>(keep + upd);
      }
      if (threadIdx.x == 0) p.tickets_s[rg] = 0u;  // next use is after a grid barrier
    }
  }
}

// ------------------------------------------------------------------------- phase 2: READOUT
template <typename T, int NT>
__device__ void readout_phase(const HeadParams<T>& p, int step, const T* s_cur, T* xs,
                              const T** seg0, const T** seg1, bool* flag) {
  const int r = p.r, kdim = r + p.H;
  __syncthreads();
  if (threadIdx.x < NT * 8) {
    const int b = threadIdx.x;
    seg0[b] = b < p.B ? s_cur + size_t(b) * r : nullptr;
    seg1[b] = b < p.B ? p.d + (size_t(b) * p.K + step) * p.H : nullptr;
  }
  const int n_slices = kdim / p.slice, n_groups = (r + kReadRows - 1) / kReadRows;
  const int warp = threadIdx.x >> 5;
  const int xstride = p.slice + kPad;
  for (int u = blockIdx.x; u < n_groups * n_slices; u += gridDim.x) {
    const int rg = u / n_slices, ks = u % n_slices;
    __syncthreads();  // seg pointers ready; previous unit done with xs
    const int row0 = rg * kReadRows + 16 * warp;
    float acc[NT][4];
    unit_gemm<T, NT>(p.w_f, kdim, r, row0, ks * p.slice, p.slice / 32, xs, xstride, acc,
                     [&] { stage_slice<T, NT>(xs, xstride, seg0, seg1, r, ks * p.slice, p.slice); });
    store_partials<NT>(p.part + size_t(ks) * kMaxBatch * r, r, row0, r, p.B, acc);
    if (last_of_group(p.tickets_f + rg, unsigned(n_slices), flag)) {
      for (int i = threadIdx.x; i < p.B * kReadRows; i += kThreads) {
        const int b = i / kReadRows, j = rg * kReadRows + i % kReadRows;
        if (j >= r) continue;
        float o = 0.f;
        for (int q = 0; q < n_slices; ++q) o += __ldcg(p.part + (size_t(q) * kMaxBatch + b) * r + j);
        p.obuf[size_t(b) * r + j] = from_float<T>(o + to_float(p.b_f[j]));
      }
      if (threadIdx.x == 0) p.tickets_f[rg] = 0u;
    }
  }
}

// ------------------------------------------------------------------------- phase 3: LOGITS
// U = 16 B vectors per row and thread per register stage (sub-stage = 32 U k elements).
template <typename T, int NT, int U>
__device__ void logits_phase(const HeadParams<T>& p, int step, T* xs,
                             unsigned long long* best_s) {
  const int r = p.r;
  const int xstride = r + kPad;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, warp = threadIdx.x >> 5;

  // this warp's contiguous range of 16-row tiles
  const int64_t n_tiles = (p.V + 15) / 16;
  const int64_t gw = int64_t(blockIdx.x) * kWarps + warp, n_warps = int64_t(gridDim.x) * kWarps;
  const int64_t tile_begin = gw * n_tiles / n_warps, tile_end = (gw + 1) * n_tiles / n_warps;
  const int nsub = r / (32 * U);
  const int64_t n_iter = (tile_end - tile_begin) * nsub;

  unsigned long long keys[NT][2];
#pragma unroll
  for (int j = 0; j < NT; ++j) keys[j][0] = keys[j][1] = 0ull;
  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[j][c] = 0.f;

  // (tile, sub) of the next vectors to request; advanced without divisions
  int64_t ld_tile = tile_begin;
  int ld_sub = 0;
  auto load = [&](uint4 (&w)[2][U]) {
    const int64_t row_lo = min(ld_tile * 16 + g, p.V - 1);
    const int64_t row_hi = min(ld_tile * 16 + g + 8, p.V - 1);
    const T* plo = p.w_o + row_lo * r + ld_sub * 32 * U + 8 * t;
    const T* phi = p.w_o + row_hi * r + ld_sub * 32 * U + 8 * t;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      w[0][u] = ld_stream(plo + 32 * u);
      w[1][u] = ld_stream(phi + 32 * u);
    }
    if (++ld_sub == nsub) {
      ld_sub = 0;
      ++ld_tile;
    }
  };

  uint4 w[2][2][U];
  if (n_iter > 0) load(w[0]);
  __syncthreads();  // previous users of xs / best_s are done
  // stage o (all r columns) once per CTA, while the first W_o vectors are in flight
  const int vec_per_row = r / 8;
  for (int v = threadIdx.x; v < NT * 8 * vec_per_row; v += kThreads) {
    const int n = v / vec_per_row, c = (v % vec_per_row) * 8;
    uint4 val = make_uint4(0u, 0u, 0u, 0u);
    if (n < p.B) val = __ldcg(reinterpret_cast<const uint4*>(p.obuf + size_t(n) * r + c));
    *reinterpret_cast<uint4*>(xs + n * xstride + c) = val;
  }
  if (threadIdx.x < kMaxBatch) best_s[threadIdx.x] = 0ull;
  __syncthreads();

  int64_t tile = tile_begin;  // (tile, sub) being multiplied
  int sub = 0;
  for (int64_t it = 0; it < n_iter; it += 2) {
    // two iterations per loop trip so the register buffers are indexed by constants
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (it + h < n_iter) {
        if (it + h + 1 < n_iter) load(w[h ^ 1]);  // prefetch (may cross into the next tile)
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            const uint4 x = ld_shared16(xs + (8 * j + g) * xstride + sub * 32 * U + 32 * u + 8 * t);
            mma_pair<T>(acc[j], w[h][0][u], w[h][1][u], x);
          }
        if (++sub == nsub) {  // tile done: epilogue
#pragma unroll
          for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
              const int col = 8 * j + 2 * t + (c & 1);
              const int64_t row = tile * 16 + g + 8 * (c >> 1);
              if (col < p.B && row < p.V) {
                const float v = round_through<T>(acc[j][c]);
                __stcs(p.logits + (size_t(col) * p.num_steps + step) * p.V + row, v);
                const unsigned long long k = argmax_key(v, row);
                keys[j][c & 1] = k > keys[j][c & 1] ? k : keys[j][c & 1];
              }
              acc[j][c] = 0.f;
            }
          sub = 0;
          ++tile;
        }
      }
    }
  }
  // reduce over g (lanes with the same t hold the same columns), then CTA, then grid
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      unsigned long long k = keys[j][e];
#pragma unroll
      for (int m = 4; m < 32; m <<= 1) {
        const unsigned long long o = __shfl_xor_sync(kAllLanes, k, m);
        k = o > k ? o : k;
      }
      const int col = 8 * j + 2 * t + e;
      if (g == 0 && col < p.B && k != 0ull) atomicMax(best_s + col, k);
    }
  __syncthreads();
  if (threadIdx.x < p.B && best_s[threadIdx.x] != 0ull)
    atomicMax(p.best + size_t(step) * kMaxBatch + threadIdx.x, best_s[threadIdx.x]);
}

// ------------------------------------------------------------------------- the kernel
template <typename T, int NT, int U>
__global__ void __launch_bounds__(kThreads, 1)
sequential_head_kernel(const HeadParams<T> p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* xs = reinterpret_cast<T*>(smem_raw);
  __shared__ const T* seg0[kMaxBatch];
  __shared__ const T* seg1[kMaxBatch];
  __shared__ unsigned long long best_s[kMaxBatch];
  __shared__ bool flag;
  unsigned target = 0;
  const int r = p.r;

  const T* s_prev = nullptr;
  int buf = 0;
  if (p.prime != nullptr) {  // s_0 = Phi(0, x_{a-1})
    state_phase<T, NT>(p, 0, 0, nullptr, p.sbuf, xs, seg0, seg1, &flag);
    grid_barrier(p.barrier, target);
    s_prev = p.sbuf;
    buf = 1;
  }
  for (int k = 0; k < p.num_steps; ++k) {
    T* s_out = p.sbuf + size_t(buf) * kMaxBatch * r;
    state_phase<T, NT>(p, k == 0 ? 1 : 2, k, s_prev, s_out, xs, seg0, seg1, &flag);
    grid_barrier(p.barrier, target);
    readout_phase<T, NT>(p, k, s_out, xs, seg0, seg1, &flag);
    grid_barrier(p.barrier, target);
    logits_phase<T, NT, U>(p, k, xs, best_s);
    grid_barrier(p.barrier, target);
    s_prev = s_out;
    buf ^= 1;
  }
  if (blockIdx.x == 0) {
    for (int i = threadIdx.x; i < p.B * p.num_steps; i += kThreads) {
      const int b = i / p.num_steps, k = i % p.num_steps;
      p.ids[i] = argmax_key_index(__ldcg(p.best + size_t(k) * kMaxBatch + b));
    }
  }
}

size_t smem_bytes(int nt, int r) {
  const size_t rows = size_t(nt) * 8;
  return std::max(rows * (r + kPad), rows * (kMaxSlice + kPad)) * 2;
}

#define DLITE_TRY(expr)                      \
  do {                                       \
    const cudaError_t err_ = (expr);         \
    if (err_ != cudaSuccess) return err_;    \
  } while (0)

template <typename T, int NT, int U>
cudaError_t launch_chunk(const HeadParams<T>& p, cudaStream_t stream) {
  auto kernel = sequential_head_kernel<T, NT, U>;
  const size_t smem = smem_bytes(NT, p.r);
  DLITE_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  int dev = 0, sms = 0, occ = 0;
  DLITE_TRY(cudaGetDevice(&dev));
  DLITE_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  DLITE_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel, kThreads, smem));
  if (occ < 1) return cudaErrorInvalidConfiguration;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned(sms * std::min(occ, 2)));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;  // all CTAs resident: the grid barrier is safe
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, p);
}

template <typename T, int NT>
cudaError_t launch_u(const HeadParams<T>& p, cudaStream_t stream) {
  return p.r % 128 == 0 ? launch_chunk<T, NT, 4>(p, stream) : launch_chunk<T, NT, 2>(p, stream);
}

template <typename T>
cudaError_t launch_typed(const SequentialHeadArgs& a, cudaStream_t stream) {
  const Workspace ws = carve(a.H, a.r, a.num_steps);
  unsigned char* base = static_cast<unsigned char*>(a.workspace);
  HeadParams<T> p{};
  p.emb = static_cast<const T*>(a.emb);
  p.w_s = static_cast<const T*>(a.w_s);
  p.b_s = static_cast<const T*>(a.b_s);
  p.w_f = static_cast<const T*>(a.w_f);
  p.b_f = static_cast<const T*>(a.b_f);
  p.w_o = static_cast<const T*>(a.w_o);
  p.K = a.K;
  p.H = a.H;
  p.r = a.r;
  p.num_steps = a.num_steps;
  p.slice = slice_for(a.H, a.r);
  p.V = a.V;
  p.barrier = reinterpret_cast<unsigned*>(base + ws.barrier);
  p.tickets_s = reinterpret_cast<unsigned*>(base + ws.tickets_s);
  p.tickets_f = reinterpret_cast<unsigned*>(base + ws.tickets_f);
  p.best = reinterpret_cast<unsigned long long*>(base + ws.best);
  p.part = reinterpret_cast<float*>(base + ws.part);
  p.sbuf = reinterpret_cast<T*>(base + ws.sbuf);
  p.obuf = reinterpret_cast<T*>(base + ws.obuf);
  for (int b0 = 0; b0 < a.B; b0 += kMaxBatch) {
    const int nb = std::min(kMaxBatch, a.B - b0);
    DLITE_TRY(cudaMemsetAsync(base, 0, ws.zero_bytes, stream));
    if (a.poison_workspace)
      DLITE_TRY(cudaMemsetAsync(base + ws.zero_bytes, 0xff, ws.total - ws.zero_bytes, stream));
    p.d = static_cast<const T*>(a.d) + size_t(b0) * a.K * a.H;
    p.anchor = a.anchor + b0;
    p.prime = a.prime != nullptr ? a.prime + b0 : nullptr;
    p.ids = a.draft_ids + size_t(b0) * a.num_steps;
    p.logits = a.logits + size_t(b0) * a.num_steps * size_t(a.V);
    p.B = nb;
    cudaError_t err;
    if (nb <= 8) err = launch_u<T, 1>(p, stream);
    else if (nb <= 16) err = launch_u<T, 2>(p, stream);
    else if (nb <= 32) err = launch_u<T, 4>(p, stream);
    else err = launch_u<T, 8>(p, stream);
    DLITE_TRY(err);
  }
  return cudaSuccess;
}

}  // namespace

const char* sequential_head_unsupported(int H, int r, int64_t V, DType dtype) {
  if (dtype != DType::kBFloat16 && dtype != DType::kFloat16) return "head dtype not bf16/fp16";
  if (r <= 0 || r % 64 != 0 || r > kMaxRank) return "rank not a multiple of 64 in 64..1024";
  if (H <= 0 || H % 64 != 0) return "hidden size not a multiple of 64";
  if (V <= 0 || V >= (int64_t(1) << 31)) return "vocabulary size not in 1 .. 2^31 - 1";
  return nullptr;
}

size_t sequential_head_workspace_bytes(int H, int r, int num_steps) {
  return carve(H, r, num_steps).total;
}

cudaError_t sequential_head_greedy_launch(const SequentialHeadArgs& a, cudaStream_t stream) {
  if (sequential_head_unsupported(a.H, a.r, a.V, a.dtype) != nullptr) return cudaErrorInvalidValue;
  if (a.B <= 0 || a.num_steps <= 0) return cudaSuccess;
  if (a.num_steps > a.K) return cudaErrorInvalidValue;
  switch (a.dtype) {
    case DType::kFloat16: return launch_typed<__half>(a, stream);
    case DType::kBFloat16: return launch_typed<__nv_bfloat16>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace dlite
