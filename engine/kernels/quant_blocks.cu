// Block decoders for the GGUF quant types of the engine core, one struct per type.
//
// Every decoder answers one question: "the 8 consecutive values [8j, 8j + 8) of this block".
// The dequantize kernel writes those 8 values as one 16-byte store; the GEMV kernel multiplies
// them into its dot products. Byte layouts (block bytes TS, values per block QK) must equal
// gguf.GGML_QUANT_SIZES; engine/kernels/dequant.py checks this at import. Bit layouts follow
// the reference decoders of gguf-py (quants.py), re-derived here, and are tested against them.
//
// Alignment: a decoder may assume its block starts at a multiple of min(ALIGN, 16) bytes,
// where ALIGN is the largest power of two dividing TS (blocks are packed back to back).
// F32/F16/BF16 are decoded as pseudo-blocks of 8 values.
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

// IQ4_XS: eight sub-blocks of 32; 6-bit signed scale (low 4 bits in scales_l, high 2 in
// scales_h); values are kvalues[nibble] with the IQ4_NL non-linear table (tab: 16 int8, packed).
struct BIQ4_XS {  // d f16 | scales_h u16 | scales_l[4] | qs[128]
  enum { QK = 256, TS = 136 };
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
  enum { QK = 256, TS = 98 };
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
