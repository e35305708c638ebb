// Block decoders for the GGUF quant types of the engine core, one struct per type.
//
// Every decoder answers one question: "the 8 consecutive values [8j, 8j + 8) of this block".
// The dequantize kernel writes those 8 values as one 16-byte store; the GEMV kernel multiplies
// them into its dot products. Byte layouts (block bytes TS, values per block QK) must equal
// gguf.GGML_QUANT_SIZES; engine/kernels/dequant.py checks this at import. Bit layouts follow
// the reference decoders of gguf-py (quants.py), re-derived here, and are tested against them.
//
// Alignment: a decoder may assume its block starts at a multiple of min(ALIGN, 16) bytes,
// where ALIGN is the largest power of two dividing TS (blocks are packed back to back); for
// an odd TS (MXFP4) that is 1, so such a decoder reads bytes only.
// F32/F16/BF16 are decoded as pseudo-blocks of 8 values.
//
// Lookup tables (`tab`): a decoder that reads one declares NTAB, its size in u32 words, in the
// enum beside QK and TS; the kernels stage that many words in shared memory (random lookups
// into a few KiB hit banks far faster than L1 lines). dequant.py builds every table from
// gguf.quants at run time and checks that it fits NTAB.
//
// The file is plain C++ apart from QB_FN and the two f16 conversions, so the same text is
// also compiled for the host by the decoder unit check (QB_HOST).

#ifndef QB_HOST
#define QB_FN __device__ __forceinline__
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
QB_FN float h2f(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
QB_FN u16 f2h(float f) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
QB_FN int popc8(u32 v) { return __popc(v); }
#endif

QB_FN u16 ld16(const u8* p) { return *(const u16*)p; }
QB_FN u32 ld32(const u8* p) { return *(const u32*)p; }            // 4-aligned
QB_FN u32 ld32h(const u8* p) { return ld16(p) | ((u32)ld16(p + 2) << 16); }  // 2-aligned

// Eight bytes at a 2-aligned address, as two words (lo = bytes 0..3, hi = bytes 4..7).
struct W2 { u32 lo, hi; };
QB_FN W2 ld64h(const u8* p) { W2 w = {ld32h(p), ld32h(p + 4)}; return w; }
QB_FN W2 ld64(const u8* p) { W2 w = {ld32(p), ld32(p + 4)}; return w; }
QB_FN u32 byte_of(W2 w, int k) { return ((k < 4 ? w.lo : w.hi) >> (8 * (k & 3))) & 0xFF; }

// NTAB of a decoder, 0 where it declares none (no shared table, no fill, no barrier).
template <class BT, class = void>
struct TabWords { enum { N = 0 }; };
template <class BT>
struct TabWords<BT, decltype(void(BT::NTAB))> { enum { N = BT::NTAB }; };

// ---- float types (pseudo-blocks of 8 values) -----------------------------------------------

struct BF32 {
  enum { QK = 8, TS = 32 };
  static QB_FN void dec8(const u8* b, int, float* v, const u32*) {
    for (int k = 0; k < 8; ++k) { u32 u = ld32(b + 4 * k); v[k] = *(const float*)&u; }
  }
};
struct BF16h {  // IEEE half
  enum { QK = 8, TS = 16 };
  static QB_FN void dec8(const u8* b, int, float* v, const u32*) {
    for (int k = 0; k < 8; ++k) v[k] = h2f(ld16(b + 2 * k));
  }
};
struct BBF16 {  // bfloat16: the top half of an f32
  enum { QK = 8, TS = 16 };
  static QB_FN void dec8(const u8* b, int, float* v, const u32*) {
    for (int k = 0; k < 8; ++k) { u32 u = (u32)ld16(b + 2 * k) << 16; v[k] = *(const float*)&u; }
  }
};

// ---- 32-value blocks ----------------------------------------------------------------------
// Q4_x/Q5_x: value i < 16 is the low nibble of qs[i], value i >= 16 the high nibble of qs[i-16];
// Q5_x add bit i of the 32-bit qh as the fifth bit.

struct BQ4_0 {  // d f16 | qs[16]
  enum { QK = 32, TS = 18 };
  static QB_FN void dec8(const u8* b, int j, float* v, const u32*) {
    float d = h2f(ld16(b));
    W2 q = ld64h(b + 2 + (j & 1) * 8);
    int sh = (j >> 1) * 4;
    for (int k = 0; k < 8; ++k) v[k] = d * (float)((int)((byte_of(q, k) >> sh) & 15) - 8);
  }
};
struct BQ4_1 {  // d f16 | m f16 | qs[16]
  enum { QK = 32, TS = 20 };
  static QB_FN void dec8(const u8* b, int j, float* v, const u32*) {
    float d = h2f(ld16(b)), m = h2f(ld16(b + 2));
    W2 q = ld64(b + 4 + (j & 1) * 8);
    int sh = (j >> 1) * 4;
    for (int k = 0; k < 8; ++k) v[k] = d * (float)((byte_of(q, k) >> sh) & 15) + m;
  }
};
struct BQ5_0 {  // d f16 | qh u32 | qs[16]
  enum { QK = 32, TS = 22 };
  static QB_FN void dec8(const u8* b, int j, float* v, const u32*) {
    float d = h2f(ld16(b));
    u32 qh = ld32h(b + 2) >> (8 * j);
    W2 q = ld64h(b + 6 + (j & 1) * 8);
    int sh = (j >> 1) * 4;
    for (int k = 0; k < 8; ++k) {
      int x = (int)(((byte_of(q, k) >> sh) & 15) | (((qh >> k) & 1) << 4));
      v[k] = d * (float)(x - 16);
    }
  }
};
struct BQ5_1 {  // d f16 | m f16 | qh u32 | qs[16]
  enum { QK = 32, TS = 24 };
  static QB_FN void dec8(const u8* b, int j, float* v, const u32*) {
    float d = h2f(ld16(b)), m = h2f(ld16(b + 2));
    u32 qh = ld32(b + 4) >> (8 * j);
    W2 q = ld64(b + 8 + (j & 1) * 8);
    int sh = (j >> 1) * 4;
    for (int k = 0; k < 8; ++k) {
      u32 x = ((byte_of(q, k) >> sh) & 15) | (((qh >> k) & 1) << 4);
      v[k] = d * (float)x + m;
    }
  }
};
struct BQ8_0 {  // d f16 | qs int8[32]
  enum { QK = 32, TS = 34 };
  static QB_FN void dec8(const u8* b, int j, float* v, const u32*) {
    float d = h2f(ld16(b));
    W2 q = ld64h(b + 2 + 8 * j);
    for (int k = 0; k < 8; ++k) v[k] = d * (float)(signed char)byte_of(q, k);
  }
};
// IQ4_NL: Q4_0's nibble order; values are kvalues[nibble] (tab: 16 int8, packed).
struct BIQ4_NL {  // d f16 | qs[16]
  enum { QK = 32, TS = 18, NTAB = 4 };
  static QB_FN void dec8(const u8* b, int j, float* v, const u32* tab) {
    float d = h2f(ld16(b));
    W2 q = ld64h(b + 2 + (j & 1) * 8);
    int sh = (j >> 1) * 4;
    const signed char* kv = (const signed char*)tab;
    for (int k = 0; k < 8; ++k) v[k] = d * (float)kv[(byte_of(q, k) >> sh) & 15];
  }
};
// MXFP4: E8M0 exponent e, then Q4_0's nibble order of E2M1 codes. tab holds gguf's E2M1 values
// doubled (16 int8, packed), so the scale is half of 2^(e - 127): the f32 with exponent field
// e - 1, or the subnormal 2^-128 << e for e < 2 (ggml_e8m0_to_fp32_half). TS = 17 is odd: the
// block may start at any byte, so only byte loads.
struct BMXFP4 {  // e u8 | qs[16]
  enum { QK = 32, TS = 17, NTAB = 4 };
  static QB_FN void dec8(const u8* b, int j, float* v, const u32* tab) {
    u32 e = b[0];
    u32 bits = e < 2 ? 0x00200000u << e : (e - 1) << 23;
    float d = *(const float*)&bits;
    const u8* q = b + 1 + (j & 1) * 8;
    int sh = (j >> 1) * 4;
    const signed char* kv = (const signed char*)tab;
    for (int k = 0; k < 8; ++k) v[k] = d * (float)kv[(q[k] >> sh) & 15];
  }
};

// ---- 256-value super-blocks ---------------------------------------------------------------

// Q4_K/Q5_K: eight sub-blocks of 32 with 6-bit scale and min packed in 12 bytes:
// sub-block s < 4: scale = sc[s] & 63, min = sc[s + 4] & 63;
// s >= 4: scale = (sc[s + 4] & 15) | (sc[s - 4] >> 6) << 4, min = (sc[s + 4] >> 4) | (sc[s] >> 6) << 4.
QB_FN void k_scale_min(const u8* sc, int s, float* scale, float* mn) {
  u32 a, m;
  if (s < 4) {
    a = sc[s] & 63;
    m = sc[s + 4] & 63;
  } else {
    a = (sc[s + 4] & 15) | ((u32)(sc[s - 4] >> 6) << 4);
    m = (sc[s + 4] >> 4) | ((u32)(sc[s] >> 6) << 4);
  }
  *scale = (float)a;
  *mn = (float)m;
}

struct BQ4_K {  // d f16 | dmin f16 | scales[12] | qs[128]
  enum { QK = 256, TS = 144 };
  static QB_FN void dec8(const u8* b, int j, float* v, const u32*) {
    int s = j >> 2;  // sub-block of 32; its nibbles: 32-byte run s/2, low or high half
    float sc, mn;
    k_scale_min(b + 4, s, &sc, &mn);
    float d = h2f(ld16(b)) * sc, m = h2f(ld16(b + 2)) * mn;
    W2 q = ld64(b + 16 + (s >> 1) * 32 + (j & 3) * 8);
    int sh = (s & 1) * 4;
    for (int k = 0; k < 8; ++k) v[k] = d * (float)((byte_of(q, k) >> sh) & 15) - m;
  }
};
struct BQ5_K {  // d f16 | dmin f16 | scales[12] | qh[32] | qs[128]
  enum { QK = 256, TS = 176 };
  static QB_FN void dec8(const u8* b, int j, float* v, const u32*) {
    int s = j >> 2;
    float sc, mn;
    k_scale_min(b + 4, s, &sc, &mn);
    float d = h2f(ld16(b)) * sc, m = h2f(ld16(b + 2)) * mn;
    int e = (j & 3) * 8;  // first value within the sub-block
    W2 q = ld64(b + 48 + (s >> 1) * 32 + e);
    W2 h = ld64(b + 16 + e);  // bit s of qh[e + k] is the fifth bit
    int sh = (s & 1) * 4;
    for (int k = 0; k < 8; ++k) {
      u32 x = ((byte_of(q, k) >> sh) & 15) | (((byte_of(h, k) >> s) & 1) << 4);
      v[k] = d * (float)x - m;
    }
  }
};
struct BQ6_K {  // ql[128] | qh[64] | scales int8[16] | d f16
  enum { QK = 256, TS = 210 };
  static QB_FN void dec8(const u8* b, int j, float* v, const u32*) {
    int i0 = 8 * j;
    int a = i0 >> 7, r = i0 & 127;  // half of the block; position in it
    float d = h2f(ld16(b + 208)) * (float)(signed char)b[192 + (i0 >> 4)];
    W2 lo = ld64h(b + a * 64 + (r & 63));
    W2 hi = ld64h(b + 128 + a * 32 + (r & 31));
    int shl = (r >> 6) * 4, shh = (r >> 5) * 2;
    for (int k = 0; k < 8; ++k) {
      int x = (int)(((byte_of(lo, k) >> shl) & 15) | (((byte_of(hi, k) >> shh) & 3) << 4));
      v[k] = d * (float)(x - 32);
    }
  }
};

// Q2_K/Q3_K: sixteen sub-blocks of 16. The 2 low bits of value i are bits 2 * ((i >> 5) & 3)
// of qs[32 * (i >> 7) + (i & 31)].
struct BQ2_K {  // scales[16] (4-bit scale | 4-bit min << 4) | qs[64] | d f16 | dmin f16
  enum { QK = 256, TS = 84 };
  static QB_FN void dec8(const u8* b, int j, float* v, const u32*) {
    int i0 = 8 * j;
    u32 sc = b[j >> 1];
    float d = h2f(ld16(b + 80)) * (float)(sc & 15), m = h2f(ld16(b + 82)) * (float)(sc >> 4);
    W2 q = ld64(b + 16 + (i0 >> 7) * 32 + (i0 & 31));
    int sh = ((i0 >> 5) & 3) * 2;
    for (int k = 0; k < 8; ++k) v[k] = d * (float)((byte_of(q, k) >> sh) & 3) - m;
  }
};
// Q3_K: 6-bit scales biased by 32: low 4 bits of sub-block s in byte s & 7 of scales (high
// nibble for s >= 8), high 2 bits in byte 8 + (s & 3), bits 2 * (s >> 2). A value is its 2 low
// bits minus 4 unless bit i >> 5 of hmask[i & 31] is set.
struct BQ3_K {  // hmask[32] | qs[64] | scales[12] | d f16
  enum { QK = 256, TS = 110 };
  static QB_FN void dec8(const u8* b, int j, float* v, const u32*) {
    int i0 = 8 * j, s = j >> 1;
    u32 lo = (b[96 + (s & 7)] >> (4 * (s >> 3))) & 15;
    u32 hi = (b[104 + (s & 3)] >> (2 * (s >> 2))) & 3;
    float d = h2f(ld16(b + 108)) * (float)((int)(lo | (hi << 4)) - 32);
    W2 q = ld64h(b + 32 + (i0 >> 7) * 32 + (i0 & 31));
    W2 h = ld64h(b + (i0 & 31));
    int sh = ((i0 >> 5) & 3) * 2, hb = i0 >> 5;
    for (int k = 0; k < 8; ++k) {
      int x = (int)((byte_of(q, k) >> sh) & 3) - ((byte_of(h, k) >> hb) & 1 ? 0 : 4);
      v[k] = d * (float)x;
    }
  }
};

// IQ4_XS: eight sub-blocks of 32; 6-bit signed scale (low 4 bits in scales_l, high 2 in
// scales_h); values are kvalues[nibble] with the IQ4_NL non-linear table (tab: 16 int8, packed).
struct BIQ4_XS {  // d f16 | scales_h u16 | scales_l[4] | qs[128]
  enum { QK = 256, TS = 136, NTAB = 4 };
  static QB_FN void dec8(const u8* b, int j, float* v, const u32* tab) {
    int s = j >> 2, e = (j & 3) * 8;
    u32 lo = (b[4 + (s >> 1)] >> (4 * (s & 1))) & 15;
    u32 hi = (ld16(b + 2) >> (2 * s)) & 3;
    float d = h2f(ld16(b)) * (float)((int)(lo | (hi << 4)) - 32);
    W2 q = ld64(b + 8 + s * 16 + (e & 15));
    int sh = (e >> 4) * 4;
    const signed char* kv = (const signed char*)tab;
    for (int k = 0; k < 8; ++k) v[k] = d * (float)kv[(byte_of(q, k) >> sh) & 15];
  }
};

// IQ3_XXS: eight sub-blocks of 32, each: 8 grid indices (4 values each, tab = 256 packed
// uint32 of the IQ3_XXS grid) and one u32 holding four 7-bit sign indices and a 4-bit scale.
// A sign index expands to 8 sign bits: the index plus an even-parity bit 7.
struct BIQ3_XXS {  // d f16 | qs[64] | scales u32[8]
  enum { QK = 256, TS = 98, NTAB = 256 };
  static QB_FN void dec8(const u8* b, int j, float* v, const u32* tab) {
    int s = j >> 2, l = j & 3;
    u32 aux = ld32h(b + 66 + 4 * s);
    float db = h2f(ld16(b)) * (0.5f + (float)(aux >> 28)) * 0.5f;
    u32 si = (aux >> (7 * l)) & 127;
    u32 signs = si | ((u32)(popc8(si) & 1) << 7);
    u32 g0 = tab[b[2 + 8 * s + 2 * l]], g1 = tab[b[2 + 8 * s + 2 * l + 1]];
    for (int k = 0; k < 8; ++k) {
      float g = (float)(((k < 4 ? g0 : g1) >> (8 * (k & 3))) & 0xFF);
      v[k] = db * ((signs >> k) & 1 ? -g : g);
    }
  }
};

// ---- grid types (IQ2_*, IQ3_S, IQ1_*) ------------------------------------------------------

// 7-bit sign index -> 8 sign bits: the index plus an even-parity bit 7 (gguf's ksigns).
QB_FN u32 ksign(u32 si) { return si | ((u32)(popc8(si) & 1) << 7); }

// The 8 byte-sized values of grid point g (two words) times db, negated where `signs` has bit k.
QB_FN void grid8(const u32* g, u32 signs, float db, float* v) {
  u32 g0 = g[0], g1 = g[1];
  for (int k = 0; k < 8; ++k) {
    float x = (float)(((k < 4 ? g0 : g1) >> (8 * (k & 3))) & 0xFF);
    v[k] = db * ((signs >> k) & 1 ? -x : x);
  }
}

// IQ2_XXS: eight sub-blocks of 32, each two u32: four grid indices (a byte per 8 values; tab =
// 256 grid points of 8 bytes) and four 7-bit sign indices with a 4-bit scale in bits 28..31.
struct BIQ2_XXS {  // d f16 | per sub-block: indices u8[4] | signs and scale u32
  enum { QK = 256, TS = 66, NTAB = 512 };
  static QB_FN void dec8(const u8* b, int j, float* v, const u32* tab) {
    int s = j >> 2, l = j & 3;
    u32 aux = ld32h(b + 6 + 8 * s);
    float db = h2f(ld16(b)) * (0.5f + (float)(aux >> 28)) * 0.25f;
    grid8(tab + 2 * b[2 + 8 * s + l], ksign((aux >> (7 * l)) & 127), db, v);
  }
};
// IQ2_XS: per 8 values a u16: 9-bit grid index (tab = 512 grid points of 8 bytes) and a 7-bit
// sign index on top; sixteen 4-bit scales, one per 16 values.
struct BIQ2_XS {  // d f16 | qs u16[32] | scales[8]
  enum { QK = 256, TS = 74, NTAB = 1024 };
  static QB_FN void dec8(const u8* b, int j, float* v, const u32* tab) {
    u32 q = ld16(b + 2 + 2 * j);
    u32 sc = (b[66 + (j >> 2)] >> (4 * ((j >> 1) & 1))) & 15;
    float db = h2f(ld16(b)) * (0.5f + (float)sc) * 0.25f;
    grid8(tab + 2 * (q & 511), ksign(q >> 9), db, v);
  }
};
// IQ2_S: per 8 values a 10-bit grid index (low 8 bits in qs, high 2 in qh, 2 bits each; tab =
// 1024 grid points of 8 bytes) and a plain sign byte; scales as IQ2_XS.
struct BIQ2_S {  // d f16 | qs[32] | signs[32] | qh[8] | scales[8]
  enum { QK = 256, TS = 82, NTAB = 2048 };
  static QB_FN void dec8(const u8* b, int j, float* v, const u32* tab) {
    u32 idx = b[2 + j] | ((((u32)b[66 + (j >> 2)] >> (2 * (j & 3))) & 3) << 8);
    u32 sc = (b[74 + (j >> 2)] >> (4 * ((j >> 1) & 1))) & 15;
    float db = h2f(ld16(b)) * (0.5f + (float)sc) * 0.25f;
    grid8(tab + 2 * idx, b[34 + j], db, v);
  }
};
// IQ3_S: per 4 values a 9-bit grid index (low 8 bits in qs, bit 8 in qh; tab = 512 grid points
// of 4 bytes); a plain sign byte per 8 values; eight 4-bit scales, d * (1 + 2 * scale) per 32.
struct BIQ3_S {  // d f16 | qs[64] | qh[8] | signs[32] | scales[4]
  enum { QK = 256, TS = 110, NTAB = 512 };
  static QB_FN void dec8(const u8* b, int j, float* v, const u32* tab) {
    int s = j >> 2;
    u32 sc = (b[106 + (s >> 1)] >> (4 * (s & 1))) & 15;
    float db = h2f(ld16(b)) * (float)(1 + 2 * sc);
    u32 qh = (u32)b[66 + s] >> (2 * (j & 3));  // bits of indices 2j, 2j + 1
    u32 g[2] = {tab[b[2 + 2 * j] | ((qh & 1) << 8)], tab[b[3 + 2 * j] | ((qh & 2) << 7)]};
    grid8(g, b[74 + j], db, v);
  }
};

// IQ1_S/IQ1_M: per 8 values an 11-bit index into 2048 grid points of 8 values in {-1, 0, 1},
// which tab stores as 2-bit codes (value + 1), 16 bits a point, two points a word; a value is
// dl * (grid + delta) with delta = +-1/8 (gguf's IQ1_S.delta).
QB_FN void grid1(const u32* tab, u32 idx, float dl, float delta, float* v) {
  u32 g = tab[idx >> 1] >> (16 * (idx & 1));
  float off = delta - 1.0f;  // code - 1 + delta, exact
  for (int k = 0; k < 8; ++k) v[k] = dl * ((float)((g >> (2 * k)) & 3) + off);
}
// IQ1_S: qh[s] per 32 values: 3 high index bits for each of its 4 groups of 8 (bits 3l..3l+2),
// a 3-bit scale in bits 12..14 (dl = d * (2 * scale + 1)), the sign of delta in bit 15.
struct BIQ1_S {  // d f16 | qs[32] | qh u16[8]
  enum { QK = 256, TS = 50, NTAB = 1024 };
  static QB_FN void dec8(const u8* b, int j, float* v, const u32* tab) {
    u32 qh = ld16(b + 34 + 2 * (j >> 2));
    float dl = h2f(ld16(b)) * (float)(2 * ((qh >> 12) & 7) + 1);
    u32 idx = b[2 + j] | (((qh >> (3 * (j & 3))) & 7) << 8);
    grid1(tab, idx, dl, qh & 0x8000 ? -0.125f : 0.125f, v);
  }
};
// IQ1_M: d is an f16 split over the top nibbles of the four scale words (word w: bits 4w..4w+3
// of d); their low 12 bits hold sixteen 3-bit scales, dl = d * (2 * scale + 1) per 16 values.
// Nibble j of qh (low nibble first): 3 high index bits, the sign of delta in bit 3.
struct BIQ1_M {  // qs[32] | qh[16] | scales u16[4]
  enum { QK = 256, TS = 56, NTAB = 1024 };
  static QB_FN void dec8(const u8* b, int j, float* v, const u32* tab) {
    W2 sw = ld64(b + 48);
    u32 dh = ((sw.lo >> 12) & 0xF) | ((sw.lo >> 24) & 0xF0) | ((sw.hi >> 4) & 0xF00) |
             ((sw.hi >> 16) & 0xF000);
    int t = j >> 1;  // scale index: word t >> 2, bits 3 * (t & 3)
    u32 word = ((t < 8 ? sw.lo : sw.hi) >> (16 * ((t >> 2) & 1))) & 0xFFFF;
    float dl = h2f((u16)dh) * (float)(2 * ((word >> (3 * (t & 3))) & 7) + 1);
    u32 qh = (b[32 + (j >> 1)] >> (4 * (j & 1))) & 15;
    grid1(tab, b[j] | ((qh & 7) << 8), dl, qh & 8 ? -0.125f : 0.125f, v);
  }
};
