// Dequantize and fused dequantize-GEMV kernels over the block decoders of quant_blocks.cu.
//
// dequant_multi: n_jobs tensors of one quant type and size, one thread per 8 values; job j reads
// srcs[j] and writes dsts[j] (fp16 or fp32), so the MoE path decodes every part of a group of
// experts in one launch.
//
// gemv: y[b, n] = sum_k W[n, k] x[b, k] with W quantized, x float32 [B, n_in], y float32
// [B, n_out]; with `jobs`, grid row blockIdx.y computes one of several such products (one
// launch for all experts of a decode step). A warp owns R consecutive rows. It streams each row
// in chunks of NB whole blocks (a multiple of 16 bytes): wide coalesced loads of chunk c + 1 go
// into registers while chunk c, already in shared memory, is decoded; every decoded group of 8
// weights is multiplied by x of all B batch rows, and each x load serves all R rows.
// One block = 4 warps.
//
// Both kernels first stage the decoder's lookup table (NTAB words, at most 8 KiB) in shared
// memory; dequantize launches of the large-table types give each thread several groups
// (dequant.py: _groups_per_thread) so that the fill is paid over many lookups.

#define WARPS 4

template <class BT>
struct Chunk {
  enum {
    GPB = BT::QK / 8,                                  // groups of 8 values per block
    A16 = (BT::TS % 16 == 0) ? 16 : (BT::TS % 8 == 0) ? 8 : (BT::TS % 4 == 0) ? 4
          : (BT::TS % 2 == 0) ? 2 : 1,                 // block alignment; 1: odd TS (MXFP4)
    NB0 = 16 / A16,                                    // blocks per 16-byte multiple
    WANT = (128 + NB0 * GPB - 1) / (NB0 * GPB) * NB0,  // >= 128 groups per chunk
    CAP = 2048 / BT::TS / NB0 * NB0,                   // <= 2 KiB per row and chunk
    NB = WANT < CAP ? WANT : CAP,
    CB = NB * BT::TS                                   // chunk bytes
  };
};

// The decoder's lookup table (NT words, n_tab of them filled) -> shared memory, by the whole
// block; nothing, not even the barrier, for decoders without one.
template <int NT>
__device__ __forceinline__ void stage_table(u32* s_tab, const u32* __restrict__ tab_g, int n_tab) {
  if (NT > 0) {
    const int n = n_tab < NT ? n_tab : NT;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s_tab[i] = tab_g[i];
    __syncthreads();
  }
}

template <class BT, bool F16OUT>
__global__ void dequant_multi(const unsigned long long* __restrict__ srcs,
                              const unsigned long long* __restrict__ dsts, i64 n_groups,
                              const u32* __restrict__ tab_g, int n_tab) {
  __shared__ u32 s_tab[TabWords<BT>::N > 0 ? TabWords<BT>::N : 1];
  stage_table<TabWords<BT>::N>(s_tab, tab_g, n_tab);
  const u8* src = (const u8*)srcs[blockIdx.y];
  void* dst = (void*)dsts[blockIdx.y];
  const int GPB = BT::QK / 8;
  for (i64 g = (i64)blockIdx.x * blockDim.x + threadIdx.x; g < n_groups;
       g += (i64)gridDim.x * blockDim.x) {
    float v[8];
    BT::dec8(src + (g / GPB) * BT::TS, (int)(g % GPB), v, s_tab);
    if (F16OUT) {
      uint4 o;
      o.x = f2h(v[0]) | ((u32)f2h(v[1]) << 16);
      o.y = f2h(v[2]) | ((u32)f2h(v[3]) << 16);
      o.z = f2h(v[4]) | ((u32)f2h(v[5]) << 16);
      o.w = f2h(v[6]) | ((u32)f2h(v[7]) << 16);
      ((uint4*)dst)[g] = o;
    } else {
      float4 lo, hi;
      lo.x = v[0], lo.y = v[1], lo.z = v[2], lo.w = v[3];
      hi.x = v[4], hi.y = v[5], hi.z = v[6], hi.w = v[7];
      ((float4*)dst)[2 * g] = lo;
      ((float4*)dst)[2 * g + 1] = hi;
    }
  }
}

template <class BT, int R, int B>
__global__ void __launch_bounds__(WARPS * 32)
    gemv(const u8* __restrict__ w, const float* __restrict__ x, float* __restrict__ y, int n_out,
         int n_in, const u32* __restrict__ tab_g, int n_tab,
         const unsigned long long* __restrict__ jobs) {
  typedef Chunk<BT> C;
  if (jobs != 0) {  // several matrices in one launch: job blockIdx.y = (w, x, y) pointers
    w = (const u8*)jobs[3 * blockIdx.y];
    x = (const float*)jobs[3 * blockIdx.y + 1];
    y = (float*)jobs[3 * blockIdx.y + 2];
  }
  // A row chunk is staged from the 16-byte boundary at or below its start (`lead` bytes
  // earlier), so every row uses 16-byte loads whatever its alignment; the bytes read before the
  // start and after the end lie in the same 16-byte segments as row bytes.
  enum { SB = C::CB + 16, WPL = (SB / 16 + 31) / 32 };  // smem bytes, uint4 per lane per row
  __shared__ __align__(16) u8 s_raw[WARPS][R][SB];
  __shared__ u32 s_tab[TabWords<BT>::N > 0 ? TabWords<BT>::N : 1];
  stage_table<TabWords<BT>::N>(s_tab, tab_g, n_tab);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * WARPS + warp) * R;
  if (row0 >= n_out) return;
  const int nblk = n_in / BT::QK;
  const i64 row_bytes = (i64)nblk * BT::TS;
  const int n_chunks = (nblk + C::NB - 1) / C::NB;
  const u8* rows[R];
  int lead[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    rows[r] = w + (i64)min(row0 + r, n_out - 1) * row_bytes;
    lead[r] = (int)((unsigned long long)rows[r] & 15);
  }

  uint4 pre[R][WPL];
  float acc[R][B];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int b = 0; b < B; ++b) acc[r][b] = 0.f;

  // chunk c of every row -> registers (16-byte words; none past the row's last segment)
#define GEMV_LOAD(c)                                                                   \
  {                                                                                    \
    const int n_bytes = min(C::NB, nblk - (c) * C::NB) * BT::TS;                       \
    _Pragma("unroll") for (int r = 0; r < R; ++r) {                                    \
      const uint4* src = (const uint4*)(rows[r] + (i64)(c) * C::CB - lead[r]);         \
      const int nw = (lead[r] + n_bytes + 15) >> 4;                                    \
      _Pragma("unroll") for (int i = 0; i < WPL; ++i) {                                \
        const int idx = lane + 32 * i;                                                 \
        if (idx < nw) pre[r][i] = src[idx];                                            \
      }                                                                                \
    }                                                                                  \
  }

  GEMV_LOAD(0);
  for (int c = 0; c < n_chunks; ++c) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int i = 0; i < WPL; ++i) {
        const int idx = lane + 32 * i;
        if (idx * 16 < SB) ((uint4*)s_raw[warp][r])[idx] = pre[r][i];
      }
    __syncwarp();
    if (c + 1 < n_chunks) GEMV_LOAD(c + 1);
    const int ng = min(C::NB, nblk - c * C::NB) * C::GPB;
    const float* xc = x + (i64)c * C::NB * BT::QK;
#pragma unroll 2
    for (int g = lane; g < ng; g += 32) {
      const int blk = g / C::GPB, j = g % C::GPB;
      float v[R][8];
#pragma unroll
      for (int r = 0; r < R; ++r)
        BT::dec8(s_raw[warp][r] + lead[r] + blk * BT::TS, j, v[r], s_tab);
      const int k0 = blk * BT::QK + 8 * j;
#pragma unroll
      for (int b = 0; b < B; ++b) {
        const float4* xp = (const float4*)(xc + (i64)b * n_in + k0);
        const float4 x0 = xp[0], x1 = xp[1];
#pragma unroll
        for (int r = 0; r < R; ++r)
          acc[r][b] += v[r][0] * x0.x + v[r][1] * x0.y + v[r][2] * x0.z + v[r][3] * x0.w +
                       v[r][4] * x1.x + v[r][5] * x1.y + v[r][6] * x1.z + v[r][7] * x1.w;
      }
    }
    __syncwarp();
  }
#undef GEMV_LOAD

#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int b = 0; b < B; ++b) {
      float s = acc[r][b];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (lane == 0 && row0 + r < n_out) y[(i64)b * n_out + row0 + r] = s;
    }
}
