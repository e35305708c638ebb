// Fused small ops of the decode step (and the prompt path): each replaces 5-12 CuPy launches.
// Compiled by NVRTC through cupy.RawModule after common.cuh (u16, h2f, f2h).

// Block-wide sum of one float per thread (blockDim.x a multiple of 32, <= 1024).
__device__ __forceinline__ float block_sum(float v, float* shared) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  const int n_warps = blockDim.x >> 5;
  v = threadIdx.x < n_warps ? shared[threadIdx.x] : 0.0f;
  if (warp == 0)
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x == 0) shared[0] = v;
  __syncthreads();
  v = shared[0];
  __syncthreads();  // shared[] may be reused by the caller
  return v;
}

// RMSNorm of rows: y[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w[:]. One block per row.
// W is float or u16 (the weight's dtype on the device).
template <typename W>
__device__ __forceinline__ float load_w(const W* w, int i);
template <>
__device__ __forceinline__ float load_w<float>(const float* w, int i) { return w[i]; }
template <>
__device__ __forceinline__ float load_w<u16>(const u16* w, int i) {
  return h2f(w[i]);
}

template <typename W>
__global__ void rms_norm_rows(const float* __restrict__ x, const W* __restrict__ w,
                              float* __restrict__ y, int n, float eps) {
  __shared__ float shared[32];
  const long long row = blockIdx.x;
  const float* xr = x + row * n;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
  ss = block_sum(ss, shared);
  const float scale = 1.0f / sqrtf(ss / (float)n + eps);
  for (int i = threadIdx.x; i < n; i += blockDim.x) y[row * n + i] = xr[i] * scale * load_w<W>(w, i);
}

// NEOX rotary embedding in place: x [T, H, D]; query t sits at position pos0 + t (plus pos[0]
// when `pos` is given: the token graph's device-side position); inv_freq [D/2].
// One thread per (t, h, i < D/2) rotates the pair (i, i + D/2).
extern "C" __global__ void rope_neox_inplace(float* __restrict__ x,
                                             const float* __restrict__ inv_freq, long long n_pairs,
                                             int n_head, int half, long long pos0,
                                             const int* __restrict__ pos, int head_dim) {
  // `half` pairs (i, i + half) of each head's first 2 * half dims (partial RoPE where that is
  // less than head_dim: the rest pass through)
  const long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (k >= n_pairs) return;
  if (pos) pos0 += pos[0];
  const int i = (int)(k % half);
  const long long th = k / half;  // t * H + h
  const long long t = th / n_head;
  const float ang = __fmul_rn((float)(pos0 + t), inv_freq[i]);
  const float c = cosf(ang), s = sinf(ang);
  float* row = x + th * head_dim;
  const float x1 = row[i], x2 = row[i + half];
  row[i] = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
  row[i + half] = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
}

// q4_0 KV encoding of n_blocks blocks of 32 floats: scale = fp16(signed max |x| / -8),
// q = clamp(floor(x / scale + 8.5), 0, 15), low nibbles = values 0..15, high = 16..31.
// One thread per block (the rounding steps as the numpy codec does them, no FMA contraction).
// With `pos` (the token graph), q and scale start at cell 0 and the output starts at cell pos[0]
// of `blocks_per_cell` blocks each.
extern "C" __global__ void kv_q4_encode(const float* __restrict__ x, unsigned char* __restrict__ q,
                                        u16* __restrict__ scale, long long n_blocks,
                                        const int* __restrict__ pos, long long blocks_per_cell) {
  const long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= n_blocks) return;
  if (pos) {
    q += (long long)pos[0] * blocks_per_cell * 16;
    scale += (long long)pos[0] * blocks_per_cell;
  }
  const float* v = x + b * 32;
  float m = v[0];
  for (int i = 1; i < 32; ++i)
    if (fabsf(v[i]) > fabsf(m)) m = v[i];  // the first of equal magnitudes, as argmax
  const u16 s16 = f2h(m / -8.0f);
  const float s = h2f(s16);
  const float inv = s == 0.0f ? 0.0f : 1.0f / s;
  scale[b] = s16;
  for (int i = 0; i < 16; ++i) {
    const float lo = fminf(fmaxf(floorf(__fadd_rn(__fmul_rn(v[i], inv), 8.5f)), 0.0f), 15.0f);
    const float hi = fminf(fmaxf(floorf(__fadd_rn(__fmul_rn(v[i + 16], inv), 8.5f)), 0.0f), 15.0f);
    q[b * 16 + i] = (unsigned char)((int)lo | ((int)hi << 4));
  }
}

// q4_0 KV decoding: one thread per packed byte -> two values (value i and i + 16 of its block),
// float32 or (the prompt attention's operands) rounded once to fp16.
__device__ __forceinline__ void put(float* p, float v) { *p = v; }
__device__ __forceinline__ void put(u16* p, float v) { *p = f2h(v); }

template <typename T>
__device__ __forceinline__ void kv_q4_decode_to(const unsigned char* __restrict__ q,
                                                const u16* __restrict__ scale,
                                                T* __restrict__ out, long long n_bytes) {
  const long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (k >= n_bytes) return;
  const long long b = k / 16;
  const int i = (int)(k % 16);
  const float s = h2f(scale[b]);
  const unsigned char byte = q[k];
  put(out + b * 32 + i, (float)((int)(byte & 0x0F) - 8) * s);
  put(out + b * 32 + i + 16, (float)((int)(byte >> 4) - 8) * s);
}

extern "C" __global__ void kv_q4_decode(const unsigned char* __restrict__ q,
                                        const u16* __restrict__ scale,
                                        float* __restrict__ out, long long n_bytes) {
  kv_q4_decode_to<float>(q, scale, out, n_bytes);
}

extern "C" __global__ void kv_q4_decode_f16(const unsigned char* __restrict__ q,
                                            const u16* __restrict__ scale,
                                            u16* __restrict__ out, long long n_bytes) {
  kv_q4_decode_to<u16>(q, scale, out, n_bytes);
}

// Rows per expert: counts[ids[i]] += 1 for i < n (counts zeroed by the caller). One launch of
// any size: CuPy's bincount checks its input with a reduction compiled per block size, which
// stalled a request on NVRTC the first time a routing of a new size came.
extern "C" __global__ void count_ids(const long long* __restrict__ ids, int n, int* __restrict__ counts) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) atomicAdd(&counts[ids[i]], 1);
}

// Router: probs = softmax(logits[t, :E]); the k largest (ties: lower index first) -> ids[t, :k]
// (int64), their probabilities renormalised to sum 1 -> w[t, :k], and the margin
// p(k-th) - p((k+1)-th) -> margin[t] (1 when k == E). One block per token, E <= 1024.
// One block per row. Choice scores: softmax probabilities, or (sigmoid) each expert's sigmoid
// plus bias[e] where a bias is given; the top-k by choice score (ties: lower index first), the
// weights the probabilities of the chosen (not the biased scores), renormalised to sum 1 when
// `norm`, times `scale`; the margin is the k-th minus the (k+1)-th choice score.
extern "C" __global__ void route_topk(const float* __restrict__ logits, long long* __restrict__ ids,
                                      float* __restrict__ w, float* __restrict__ margin,
                                      int n_expert, int k, const float* __restrict__ bias,
                                      int sigmoid, int norm, float scale) {
  __shared__ float p[1024];
  __shared__ float best_v[32];
  __shared__ int best_i[32];
  __shared__ float shared[32];
  __shared__ float chosen[33];
  __shared__ float prob[32];
  const float neg_inf = -__int_as_float(0x7f800000);
  const long long t = blockIdx.x;
  const float* row = logits + t * n_expert;
  if (sigmoid) {
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
      const float s = 1.0f / (1.0f + expf(-row[e]));
      p[e] = bias ? s + bias[e] : s;
    }
  } else {
    float mx = neg_inf;
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) mx = fmaxf(mx, row[e]);
    // block max through the same shared scratch
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if ((threadIdx.x & 31) == 0) shared[threadIdx.x >> 5] = mx;
    __syncthreads();
    if (threadIdx.x < 32) {
      float v = threadIdx.x < (blockDim.x >> 5) ? shared[threadIdx.x] : neg_inf;
      for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
      if (threadIdx.x == 0) shared[0] = v;
    }
    __syncthreads();
    mx = shared[0];
    __syncthreads();
    float sum = 0.0f;
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
      p[e] = expf(row[e] - mx);
      sum += p[e];
    }
    sum = block_sum(sum, shared);
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) p[e] = p[e] / sum;
  }
  __syncthreads();
  const int rounds = k < n_expert ? k + 1 : k;
  for (int r = 0; r < rounds; ++r) {
    float v = neg_inf;
    int vi = n_expert;
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x)
      if (p[e] > v || (p[e] == v && e < vi)) { v = p[e]; vi = e; }
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, v, o);
      const int oi = __shfl_xor_sync(0xffffffffu, vi, o);
      if (ov > v || (ov == v && oi < vi)) { v = ov; vi = oi; }
    }
    if ((threadIdx.x & 31) == 0) { best_v[threadIdx.x >> 5] = v; best_i[threadIdx.x >> 5] = vi; }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int j = 1; j < (int)(blockDim.x >> 5); ++j)
        if (best_v[j] > v || (best_v[j] == v && best_i[j] < vi)) { v = best_v[j]; vi = best_i[j]; }
      chosen[r] = v;
      if (r < k) {
        ids[t * k + r] = vi;
        // the weight: the probability itself (the chosen score less its bias)
        prob[r] = (sigmoid && bias) ? 1.0f / (1.0f + expf(-row[vi])) : v;
        p[vi] = neg_inf;  // taken
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (int r = 0; r < k; ++r) total += prob[r];
    for (int r = 0; r < k; ++r) w[t * k + r] = (norm ? prob[r] / total : prob[r]) * scale;
    margin[t] = k < n_expert ? chosen[k - 1] - chosen[k] : 1.0f;
  }
}
