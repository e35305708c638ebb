// Hopper (sm_90a) building blocks of flash90.cu: shared-memory tiles in the layout `wgmma`
// reads, their matrix descriptors, mbarriers, proxy fences and the `wgmma.mma_async` forms the
// kernel uses. Compiled by NVRTC after common.cuh, before flash90.cu; no CUDA headers.
//
// Tiles in shared memory are stored K-major ("rows" x "cols", cols contiguous) in the
// 128-byte swizzled layout wgmma reads: the cols are cut into atoms of 64 halves (128 bytes);
// atom a holds cols 64a..64a+63 of all rows, row i at byte i*128 of the atom, atoms one after
// another (atom a at byte a * rows * 128); inside a row, 16-byte chunk c (halves 8c..8c+7 of the
// atom) sits at chunk position c ^ (i % 8). Atoms start 1024-byte aligned (8 rows x 128 bytes),
// so the XOR uses the address bits 4-6 and 7-9 the hardware swizzles.
//
// Matrix descriptor of a K-major operand (64 bits; PTX ISA "Matrix Descriptor Format"):
//   bits  0-13  start address >> 4: row 0 of the operand at k-step ks (16 halves) is
//               atom ks/4 + 32 bytes * (ks % 4); the hardware applies the swizzle to the
//               addresses it forms from there, so the start moves by plain byte offsets;
//   bits 16-29  leading-dimension byte offset >> 4: unused for a swizzled K-major operand (its
//               16 halves of K lie inside one 128-byte row); 1, as CUTLASS sets it;
//   bits 32-45  stride-dimension byte offset >> 4: 1024 bytes from one group of 8 rows to the
//               next (M for A, N for B);
//   bits 49-51  base offset: 0 (atoms are 1024-byte aligned);
//   bits 62-63  swizzle mode: 1 = 128-byte swizzle.

typedef unsigned long long u64;

__device__ __forceinline__ u32 smem_u32(const void* p) {  // shared-window address of p
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

// {lo, hi} as one f16x2 register. cvt's FIRST source goes to the UPPER half, hence (hi, lo).
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// ---- shared-memory tiles and descriptors --------------------------------------------------

// Byte offset of 16-byte chunk `chunk` (halves 8*chunk..8*chunk+7) of row `row` in a swizzled
// K-major tile of ROWS rows (see the top of this file).
template <int ROWS>
__device__ __forceinline__ u32 sw128_offset(int row, int chunk) {
  return (chunk >> 3) * (ROWS * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
}

// Rows 0..ROWS-1, halves 0..COLS-1 of a row-major fp16 matrix (row stride ld halves) into the
// swizzled tile at dst by cp.async, 16 bytes a copy, spread over THREADS threads. Halves past
// (rows_valid, cols_valid) are zero-filled (src-size < 16) and not read, so masked keys bring
// no NaN into 0 * V (their copies point at src itself, which must be a valid address).
template <int ROWS, int COLS, int THREADS>
__device__ __forceinline__ void load_tile(u32 dst, const u16* src, i64 ld, int rows_valid,
                                          int cols_valid) {
  constexpr int CPR = COLS / 8;  // chunks per row
  static_assert(ROWS * CPR % THREADS == 0, "whole chunks per thread");
#pragma unroll
  for (int i = 0; i < ROWS * CPR / THREADS; ++i) {
    const int c = threadIdx.x % THREADS + i * THREADS, row = c / CPR, chunk = c % CPR;
    const int n = row < rows_valid ? min(max(cols_valid - 8 * chunk, 0), 8) : 0;  // halves
    const u16* g = src + (n > 0 ? row * ld + 8 * chunk : 0);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(dst + sw128_offset<ROWS>(row, chunk)), "l"(g), "r"(2 * n) : "memory");
  }
}

// Shared-memory address of k-step ks (16 halves of K) of a K-major operand whose first row is
// at `rows0` inside a swizzled tile of ROWS rows (rows0: the tile's address + row * 128, with
// row a multiple of 8).
template <int ROWS>
__device__ __forceinline__ u32 kstep_addr(u32 rows0, int ks) {
  return rows0 + (ks >> 2) * (ROWS * 128) + (ks & 3) * 32;
}

// The wgmma matrix descriptor of a swizzled K-major operand starting at addr (see the top of this file).
__device__ __forceinline__ u64 desc_sw128(u32 addr) {
  return (u64)((addr & 0x3FFFF) >> 4)  // start address
         | (u64)1 << 16                 // leading-dimension byte offset (unused): 16 bytes
         | (u64)(1024 >> 4) << 32       // stride-dimension byte offset: 8 rows of 128 bytes
         | (u64)1 << 62;                // 128-byte swizzle (base offset 0)
}

// ---- mbarriers and proxy fences -----------------------------------------------------------

__device__ __forceinline__ void mbar_init(u32 bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}

// One arrival on bar once all cp.async copies this thread has issued so far have landed.
__device__ __forceinline__ void mbar_arrive_cp_async(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(bar) : "memory");
}

// Wait until the phase of bar with this parity (phase number % 2) has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, int parity) {
  u32 done;
  do {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;"
                 " selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}

// Shared-memory writes made visible through the generic proxy (cp.async), before wgmma reads
// them through the async proxy.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// ---- wgmma --------------------------------------------------------------------------------

__device__ __forceinline__ void wgmma_fence() {  // registers written before -> wgmma reads them
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

template <int N>  // wait until at most N of this warpgroup's wgmma groups are pending
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}

// Keeps the compiler from moving accesses of r across the asm statements around it (a wgmma in
// flight owns its accumulator and A registers until wgmma_wait).
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i]) :: "memory");
}

template <int N>
__device__ __forceinline__ void fence_regs(u32 (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i]) :: "memory");
}

#define WG_ACC8(i)                                                                         \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])

#define WG_REGS32                                                                          \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"

#define WG_REGS64                                                                          \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "  \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "  \
  "%56, %57, %58, %59, %60, %61, %62, %63}"

// d (64 x 128 fp32) = (SCALE_D ? d : 0) + A B, A (64 x 16) and B (16 x 128, as 128 rows of K)
// K-major in shared memory (descriptors a, b).
template <int SCALE_D>
__device__ __forceinline__ void wgmma_ss_n128(float (&d)[64], u64 a, u64 b) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " WG_REGS64
               ", %64, %65, %66, 1, 1, 0, 0;"
               : WG_ACC8(0), WG_ACC8(8), WG_ACC8(16), WG_ACC8(24), WG_ACC8(32), WG_ACC8(40),
                 WG_ACC8(48), WG_ACC8(56)
               : "l"(a), "l"(b), "n"(SCALE_D));
}

// d (64 x 128 fp32) += A B, A (64 x 16 fp16) from registers a[0..3], B K-major (descriptor b).
__device__ __forceinline__ void wgmma_rs_n128(float (&d)[64], const u32* a, u64 b) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " WG_REGS64
               ", {%64, %65, %66, %67}, %68, 1, 1, 1, 0;"
               : WG_ACC8(0), WG_ACC8(8), WG_ACC8(16), WG_ACC8(24), WG_ACC8(32), WG_ACC8(40),
                 WG_ACC8(48), WG_ACC8(56)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// d (64 x 64 fp32) += A B, as wgmma_rs_n128 with N = 64.
__device__ __forceinline__ void wgmma_rs_n64(float (&d)[32], const u32* a, u64 b) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " WG_REGS32
               ", {%32, %33, %34, %35}, %36, 1, 1, 1, 0;"
               : WG_ACC8(0), WG_ACC8(8), WG_ACC8(16), WG_ACC8(24)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
