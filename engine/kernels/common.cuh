// Shared by the kernel sources of engine/kernels (prepended by `cuda_source`): short integer
// names and fp16 <-> fp32 conversions as `cvt` PTX, so NVRTC needs no CUDA headers.

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

__device__ __forceinline__ float h2f(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

__device__ __forceinline__ u16 f2h(float f) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
