// Small device helpers shared by the DLite kernels (no torch headers).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dlite {

// ------------------------------------------------------------------ scalar conversions (to fp32)
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// fp32 -> T -> fp32: what `F.linear(x_T, W_T).float()` does to an fp32 accumulator.
template <typename T>
__device__ __forceinline__ float round_through(float x) {
  return to_float(from_float<T>(x));
}

// ------------------------------------------------------------------ short vectors of N elements
// Loads/stores N consecutive elements with the widest aligned access (caller guarantees alignment
// of N * sizeof(T) bytes, which holds for the row offsets used here).
template <int Bytes>
struct VecType;
template <>
struct VecType<2> { using type = unsigned short; };
template <>
struct VecType<4> { using type = unsigned int; };
template <>
struct VecType<8> { using type = uint2; };
template <>
struct VecType<16> { using type = uint4; };

template <typename T, int N>
__device__ __forceinline__ void load_vec(const T* __restrict__ p, float (&out)[N]) {
  constexpr int kBytes = N * int(sizeof(T));
  constexpr int kAccess = kBytes >= 16 ? 16 : kBytes;  // bytes per load instruction
  using V = typename VecType<kAccess>::type;
  constexpr int kPer = kAccess / int(sizeof(T));      // elements per load instruction
  static_assert(kBytes % kAccess == 0, "vector width");
#pragma unroll
  for (int i = 0; i < N / kPer; ++i) {
    union {
      V v;
      T e[kPer];
    } u;
    u.v = reinterpret_cast<const V*>(p)[i];
#pragma unroll
    for (int k = 0; k < kPer; ++k) out[i * kPer + k] = to_float(u.e[k]);
  }
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* __restrict__ p, const float (&in)[N]) {
  constexpr int kBytes = N * int(sizeof(T));
  constexpr int kAccess = kBytes >= 16 ? 16 : kBytes;
  using V = typename VecType<kAccess>::type;
  constexpr int kPer = kAccess / int(sizeof(T));
#pragma unroll
  for (int i = 0; i < N / kPer; ++i) {
    union {
      V v;
      T e[kPer];
    } u;
#pragma unroll
    for (int k = 0; k < kPer; ++k) u.e[k] = from_float<T>(in[i * kPer + k]);
    reinterpret_cast<V*>(p)[i] = u.v;
  }
}

// Two 16-bit elements packed in a 32-bit word (low half = lower index) -> fp32, in registers.
__device__ __forceinline__ void unpack2(__nv_bfloat16*, uint32_t w, float& lo, float& hi) {
  lo = __uint_as_float(w << 16);  // bf16 is the top half of an fp32
  hi = __uint_as_float(w & 0xffff0000u);
}
__device__ __forceinline__ void unpack2(__half*, uint32_t w, float& lo, float& hi) {
  lo = __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu)));
  hi = __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
}

// Eight 16-bit elements packed in a uint4 -> fp32.
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& v, float (&out)[8]) {
  unpack2(static_cast<T*>(nullptr), v.x, out[0], out[1]);
  unpack2(static_cast<T*>(nullptr), v.y, out[2], out[3]);
  unpack2(static_cast<T*>(nullptr), v.z, out[4], out[5]);
  unpack2(static_cast<T*>(nullptr), v.w, out[6], out[7]);
}

__device__ __forceinline__ float warp_allreduce_sum(float x) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

}  // namespace dlite
