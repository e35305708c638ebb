// Kernels of the token graph (engine/model/token_graph.py): attention of a decode step over the KV
// cache and the MoE job table. Positions come from device memory (`pos[0]` = position of row 0)
// and expert residency from the staged residency table, so one captured CUDA graph serves every
// step. Compiled by NVRTC after common.cuh.

// ---- KV rows -------------------------------------------------------------------------------
// One (cell, kv head) row of D values: `block(row, b, v)` decodes values 32b..32b+31, `one(row,
// i)` value i. Values are what engine/kv.py's numpy codecs decode, in float32.

template <int D>
struct KvQ4 {  // q4_0: D/2 packed bytes (low nibbles = values 0..15 of a block) + D/32 fp16 scales
  const unsigned char* q;
  const u16* s;
  __device__ KvQ4(const void* cells, const void* scales)
      : q((const unsigned char*)cells), s((const u16*)scales) {}
  __device__ __forceinline__ void block(i64 row, int b, float* v) const {
    const uint4 raw = *(const uint4*)(q + row * (D / 2) + b * 16);
    const unsigned char* by = (const unsigned char*)&raw;
    const float sc = h2f(s[row * (D / 32) + b]);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      v[i] = (float)((int)(by[i] & 15) - 8) * sc;
      v[i + 16] = (float)((int)(by[i] >> 4) - 8) * sc;
    }
  }
  __device__ __forceinline__ float one(i64 row, int i) const {
    const int b = i >> 5, j = i & 31;
    const unsigned char by = q[row * (D / 2) + b * 16 + (j & 15)];
    const int n = j < 16 ? (by & 15) : (by >> 4);
    return (float)(n - 8) * h2f(s[row * (D / 32) + b]);
  }
};

template <int D>
struct KvF16 {  // f16: D half values
  const u16* q;
  __device__ KvF16(const void* cells, const void*) : q((const u16*)cells) {}
  __device__ __forceinline__ void block(i64 row, int b, float* v) const {
    const u16* p = q + row * D + b * 32;
#pragma unroll
    for (int i = 0; i < 32; ++i) v[i] = h2f(p[i]);
  }
  __device__ __forceinline__ float one(i64 row, int i) const { return h2f(q[row * D + i]); }
};

// ---- attention -----------------------------------------------------------------------------
// Flash-decoding in two kernels. attn_tiles: block (tile, kv head, row t) scores the KEYS keys
// of its tile (one thread per key) for the G query heads sharing the kv head, then writes per
// head the tile's max m, sum l of exp(s - m) and the exp-weighted sum of V [D]. Row t sits at
// position pos + t and sees cells 0..pos+t; tiles past that return at once, so the grid covers
// the whole context and stays the same every step. attn_merge combines a row's tiles.
// q: [T, H, D] float32 (H = Hkv * G), already RoPE'd; part_ml: [T, H, n_tiles, 2];
// part_acc: [T, H, n_tiles, D]; out: [T, H, D].

#define KEYS 128

template <class KV, int G, int D>
__global__ void __launch_bounds__(KEYS)
    attn_tiles(const float* __restrict__ q, const void* k_cells, const void* k_scales,
               const void* v_cells, const void* v_scales, const int* __restrict__ pos,
               int n_head_kv, float scale, int n_tiles, float* __restrict__ part_ml,
               float* __restrict__ part_acc) {
  const KV k(k_cells, k_scales), v(v_cells, v_scales);
  const int tile = blockIdx.x, hk = blockIdx.y, t = blockIdx.z;
  const int n_keys = pos[0] + t + 1;
  const int j0 = tile * KEYS;
  if (j0 >= n_keys) return;
  __shared__ float sq[G * D];
  __shared__ float sp[G][KEYS];
  __shared__ float sm[G], sl[G];
  const int n_head = n_head_kv * G;
  const float* qt = q + ((i64)t * n_head + hk * G) * D;  // [G, D]
  for (int i = threadIdx.x; i < G * D; i += KEYS) sq[i] = qt[i] * scale;
  __syncthreads();

  const int j = j0 + threadIdx.x;
  float s[G];
#pragma unroll
  for (int g = 0; g < G; ++g) s[g] = 0.0f;
  if (j < n_keys) {
    const i64 row = (i64)j * n_head_kv + hk;
    for (int b = 0; b < D / 32; ++b) {
      float kb[32];
      k.block(row, b, kb);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float* qg = sq + g * D + b * 32;
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < 32; ++i) acc += qg[i] * kb[i];
        s[g] += acc;
      }
    }
  }
  const float NEG_INF = -__int_as_float(0x7f800000);
#pragma unroll
  for (int g = 0; g < G; ++g) sp[g][threadIdx.x] = j < n_keys ? s[g] : NEG_INF;
  __syncthreads();

  // per head: tile max and sum (warp w takes heads w, w + 4, ...), probabilities in place
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int g = warp; g < G; g += KEYS / 32) {
    float m = NEG_INF;
    for (int i = lane; i < KEYS; i += 32) m = fmaxf(m, sp[g][i]);
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float l = 0.0f;
    for (int i = lane; i < KEYS; i += 32) {
      const float p = expf(sp[g][i] - m);  // 0 for keys past the row's position
      sp[g][i] = p;
      l += p;
    }
    for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
    if (lane == 0) {
      sm[g] = m;
      sl[g] = l;
    }
  }
  __syncthreads();

  const int n_here = min(KEYS, n_keys - j0);
  for (int d = threadIdx.x; d < D; d += KEYS) {
    float acc[G];
#pragma unroll
    for (int g = 0; g < G; ++g) acc[g] = 0.0f;
    for (int jj = 0; jj < n_here; ++jj) {
      const float val = v.one((i64)(j0 + jj) * n_head_kv + hk, d);
#pragma unroll
      for (int g = 0; g < G; ++g) acc[g] += sp[g][jj] * val;
    }
#pragma unroll
    for (int g = 0; g < G; ++g)
      part_acc[(((i64)t * n_head + hk * G + g) * n_tiles + tile) * D + d] = acc[g];
  }
  if (threadIdx.x < G) {
    const i64 at = (((i64)t * n_head + hk * G + threadIdx.x) * n_tiles + tile) * 2;
    part_ml[at] = sm[threadIdx.x];
    part_ml[at + 1] = sl[threadIdx.x];
  }
}

// Block (head, row t) of SLICES * D threads: out[t, h, :] = sum_i acc_i e^(m_i - M) /
// sum_i l_i e^(m_i - M) over the row's tiles i. The block finds M together, then slice s
// (threads s*D .. s*D + D-1, one per value d) sums tiles s, s + SLICES, ... and the slices'
// sums are added in shared memory: a 31k-cell row has 243 tiles, which one thread per d would
// walk serially (the decode step's largest attention cost at long contexts).
#define SLICES 4

template <int D>
__global__ void __launch_bounds__(SLICES * D)
    attn_merge(const float* __restrict__ part_ml, const float* __restrict__ part_acc,
               const int* __restrict__ pos, int n_head, int n_tiles, float* __restrict__ out) {
  const int h = blockIdx.x, t = blockIdx.y;
  const int d = threadIdx.x % D, slice = threadIdx.x / D;
  const int n_valid = (pos[0] + t + 1 + KEYS - 1) / KEYS;  // >= 1
  const i64 base = (i64)t * n_head + h;
  const float* ml = part_ml + base * n_tiles * 2;
  const float* acc_row = part_acc + base * n_tiles * D;

  __shared__ float s_max[SLICES * D / 32];
  const float NEG_INF = -__int_as_float(0x7f800000);
  float m = NEG_INF;
  for (int i = threadIdx.x; i < n_valid; i += SLICES * D) m = fmaxf(m, ml[2 * i]);
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if ((threadIdx.x & 31) == 0) s_max[threadIdx.x >> 5] = m;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < SLICES * D / 32; ++w) m = fmaxf(m, s_max[w]);

  float l = 0.0f, acc = 0.0f;
#pragma unroll 4
  for (int i = slice; i < n_valid; i += SLICES) {
    const float w = expf(ml[2 * i] - m);
    l += ml[2 * i + 1] * w;
    acc += acc_row[(i64)i * D + d] * w;
  }
  __shared__ float s_acc[SLICES][D], s_l[SLICES];
  s_acc[slice][d] = acc;
  if (d == 0) s_l[slice] = l;
  __syncthreads();
  if (slice == 0) {
    float a = 0.0f, sum = 0.0f;
#pragma unroll
    for (int j = 0; j < SLICES; ++j) a += s_acc[j][d], sum += s_l[j];
    out[base * D + d] = a / sum;
  }
}

// ---- KV writes at the device position ------------------------------------------------------
// f16 cells: x [T, Hkv, D] float32 -> cells pos..pos+T-1 of one layer's K or V (half values).
extern "C" __global__ void kv_f16_write(const float* __restrict__ x, u16* __restrict__ cells,
                                        long long n, long long per_cell,
                                        const int* __restrict__ pos) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) cells[(long long)pos[0] * per_cell + i] = f2h(x[i]);
}

// ---- MoE jobs ------------------------------------------------------------------------------
// One thread per routed pair p = (token t, slot j) of a layer: expert e = ids[p]; its gate, up
// and down bytes are in cache slot table[e] (slot_base + slot * blob_bytes + part offset) or, on
// a miss, read in place from the page-locked GGUF over PCIe (host[part] + e * part_bytes[part],
// device-mapped addresses). Writes the gemv job rows (weights, x, y) for gate and up (2P rows:
// gate first) and down (P rows), and counts hits and misses.
// x: [T, d]; gu: [2, P, f]; act: [P, f]; y: [P, d] (float32 addresses).
extern "C" __global__ void moe_jobs(const long long* __restrict__ ids, int n_pairs, int k,
                                    const int* __restrict__ table, unsigned long long slot_base,
                                    long long blob_bytes, long long off_up, long long off_down,
                                    const unsigned long long* __restrict__ host,
                                    const long long* __restrict__ part_bytes,
                                    unsigned long long x, unsigned long long gu,
                                    unsigned long long act, unsigned long long y, int d, int f,
                                    unsigned long long* __restrict__ jobs_gu,
                                    unsigned long long* __restrict__ jobs_down,
                                    unsigned long long* __restrict__ counts) {
  const int p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p >= n_pairs) return;
  const long long e = ids[p];
  const int slot = table[e];
  unsigned long long w_gate, w_up, w_down;
  if (slot >= 0) {
    const unsigned long long base = slot_base + (unsigned long long)slot * blob_bytes;
    w_gate = base;
    w_up = base + off_up;
    w_down = base + off_down;
    atomicAdd(counts, 1ull);
  } else {
    w_gate = host[0] + e * part_bytes[0];
    w_up = host[1] + e * part_bytes[1];
    w_down = host[2] + e * part_bytes[2];
    atomicAdd(counts + 1, 1ull);
  }
  const unsigned long long xt = x + (unsigned long long)(p / k) * d * 4;
  unsigned long long* g = jobs_gu + 3 * p;
  g[0] = w_gate, g[1] = xt, g[2] = gu + (unsigned long long)p * f * 4;
  unsigned long long* u = jobs_gu + 3 * (n_pairs + p);
  u[0] = w_up, u[1] = xt, u[2] = gu + (unsigned long long)(n_pairs + p) * f * 4;
  unsigned long long* dn = jobs_down + 3 * p;
  dn[0] = w_down, dn[1] = act + (unsigned long long)p * f * 4, dn[2] = y + (unsigned long long)p * d * 4;
}

// out[t, :] = sum_j w[t, j] * y[t * k + j, :]; block per token. y: [T*k, d], w: [T, k].
extern "C" __global__ void moe_weighted_sum(const float* __restrict__ y, const float* __restrict__ w,
                                            float* __restrict__ out, int k, int d) {
  const int t = blockIdx.x;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    float acc = 0.0f;
    for (int j = 0; j < k; ++j) acc += w[t * k + j] * y[((i64)t * k + j) * d + i];
    out[(i64)t * d + i] = acc;
  }
}
