// Causal softmax of one query block's attention scores (engine/kernels/attention.py); the two
// GEMMs around it (Q K^T and P V) are cuBLAS. fp16 storage, fp32 arithmetic. No CUDA headers:
// fp16 conversions are `cvt` PTX.

// (u16, u32, i64, h2f, f2h: common.cuh)

#define SOFTMAX_THREADS 256  // must match _SOFTMAX_THREADS in attention.py
#define LOG2E 1.4426950408889634f
#define NEG_BIG -1.0e30f  // "minus infinity" that keeps exp2f(a - b) free of inf - inf

// (m, l) <- the running max and sum of 2^(x - m) of the union of two partial rows.
__device__ __forceinline__ void merge(float& m, float& l, float m2, float l2) {
  const float mx = fmaxf(m, m2);
  l = l * exp2f(m - mx) + l2 * exp2f(m2 - mx);
  m = mx;
}

// In place over s, a score block of n_rows rows (gridDim.x) with row stride ld (a multiple of 8,
// rows 16-byte aligned): row r belongs to query t = (r % rows_per_head) / group of the block
// (rows are [Hkv, Tq, G] in that order), which sits at position pos_first + t and sees keys
// 0..pos_first + t. Writes p[j] = softmax(row)[j] for visible keys and 0 for the rest of the
// first s_eff columns (the P V GEMM reads exactly those); columns >= s_eff are not touched
// except up to the next multiple of 8 (padding, inside ld).
// One block per row: pass 1 keeps a running (max, sum of exp) per thread and merges them; pass
// 2 reads the row again (mostly from L2) and writes the normalized fp16 probabilities.
extern "C" __global__ void __launch_bounds__(SOFTMAX_THREADS)
    causal_softmax_f16(u16* __restrict__ s, int ld, int s_eff, int rows_per_head, int group,
                       int pos_first) {
  const i64 row = blockIdx.x;
  const int t = (int)(row % rows_per_head) / group;
  const int n_vis = pos_first + t + 1;  // <= s_eff
  uint4* p = (uint4*)(s + row * (i64)ld);

  float m = NEG_BIG, l = 0.f;  // in base-2 units: x * log2(e)
  const int n_read = (n_vis + 7) >> 3;  // 8-value chunks holding visible keys
  for (int c = threadIdx.x; c < n_read; c += SOFTMAX_THREADS) {
    const uint4 w = p[c];
    const u32 words[4] = {w.x, w.y, w.z, w.w};
    float x[8], cm = NEG_BIG;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const u16 h = (u16)(words[e >> 1] >> ((e & 1) * 16));
      x[e] = (c * 8 + e < n_vis) ? h2f(h) * LOG2E : NEG_BIG;  // select, no math on padding
      cm = fmaxf(cm, x[e]);
    }
    if (cm > m) {
      l *= exp2f(m - cm);
      m = cm;
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) l += exp2f(x[e] - m);
  }

  __shared__ float s_m[SOFTMAX_THREADS / 32], s_l[SOFTMAX_THREADS / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
    const float l2 = __shfl_xor_sync(0xffffffffu, l, o);
    merge(m, l, m2, l2);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) s_m[warp] = m, s_l[warp] = l;
  __syncthreads();
  m = s_m[0], l = s_l[0];
#pragma unroll
  for (int w = 1; w < SOFTMAX_THREADS / 32; ++w) merge(m, l, s_m[w], s_l[w]);
  const float inv = 1.f / l;  // l >= 1: the max element contributes 2^0

  const int n_write = (s_eff + 7) >> 3;
  for (int c = threadIdx.x; c < n_write; c += SOFTMAX_THREADS) {
    uint4 o;
    o.x = o.y = o.z = o.w = 0u;
    if (c < n_read) {
      const uint4 w = p[c];
      const u32 words[4] = {w.x, w.y, w.z, w.w};
      u32 out[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        u32 packed = 0u;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int e = 2 * i + half;
          const float x = h2f((u16)(words[i] >> (half * 16)));
          const float y = (c * 8 + e < n_vis) ? exp2f(x * LOG2E - m) * inv : 0.f;
          packed |= (u32)f2h(y) << (half * 16);
        }
        out[i] = packed;
      }
      o.x = out[0], o.y = out[1], o.z = out[2], o.w = out[3];
    }
    p[c] = o;
  }
}
