// Causal grouped-query flash attention, forward (engine/kernels/flash.py): FlashAttention-2 style,
// fp16 tensor-core mma.sync (m16n8k16, fp32 accumulation), online softmax in fp32, the scores
// never leave registers. Needs sm_80+ (f16 mma m16n8k16, cp.async, cvt f16x2). Compiled by
// NVRTC after common.cuh; no CUDA headers.
//
// Layouts (fp16 = u16): q [Hkv, R, D] with R = T*G rows, row r = t*G + g (query t, head g of the
// kv head's group); k, v [Hkv, s_len, D]; out [T, H, D] float32, H = Hkv*G, head hk*G + g.
// Row r sits at position pos0 + r/G and sees keys 0..pos0 + r/G.
//
// Grid (ceil(R/64), Hkv), 128 threads: warp w owns the 16 rows rb + 16w..rb + 16w + 15 of the
// block's 64 (rb = 64 * row tile). Key tiles of BC keys are staged in shared memory; per tile a
// warp computes S = Q K^T (16 x BC), folds it into the running max / sum, and adds P V to O.
//
// mma.sync.m16n8k16 fragments (lane = 4*grp + qd; "{x, y}" = one 32-bit register, x in the low
// half; A is 16x16 row-major, B is 16x8 (k x n), C is 16x8 fp32):
//   A: a0 = {A[grp][2qd], A[grp][2qd+1]}  a1 = rows +8  a2 = cols +8  a3 = rows +8, cols +8
//   B: b0 = {B[2qd][grp], B[2qd+1][grp]}  b1 = k rows +8
//   C: c0 = C[grp][2qd]  c1 = C[grp][2qd+1]  c2 = C[grp+8][2qd]  c3 = C[grp+8][2qd+1]
// B operands come from shared memory by ldmatrix.x4: lane 8i + j gives the address of row j of
// 8x8 matrix i (8 contiguous halves); register i of lane 4*grp + qd receives {M_i[grp][2qd],
// M_i[grp][2qd+1]}, or with .trans {M_i[2qd][grp], M_i[2qd+1][grp]}.

#define FA_THREADS 128  // 4 warps; must match _THREADS in flash.py
#define FA_ROWS 64      // rows of q per block (16 per warp); must match _ROWS in flash.py
#define FA_NEG -1.0e30f // masked score: exp2f(FA_NEG - m) == 0, and no inf - inf

__device__ __forceinline__ u32 smem_u32(const void* p) {  // shared-window address of p
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

__device__ __forceinline__ void ldsm_x4(u32* r, u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}

__device__ __forceinline__ void ldsm_x4_t(u32* r, u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}

// Rows j0..j0+BC-1 of a [*, D] fp16 matrix into shared memory at dst (row stride D+8 halves)
// by cp.async, 16 bytes a copy, one commit group (empty if j0 >= n_keys); rows >= n_keys are
// zero-filled (src-size 0), so masked keys bring no NaN into 0 * V.
template <int D, int BC>
__device__ __forceinline__ void load_tile(u32 dst, const u16* src, int j0, int n_keys) {
  for (int c = threadIdx.x; j0 < n_keys && c < BC * D / 8; c += FA_THREADS) {
    const int row = c / (D / 8), col = (c % (D / 8)) * 8;
    const bool in = j0 + row < n_keys;
    const u16* g = src + (i64)(in ? j0 + row : 0) * D + col;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(dst + 2 * (row * (D + 8) + col)), "l"(g), "r"(in ? 16 : 0) : "memory");
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

template <int N>  // wait until at most N of this thread's cp.async groups are pending
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}

// c (16x8 fp32, C layout) += A (16x16 fp16, 4 regs) * B (16x8 fp16, b0 b1).
__device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// {lo, hi} as one f16x2 register. cvt's FIRST source goes to the UPPER half, hence (hi, lo).
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// One tile of the online softmax for this lane's rows a (grp) and c (grp + 8): s (NT C fragments
// of Q K^T) becomes P = 2^(s * scale_log2 - m), m and l are updated, O is rescaled. `crosses`:
// the tile reaches past some row's last key; key0 = the key of s[0][0] (tile start + 2qd).
template <int NT, int ND>
__device__ __forceinline__ void online_softmax(float (&s)[NT][4], float (&o)[ND][4], float& m_a,
                                               float& m_c, float& l_a, float& l_c,
                                               float scale_log2, bool crosses, int key0,
                                               int lim_a, int lim_c) {
  float mx_a = m_a, mx_c = m_c;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {  // e: 0, 1 row a, 2, 3 row c; keys key0 + 8n + (e & 1)
      float x = s[n][e] * scale_log2;
      if (crosses && key0 + 8 * n + (e & 1) > (e < 2 ? lim_a : lim_c)) x = FA_NEG;
      s[n][e] = x;
    }
    mx_a = fmaxf(mx_a, fmaxf(s[n][0], s[n][1]));
    mx_c = fmaxf(mx_c, fmaxf(s[n][2], s[n][3]));
  }
  // A row's values of the tile live in the 4 lanes of a quad (qd): reduce over them.
#pragma unroll
  for (int x = 1; x <= 2; x <<= 1) {
    mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, x));
    mx_c = fmaxf(mx_c, __shfl_xor_sync(0xffffffffu, mx_c, x));
  }
  // Tile 0 holds key 0, visible to every row, so after it m is a real score and every later
  // exp2f(FA_NEG - m) is 0; in tile 0, alpha = exp2f(FA_NEG - m) = 0 clears nothing but zeros.
  const float alpha_a = exp2f(m_a - mx_a), alpha_c = exp2f(m_c - mx_c);
  m_a = mx_a, m_c = mx_c;
  float sum_a = 0.f, sum_c = 0.f;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    s[n][0] = exp2f(s[n][0] - m_a), s[n][1] = exp2f(s[n][1] - m_a);
    s[n][2] = exp2f(s[n][2] - m_c), s[n][3] = exp2f(s[n][3] - m_c);
    sum_a += s[n][0] + s[n][1], sum_c += s[n][2] + s[n][3];
  }
  l_a = l_a * alpha_a + sum_a, l_c = l_c * alpha_c + sum_c;  // this lane's part of the row sums
#pragma unroll
  for (int n = 0; n < ND; ++n) {
    o[n][0] *= alpha_a, o[n][1] *= alpha_a, o[n][2] *= alpha_c, o[n][3] *= alpha_c;
  }
}

template <int D>
__global__ void __launch_bounds__(FA_THREADS)
    flash_attn(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v,
               float* __restrict__ out, int rows, int group, int s_len, int pos0,
               float scale_log2) {
  constexpr int BC = D <= 128 ? 64 : 32;  // keys per tile (smem 2*BC*(D+8)*2 bytes < 48 KiB)
  constexpr int LD = D + 8;  // smem row stride in halves: 8 rows of an ldmatrix hit 32 banks
  constexpr int KS = D / 16, ND = D / 8, NT = BC / 8;  // k-steps of Q K^T, n8 tiles of O and S
  __shared__ __align__(16) u16 sk[BC * LD];
  __shared__ __align__(16) u16 sv[BC * LD];

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, grp = lane >> 2, qd = lane & 3;
  const int hk = blockIdx.y;
  const int rb = (gridDim.x - 1 - blockIdx.x) * FA_ROWS;  // last row tiles (most keys) first
  const int r0 = rb + warp * 16, last = rows - 1;
  const int ra = min(r0 + grp, last), rc = min(r0 + grp + 8, last);  // this lane's two rows
  const int lim_a = pos0 + ra / group, lim_c = pos0 + rc / group;     // their last keys
  const int warp_lo = pos0 + min(r0, last) / group;       // smallest last key of the warp
  const int warp_hi = r0 > last ? -1 : pos0 + min(r0 + 15, last) / group;  // largest (-1: no rows)
  const int n_keys = pos0 + min(rb + FA_ROWS - 1, last) / group + 1;  // keys the block needs

  // Q as A fragments for the whole kernel (rows past `last` repeat it and are not stored).
  u32 qa[KS][4];
  const u16* qa_row = q + ((i64)hk * rows + ra) * D + 2 * qd;
  const u16* qc_row = q + ((i64)hk * rows + rc) * D + 2 * qd;
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    qa[ks][0] = *(const u32*)(qa_row + 16 * ks);
    qa[ks][1] = *(const u32*)(qc_row + 16 * ks);
    qa[ks][2] = *(const u32*)(qa_row + 16 * ks + 8);
    qa[ks][3] = *(const u32*)(qc_row + 16 * ks + 8);
  }

  float o[ND][4];
#pragma unroll
  for (int n = 0; n < ND; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m_a = FA_NEG, m_c = FA_NEG, l_a = 0.f, l_c = 0.f;  // l: this lane's part of the sum

  const u16* kh = k + (i64)hk * s_len * D;
  const u16* vh = v + (i64)hk * s_len * D;
  // ldmatrix row addresses of this lane (matrix i = lane >> 3, row j = lane & 7), tile-relative:
  // K (S = Q K^T, B[d][key] = K[key][d]): matrix i = keys +8*(i>>1), dims +8*(i&1), so regs
  //   0, 1 = b0, b1 of key tile 2p and regs 2, 3 = b0, b1 of key tile 2p + 1;
  // V (O += P V, B[key][d] = V[key][d], .trans): matrix i = keys +8*(i&1), dims +8*(i>>1), so
  //   regs 0, 1 = b0, b1 of dim tile 2p and regs 2, 3 = b0, b1 of dim tile 2p + 1.
  const u32 sk_addr = smem_u32(sk), sv_addr = smem_u32(sv);
  const int j8 = lane & 7, i_hi = (lane >> 4) & 1, i_lo = (lane >> 3) & 1;
  const u32 k_addr = sk_addr + 2 * ((i_hi * 8 + j8) * LD + i_lo * 8);
  const u32 v_addr = sv_addr + 2 * ((i_lo * 8 + j8) * LD + i_hi * 8);

  // Three barriers a tile; V(j0) loads during S(j0), K(j0 + BC) during P V(j0).
  load_tile<D, BC>(sk_addr, kh, 0, n_keys);
  for (int j0 = 0; j0 < n_keys; j0 += BC) {
    cp_async_wait<0>();
    __syncthreads();  // K(j0) is in sk; every warp is done with sv (tile j0 - BC)
    load_tile<D, BC>(sv_addr, vh, j0, n_keys);
    const bool active = j0 <= warp_hi;  // some row of this warp sees the tile (warp-uniform)
    float s[NT][4];  // S = Q K^T, then P: s[n] = the C fragment of keys j0 + 8n .. j0 + 8n + 7
    if (active) {
#pragma unroll
      for (int n = 0; n < NT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
      for (int p = 0; p < NT / 2; ++p) {
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
          u32 b[4];
          ldsm_x4(b, k_addr + 2 * (16 * p * LD + 16 * ks));
          mma16816(s[2 * p], qa[ks], b[0], b[1]);
          mma16816(s[2 * p + 1], qa[ks], b[2], b[3]);
        }
      }
      online_softmax<NT, ND>(s, o, m_a, m_c, l_a, l_c, scale_log2,
                             j0 + BC - 1 > warp_lo, j0 + 2 * qd, lim_a, lim_c);
    }
    __syncthreads();  // every warp is done with sk
    load_tile<D, BC>(sk_addr, kh, j0 + BC, n_keys);  // (past the end: an empty group)
    cp_async_wait<1>();
    __syncthreads();  // V(j0) is in sv
    if (!active) continue;
    // O += P V over 16-key steps: the C fragments of key tiles 2kk, 2kk+1 are the A fragment.
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk) {
      u32 pa[4];
      pa[0] = pack_f16x2(s[2 * kk][0], s[2 * kk][1]);          // row grp, keys 2qd, 2qd+1
      pa[1] = pack_f16x2(s[2 * kk][2], s[2 * kk][3]);          // row grp+8
      pa[2] = pack_f16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);  // row grp, keys +8
      pa[3] = pack_f16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);  // row grp+8, keys +8
#pragma unroll
      for (int p = 0; p < D / 16; ++p) {
        u32 b[4];
        ldsm_x4_t(b, v_addr + 2 * (16 * kk * LD + 16 * p));
        mma16816(o[2 * p], pa, b[0], b[1]);
        mma16816(o[2 * p + 1], pa, b[2], b[3]);
      }
    }
  }

  // out[t, hk*G + g, :] = O / l for this lane's rows that exist.
#pragma unroll
  for (int x = 1; x <= 2; x <<= 1) {
    l_a += __shfl_xor_sync(0xffffffffu, l_a, x);
    l_c += __shfl_xor_sync(0xffffffffu, l_c, x);
  }
  const int n_head = gridDim.y * group;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = r0 + grp + 8 * half;
    if (r > last) continue;
    const float inv = 1.f / (half ? l_c : l_a);  // l >= 1: the max key contributes 2^0
    const int t = r / group, g = r - t * group;
    float* dst = out + ((i64)t * n_head + hk * group + g) * D + 2 * qd;
#pragma unroll
    for (int n = 0; n < ND; ++n) {
      float2 w;
      w.x = o[n][2 * half] * inv, w.y = o[n][2 * half + 1] * inv;
      *(float2*)(dst + 8 * n) = w;
    }
  }
}
