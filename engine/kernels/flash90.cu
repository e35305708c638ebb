// Causal grouped-query flash attention, forward, for Hopper (engine/kernels/flash.py): the
// algorithm of flash.cu (FlashAttention-2: online softmax in fp32, base 2, scores never leave
// registers) on the asynchronous warpgroup tensor-core instruction `wgmma.mma_async`, with the
// softmax of one key tile overlapping the P V product of the previous one (FlashAttention-3's
// intra-warpgroup order, without its producer warpgroup or TMA). Needs the arch-specific target
// sm_90a (wgmma), so compute capability 9.0 exactly; head sizes D = 64 and 128. Compiled by NVRTC
// after common.cuh and hopper.cuh; no CUDA headers.
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
// [D, KEYS], 8 mbarriers; every tile K-major in the 128-byte swizzled layout wgmma reads, with
// the matrix descriptors of hopper.cuh (which explains both).
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

#define F9_THREADS 256  // 2 warpgroups; must match _THREADS90 in flash.py
#define F9_ROWS 128     // rows of q per block (64 per warpgroup); must match _ROWS90 in flash.py
#define F9_KEYS 128     // keys per tile; must match _KEYS90 in flash.py
#define F9_NEG -1.0e30f // masked score: exp2f(F9_NEG - m) == 0, and no inf - inf

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
