// Element-wise steps of the grouped MoE prefill (engine/kernels/moe.py); the GEMMs are cuBLAS.
// Rows are token-expert pairs sorted by expert. fp16 storage, fp32 arithmetic.

// (u16, i64, h2f, f2h: common.cuh)

// a[r, i] = silu(gu[r, i]) * gu[r, f + i]; gu: [n_rows, 2f] (gate | up), a: [n_rows, f]
extern "C" __global__ void swiglu(const u16* __restrict__ gu, u16* __restrict__ a, i64 n_rows,
                                  int f) {
  const i64 n = n_rows * f;
  for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (i64)gridDim.x * blockDim.x) {
    const i64 r = e / f;
    const int i = (int)(e - r * f);
    const float g = h2f(gu[r * 2 * f + i]), u = h2f(gu[r * 2 * f + f + i]);
    a[e] = f2h(g / (1.f + __expf(-g)) * u);
  }
}

// out[t, c] = sum_j w[t, j] * y[pos[t, j], c]; one block per token, deterministic (no atomics).
// y: [T*k, d] fp16 expert outputs in sorted-row order; pos: [T, k] row of (t, j); w: [T, k].
extern "C" __global__ void combine(const u16* __restrict__ y, const int* __restrict__ pos,
                                   const float* __restrict__ w, float* __restrict__ out, int k,
                                   int d) {
  const int t = blockIdx.x;
  for (int c = threadIdx.x; c < d; c += blockDim.x) {
    float s = 0.f;
    for (int j = 0; j < k; ++j) s += w[t * k + j] * h2f(y[(i64)pos[t * k + j] * d + c]);
    out[(i64)t * d + c] = s;
  }
}
