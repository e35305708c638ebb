// Causal grouped-query flash attention, forward, for Hopper (engine/kernels/flash.py): the
// algorithm of flash.cu (FlashAttention-2: online softmax in fp32, base 2, scores never leave
// registers) on the asynchronous warpgroup tensor-core instruction `wgmma.mma_async`, with the
// softmax of one key tile overlapping the P V product of the previous one (FlashAttention-3's
// intra-warpgroup order, without its producer warpgroup or TMA). Needs the arch-specific target
// sm_90a (wgmma), so compute capability 9.0 exactly; head sizes D = 64 and 128. Compiled by NVRTC
// after common.cuh; no CUDA headers.
//
// Layouts (fp16 = u16): q [Hkv, R, D] with R = T*G rows, row r = t*G + g; k [Hkv, s_len, D];
// vt [Hkv, D, vt_ld] = V transposed (vt[h][d][j] = v[j][h][d]; vt_ld >= s_len, a multiple of 8
// so that rows are 16-byte aligned; columns past s_len are never read); out [T, H, D] float32,
// head hk*G + g. Row r sits at position pos0 + r/G and sees keys 0..pos0 + r/G.
//
// Grid (ceil(R/128), Hkv), 256 threads = 2 warpgroups: warpgroup wg owns the 64 rows
// rb + 64wg .. rb + 64wg + 63 of the block's 128 (rb = 128 * row tile, last tiles first), warp w
// of it the 16 rows +16w. The block walks its keys in tiles of KEYS = 128; per tile j a
// warpgroup computes
//   S = Q K_j^T   wgmma m64n128k16, A = Q and B = K_j from shared memory (D/16 k-steps),
//   softmax       masks, running max and sum per row, P = 2^(S*scale - m) in registers,
//   O += P V_j    wgmma m64nDk16, A = P from registers (fp16), B = V_j^T from shared memory
//                 (KEYS/16 k-steps),
// issued in the order S_j, then O += P_{j-1} V_{j-1}, so that the tensor cores run P V while the
// threads do the softmax of tile j; O is rescaled once that product has completed.
//
// Shared memory (dynamic, 1024-byte aligned): Q [128, D], two K stages [KEYS, D], two V^T stages
// [D, KEYS], 8 mbarriers. Every tile is stored K-major ("rows" x "cols", cols contiguous) in the
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
//
// Register fragments (lane = 4*grp + qd of warp w of the warpgroup; "{x, y}" = one 32-bit register,
// x in the low half):
//   accumulator of m64nNk16 (fp32, N/2 registers): d[4n + e] = D[16w + grp + 8(e >> 1)]
//     [8n + 2qd + (e & 1)], i.e. the mma.sync m16n8 C fragment repeated over the n8 tiles n;
//   A from registers (fp16, 4 registers per k-step): a0 = {A[16w + grp][2qd], A[..][2qd + 1]},
//     a1 = rows +8, a2 = cols +8, a3 = rows +8, cols +8, the mma.sync m16n8k16 A fragment.
// So the S accumulator of keys 16kk..16kk+15 (n8 tiles 2kk, 2kk+1, registers 8kk..8kk+7) packs
// pairwise into the A fragment of k-step kk of P V: a_i = {s[8kk + 2i], s[8kk + 2i + 1]}.
//
// Pipeline: all 256 threads issue the cp.async copies (16 bytes each) of every tile. Each stage
// has a "full" mbarrier (256 arrivals: cp.async.mbarrier.arrive.noinc, triggered when the
// thread's copies have landed) and a "free" mbarrier (8 arrivals: one lane per warp, once its
// warpgroup's wgmma that read the stage has completed). At the top of tile j a thread waits for
// K_j and V_{j-1} to be full, executes fence.proxy.async (cp.async writes through the generic
// proxy, wgmma reads through the async proxy; the fence comes before the thread's next copies,
// so it has none in flight to wait for), then loads K_{j+1} (into the stage K_{j-1} left) and
// V_j (the stage V_{j-2} left): each tile has one tile of time to arrive, and a warpgroup may
// run up to about a tile ahead of the other. Use n of a stage (tile j: stage j % 2, use j / 2)
// is phase n of its barriers, so a wait passes the parity (j / 2) % 2.
//
// Why mbarriers rather than cp.async.wait_group + __syncthreads: block-wide barriers would keep
// the two warpgroups in step, both in their softmax at once while the tensor cores idle; with
// the stages handed over by mbarriers, one warpgroup's softmax can overlap the other's wgmma.
// There is no producer warpgroup (FlashAttention-3 has one, with TMA and setmaxnreg): the two
// warpgroups issue their own copies, one tile ahead, and each thread may use up to 255
// registers (S, O and P take 64 + D/2 + 32 of them).

typedef unsigned long long u64;

#define F9_THREADS 256  // 2 warpgroups; must match _THREADS90 in flash.py
#define F9_ROWS 128     // rows of q per block (64 per warpgroup); must match _ROWS90 in flash.py
#define F9_KEYS 128     // keys per tile; must match _KEYS90 in flash.py
#define F9_NEG -1.0e30f // masked score: exp2f(F9_NEG - m) == 0, and no inf - inf

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
// K-major tile of ROWS rows (see the header).
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

// The wgmma matrix descriptor of a swizzled K-major operand starting at addr (see the header).
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

#define F9_ACC8(i)                                                                         \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])

#define F9_REGS32                                                                          \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"

#define F9_REGS64                                                                          \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "  \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "  \
  "%56, %57, %58, %59, %60, %61, %62, %63}"

// d (64 x 128 fp32) = (SCALE_D ? d : 0) + A B, A (64 x 16) and B (16 x 128, as 128 rows of K)
// K-major in shared memory (descriptors a, b).
template <int SCALE_D>
__device__ __forceinline__ void wgmma_ss_n128(float (&d)[64], u64 a, u64 b) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " F9_REGS64
               ", %64, %65, %66, 1, 1, 0, 0;"
               : F9_ACC8(0), F9_ACC8(8), F9_ACC8(16), F9_ACC8(24), F9_ACC8(32), F9_ACC8(40),
                 F9_ACC8(48), F9_ACC8(56)
               : "l"(a), "l"(b), "n"(SCALE_D));
}

// d (64 x 128 fp32) += A B, A (64 x 16 fp16) from registers a[0..3], B K-major (descriptor b).
__device__ __forceinline__ void wgmma_rs_n128(float (&d)[64], const u32* a, u64 b) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " F9_REGS64
               ", {%64, %65, %66, %67}, %68, 1, 1, 1, 0;"
               : F9_ACC8(0), F9_ACC8(8), F9_ACC8(16), F9_ACC8(24), F9_ACC8(32), F9_ACC8(40),
                 F9_ACC8(48), F9_ACC8(56)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// d (64 x 64 fp32) += A B, as wgmma_rs_n128 with N = 64.
__device__ __forceinline__ void wgmma_rs_n64(float (&d)[32], const u32* a, u64 b) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " F9_REGS32
               ", {%32, %33, %34, %35}, %36, 1, 1, 1, 0;"
               : F9_ACC8(0), F9_ACC8(8), F9_ACC8(16), F9_ACC8(24)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// s (64 x KEYS) = Q K^T: q_rows = this warpgroup's first row in a Q tile of Q_ROWS rows,
// k_tile = a K tile [KEYS, D]. Issues D/16 wgmmas (no commit).
template <int D, int Q_ROWS>
__device__ __forceinline__ void qk_gemm(float (&s)[64], u32 q_rows, u32 k_tile) {
  wgmma_ss_n128<0>(s, desc_sw128(kstep_addr<Q_ROWS>(q_rows, 0)),
                   desc_sw128(kstep_addr<F9_KEYS>(k_tile, 0)));
#pragma unroll
  for (int ks = 1; ks < D / 16; ++ks) {
    wgmma_ss_n128<1>(s, desc_sw128(kstep_addr<Q_ROWS>(q_rows, ks)),
                     desc_sw128(kstep_addr<F9_KEYS>(k_tile, ks)));
  }
}

// o (64 x D) += P V: p = the A fragments of P (4 registers per 16 keys), v_tile = a V^T tile
// [D, KEYS]. Issues KEYS/16 wgmmas (no commit).
template <int D>
__device__ __forceinline__ void pv_gemm(float (&o)[D / 2], const u32 (&p)[F9_KEYS / 4],
                                        u32 v_tile) {
#pragma unroll
  for (int kk = 0; kk < F9_KEYS / 16; ++kk) {
    const u64 b = desc_sw128(kstep_addr<D>(v_tile, kk));
    if constexpr (D == 128) {
      wgmma_rs_n128(o, &p[4 * kk], b);
    } else {
      wgmma_rs_n64(o, &p[4 * kk], b);
    }
  }
}

// The A fragments of P from the S accumulator (see the header): p[4kk + i] = {s[8kk + 2i],
// s[8kk + 2i + 1]} rounded to fp16.
__device__ __forceinline__ void pack_p(u32 (&p)[F9_KEYS / 4], const float (&s)[F9_KEYS / 2]) {
#pragma unroll
  for (int i = 0; i < F9_KEYS / 4; ++i) p[i] = pack_f16x2(s[2 * i], s[2 * i + 1]);
}

// ---- softmax ------------------------------------------------------------------------------

// One tile of the online softmax for this thread's rows a (grp) and c (grp + 8): s (the S
// accumulator: s[4n + e] is key key0 + 8n + (e & 1), row a for e < 2, c for e >= 2; key0 = the
// tile's first key + 2qd) becomes P = 2^(s * scale_log2 - m) in place; m (the running max in
// log2 units) and l (this thread's part of the row sums) are updated, and alpha, the factor
// that brings O to the new max, is returned. `crosses`: the tile reaches past some row's last
// key (lim_a, lim_c: this thread's rows' last keys).
__device__ __forceinline__ void softmax_tile(float (&s)[F9_KEYS / 2], float& m_a, float& m_c,
                                             float& l_a, float& l_c, float& alpha_a,
                                             float& alpha_c, float scale_log2, bool crosses,
                                             int key0, int lim_a, int lim_c) {
#pragma unroll
  for (int i = 0; i < F9_KEYS / 2; ++i) s[i] *= scale_log2;
  if (crosses) {
#pragma unroll
    for (int i = 0; i < F9_KEYS / 2; ++i) {  // i = 4n + e: key key0 + 8n + (e & 1)
      if (key0 + 8 * (i >> 2) + (i & 1) > ((i & 2) ? lim_c : lim_a)) s[i] = F9_NEG;
    }
  }
  float mx_a = m_a, mx_c = m_c;
#pragma unroll
  for (int n = 0; n < F9_KEYS / 8; ++n) {
    mx_a = fmaxf(mx_a, fmaxf(s[4 * n], s[4 * n + 1]));
    mx_c = fmaxf(mx_c, fmaxf(s[4 * n + 2], s[4 * n + 3]));
  }
  // A row's values of the tile live in the 4 lanes of a quad (qd): reduce over them.
#pragma unroll
  for (int x = 1; x <= 2; x <<= 1) {
    mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, x));
    mx_c = fmaxf(mx_c, __shfl_xor_sync(0xffffffffu, mx_c, x));
  }
  // Tile 0 holds key 0, visible to every row, so after it m is a real score and every later
  // exp2f(F9_NEG - m) is 0; in tile 0, alpha = exp2f(F9_NEG - m) = 0 scales an O of zeros.
  alpha_a = exp2f(m_a - mx_a), alpha_c = exp2f(m_c - mx_c);
  m_a = mx_a, m_c = mx_c;
  float sum_a = 0.f, sum_c = 0.f;
#pragma unroll
  for (int n = 0; n < F9_KEYS / 8; ++n) {
    s[4 * n] = exp2f(s[4 * n] - m_a), s[4 * n + 1] = exp2f(s[4 * n + 1] - m_a);
    s[4 * n + 2] = exp2f(s[4 * n + 2] - m_c), s[4 * n + 3] = exp2f(s[4 * n + 3] - m_c);
    sum_a += s[4 * n] + s[4 * n + 1], sum_c += s[4 * n + 2] + s[4 * n + 3];
  }
  l_a = l_a * alpha_a + sum_a, l_c = l_c * alpha_c + sum_c;
}

// ---- the kernel ---------------------------------------------------------------------------

// Shared-memory bytes of flash90<D>; must match _smem90 in flash.py.
template <int D>
struct Smem90 {
  static constexpr u32 Q = F9_ROWS * D * 2, K = F9_KEYS * D * 2, V = D * F9_KEYS * 2;
  static constexpr u32 BARS = Q + 2 * K + 2 * V;  // 8 mbarriers of 8 bytes after the tiles
  static constexpr u32 TOTAL = 1024 + BARS + 64;  // + slack for the 1024-byte alignment
};

template <int D>
__global__ void __launch_bounds__(F9_THREADS, 1)
    flash90(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ vt,
            float* __restrict__ out, int rows, int group, int s_len, int vt_ld, int pos0,
            float scale_log2) {
  static_assert(D == 64 || D == 128, "flash90: D = 64 or 128");
  using L = Smem90<D>;
  extern __shared__ unsigned char smem_raw[];
  const u32 sq = (smem_u32(smem_raw) + 1023) & ~1023u;  // Q [128, D]
  const u32 sk = sq + L::Q, sv = sk + 2 * L::K;          // K [KEYS, D], V^T [D, KEYS] x 2 stages
  const u32 bars = sq + L::BARS;
  // mbarriers of stage st: K landed, V landed (F9_THREADS arrivals), K read, V read (8 warps)
  auto k_full = [&](int st) { return bars + 8 * st; };
  auto v_full = [&](int st) { return bars + 16 + 8 * st; };
  auto k_free = [&](int st) { return bars + 32 + 8 * st; };
  auto v_free = [&](int st) { return bars + 48 + 8 * st; };

  const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  const int grp = lane >> 2, qd = lane & 3;
  const int hk = blockIdx.y;
  const int rb = (gridDim.x - 1 - blockIdx.x) * F9_ROWS;  // last row tiles (most keys) first
  const int r0 = rb + 64 * wg + 16 * warp + grp, last = rows - 1;  // this thread's row a
  const int lim_a = pos0 + min(r0, last) / group, lim_c = pos0 + min(r0 + 8, last) / group;
  const int wg_lo = pos0 + min(rb + 64 * wg, last) / group;  // smallest last key of the wg
  const int n_keys = pos0 + min(rb + F9_ROWS - 1, last) / group + 1;  // keys the block needs
  const int n_tiles = (n_keys + F9_KEYS - 1) / F9_KEYS;

  if (tid == 0) {
    for (int st = 0; st < 2; ++st) {
      mbar_init(k_full(st), F9_THREADS), mbar_init(v_full(st), F9_THREADS);
      mbar_init(k_free(st), F9_THREADS / 32), mbar_init(v_free(st), F9_THREADS / 32);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  const u16* kh = k + (i64)hk * s_len * D;   // [s_len, D]
  const u16* vh = vt + (i64)hk * D * vt_ld;  // [D, vt_ld]
  // Waits for K_j and V_{j-1}, then loads K_{j+1} and V_j (see the header).
  auto next_tile = [&](int j) {
    const int st = j & 1, j0 = j * F9_KEYS;
    mbar_wait(k_full(st), (j >> 1) & 1);
    if (j >= 1) mbar_wait(v_full(st ^ 1), ((j - 1) >> 1) & 1);
    fence_proxy_async();
    if (j + 1 < n_tiles) {
      if (j >= 1) mbar_wait(k_free(st ^ 1), ((j - 1) >> 1) & 1);
      load_tile<F9_KEYS, D, F9_THREADS>(sk + (st ^ 1) * L::K, kh + (i64)(j0 + F9_KEYS) * D, D,
                                        n_keys - j0 - F9_KEYS, D);
      mbar_arrive_cp_async(k_full(st ^ 1));
    }
    if (j >= 2) mbar_wait(v_free(st), ((j - 2) >> 1) & 1);
    load_tile<D, F9_KEYS, F9_THREADS>(sv + st * L::V, vh + j0, vt_ld, D, n_keys - j0);
    mbar_arrive_cp_async(v_full(st));
  };
  load_tile<F9_ROWS, D, F9_THREADS>(sq, q + ((i64)hk * rows + rb) * D, D, rows - rb, D);
  load_tile<F9_KEYS, D, F9_THREADS>(sk, kh, D, n_keys, D);
  mbar_arrive_cp_async(k_full(0));  // Q and K_0

  const u32 q_rows = sq + wg * 64 * 128;  // this warpgroup's 64 rows of Q
  float o[D / 2];  // O accumulator (64 x D per warpgroup)
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  float s[F9_KEYS / 2];  // S accumulator, then P in fp32
  u32 p[F9_KEYS / 4];    // P as fp16 A fragments
  float m_a = F9_NEG, m_c = F9_NEG, l_a = 0.f, l_c = 0.f;  // l: this thread's part of the sum
  float alpha_a, alpha_c;
  auto softmax = [&](int j) {
    const int j0 = j * F9_KEYS;
    softmax_tile(s, m_a, m_c, l_a, l_c, alpha_a, alpha_c, scale_log2, j0 + F9_KEYS - 1 > wg_lo,
                 j0 + 2 * qd, lim_a, lim_c);
  };

  // Tile 0: S = Q K_0^T and its softmax (O is still 0).
  next_tile(0);
  wgmma_fence();
  qk_gemm<D, F9_ROWS>(s, q_rows, sk);
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(s);
  if (lane == 0) mbar_arrive(k_free(0));
  softmax(0);
  pack_p(p, s);

  for (int j = 1; j < n_tiles; ++j) {
    const int st = j & 1;
    next_tile(j);
    // S = Q K_j^T, then O += P_{j-1} V_{j-1} behind it.
    fence_regs(s);
    wgmma_fence();
    qk_gemm<D, F9_ROWS>(s, q_rows, sk + st * L::K);
    wgmma_commit();
    pv_gemm<D>(o, p, sv + (st ^ 1) * L::V);
    wgmma_commit();
    wgmma_wait<1>();  // S_j is complete; the softmax runs while P_{j-1} V_{j-1} does
    fence_regs(s);
    if (lane == 0) mbar_arrive(k_free(st));
    softmax(j);
    wgmma_wait<0>();  // P_{j-1} V_{j-1} is complete: O and p are free
    fence_regs(o);
    fence_regs(p);
    if (lane == 0) mbar_arrive(v_free(st ^ 1));
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] *= (i & 2) ? alpha_c : alpha_a;  // rows a, a, c, c
    pack_p(p, s);
  }
  // O += P V of the last tile.
  const int st = (n_tiles - 1) & 1;
  mbar_wait(v_full(st), ((n_tiles - 1) >> 1) & 1);
  fence_proxy_async();
  fence_regs(o);
  wgmma_fence();
  pv_gemm<D>(o, p, sv + st * L::V);
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(o);

  // out[t, hk*G + g, :] = O / l for this thread's rows that exist.
#pragma unroll
  for (int x = 1; x <= 2; x <<= 1) {
    l_a += __shfl_xor_sync(0xffffffffu, l_a, x);
    l_c += __shfl_xor_sync(0xffffffffu, l_c, x);
  }
  const int n_head = gridDim.y * group;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = r0 + 8 * half;
    if (r > last) continue;
    const float inv = 1.f / (half ? l_c : l_a);  // l >= 1: the max key contributes 2^0
    const int t = r / group, g = r - t * group;
    float* dst = out + ((i64)t * n_head + hk * group + g) * D + 2 * qd;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      float2 w;
      w.x = o[4 * n + 2 * half] * inv, w.y = o[4 * n + 2 * half + 1] * inv;
      *(float2*)(dst + 8 * n) = w;
    }
  }
}

// ---- a check of the building blocks ------------------------------------------------------

// Shared-memory bytes of wgmma_gemm_test<D>; must match _smem90_test in flash.py.
template <int D>
struct SmemTest90 {
  static constexpr u32 Q = 64 * D * 2, K = F9_KEYS * D * 2, V = D * F9_KEYS * 2;
  static constexpr u32 TOTAL = 1024 + Q + K + V;
};

// One warpgroup (128 threads) runs the flash90 building blocks once, for tests: q [64, D],
// k [KEYS, D], vt [D, KEYS] fp16 (row-major, contiguous) through load_tile, qk_gemm, pack_p and
// pv_gemm; s_out [64, KEYS] = q k^T and o_out [64, D] = fp16(s_out) vt^T, float32, written from
// the accumulator fragments by the layout of the header. A wrong swizzle, descriptor or
// fragment mapping shows up here as misplaced entries.
template <int D>
__global__ void __launch_bounds__(128)
    wgmma_gemm_test(const u16* __restrict__ q, const u16* __restrict__ k,
                    const u16* __restrict__ vt, float* __restrict__ s_out,
                    float* __restrict__ o_out) {
  using L = SmemTest90<D>;
  extern __shared__ unsigned char smem_raw[];
  const u32 sq = (smem_u32(smem_raw) + 1023) & ~1023u, sk = sq + L::Q, sv = sk + L::K;
  load_tile<64, D, 128>(sq, q, D, 64, D);
  load_tile<F9_KEYS, D, 128>(sk, k, D, F9_KEYS, D);
  load_tile<D, F9_KEYS, 128>(sv, vt, F9_KEYS, D, F9_KEYS);
  asm volatile("cp.async.commit_group;" ::: "memory");
  asm volatile("cp.async.wait_group 0;" ::: "memory");
  fence_proxy_async();
  __syncthreads();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, grp = lane >> 2, qd = lane & 3;
  const int row = 16 * warp + grp;  // and row + 8
  float s[F9_KEYS / 2];
  fence_regs(s);
  wgmma_fence();
  qk_gemm<D, 64>(s, sq, sk);
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(s);
#pragma unroll
  for (int i = 0; i < F9_KEYS / 2; ++i) {
    s_out[(row + 8 * ((i >> 1) & 1)) * F9_KEYS + 8 * (i >> 2) + 2 * qd + (i & 1)] = s[i];
  }

  u32 p[F9_KEYS / 4];
  pack_p(p, s);
  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  fence_regs(o);
  wgmma_fence();
  pv_gemm<D>(o, p, sv);
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(o);
#pragma unroll
  for (int i = 0; i < D / 2; ++i) {
    o_out[(row + 8 * ((i >> 1) & 1)) * D + 8 * (i >> 2) + 2 * qd + (i & 1)] = o[i];
  }
}
