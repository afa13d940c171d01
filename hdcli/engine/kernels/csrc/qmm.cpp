// Weight-only GEMMs on a GGUF's quantized weights, repacked in about the file's own bytes, and the
// repacking itself: see hdcli/engine/kernels/quants.py.
//
// y[m, n] = sum over groups g of GK k: scale[n, g] * (sum over k in g of x[m, k] * q[n, k])
//                                      + low[n, g] * (sum over k in g of x[m, k])
// which is sum over k of x[m, k] * (scale q + low): the GGUF's weights exactly (q an integer of
// at most 8 bits, which a bf16 holds exactly; scale and low computed here in fp32 from the file's
// numbers, exact products), the activations as they come (bf16). The formats (`pack` makes them
// from the GGUF blocks; bytes a weight, the file's in brackets):
//   "q4z" Q4_0  4-bit codes 0..15, the block's fp16 d; scale d, low -8 d            0.5625 (0.5625)
//   "q4h" Q4_1  4-bit codes 0..15, fp16 d and m; scale d, low m                      0.625  (0.625)
//   "q4k" Q4_K  4-bit codes 0..15, each column's fp16 d and dmin a super-block of 256, a 6-bit
//               scale sc and min mn a group of 32; scale d sc, low -(dmin mn)        0.578  (0.5625)
//   "q6k" Q6_K  6-bit codes 0..63 (the file's q; the kernel's table subtracts 32), fp16 d a
//               super-block, an int8 scale sc a group of 16; scale d sc, no low      0.820  (0.8203)
//   "q8h" Q8_0  int8 codes, fp16 d; scale d, no low (and Q5_0: codes q - 16)        1.0625 (1.0625)
//   "q8f" Q5_1, Q5_K  int8 codes 0..31, fp32 scale and low (as Q5_1: d, m; Q5_K: d sc, -(dmin mn))
//                                                                                    1.25 (0.75, 0.6875)
// and, in those formats without a layout of their own (dec_q3_k below): Q3_K as q6k 0.820 (0.4297),
// IQ4_NL as q8h 1.0625 (0.5625), IQ4_XS as q8f 1.25 (0.5312). For int8 activations (mm8 only)
// IQ4_NL and IQ4_XS have 4-bit layouts of their own, the file's indices into IQ4_NL's table of 16
// int8 values, looked up in the kernel (VPSHUFB):
//   "q4n" IQ4_NL  4-bit indices, the block's fp16 d; scale d, no low                0.5625 (0.5625)
//   "q4x" IQ4_XS  4-bit indices, each column's fp16 d a super-block of 256, an int8 scale
//                 ls - 32 a group of 32; scale d (ls - 32), no low                  0.539  (0.5312)
// Every scale and low is an exact fp32 product of the file's numbers (fp16 times an integer of at
// most 8 bits), so where it is computed does not change a bit.
//
// Per output the arithmetic is fixed, whatever the number of rows M and wherever the row sits:
//   s1 = 0; for k-pairs p of the group in order: s1 = dpbf16(s1, (x[2p], x[2p+1]), (q, q'))
//   (VDPBF16PS: the two products exact in fp32, added to s1 in turn, each add rounded);
//   s0 = x[m, k] of the group summed in order in fp32 (scalar; formats with a low only);
//   out = fma(s1, scale, out); out = fma(s0, low, out), group by group in order;
//   y = bf16(out) (VCVTNEPS2BF16, to nearest even).
// Rows are computed side by side in tiles of up to 16 (a pair's weights are turned into bf16 once
// a tile; tiles of up to 4 rows also take two groups side by side), but no sum crosses rows and
// every output of a tile goes through the same operations in the same order whatever the tile's
// height: a row's result is the same in any M, which keeps the M-invariant forward
// (engine/kernels/invariant.py) exact. Needs AVX512-BF16 (`supported()`); without it the GEMM with
// int8 activations below (`supported8()`: AVX512-VNNI, or AVX2) is the GEMM there.
//
// Layout: packed [N/16][K/(GK GS)][SB] uint8: a column block of 16 columns, then its super-blocks
// of GS groups of GK k in order (a column block is one stream read front to back). A super-block
// is HEAD bytes of per-column constants (q4k: d[16], dmin[16] fp16; q6k: d[16] fp16; others none)
// and GS groups of GROUP bytes: GK/4 units of two pairs of codes, then the group's per-column
// constants. Lane L of pair p = (column L / 2, k = GK g + 2 p + L % 2). A unit of pairs a = 2 u
// and b = 2 u + 1: 4-bit, 32 bytes, byte L holding lane L of a in its low nibble and of b in its
// high one; 6-bit, those 32 bytes of the low 4 bits, then 16 bytes of the high 2 bits, byte j
// holding lanes j and j + 16 of b in bits 0-1 and 2-3 and of a in bits 4-5 and 6-7; 8-bit, 64
// bytes, byte 32 h + L lane L of pair h.
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

// ------------------------------------------------------------------ formats

// W bits a code, GK k a group, GS groups a super-block, HEAD bytes of super-block constants,
// CONSTS bytes of group constants after the codes; LOW: whether the format has a low.
template <int W_, int GK_, int GS_, int HEAD_, int CONSTS_, bool LOW_>
struct Layout {
  static constexpr int W = W_, GK = GK_, GS = GS_;
  static constexpr int64_t HEAD = HEAD_, CONSTS = CONSTS_;
  static constexpr bool LOW = LOW_;
  static constexpr int UNITS = GK / 4;     // a unit: two pairs of k, decoded together
  static constexpr int UNIT_BYTES = W == 4 ? 32 : W == 6 ? 48 : 64;
  static constexpr int64_t CODES = UNITS * UNIT_BYTES;
  static constexpr int64_t GROUP = CODES + CONSTS;
  static constexpr int64_t SB = HEAD + GS * GROUP;
};

struct Q4Z : Layout<4, 32, 1, 0, 32, true> {};     // + d[16] fp16
struct Q4H : Layout<4, 32, 1, 0, 64, true> {};     // + d[16], m[16] fp16
struct Q4K : Layout<4, 32, 8, 64, 32, true> {};    // head d[16], dmin[16] fp16; + sc[16], mn[16] uint8
struct Q6K : Layout<6, 16, 16, 32, 16, false> {};  // head d[16] fp16; + sc[16] int8
struct Q8H : Layout<8, 32, 1, 0, 32, false> {};    // + d[16] fp16
struct Q8F : Layout<8, 32, 1, 0, 128, true> {};    // + scale[16], low[16] fp32
struct Q8F8 : Layout<8, 32, 8, 0, 128, true> {};   // q8f's bytes, packed 8 groups at a time (Q5_K's blocks)
struct Q4N : Layout<4, 32, 1, 0, 32, false> {};    // + d[16] fp16; codes: indices into IQ4NL_VALUES (mm8 only)
struct Q4X : Layout<4, 32, 8, 32, 16, false> {};   // head d[16] fp16; + sc[16] int8 (ls - 32); codes as q4n

// IQ4_NL's (and IQ4_XS's) 16 weights, the values a q4n or q4x index stands for
static const int8_t IQ4NL_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// Whether a format's 4-bit codes are indices into IQ4NL_VALUES: mm8 looks them up as the value
// plus 128 (1..241, unsigned as VPDPBUSD reads codes), the group's sum offset by 128 (offset8).
template <typename F>
constexpr bool table8() {
  return std::is_same_v<F, Q4N> || std::is_same_v<F, Q4X>;
}
// IQ4NL_VALUES + 128 as bytes, the table mm8 looks indices up in (VPSHUFB: 16 bytes a lane)
static inline __m128i iq4nl_table8() {
  return _mm_setr_epi8(1, 24, 45, 63, 79, 93, 106, 118, (char)129, (char)141, (char)153, (char)166, (char)181,
                       (char)197, (char)217, (char)241);
}

static inline float f32_of_bf16(uint16_t h) {   // exact: a bf16 is an fp32's top half
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

static inline const uint8_t* super_at(const uint8_t* pk, int64_t sb_bytes, int64_t supers, int64_t cb, int64_t s) {
  return pk + (cb * supers + s) * sb_bytes;
}

// Where the GEMM reads: the packing, its super-blocks a column block, the groups a row.
struct Packed {
  const uint8_t* pk;
  int64_t supers, G;
};

// The M rows in tiles of at most `most`, as even as they go; each tile streams the weights once.
// A tile's x is laid out by group, [G][height][GK] (`at`), so that a group's rows are a few
// consecutive cache lines: rows K apart, with K a power of 2 (2048), fall in one L1 set, and 16 of
// them overran its ways (AMD EPYC, N = K = 2048, 16 rows, one thread: 688 us against 1556 in int4mm's
// layout).
struct Tiling {
  int64_t M, tiles;
  std::vector<int64_t> first, height;   // per row: its tile's first row and height
  Tiling(int64_t M_, int64_t most) : M(M_), tiles((M_ + most - 1) / most), first(M_), height(M_) {
    for (int64_t t = 0; t < tiles; ++t)
      for (int64_t m = begin(t); m < begin(t + 1); ++m) {
        first[m] = begin(t);
        height[m] = begin(t + 1) - begin(t);
      }
  }
  int64_t begin(int64_t t) const { return t * M / tiles; }
  // where row m's group g starts in its tile's layout (tiles one after the other, K a row)
  int64_t at(int64_t m, int64_t g, int64_t K, int GK) const { return first[m] * K + (g * height[m] + m - first[m]) * GK; }
};

// prepare(i) for every group i of every row (M * G of them), then tile(t, cb) for every tile and
// column block, on torch's threads. A few thousand x (a decode step's row) are prepared before the
// threads start (a microsecond or two), more by the threads before the tiles: a barrier more,
// which costs most where the threads share the cores with other work.
template <typename Prepare, typename Tile>
static void schedule(const Tiling& T, int64_t G, int64_t K, int64_t NB, bool any, Prepare prepare, Tile tile) {
  const int64_t groups = T.M * G;
  const bool alone = T.M * K <= 4096;
  if (any && alone)
    for (int64_t i = 0; i < groups; ++i) prepare(i);
#pragma omp parallel
  {
    if (any && !alone) {
#pragma omp for schedule(static)
      for (int64_t i = 0; i < groups; ++i) prepare(i);
    }
#pragma omp for schedule(static) collapse(2)
    for (int64_t cb = 0; cb < NB; ++cb)
      for (int64_t t = 0; t < T.tiles; ++t) tile(t, cb);
  }
}

// The packing's shape checked against format F and K (`what`: the GEMM, in the message).
template <typename F>
static void check_packing(const torch::Tensor& packed, int64_t K, const char* what) {
  TORCH_CHECK(packed.size(2) == F::SB && packed.size(1) * F::GS * F::GK == K, what, ": the packing's super-blocks are ",
              packed.size(2), " bytes, ", packed.size(1), " a column block; the format's ", F::SB, " bytes, K / ", F::GS * F::GK);
}

// run(static_cast<F*>(nullptr)) for the format named fmt (a kernel's entry point picks its run<F>).
template <typename Run>
static torch::Tensor by_format(const std::string& fmt, const char* what, Run run) {
  if (fmt == "q4z") return run(static_cast<Q4Z*>(nullptr));
  if (fmt == "q4h") return run(static_cast<Q4H*>(nullptr));
  if (fmt == "q4k") return run(static_cast<Q4K*>(nullptr));
  if (fmt == "q6k") return run(static_cast<Q6K*>(nullptr));
  if (fmt == "q8h") return run(static_cast<Q8H*>(nullptr));
  if (fmt == "q8f") return run(static_cast<Q8F*>(nullptr));
  TORCH_CHECK(false, what, ": no format ", fmt);
  return torch::Tensor();
}

// by_format, and the formats only mm8 reads (q4n, q4x)
template <typename Run>
static torch::Tensor by_format8(const std::string& fmt, const char* what, Run run) {
  if (fmt == "q4n") return run(static_cast<Q4N*>(nullptr));
  if (fmt == "q4x") return run(static_cast<Q4X*>(nullptr));
  return by_format(fmt, what, run);
}

// mm's and mm8's checks of their arguments; `what` names the GEMM in the message.
static void check_gemm_args(const torch::Tensor& x, const torch::Tensor& packed, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, what, ": x must be [M, K] bf16");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(),
              what, ": packed must be [N/16, super-blocks, bytes] uint8, contiguous");
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// Bytes ahead to ask the cache for (int4mm's measurement: a tile of many rows computes long enough
// on a group that the hardware prefetcher alone left it waiting for the next one).
constexpr int64_t PREFETCH_BYTES = 8 * 320;

static inline __m512 f16x16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
static inline __m512 u8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
static inline __m512 i8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
static inline __m512 negated(__m512 v) {   // -v as numpy's negation: the sign bit flipped
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(static_cast<int>(0x80000000u))));
}

// The 16 columns' scale and low of a group: its super-block's head, the group's bytes.
template <typename F>
static inline void consts(const uint8_t* head, const uint8_t* grp, __m512& scale, __m512& low) {
  const uint8_t* c = grp + F::CODES;
  if constexpr (std::is_same_v<F, Q4Z>) {
    scale = f16x16(c);
    low = _mm512_mul_ps(scale, _mm512_set1_ps(-8.0f));
  } else if constexpr (std::is_same_v<F, Q4H>) {
    scale = f16x16(c);
    low = f16x16(c + 32);
  } else if constexpr (std::is_same_v<F, Q4K>) {
    scale = _mm512_mul_ps(f16x16(head), u8x16(c));
    low = negated(_mm512_mul_ps(f16x16(head + 32), u8x16(c + 16)));
  } else if constexpr (std::is_same_v<F, Q6K> || std::is_same_v<F, Q4X>) {
    scale = _mm512_mul_ps(f16x16(head), i8x16(c));
  } else if constexpr (std::is_same_v<F, Q8H> || std::is_same_v<F, Q4N>) {
    scale = f16x16(c);
  } else {
    scale = _mm512_loadu_ps(c);
    low = _mm512_loadu_ps(c + 64);
  }
}

// A unit's two pairs of codes as bf16 (exact: integers of at most 8 significant bits), lane L of
// each pair in lane L. One load and one widening serve both pairs of a 4- or 6-bit unit: a decode
// step (one row) spends more on turning codes into bf16 than on the products.
template <typename F>
static inline void codes(const uint8_t* unit, __m512bh& a, __m512bh& b) {
  if constexpr (F::W == 4 || F::W == 6) {
    // byte L of the unit: lane L of pair a (low nibble) and of pair b (high nibble)
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit)));
    __m512i qa = _mm512_and_si512(w, _mm512_set1_epi16(0x0F)), qb = _mm512_srli_epi16(w, 4);
    if constexpr (F::W == 4) {
      // bf16 bits of 0..15, twice (VPERMW indexes 32 words: one table a 256-bit half)
      const __m512i table = _mm512_set_epi16(
          0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000,
          0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000);
      a = (__m512bh)_mm512_permutexvar_epi16(qa, table);
      b = (__m512bh)_mm512_permutexvar_epi16(qb, table);
    } else {
      // the high 2 bits, 16 bytes after the nibbles: byte j holds lane j of pair b in bits 0-1,
      // lane j + 16 of b in bits 2-3, lane j of a in bits 4-5, lane j + 16 of a in bits 6-7
      const __m512i hw = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(unit + 32))));
      const __m512i right = _mm512_set_epi16(2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
      const __m512i left = _mm512_set_epi16(2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4);
      const __m512i bits45 = _mm512_set1_epi16(0x30);
      qa = _mm512_ternarylogic_epi32(qa, _mm512_srlv_epi16(hw, right), bits45, 0xF8);   // qa | (hw >> r & 0x30)
      qb = _mm512_ternarylogic_epi32(qb, _mm512_sllv_epi16(hw, left), bits45, 0xF8);
      // q in 0..63; bf16 bits of q - 32 from two tables of 32 (VPERMI2W)
      const __m512i t0 = _mm512_set_epi16(   // -1 .. -32 from lane 31 down
          (short)0xBF80, (short)0xC000, (short)0xC040, (short)0xC080, (short)0xC0A0, (short)0xC0C0, (short)0xC0E0, (short)0xC100,
          (short)0xC110, (short)0xC120, (short)0xC130, (short)0xC140, (short)0xC150, (short)0xC160, (short)0xC170, (short)0xC180,
          (short)0xC188, (short)0xC190, (short)0xC198, (short)0xC1A0, (short)0xC1A8, (short)0xC1B0, (short)0xC1B8, (short)0xC1C0,
          (short)0xC1C8, (short)0xC1D0, (short)0xC1D8, (short)0xC1E0, (short)0xC1E8, (short)0xC1F0, (short)0xC1F8, (short)0xC200);
      const __m512i t1 = _mm512_set_epi16(   // 31 .. 0 from lane 31 down
          0x41F8, 0x41F0, 0x41E8, 0x41E0, 0x41D8, 0x41D0, 0x41C8, 0x41C0, 0x41B8, 0x41B0, 0x41A8, 0x41A0, 0x4198, 0x4190, 0x4188, 0x4180,
          0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000);
      a = (__m512bh)_mm512_permutex2var_epi16(t0, qa, t1);
      b = (__m512bh)_mm512_permutex2var_epi16(t0, qb, t1);
    }
  } else {
    // int8 -> int32 -> fp32 -> bf16, each step exact; VCVTNE2PS2BF16 puts its second operand in
    // lanes 0..15. Pair a in bytes 0..31, b in 32..63, byte L lane L.
    auto one = [](const uint8_t* pair) {
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair))));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair + 16))));
      return _mm512_cvtne2ps_pbh(hi, lo);
    };
    a = one(unit);
    b = one(unit + 32);
  }
}

// GI groups g.. of TR rows of column block cb, added to the rows' running outputs (out: in
// registers, or outm: in L1). Each group's s1 is its own chain of VDPBF16PS, so GI groups side by
// side are GI x TR independent sums in flight; the outputs still take the groups in order.
template <typename F, int TR, int GI, bool REG>
static inline __attribute__((always_inline)) void groups(const uint16_t* x, const float* s0, const Packed& P,
                                                         int64_t cb, int64_t g, __m512* out, float* outm) {
  constexpr int GK = F::GK;
  const uint8_t* head[GI];
  const uint8_t* grp[GI];
  for (int i = 0; i < GI; ++i) {
    head[i] = super_at(P.pk, F::SB, P.supers, cb, (g + i) / F::GS);
    grp[i] = head[i] + F::HEAD + ((g + i) % F::GS) * F::GROUP;
  }
  for (int64_t l = 0; l < GI * F::GROUP; l += 64)   // past the end: a hint, never a fault
    _mm_prefetch(reinterpret_cast<const char*>(grp[0] + PREFETCH_BYTES + l), _MM_HINT_T0);
  __m512 s1[GI][TR];
  for (int i = 0; i < GI; ++i)
    for (int r = 0; r < TR; ++r) s1[i][r] = _mm512_setzero_ps();
  for (int u = 0; u < F::UNITS; ++u)
    for (int i = 0; i < GI; ++i) {
      __m512bh wb[2];
      codes<F>(grp[i] + u * F::UNIT_BYTES, wb[0], wb[1]);
      for (int h = 0; h < 2; ++h)   // pair 2 u + h
        for (int r = 0; r < TR; ++r) {
          uint32_t pair;
          std::memcpy(&pair, x + ((g + i) * TR + r) * GK + 4 * u + 2 * h, 4);
          s1[i][r] = _mm512_dpbf16_ps(s1[i][r], wb[h], (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)));
        }
    }
  for (int i = 0; i < GI; ++i) {
    __m512 dv, lv = _mm512_setzero_ps();
    consts<F>(head[i], grp[i], dv, lv);
    for (int r = 0; r < TR; ++r) {
      __m512 o;
      if constexpr (REG) o = out[r]; else o = _mm512_load_ps(outm + r * 16);
      o = _mm512_fmadd_ps(s1[i][r], dv, o);
      if constexpr (F::LOW) o = _mm512_fmadd_ps(_mm512_set1_ps(s0[r * P.G + g + i]), lv, o);
      if constexpr (REG) out[r] = o; else _mm512_store_ps(outm + r * 16, o);
    }
  }
}

// Groups side by side for few rows: a row's chain of VDPBF16PS waits 6 cycles on each sum and
// two can start a cycle (AMD EPYC), so a tile's TR rows and GI groups are what keeps the unit
// busy. Two groups for up to 4 rows (N = K = 2048, one thread, 1 row: Q4_0 149 -> 130 us, Q5_K
// 180 -> 181, 4 rows: Q4_0 234 -> 223 us; four groups for 1-2 rows were no faster for 4-bit codes
// and slower for 8-bit ones; 8 rows and more no faster). Each group's address is its own (`groups`),
// so two side by side may lie in two super-blocks.
constexpr int interleave(int TR) { return TR <= 4 ? 2 : 1; }

// TR rows of one column block of 16. x: the tile's rows interleaved by group, [G][TR][GK] (`run`);
// s0 [TR][G].
template <typename F, int TR>
static inline void block(const uint16_t* x, const float* s0, const Packed& P, uint16_t* y, int64_t N, int64_t cb) {
  constexpr bool REG = TR <= 8;          // the running outputs in registers, else in L1 (32 registers in all)
  constexpr int GI = interleave(TR);
  __m512 out[REG ? TR : 1];
  alignas(64) float outm[REG ? 16 : TR * 16];
  if constexpr (REG) {
    for (int r = 0; r < TR; ++r) out[r] = _mm512_setzero_ps();
  } else {
    std::memset(outm, 0, sizeof(outm));
  }
  int64_t g = 0;
  for (; g + GI <= P.G; g += GI) groups<F, TR, GI, REG>(x, s0, P, cb, g, out, outm);
  for (; g < P.G; ++g) groups<F, TR, 1, REG>(x, s0, P, cb, g, out, outm);
  for (int r = 0; r < TR; ++r) {   // to bf16, rounded to nearest even
    __m512 o;
    if constexpr (REG) o = out[r]; else o = _mm512_load_ps(outm + r * 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * N + cb * 16), (__m256i)_mm512_cvtneps_pbh(o));
  }
}

// block<rows> for rows 1..16
template <typename F, int TR = 1>
static inline void tile(int rows, const uint16_t* x, const float* s0, const Packed& P, uint16_t* y, int64_t N, int64_t cb) {
  if constexpr (TR < 16) {
    if (rows > TR) return tile<F, TR + 1>(rows, x, s0, P, y, N, cb);
  }
  block<F, TR>(x, s0, P, y, N, cb);
}

template <typename F>
static torch::Tensor run(const torch::Tensor& x, const torch::Tensor& packed) {
  constexpr int GK = F::GK;
  const int64_t M = x.size(0), K = x.size(1), G = K / GK, N = packed.size(0) * 16;
  check_packing<F>(packed, K, "GGUF GEMM");
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  auto y = torch::empty({M, N}, x.options());
  const Packed P{packed.data_ptr<uint8_t>(), packed.size(1), G};
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const Tiling T(M, 16);
  // The tiles' layout (Tiling); one row is its own layout already.
  std::vector<uint16_t> xt(M > 1 ? static_cast<size_t>(M * K) : 0);
  uint16_t* xtp = M > 1 ? xt.data() : const_cast<uint16_t*>(xp);
  std::vector<float> s0(F::LOW ? static_cast<size_t>(M * G) : 0);
  float* s0p = s0.data();
  // A group of a row: its copy into the tile's layout and its sum (in order).
  auto prepare = [&](int64_t i) {
    const int64_t m = i / G, g = i % G;
    const uint16_t* xg = xp + m * K + g * GK;
    if (M > 1)
      std::memcpy(xtp + T.at(m, g, K, GK), xg, GK * sizeof(uint16_t));
    if constexpr (F::LOW) {
      float s = 0.0f;
      for (int k = 0; k < GK; ++k) s += f32_of_bf16(xg[k]);
      s0p[i] = s;
    }
  };
  schedule(T, G, K, N / 16, M > 1 || F::LOW, prepare, [&](int64_t t, int64_t cb) {
    const int64_t m0 = T.begin(t);
    tile<F>(static_cast<int>(T.begin(t + 1) - m0), xtp + m0 * K, s0p + m0 * G, P, yp + m0 * N, N, cb);
  });
  return y;
}

// x [M, K] bf16, packed [N/16, K/(GK GS), SB] uint8 in format fmt (above). Returns [M, N] bf16.
torch::Tensor mm(torch::Tensor x, torch::Tensor packed, const std::string& fmt) {
  check_gemm_args(x, packed, "GGUF GEMM");
  auto xs = x.contiguous();
  return by_format(fmt, "GGUF GEMM", [&](auto* f) { return run<std::remove_pointer_t<decltype(f)>>(xs, packed); });
}
#else
torch::Tensor mm(torch::Tensor x, torch::Tensor packed, const std::string& fmt) {
  TORCH_CHECK(false, "GGUF GEMM: built without AVX512-BF16");
  return x;
}
#endif


// ------------------------------------------------------------------ int8 activations (AVX512-VNNI or AVX2)
//
// The same formats' bytes with the codes arranged for VPDPBUSD (four unsigned codes of a column
// times four signed int8 activations, summed into an int32: twice the products of a VDPBF16PS
// and no conversion of codes), and the activations quantized row by row as llama.cpp does:
//   per row m and group g of GK k: amax = max |x|, dx = amax / 127, xq = nearest-even(x * (127 / amax))
//   (all 0 for a zero group), xs = sum of xq;
//   isum[n] = sum over k in g of q[n, k] * xq[m, k] - OFFSET xs   (exact in int32: any order gives it)
//   t = fp32(isum) * scale[n, g]; t = fma(low[n, g], xs, t) (formats with a low of their own);
//   out = fma(t, dx, out), group by group in order; y = bf16(out).
// OFFSET (offset8) is the code's fixed offset: Q4_0 8 (codes 0..15), Q6_K 32 (the file's q,
// 0..63), Q8_0 and Q5_0 128 (their int8 codes stored plus 128), else 0. A row's xq, dx
// and xs depend on that row alone and its outputs take the same operations whatever the tile's
// height, so a row's result is the same in any M (the M-invariant forward). The numbers differ from
// the bf16-activation GEMM's (the activations are rounded to 8 bits a group: docs/dtype.md).
//
// A unit is 8 k of the 16 columns: 4-bit 64 bytes, byte j holding column j / 4's code of k j % 4
// (quad a) in its low nibble and of k 4 + j % 4 (quad b) in its high one; 6-bit those 64 bytes of
// the low 4 bits, then 32 bytes of the high 2 bits, byte j holding quad a's bytes j and j + 32 in
// bits 0-1 and 2-3 and quad b's in bits 4-5 and 6-7; 8-bit 128 bytes, quad a then quad b.
template <typename F>
struct I8 {
  static constexpr int UNITS = F::GK / 8;
  static constexpr int UNIT_BYTES = F::W == 4 ? 64 : F::W == 6 ? 96 : 128;
  static_assert(UNITS * UNIT_BYTES == F::CODES, "the int8 arrangement keeps the format's bytes");
};

// Formats whose low is a fixed multiple of the scale, low = -OFFSET scale (Q4_0: 8, Q6_K: 32,
// Q8_0/Q5_0 stored plus 128, q4n/q4x looked up plus 128: 128): their sums start at -OFFSET xs, in
// int32, exact, so that scale (isum - OFFSET xs) is the whole group and no low is added. Others
// (Q4_1, Q4_K, Q5_1, Q5_K) add their own low: OFFSET 0.
template <typename F>
constexpr int offset8() {
  return std::is_same_v<F, Q4Z> ? 8 : std::is_same_v<F, Q6K> ? 32 : std::is_same_v<F, Q8H> || table8<F>() ? 128 : 0;
}

// The tile's activations: xq [G][TR][GK] int8 (rows interleaved by group, as run's x), dx and xs [TR][G].
struct Act8 {
  const int8_t* q;
  const float *d, *s;
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define HD_MM8 "AVX512-VNNI"
// Tiles of up to 8 rows: a column block's weights (18 KB at K = 2048 in Q4_0) stay in L1 for the
// next tile, and 16 rows' sums did not fit the registers (AMD EPYC, 65536 x 2048 Q4_0, 2 threads:
// 16 rows 14.3 -> 8.6 ms, 32 rows 28.0 -> 15.8 ms; 1-8 rows alike).
constexpr int TILE8 = 8;
// Groups ahead to ask the cache for (65536 x 2048, 2 threads: 2 groups ahead was 10-30% slower
// than 9 for one row; 9 to 32 alike).
constexpr int AHEAD8 = 9;

static inline void codes8(const uint8_t* unit, int W, bool table, __m512i& a, __m512i& b) {
  if (W == 8) {
    a = _mm512_loadu_si512(unit);
    b = _mm512_loadu_si512(unit + 64);
    return;
  }
  const __m512i v = _mm512_loadu_si512(unit), nib = _mm512_set1_epi8(0x0F);
  a = _mm512_and_si512(v, nib);
  b = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
  if (table) {   // q4n, q4x: the indices' values plus 128
    const __m512i t = _mm512_broadcast_i32x4(iq4nl_table8());
    a = _mm512_shuffle_epi8(t, a);
    b = _mm512_shuffle_epi8(t, b);
  }
  if (W == 6) {
    const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + 64)));
    const __m512i left = _mm512_set_epi16(2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4);
    const __m512i right = _mm512_set_epi16(2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i bits45 = _mm512_set1_epi8(0x30);
    a = _mm512_ternarylogic_epi32(a, _mm512_sllv_epi16(h, left), bits45, 0xF8);    // a | (h << s & 0x30)
    b = _mm512_ternarylogic_epi32(b, _mm512_srlv_epi16(h, right), bits45, 0xF8);
  }
}

// Group g of TR rows of column block cb, added to the rows' running outputs. One group at a time:
// two side by side (as the bf16 GEMM does for few rows) made one row 10-25% slower here, and
// Q8_0's one row slower than the bf16 GEMM's (AMD EPYC, 65536 x 2048, 2 threads: Q4_0 2199 -> 1759
// us, Q4_K 2021 -> 1857, Q8_0 5005 -> 3089). Tiles of up to 4 rows keep two sums a row (quads a and
// b) instead, so that more chains of VPDPBUSD are in flight; integer sums are exact, so the split
// changes no bit.
template <typename F, int TR>
static inline __attribute__((always_inline)) void group8(const Act8& X, const Packed& P, int64_t cb, int64_t g,
                                                         __m512* out) {
  constexpr int GK = F::GK, SPLIT = TR <= 4 ? 2 : 1, OFFSET = offset8<F>();
  const uint8_t* head = super_at(P.pk, F::SB, P.supers, cb, g / F::GS);
  const uint8_t* grp = head + F::HEAD + (g % F::GS) * F::GROUP;
  for (int64_t l = 0; l < F::GROUP; l += 64)   // past the end: a hint, never a fault
    _mm_prefetch(reinterpret_cast<const char*>(grp + AHEAD8 * F::GROUP + l), _MM_HINT_T0);
  __m512i acc[TR][SPLIT];
  for (int r = 0; r < TR; ++r)
    for (int h = 0; h < SPLIT; ++h)
      acc[r][h] = h == 0 && OFFSET ? _mm512_set1_epi32(-OFFSET * static_cast<int32_t>(X.s[r * P.G + g]))
                                   : _mm512_setzero_si512();
  for (int u = 0; u < I8<F>::UNITS; ++u) {
    __m512i a, b;
    codes8(grp + u * I8<F>::UNIT_BYTES, F::W, table8<F>(), a, b);
    for (int r = 0; r < TR; ++r) {
      int32_t xa, xb;
      const int8_t* xr = X.q + (g * TR + r) * GK + 8 * u;
      std::memcpy(&xa, xr, 4);
      std::memcpy(&xb, xr + 4, 4);
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], a, _mm512_set1_epi32(xa));
      acc[r][SPLIT - 1] = _mm512_dpbusd_epi32(acc[r][SPLIT - 1], b, _mm512_set1_epi32(xb));
    }
  }
  __m512 dv, lv = _mm512_setzero_ps();
  consts<F>(head, grp, dv, lv);
  for (int r = 0; r < TR; ++r) {
    __m512i isum = acc[r][0];
    if constexpr (SPLIT == 2) isum = _mm512_add_epi32(isum, acc[r][1]);
    __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(isum), dv);
    if constexpr (OFFSET == 0) t = _mm512_fmadd_ps(lv, _mm512_set1_ps(X.s[r * P.G + g]), t);
    out[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(X.d[r * P.G + g]), out[r]);
  }
}

// TR rows (at most TILE8: their outputs stay in registers) of one column block of 16.
template <typename F, int TR>
static inline void block8(const Act8& X, const Packed& P, uint16_t* y, int64_t N, int64_t cb) {
  static_assert(TR <= TILE8, "a tile's outputs live in registers");
  __m512 out[TR];
  for (int r = 0; r < TR; ++r) out[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < P.G; ++g) group8<F, TR>(X, P, cb, g, out);
  for (int r = 0; r < TR; ++r)   // to bf16, rounded to nearest even
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * N + cb * 16), (__m256i)_mm512_cvtneps_pbh(out[r]));
}

// One group of GK (16 or 32) bf16 activations quantized: q, its scale d and the sum of q. One code
// path for every row (vector instructions, fixed order), so a row's q is the same in any call.
static inline void quantize_group(const uint16_t* x, int GK, int8_t* q, float& d, float& s) {
  auto load = [](const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  };
  const __m512 v0 = load(x), v1 = GK == 32 ? load(x + 16) : _mm512_setzero_ps();
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  d = amax / 127.0f;
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));   // to nearest even
  const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(q0));
  if (GK == 32) _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(q1));
  s = static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));   // exact: |s| <= 32 * 127
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#ifdef __AVXVNNI__
#define HD_MM8 "AVX2 + AVX-VNNI"
constexpr bool VNNI256 = true;
#else
#define HD_MM8 "AVX2"
constexpr bool VNNI256 = false;
#endif
// The int8 GEMM on AVX2 (CPUs without AVX512: Zen 1-3, most desktop Intel): the same packing,
// the same quantized rows and the same integer group sums (exact, so the instructions that form
// them do not matter), the same fp32 operations on them in the same order: the outputs are
// VPDPBUSD's bit for bit. A unit's 16 columns are two halves of 8 (a 256-bit register holds 8
// columns' four codes), taken one after the other. VPMADDUBSW adds two code x activation products
// into an int16; those int16 sums are added as int16 over as many quads as they hold exactly
// (depth8), and only then widened to int32 (VPMADDWD): on AVX2 the rows of a tile are
// compute-bound, and the widening was a third of the multiplies. Where the CPU has AVX-VNNI (Intel
// Alder Lake and newer without AVX512; -march=native defines __AVXVNNI__) VPDPBUSD on 256 bits
// forms the int32 sums itself, codes whole, as the AVX512 GEMM does.
constexpr int AHEAD8 = 9;   // groups ahead to ask the cache for (as the AVX512 GEMM)

// How VPMADDUBSW takes format F's codes (unsigned bytes; a pair's sum saturates past int16): 8-bit
// codes (Q8_0 and Q5_0 stored plus 128, the IQ4 tables' values plus 128) a nibble at a time, the
// high nibble's sums taken 16 times by VPMADDWD; the others whole: 4-bit codes at most 15, Q5_1's
// and Q5_K's (q8f) 31, Q6_K's 63.
template <typename F>
constexpr bool nibbles8() { return !VNNI256 && (table8<F>() || std::is_same_v<F, Q8H>); }
template <typename F>
constexpr int most_code8() { return nibbles8<F>() || F::W == 4 ? 15 : F::W == 6 ? 63 : 31; }
// Units whose int16 sums one int16 adds exactly: a quad's pair sum is at most 2 x most x 128 in
// size (an activation is -128..127), so 8 quads (4 units, a whole group of 32 k) of 4-bit codes
// or nibbles (30720), 4 of Q5's (31744), 2 (one unit) of Q6_K's (32256). With AVX-VNNI the sums
// are int32 from the start: the whole group.
template <typename F>
constexpr int depth8() {
  constexpr int quads = 32767 / (2 * most_code8<F>() * 128), units = quads / 2;
  return VNNI256 || units >= I8<F>::UNITS ? I8<F>::UNITS : units;
}
// Tiles of up to 4 rows, as before these sums (8 rows with one half a pass were slower: more
// broadcasts of the activations, and the decode saved was little). Where a row holds one sum a half
// (4-bit codes, Q6_K) both halves go in one pass: a row's activations are broadcast once for both
// (AMD EPYC Zen 5 as AVX2, 28672 x 4096, 2 threads, benchmarks/gemm_ab.py against dot8's one widening
// a unit: 4 rows Q4_K 3150 -> 2778 us, Q5_K 5053 -> 3738, Q6_K alike; 8 rows Q4_K 5989 -> 5110); where it holds two (nibbles, Q5's int32 sum beside its int16 one),
// one half a pass, else the sums overran the 16 registers.
constexpr int TILE8 = 4;
template <typename F>
constexpr int halves8() { return nibbles8<F>() || (depth8<F>() != I8<F>::UNITS && depth8<F>() > 1) ? 1 : 2; }

static inline __m256 f16x8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
static inline __m256 u8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
static inline __m256 i8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Half h (columns 8 h .. 8 h + 7) of a group's scale and low: consts<F> of the AVX512 GEMM, the
// same exact fp32 products.
template <typename F>
static inline void consts2(const uint8_t* head, const uint8_t* grp, int h, __m256& scale, __m256& low) {
  const uint8_t* c = grp + F::CODES;
  if constexpr (std::is_same_v<F, Q4Z> || std::is_same_v<F, Q8H> || std::is_same_v<F, Q4N>) {
    scale = f16x8(c + 16 * h);
  } else if constexpr (std::is_same_v<F, Q4H>) {
    scale = f16x8(c + 16 * h);
    low = f16x8(c + 32 + 16 * h);
  } else if constexpr (std::is_same_v<F, Q4K>) {
    scale = _mm256_mul_ps(f16x8(head + 16 * h), u8x8(c + 8 * h));
    const __m256 m = _mm256_mul_ps(f16x8(head + 32 + 16 * h), u8x8(c + 16 + 8 * h));
    low = _mm256_xor_ps(m, _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u))));   // -m, the sign flipped
  } else if constexpr (std::is_same_v<F, Q6K> || std::is_same_v<F, Q4X>) {
    scale = _mm256_mul_ps(f16x8(head + 16 * h), i8x8(c + 8 * h));
  } else {
    scale = _mm256_loadu_ps(reinterpret_cast<const float*>(c + 32 * h));
    low = _mm256_loadu_ps(reinterpret_cast<const float*>(c + 64 + 32 * h));
  }
}

// Half h of a unit's codes (mm8's arrangement, above) as VPMADDUBSW takes them: c[0], c[1] quad
// a's and quad b's; for nibbles8 formats c[2], c[3] their high nibbles (c[0], c[1] the low ones).
// The IQ4 tables' values plus 128 are looked up a nibble at a time in two tables of 16.
template <typename F>
static inline void codes_half(const uint8_t* unit, int h, __m256i c[4]) {
  auto load = [](const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
  const __m256i nib = _mm256_set1_epi8(0x0F);
  if constexpr (table8<F>() && !nibbles8<F>()) {   // VPDPBUSD: the values plus 128 whole
    const __m256i v = load(unit + 32 * h), t = _mm256_broadcastsi128_si256(iq4nl_table8());
    c[0] = _mm256_shuffle_epi8(t, _mm256_and_si256(v, nib));
    c[1] = _mm256_shuffle_epi8(t, _mm256_and_si256(_mm256_srli_epi16(v, 4), nib));
  } else if constexpr (table8<F>()) {
    const __m256i v = load(unit + 32 * h), ia = _mm256_and_si256(v, nib), ib = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
    const __m128i t = iq4nl_table8();
    const __m256i lo = _mm256_broadcastsi128_si256(_mm_and_si128(t, _mm_set1_epi8(0x0F)));
    const __m256i hi = _mm256_broadcastsi128_si256(_mm_and_si128(_mm_srli_epi16(t, 4), _mm_set1_epi8(0x0F)));
    c[0] = _mm256_shuffle_epi8(lo, ia), c[1] = _mm256_shuffle_epi8(lo, ib);
    c[2] = _mm256_shuffle_epi8(hi, ia), c[3] = _mm256_shuffle_epi8(hi, ib);
  } else if constexpr (F::W == 8) {
    c[0] = load(unit + 32 * h), c[1] = load(unit + 64 + 32 * h);
    if constexpr (nibbles8<F>()) {
      c[2] = _mm256_and_si256(_mm256_srli_epi16(c[0], 4), nib), c[3] = _mm256_and_si256(_mm256_srli_epi16(c[1], 4), nib);
      c[0] = _mm256_and_si256(c[0], nib), c[1] = _mm256_and_si256(c[1], nib);
    }
  } else {
    const __m256i v = load(unit + 32 * h);
    c[0] = _mm256_and_si256(v, nib);
    c[1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
    if constexpr (F::W == 6) {   // byte j of the high bits: quad a's bytes j and j + 32 in bits 0-1 and 2-3, quad b's in 4-5 and 6-7
      const __m256i hb = load(unit + 64), bits45 = _mm256_set1_epi8(0x30);
      c[0] = _mm256_or_si256(c[0], _mm256_and_si256(h == 0 ? _mm256_slli_epi16(hb, 4) : _mm256_slli_epi16(hb, 2), bits45));
      c[1] = _mm256_or_si256(c[1], _mm256_and_si256(h == 0 ? hb : _mm256_srli_epi16(hb, 2), bits45));
    }
  }
}

// A running sum the optimiser is to take as it stands: integer adds being associative, it regroups
// a row's whole run of sums into a tree whose products are all live at once, and spills them.
static inline void kept(__m256i& v) { asm("" : "+x"(v)); }

// Group g of TR rows of column block cb, added to the rows' running outputs (out [TR][16] fp32):
// group8's operations, HP halves a pass (halves8). Each row's int16 sums take depth8 units before
// they are widened and added to its int32 sum, which starts at -OFFSET xs; every sum is exact, so
// the group's isum is VPDPBUSD's.
template <typename F, int TR>
static inline __attribute__((always_inline)) void group8(const Act8& X, const Packed& P, int64_t cb, int64_t g,
                                                         float* out) {
  constexpr int GK = F::GK, OFFSET = offset8<F>(), UNITS = I8<F>::UNITS, DEPTH = depth8<F>(), HP = halves8<F>();
  constexpr bool NIB = nibbles8<F>();
  static_assert(UNITS % DEPTH == 0, "a group is whole runs of int16 sums");
  const uint8_t* head = super_at(P.pk, F::SB, P.supers, cb, g / F::GS);
  const uint8_t* grp = head + F::HEAD + (g % F::GS) * F::GROUP;
  for (int64_t l = 0; l < F::GROUP; l += 64)   // past the end: a hint, never a fault
    _mm_prefetch(reinterpret_cast<const char*>(grp + AHEAD8 * F::GROUP + l), _MM_HINT_T0);
  const __m256i ones = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi16(16);
  for (int h0 = 0; h0 < 2; h0 += HP) {
    // The rows' activations are read again for the second pass: hidden from the optimiser, which
    // otherwise keeps every broadcast of both passes (2 x TR x UNITS registers) and spills them.
    const int8_t* xq = X.q;
    asm volatile("" : "+r"(xq));
    __m256i acc[TR][HP];
    for (int r = 0; r < TR; ++r)
      for (int h = 0; h < HP; ++h)
        acc[r][h] = OFFSET ? _mm256_set1_epi32(-OFFSET * static_cast<int32_t>(X.s[r * P.G + g])) : _mm256_setzero_si256();
    for (int u0 = 0; u0 < UNITS; u0 += DEPTH) {
      __m256i lo[TR][HP], hi[TR][HP];
      for (int r = 0; r < TR; ++r)
        for (int h = 0; h < HP; ++h) lo[r][h] = hi[r][h] = _mm256_setzero_si256();
      for (int u = u0; u < u0 + DEPTH; ++u) {
        __m256i c[HP][4];
        for (int h = 0; h < HP; ++h) codes_half<F>(grp + u * I8<F>::UNIT_BYTES, h0 + h, c[h]);
        for (int r = 0; r < TR; ++r) {
          int32_t xa, xb;
          const int8_t* xr = xq + (g * TR + r) * GK + 8 * u;
          std::memcpy(&xa, xr, 4);
          std::memcpy(&xb, xr + 4, 4);
          const __m256i va = _mm256_set1_epi32(xa), vb = _mm256_set1_epi32(xb);
          for (int h = 0; h < HP; ++h) {
#ifdef __AVXVNNI__
            // quad b's sums apart from quad a's for 1-2 rows: more chains of VPDPBUSD in flight
            acc[r][h] = _mm256_dpbusd_avx_epi32(acc[r][h], c[h][0], va);
            if constexpr (TR <= 2) lo[r][h] = _mm256_dpbusd_avx_epi32(lo[r][h], c[h][1], vb);
            else acc[r][h] = _mm256_dpbusd_avx_epi32(acc[r][h], c[h][1], vb);
            continue;
#endif
            lo[r][h] = _mm256_add_epi16(lo[r][h], _mm256_add_epi16(_mm256_maddubs_epi16(c[h][0], va), _mm256_maddubs_epi16(c[h][1], vb)));
            kept(lo[r][h]);
            if constexpr (NIB) {
              hi[r][h] = _mm256_add_epi16(hi[r][h], _mm256_add_epi16(_mm256_maddubs_epi16(c[h][2], va), _mm256_maddubs_epi16(c[h][3], vb)));
              kept(hi[r][h]);
            }
          }
        }
      }
      for (int r = 0; r < TR; ++r)
        for (int h = 0; h < HP; ++h) {
          if constexpr (VNNI256) {   // lo: quad b's int32 sums (1-2 rows), else zero
            acc[r][h] = _mm256_add_epi32(acc[r][h], lo[r][h]);
            continue;
          }
          acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(lo[r][h], ones));
          if constexpr (NIB) acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(hi[r][h], sixteen));
        }
    }
    for (int h = 0; h < HP; ++h) {
      __m256 dv, lv = _mm256_setzero_ps();
      consts2<F>(head, grp, h0 + h, dv, lv);
      for (int r = 0; r < TR; ++r) {
        __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][h]), dv);
        if constexpr (OFFSET == 0) t = _mm256_fmadd_ps(lv, _mm256_set1_ps(X.s[r * P.G + g]), t);
        float* o = out + 16 * r + 8 * (h0 + h);
        _mm256_store_ps(o, _mm256_fmadd_ps(t, _mm256_set1_ps(X.d[r * P.G + g]), _mm256_load_ps(o)));
      }
    }
  }
}

// fp32 to bf16 as VCVTNEPS2BF16 rounds: to nearest even, a subnormal to a signed zero, a NaN quiet.
static inline uint16_t bf16_of(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  if ((bits & 0x7F800000u) == 0) return static_cast<uint16_t>((bits >> 16) & 0x8000u);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

template <typename F, int TR>
static inline void block8(const Act8& X, const Packed& P, uint16_t* y, int64_t N, int64_t cb) {
  static_assert(TR <= TILE8, "a tile's rows");
  alignas(32) float out[TR][16] = {};
  for (int64_t g = 0; g < P.G; ++g) group8<F, TR>(X, P, cb, g, &out[0][0]);
  for (int r = 0; r < TR; ++r)
    for (int j = 0; j < 16; ++j) y[r * N + cb * 16 + j] = bf16_of(out[r][j]);
}

// quantize_group of the AVX512 GEMM in plain C++, the same fp32 operations: max |x| (exact in any
// order), 127 / amax, x times it rounded to nearest even (the default rounding mode, as
// VCVTPS2DQ), the sum of the codes (exact).
static inline void quantize_group(const uint16_t* x, int GK, int8_t* q, float& d, float& s) {
  float v[32], amax = 0.0f;
  for (int k = 0; k < GK; ++k) {
    v[k] = f32_of_bf16(x[k]);
    amax = std::max(amax, std::fabs(v[k]));
  }
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  d = amax / 127.0f;
  int32_t sum = 0;
  for (int k = 0; k < GK; ++k) {
    const float r = std::nearbyint(v[k] * inv);   // a NaN: VCVTPS2DQ's INT_MIN, saturated to -128
    const int32_t c = r >= -128.0f && r <= 127.0f ? static_cast<int32_t>(r) : r > 127.0f ? 127 : -128;
    q[k] = static_cast<int8_t>(std::min(127, std::max(-128, c)));
    sum += q[k];
  }
  s = static_cast<float>(sum);
}
#endif

#ifdef HD_MM8
// block8<rows> (this build's, above) for rows 1..TILE8
template <typename F, int TR = 1>
static inline void tile8(int rows, const Act8& X, const Packed& P, uint16_t* y, int64_t N, int64_t cb) {
  if constexpr (TR < TILE8) {
    if (rows > TR) return tile8<F, TR + 1>(rows, X, P, y, N, cb);
  }
  block8<F, TR>(X, P, y, N, cb);
}

template <typename F>
static torch::Tensor run8(const torch::Tensor& x, const torch::Tensor& packed) {
  constexpr int GK = F::GK;
  const int64_t M = x.size(0), K = x.size(1), G = K / GK, N = packed.size(0) * 16;
  check_packing<F>(packed, K, "GGUF int8 GEMM");
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  auto y = torch::empty({M, N}, x.options());
  const Packed P{packed.data_ptr<uint8_t>(), packed.size(1), G};
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const Tiling T(M, TILE8);
  std::vector<int8_t> xq(static_cast<size_t>(M * K));
  std::vector<float> dx(static_cast<size_t>(M * G)), xs(static_cast<size_t>(M * G));
  auto prepare = [&](int64_t i) {   // row m's group g, into its tile's layout
    const int64_t m = i / G, g = i % G;
    quantize_group(xp + m * K + g * GK, GK, xq.data() + T.at(m, g, K, GK), dx[i], xs[i]);
  };
  schedule(T, G, K, N / 16, true, prepare, [&](int64_t t, int64_t cb) {
    const int64_t m0 = T.begin(t);
    const Act8 X{xq.data() + m0 * K, dx.data() + m0 * G, xs.data() + m0 * G};
    tile8<F>(static_cast<int>(T.begin(t + 1) - m0), X, P, yp + m0 * N, N, cb);
  });
  return y;
}

// As mm, on a packing made with pack(..., int8=true).
torch::Tensor mm8(torch::Tensor x, torch::Tensor packed, const std::string& fmt) {
  check_gemm_args(x, packed, "GGUF int8 GEMM");
  auto xs = x.contiguous();
  return by_format8(fmt, "GGUF int8 GEMM", [&](auto* f) { return run8<std::remove_pointer_t<decltype(f)>>(xs, packed); });
}
bool supported8() { return true; }
std::string isa8() { return HD_MM8; }
#else
torch::Tensor mm8(torch::Tensor x, torch::Tensor packed, const std::string& fmt) {
  TORCH_CHECK(false, "GGUF int8 GEMM: built without AVX512-VNNI or AVX2");
  return x;
}
bool supported8() { return false; }
std::string isa8() { return ""; }
#endif

bool supported() {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

// ------------------------------------------------------------------ the packing

static inline uint16_t u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
static inline float f16(const uint8_t* p) {   // exact: every fp16 is an fp32
  const uint16_t h = u16(p);
  const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
  uint32_t bits;
  if (e == 0x1F) {
    bits = sign | 0x7F800000u | (m << 13);
  } else if (e != 0) {
    bits = sign | ((e + 112) << 23) | (m << 13);
  } else if (m == 0) {
    bits = sign;
  } else {   // subnormal: normalise
    int shift = 0;
    uint32_t mm = m;
    while (!(mm & 0x400)) { mm <<= 1; ++shift; }
    bits = sign | ((113 - shift) << 23) | ((mm & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
static inline void put_f32(uint8_t* p, float v) { std::memcpy(p, &v, 4); }

// ggml's K-quant 6-bit scale and min of sub-block j from the block's 12 bytes
static inline void scale_min_k4(int j, const uint8_t* q, int& sc, int& mn) {
  if (j < 4) {
    sc = q[j] & 63;
    mn = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One super-block of a column block being packed: each of its 16 columns' codes as the kernel's
// lanes take them (4-bit 0..15, 6-bit 0..63, 8-bit an int8's bits), gathered from the columns' GGUF
// blocks first and then written out unit by unit: every byte of the super-block is written once.
template <typename F>
struct Super {
  static constexpr int KS = F::GS * F::GK;   // k a super-block
  uint8_t* out;                               // the super-block's bytes in the packing
  uint8_t codes[16][KS];
  uint8_t* group(int g) const { return out + F::HEAD + g * F::GROUP; }
  uint8_t* gconst(int g, int at) const { return group(g) + F::CODES + at; }
  uint8_t* hconst(int at) const { return out + at; }

  // The int8 GEMM's arrangement (mm8's header): units of 8 k, a column's four codes of a quad
  // side by side; Q8_0's and Q5_0's int8 codes plus 128.
  void emit8() const {
    for (int g = 0; g < F::GS; ++g)
      for (int u = 0; u < F::UNITS / 2; ++u) {
        uint8_t* unit = group(g) + u * (F::CODES / (F::UNITS / 2));
        const int base = g * F::GK + 8 * u;   // quad a: k base + 0..3, quad b: base + 4..7
        auto code = [&](int j, int quad) {    // byte j of a quad: column j / 4, k j % 4
          const uint8_t c = codes[j / 4][base + 4 * quad + j % 4];
          return static_cast<uint8_t>(std::is_same_v<F, Q8H> ? c ^ 0x80 : c);
        };
        for (int j = 0; j < 64; ++j) {
          if constexpr (F::W == 8) {
            unit[j] = code(j, 0);
            unit[64 + j] = code(j, 1);
          } else {
            unit[j] = static_cast<uint8_t>((code(j, 0) & 0x0F) | ((code(j, 1) & 0x0F) << 4));
          }
        }
        if constexpr (F::W == 6)
          for (int j = 0; j < 32; ++j) {
            auto high = [&](int jj, int quad) { return (code(jj, quad) >> 4) & 3; };
            unit[64 + j] = static_cast<uint8_t>(high(j, 0) | high(j + 32, 0) << 2 | high(j, 1) << 4 | high(j + 32, 1) << 6);
          }
      }
  }

  void emit() const {
    for (int g = 0; g < F::GS; ++g)
      for (int u = 0; u < F::UNITS; ++u) {
        uint8_t* unit = group(g) + u * F::UNIT_BYTES;
        const int base = g * F::GK + 4 * u;   // pair a: k base + 0, 1; pair b: base + 2, 3
        for (int L = 0; L < 32; ++L) {
          const uint8_t a = codes[L / 2][base + L % 2], b = codes[L / 2][base + 2 + L % 2];
          if constexpr (F::W == 8) {
            unit[L] = a;
            unit[32 + L] = b;
          } else {
            unit[L] = static_cast<uint8_t>((a & 0x0F) | ((b & 0x0F) << 4));
          }
        }
        if constexpr (F::W == 6)
          for (int j = 0; j < 16; ++j) {
            auto high = [&](int L, int h) { return (codes[L / 2][base + 2 * h + L % 2] >> 4) & 3; };
            unit[32 + j] = static_cast<uint8_t>(high(j, 1) | high(j + 16, 1) << 2 | high(j, 0) << 4 | high(j + 16, 0) << 6);
          }
      }
  }
};



// One GGUF block of column c into a super-block: per type, its codes (as quants.py's unpack reads
// them) and its constants in the format's places.
static void dec_q4_0(const uint8_t* blk, Super<Q4Z>& S, int c) {
  std::memcpy(S.gconst(0, 2 * c), blk, 2);
  for (int e = 0; e < 16; ++e) {
    S.codes[c][e] = blk[2 + e] & 0x0F;
    S.codes[c][e + 16] = blk[2 + e] >> 4;
  }
}
static void dec_q4_1(const uint8_t* blk, Super<Q4H>& S, int c) {
  std::memcpy(S.gconst(0, 2 * c), blk, 2);
  std::memcpy(S.gconst(0, 32 + 2 * c), blk + 2, 2);
  for (int e = 0; e < 16; ++e) {
    S.codes[c][e] = blk[4 + e] & 0x0F;
    S.codes[c][e + 16] = blk[4 + e] >> 4;
  }
}
static void dec_q8_0(const uint8_t* blk, Super<Q8H>& S, int c) {
  std::memcpy(S.gconst(0, 2 * c), blk, 2);
  std::memcpy(S.codes[c], blk + 2, 32);
}
static inline int q5_code(const uint8_t* qs, uint32_t qh, int e) {   // Q5_0/Q5_1: 0..31
  return (e < 16 ? qs[e] & 0x0F : qs[e - 16] >> 4) | (((qh >> e) & 1) << 4);
}
static void dec_q5_0(const uint8_t* blk, Super<Q8H>& S, int c) {
  uint32_t qh;
  std::memcpy(&qh, blk + 2, 4);
  std::memcpy(S.gconst(0, 2 * c), blk, 2);
  for (int e = 0; e < 32; ++e) S.codes[c][e] = static_cast<uint8_t>(static_cast<int8_t>(q5_code(blk + 6, qh, e) - 16));
}
static void dec_q5_1(const uint8_t* blk, Super<Q8F>& S, int c) {
  uint32_t qh;
  std::memcpy(&qh, blk + 4, 4);
  put_f32(S.gconst(0, 4 * c), f16(blk));
  put_f32(S.gconst(0, 64 + 4 * c), f16(blk + 2));
  for (int e = 0; e < 32; ++e) S.codes[c][e] = static_cast<uint8_t>(q5_code(blk + 8, qh, e));
}
static void dec_q4_k(const uint8_t* blk, Super<Q4K>& S, int c) {
  std::memcpy(S.hconst(2 * c), blk, 2);
  std::memcpy(S.hconst(32 + 2 * c), blk + 2, 2);
  for (int j = 0; j < 8; ++j) {   // sub-block j: the low (j even) or high nibbles of 32 bytes
    int sc, mn;
    scale_min_k4(j, blk + 4, sc, mn);
    *S.gconst(j, c) = static_cast<uint8_t>(sc);
    *S.gconst(j, 16 + c) = static_cast<uint8_t>(mn);
    const uint8_t* qs = blk + 16 + 32 * (j / 2);
    for (int l = 0; l < 32; ++l) S.codes[c][32 * j + l] = (qs[l] >> (4 * (j % 2))) & 0x0F;
  }
}
static void dec_q5_k(const uint8_t* blk, Super<Q8F8>& S, int c) {
  const float d = f16(blk), dmin = f16(blk + 2);
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    scale_min_k4(j, blk + 4, sc, mn);
    put_f32(S.gconst(j, 4 * c), d * static_cast<float>(sc));
    put_f32(S.gconst(j, 64 + 4 * c), -(dmin * static_cast<float>(mn)));
    const uint8_t* qs = blk + 48 + 32 * (j / 2);
    for (int l = 0; l < 32; ++l)
      S.codes[c][32 * j + l] = static_cast<uint8_t>(((qs[l] >> (4 * (j % 2))) & 0x0F) | (((blk[16 + l] >> j) & 1) << 4));
  }
}
static void dec_q6_k(const uint8_t* blk, Super<Q6K>& S, int c) {
  std::memcpy(S.hconst(2 * c), blk + 208, 2);
  for (int j = 0; j < 16; ++j) *S.gconst(j, c) = blk[192 + j];
  for (int e = 0; e < 256; ++e) {   // a half h of 128: low nibble i / 64 of byte i % 64, high bits 2 (i / 32) of byte i % 32
    const int h = e / 128, i = e % 128;
    const int low = (blk[64 * h + i % 64] >> (4 * (i / 64))) & 0x0F;
    const int high = (blk[128 + 32 * h + i % 32] >> (2 * (i / 32))) & 0x03;
    S.codes[c][e] = static_cast<uint8_t>(low | (high << 4));
  }
}

// The types without a layout of their own, written exactly in one of the formats above (their
// weights are products of an fp16 and small integers, so a wider code holds them; memory: quants.py):
//   Q3_K -> q6k: W = d (sc - 32) q, q = 2 low bits - (hmask bit ? 0 : 4) in -4..3: the code q + 32
//          (6-bit, 28..35), the int8 scale sc - 32 a group of 16, d the super-block's;
//   IQ4_NL -> q8h (mm): W = d kv[q], kv IQ4_NL's table of 16 int8 values: the code kv[q], d the
//          block's; for mm8, q4n: the index q, kv looked up in the kernel;
//   IQ4_XS -> q8f (mm): W = d (ls - 32) kv[q], ls a 6-bit scale a group of 32: the fp32 scale
//          d (ls - 32), codes kv[q] (int8), low 0; for mm8, q4x: the index q, ls - 32 an int8,
//          d the super-block's.
static void dec_q3_k(const uint8_t* blk, Super<Q6K>& S, int c) {   // hmask[32] qs[64] scales[12] d
  std::memcpy(S.hconst(2 * c), blk + 108, 2);
  const uint8_t* sc = blk + 96;
  for (int i = 0; i < 16; ++i) {   // scale i: low 4 bits a nibble of byte i % 8, top 2 of byte 8 + i % 4
    const int v = ((sc[i % 8] >> (4 * (i / 8))) & 0x0F) | (((sc[8 + i % 4] >> (2 * (i / 4))) & 3) << 4);
    *S.gconst(i, c) = static_cast<uint8_t>(static_cast<int8_t>(v - 32));
  }
  for (int e = 0; e < 256; ++e) {  // half h of 128, run j of 32, l: bits 2j of qs[32 h + l], bit 4h + j of hmask[l]
    const int h = e / 128, j = (e % 128) / 32, l = e % 32;
    const int q = ((blk[32 + 32 * h + l] >> (2 * j)) & 3) - (((blk[l] >> (4 * h + j)) & 1) ? 0 : 4);
    S.codes[c][e] = static_cast<uint8_t>(q + 32);
  }
}
static void dec_iq4_nl(const uint8_t* blk, Super<Q8H>& S, int c) {   // d, qs[16]
  std::memcpy(S.gconst(0, 2 * c), blk, 2);
  for (int e = 0; e < 16; ++e) {
    S.codes[c][e] = static_cast<uint8_t>(IQ4NL_VALUES[blk[2 + e] & 0x0F]);
    S.codes[c][e + 16] = static_cast<uint8_t>(IQ4NL_VALUES[blk[2 + e] >> 4]);
  }
}
// q4n, q4x (mm8): the file's indices and constants as they are
static void dec_iq4_nl8(const uint8_t* blk, Super<Q4N>& S, int c) {   // d, qs[16]
  std::memcpy(S.gconst(0, 2 * c), blk, 2);
  for (int e = 0; e < 16; ++e) {
    S.codes[c][e] = blk[2 + e] & 0x0F;
    S.codes[c][e + 16] = blk[2 + e] >> 4;
  }
}
static void dec_iq4_xs8(const uint8_t* blk, Super<Q4X>& S, int c) {   // d, scales_h (u16), scales_l[4], qs[128]
  std::memcpy(S.hconst(2 * c), blk, 2);
  const int high = u16(blk + 2);
  for (int j = 0; j < 8; ++j) {
    const int ls = ((blk[4 + j / 2] >> (4 * (j % 2))) & 0x0F) | (((high >> (2 * j)) & 3) << 4);
    *S.gconst(j, c) = static_cast<uint8_t>(static_cast<int8_t>(ls - 32));
    const uint8_t* qs = blk + 8 + 16 * j;
    for (int l = 0; l < 16; ++l) {
      S.codes[c][32 * j + l] = qs[l] & 0x0F;
      S.codes[c][32 * j + 16 + l] = qs[l] >> 4;
    }
  }
}
static void dec_iq4_xs(const uint8_t* blk, Super<Q8F8>& S, int c) {   // d, scales_h (u16), scales_l[4], qs[128]
  const float d = f16(blk);
  const int high = u16(blk + 2);
  for (int j = 0; j < 8; ++j) {
    const int ls = ((blk[4 + j / 2] >> (4 * (j % 2))) & 0x0F) | (((high >> (2 * j)) & 3) << 4);
    put_f32(S.gconst(j, 4 * c), d * static_cast<float>(ls - 32));
    put_f32(S.gconst(j, 64 + 4 * c), 0.0f);
    const uint8_t* qs = blk + 8 + 16 * j;
    for (int l = 0; l < 16; ++l) {
      S.codes[c][32 * j + l] = static_cast<uint8_t>(IQ4NL_VALUES[qs[l] & 0x0F]);
      S.codes[c][32 * j + 16 + l] = static_cast<uint8_t>(IQ4NL_VALUES[qs[l] >> 4]);
    }
  }
}

// The rows of one or more GGUF tensors of one type and K, side by side: column block cb (16 rows)
// of the whole is a block of one of them (q, k and v of a layer packed into one buffer: the
// joined GEMM reads them in one pass, and nothing is copied to join them). row[cb]: the first
// byte of its 16 rows; bytes[cb]: their row stride.
struct Rows {
  std::vector<const uint8_t*> row;
  std::vector<int64_t> bytes;
  Rows(const std::vector<int64_t>& addresses, const std::vector<int64_t>& ns, const std::vector<int64_t>& row_bytes) {
    TORCH_CHECK(addresses.size() == ns.size() && ns.size() == row_bytes.size() && !ns.empty(),
                "GGUF pack: one address, row count and row size a tensor");
    for (size_t t = 0; t < ns.size(); ++t) {
      TORCH_CHECK(ns[t] % 16 == 0, "GGUF pack: N % 16 must be 0");
      for (int64_t cb = 0; cb < ns[t] / 16; ++cb) {
        row.push_back(reinterpret_cast<const uint8_t*>(addresses[t]) + 16 * cb * row_bytes[t]);
        bytes.push_back(row_bytes[t]);
      }
    }
  }
  int64_t blocks() const { return static_cast<int64_t>(row.size()); }
};

// Every column block on torch's threads, super-block by super-block: the 16 columns' GGUF blocks
// (block_bytes each, one a super-block) decoded, then written.
template <typename F, typename D>
static torch::Tensor pack_all(const Rows& rows, int64_t K, int64_t block_bytes, D decode, bool int8) {
  const int64_t supers = K / (F::GK * F::GS);
  torch::Tensor out = torch::empty({rows.blocks(), supers, static_cast<int64_t>(F::SB)}, torch::kUInt8);
  uint8_t* o = out.data_ptr<uint8_t>();
#pragma omp parallel for schedule(static)
  for (int64_t cb = 0; cb < rows.blocks(); ++cb) {
    Super<F> S;
    for (int64_t s = 0; s < supers; ++s) {
      S.out = o + (cb * supers + s) * F::SB;
      for (int c = 0; c < 16; ++c) decode(rows.row[cb] + c * rows.bytes[cb] + s * block_bytes, S, c);
      if (int8) S.emit8(); else S.emit();
    }
  }
  return out;
}

// The int8 arrangement written straight from the GGUF blocks for the types most files hold (Q4_0,
// Q8_0, Q4_K, Q6_K): the bytes Super::emit8 writes from decoded codes, four codes of a column at a
// time in a 32-bit word instead of one by one (an 8B Q4_K_M file's packing ~15 s -> a few on the
// 2-core EPYC). `pack(..., reference=true)` keeps the decoded path; tests/test_quants.py compares
// the two byte for byte. A unit u of a group holds k 8u..8u+7: byte 4c + t is column c's code of
// k 8u + t (low nibble or byte 64 + ...) and of 8u + 4 + t (high nibble), as emit8's header says.
static inline uint32_t load32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
static inline void store32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }
static constexpr uint32_t NIBBLES = 0x0F0F0F0Fu;

// four nibbles of bytes qs[0..3] (shift 0: low, 4: high) under those of qs[4..7] in one word
static inline uint32_t nibble_pairs(const uint8_t* qs, int shift) {
  return ((load32(qs) >> shift) & NIBBLES) | (((load32(qs + 4) >> shift) & NIBBLES) << 4);
}

static void fast_q4_0(const uint8_t* const* blk, uint8_t* out) {   // k < 16: low nibbles of qs[k], else high ones
  for (int c = 0; c < 16; ++c) std::memcpy(out + Q4Z::CODES + 2 * c, blk[c], 2);
  for (int u = 0; u < 4; ++u)
    for (int c = 0; c < 16; ++c) store32(out + 64 * u + 4 * c, nibble_pairs(blk[c] + 2 + (8 * u) % 16, 4 * (u / 2)));
}
static void fast_q8_0(const uint8_t* const* blk, uint8_t* out) {   // the int8 codes plus 128
  for (int c = 0; c < 16; ++c) std::memcpy(out + Q8H::CODES + 2 * c, blk[c], 2);
  for (int u = 0; u < 4; ++u)
    for (int c = 0; c < 16; ++c) {
      store32(out + 128 * u + 4 * c, load32(blk[c] + 2 + 8 * u) ^ 0x80808080u);
      store32(out + 128 * u + 64 + 4 * c, load32(blk[c] + 6 + 8 * u) ^ 0x80808080u);
    }
}
static void fast_q4_k(const uint8_t* const* blk, uint8_t* out) {   // group g: nibble g % 2 of qs[32 (g / 2) + l]
  for (int c = 0; c < 16; ++c) {
    std::memcpy(out + 2 * c, blk[c], 2);
    std::memcpy(out + 32 + 2 * c, blk[c] + 2, 2);
    for (int j = 0; j < 8; ++j) {
      int sc, mn;
      scale_min_k4(j, blk[c] + 4, sc, mn);
      uint8_t* consts = out + Q4K::HEAD + j * Q4K::GROUP + Q4K::CODES;
      consts[c] = static_cast<uint8_t>(sc);
      consts[16 + c] = static_cast<uint8_t>(mn);
    }
  }
  for (int g = 0; g < 8; ++g)
    for (int u = 0; u < 4; ++u)
      for (int c = 0; c < 16; ++c)
        store32(out + Q4K::HEAD + g * Q4K::GROUP + 64 * u + 4 * c, nibble_pairs(blk[c] + 16 + 32 * (g / 2) + 8 * u, 4 * (g % 2)));
}
static void fast_q6_k(const uint8_t* const* blk, uint8_t* out) {   // dec_q6_k's codes, four at a time
  for (int c = 0; c < 16; ++c) {
    std::memcpy(out + 2 * c, blk[c] + 208, 2);
    for (int j = 0; j < 16; ++j) out[Q6K::HEAD + j * Q6K::GROUP + Q6K::CODES + c] = blk[c][192 + j];
  }
  for (int g = 0; g < 16; ++g)
    for (int u = 0; u < 2; ++u) {
      uint8_t* unit = out + Q6K::HEAD + g * Q6K::GROUP + 96 * u;
      uint32_t low[2][16], high[2][16];   // [quad][column]: 4 codes' low 4 bits, their high 2 bits
      for (int q = 0; q < 2; ++q) {
        const int e = 16 * g + 8 * u + 4 * q, h = e / 128, i = e % 128;
        for (int c = 0; c < 16; ++c) {
          low[q][c] = (load32(blk[c] + 64 * h + i % 64) >> (4 * (i / 64))) & NIBBLES;
          high[q][c] = (load32(blk[c] + 128 + 32 * h + i % 32) >> (2 * (i / 32))) & 0x03030303u;
        }
      }
      for (int c = 0; c < 16; ++c) store32(unit + 4 * c, low[0][c] | low[1][c] << 4);
      for (int c = 0; c < 8; ++c)
        store32(unit + 64 + 4 * c, high[0][c] | high[0][c + 8] << 2 | high[1][c] << 4 | high[1][c + 8] << 6);
    }
}

// Every column block on torch's threads, super-block by super-block: `write` makes one from the 16
// columns' GGUF blocks (block_bytes each, one a super-block).
template <typename F, typename W>
static torch::Tensor pack_fast(const Rows& rows, int64_t K, int64_t block_bytes, W write) {
  const int64_t supers = K / (F::GK * F::GS);
  torch::Tensor out = torch::empty({rows.blocks(), supers, static_cast<int64_t>(F::SB)}, torch::kUInt8);
  uint8_t* o = out.data_ptr<uint8_t>();
#pragma omp parallel for schedule(static)
  for (int64_t cb = 0; cb < rows.blocks(); ++cb) {
    const uint8_t* blk[16];
    for (int64_t s = 0; s < supers; ++s) {
      for (int c = 0; c < 16; ++c) blk[c] = rows.row[cb] + c * rows.bytes[cb] + s * block_bytes;
      write(blk, o + (cb * supers + s) * F::SB);
    }
  }
  return out;
}

// (packed, fmt) of GGUF tensors' rows side by side (Rows): at addresses[t], ns[t] rows of
// row_bytes[t] bytes (the file's map, read only here), K weights a row, one type. The caller
// checks the shapes (quants.fits) and the row bytes. int8: arranged for mm8 (int8 activations),
// else for mm. reference: the int8 arrangement through the decoded codes (Super::emit8) also where
// a direct writer exists (the tests' reference).
std::tuple<torch::Tensor, std::string> pack(const std::vector<int64_t>& addresses, const std::vector<int64_t>& ns,
                                            const std::vector<int64_t>& row_bytes, int64_t K, const std::string& type,
                                            bool int8, bool reference) {
  const Rows raw(addresses, ns, row_bytes);
  const int64_t B = raw.blocks();
  TORCH_CHECK(K % 32 == 0, "GGUF pack: K % 32 must be 0");
  if (int8 && type == "IQ4_NL") return {pack_all<Q4N>(raw, K, 18, dec_iq4_nl8, true), "q4n"};
  if (int8 && type == "IQ4_XS" && K % 256 == 0) return {pack_all<Q4X>(raw, K, 136, dec_iq4_xs8, true), "q4x"};
  if (int8 && !reference) {
    if (type == "Q4_0") return {pack_fast<Q4Z>(raw, K, 18, fast_q4_0), "q4z"};
    if (type == "Q8_0") return {pack_fast<Q8H>(raw, K, 34, fast_q8_0), "q8h"};
    if (K % 256 == 0 && type == "Q4_K") return {pack_fast<Q4K>(raw, K, 144, fast_q4_k), "q4k"};
    if (K % 256 == 0 && type == "Q6_K") return {pack_fast<Q6K>(raw, K, 210, fast_q6_k), "q6k"};
  }
  if (type == "Q4_0") return {pack_all<Q4Z>(raw, K, 18, dec_q4_0, int8), "q4z"};
  if (type == "Q4_1") return {pack_all<Q4H>(raw, K, 20, dec_q4_1, int8), "q4h"};
  if (type == "Q8_0") return {pack_all<Q8H>(raw, K, 34, dec_q8_0, int8), "q8h"};
  if (type == "Q5_0") return {pack_all<Q8H>(raw, K, 22, dec_q5_0, int8), "q8h"};
  if (type == "Q5_1") return {pack_all<Q8F>(raw, K, 24, dec_q5_1, int8), "q8f"};
  if (type == "IQ4_NL") return {pack_all<Q8H>(raw, K, 18, dec_iq4_nl, int8), "q8h"};
  TORCH_CHECK(K % 256 == 0, "GGUF pack: K % 256 must be 0 for a K-quant");
  if (type == "Q4_K") return {pack_all<Q4K>(raw, K, 144, dec_q4_k, int8), "q4k"};
  if (type == "Q5_K")   // no head: 8 groups of q8f in a row are q8f's super-blocks of one
    return {pack_all<Q8F8>(raw, K, 176, dec_q5_k, int8).view({B, K / 32, Q8F::SB}), "q8f"};
  if (type == "Q6_K") return {pack_all<Q6K>(raw, K, 210, dec_q6_k, int8), "q6k"};
  if (type == "Q3_K") return {pack_all<Q6K>(raw, K, 110, dec_q3_k, int8), "q6k"};
  if (type == "IQ4_XS")   // bf16 activations (int8: q4x above)
    return {pack_all<Q8F8>(raw, K, 136, dec_iq4_xs, false).view({B, K / 32, Q8F::SB}), "q8f"};
  TORCH_CHECK(false, "GGUF pack: no packing for ", type);
  return {torch::Tensor(), ""};
}

// ------------------------------------------------------------------ row-wise ops of the owned forward

// In bf16 on the CPU, one call where torch takes 8-12 small ops a layer (each a few microseconds of
// dispatch: at 1.7B a fifth of a decode step's time outside the GEMMs). Each row's arithmetic is
// fixed and sees no other row, so they keep the M-invariant forward exact.

static inline float bf(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
// fp32 -> bf16 to nearest even (c10::BFloat16's rounding; NaN stays NaN)
static inline uint16_t to_bf(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// The row ops' vectors: 8 floats (one AVX2 register; GCC lowers a wider vector to memory where
// the build has no AVX-512), bf and to_bf lane by lane: the same operations as the scalar code,
// so the same bits.
typedef float rv8 __attribute__((vector_size(32)));
typedef uint32_t ru8 __attribute__((vector_size(32)));
typedef int32_t ri8 __attribute__((vector_size(32)));
typedef uint16_t rh8 __attribute__((vector_size(16)));
static inline rv8 bf8(const uint16_t* p) {
  rh8 h;
  std::memcpy(&h, p, 16);
  const ru8 bits = __builtin_convertvector(h, ru8) << 16;
  rv8 f;
  std::memcpy(&f, &bits, 32);
  return f;
}
static inline ru8 bf_bits8(rv8 f) {   // to_bf lane by lane: each lane's bf16 bits
  ru8 bits;
  std::memcpy(&bits, &f, 32);
  const ri8 nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  return nan ? (bits >> 16) | 0x40u : (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
}
static inline void to_bf8(rv8 f, uint16_t* p) {
  const rh8 h = __builtin_convertvector(bf_bits8(f), rh8);
  std::memcpy(p, &h, 16);
}
static inline rv8 round8(rv8 f) {   // to bf16 and back: the rounding of a bf16 op's result
  const ru8 bits = bf_bits8(f) << 16;
  rv8 r;
  std::memcpy(&r, &bits, 32);
  return r;
}

// x' = x + delta (where delta is given: the residual add, bf16 as torch's), y = RMSNorm(x') with
// weight w: per row s = sum of x'^2 in fp32 (sixteen running sums, k = lane mod 16, added in a
// fixed order at the end), r = 1 / sqrt(s / d + eps), y = bf16(bf16(x' r) w) (transformers'
// LlamaRMSNorm: the normalised row rounded to the dtype, then times the weight). Returns (x', y).
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> delta,
                                                      torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16,
              "add_rms_norm: x [m, d] and w [d] bf16");
  const int64_t m = x.size(0), d = x.size(1);
  TORCH_CHECK(w.numel() == d, "add_rms_norm: w has ", w.numel(), " values for rows of ", d);
  auto xs = x.contiguous(), ws = w.contiguous();
  torch::Tensor sum = xs;
  if (delta.has_value()) {
    auto ds = delta->contiguous();
    TORCH_CHECK(ds.sizes() == xs.sizes() && ds.scalar_type() == torch::kBFloat16, "add_rms_norm: delta as x");
    sum = torch::empty_like(xs);
    const uint16_t* a = reinterpret_cast<const uint16_t*>(xs.data_ptr<at::BFloat16>());
    const uint16_t* b = reinterpret_cast<const uint16_t*>(ds.data_ptr<at::BFloat16>());
    uint16_t* o = reinterpret_cast<uint16_t*>(sum.data_ptr<at::BFloat16>());
    int64_t i = 0;
    for (; i + 8 <= m * d; i += 8) to_bf8(bf8(a + i) + bf8(b + i), o + i);
    for (; i < m * d; ++i) o[i] = to_bf(bf(a[i]) + bf(b[i]));
  }
  auto y = torch::empty_like(xs);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(sum.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(ws.data_ptr<at::BFloat16>());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  for (int64_t r = 0; r < m; ++r) {
    const uint16_t* row = xp + r * d;
    rv8 lo = {}, hi = {};                          // lanes 0-7 and 8-15 of the sixteen sums
    int64_t k = 0;
    for (; k + 16 <= d; k += 16) {
      const rv8 a = bf8(row + k), b = bf8(row + k + 8);
      lo += a * a;
      hi += b * b;
    }
    float lanes[16];
    std::memcpy(lanes, &lo, 32);
    std::memcpy(lanes + 8, &hi, 32);
    for (; k < d; ++k) {
      const float v = bf(row[k]);
      lanes[k % 16] += v * v;
    }
    for (int width = 8; width >= 1; width /= 2)   // pairwise, in a fixed order
      for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
    const float inv = 1.0f / std::sqrt(lanes[0] / static_cast<float>(d) + static_cast<float>(eps));
    uint16_t* yr = yp + r * d;
    k = 0;
    for (; k + 8 <= d; k += 8) to_bf8(round8(bf8(row + k) * inv) * bf8(wp + k), yr + k);
    for (; k < d; ++k) yr[k] = to_bf(bf(to_bf(bf(row[k]) * inv)) * bf(wp[k]));
  }
  return {sum, y};
}

// y [m, heads * hd] (a q or k projection) -> [heads, m, hd] rotated: y cos + rotate(y) sin with
// cos, sin [m, hd] bf16, each product and the sum rounded to bf16 (torch's bf16 ops, rope.py's
// Rope.apply, bit for bit). interleaved: dimension 2i turns with 2i + 1, else j with j + hd/2.
torch::Tensor rope(torch::Tensor y, torch::Tensor cos, torch::Tensor sin, int64_t heads, bool interleaved) {
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == torch::kBFloat16 && cos.scalar_type() == torch::kBFloat16 &&
              sin.scalar_type() == torch::kBFloat16, "rope: bf16 y [m, heads * hd], cos and sin [m, hd]");
  const int64_t m = y.size(0), hd = y.size(1) / heads;
  TORCH_CHECK(hd * heads == y.size(1) && hd % 2 == 0 && cos.size(0) == m && cos.size(1) == hd && sin.sizes() == cos.sizes(),
              "rope: shapes do not fit");
  auto ys = y.contiguous(), cs = cos.contiguous(), ss = sin.contiguous();
  auto out = torch::empty({heads, m, hd}, y.options());
  const uint16_t* yp = reinterpret_cast<const uint16_t*>(ys.data_ptr<at::BFloat16>());
  const uint16_t* cp = reinterpret_cast<const uint16_t*>(cs.data_ptr<at::BFloat16>());
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(ss.data_ptr<at::BFloat16>());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t half = hd / 2;
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t r = 0; r < m; ++r) {
      const uint16_t* x = yp + r * heads * hd + h * hd;
      const uint16_t* c = cp + r * hd;
      const uint16_t* s = sp + r * hd;
      uint16_t* o = op + (h * m + r) * hd;
      int64_t j = 0;
      if (interleaved ? hd % 8 == 0 : half % 8 == 0)   // 8 at a time: the same operations lane by lane
        for (; j < hd; j += 8) {
          const rv8 xv = bf8(x + j);
          rv8 rot;
          if (interleaved) {                          // (-x[j + 1], x[j]) for each pair: swapped, evens negated
            const rv8 swapped = __builtin_shufflevector(xv, xv, 1, 0, 3, 2, 5, 4, 7, 6);
            ru8 bits;
            std::memcpy(&bits, &swapped, 32);
            bits ^= ru8{0x80000000u, 0, 0x80000000u, 0, 0x80000000u, 0, 0x80000000u, 0};
            std::memcpy(&rot, &bits, 32);
          } else {
            rot = j < half ? -bf8(x + j + half) : bf8(x + j - half);
          }
          to_bf8(round8(xv * bf8(c + j)) + round8(rot * bf8(s + j)), o + j);
        }
      for (; j < hd; ++j) {
        float rot;
        if (interleaved) rot = j % 2 ? bf(x[j - 1]) : -bf(x[j + 1]);
        else rot = j < half ? -bf(x[j + half]) : bf(x[j - half]);
        o[j] = to_bf(bf(to_bf(bf(x[j]) * bf(c[j]))) + bf(to_bf(rot * bf(s[j]))));
      }
    }
  return out;
}

// ---------------------------------------------------------------- the decoder layers in one call
// A forward's decoder layers, final norm and head (hdcli/engine/model/compiled.py), in three
// styles. Per layer, llama (the llama family; Granite's residual multiplier r where it is not 1):
//   h = norm(x); q, k, v = qkv(h), q and k rotated (Qwen3: each head normed first);
//   a = attention(q, k, v) (appending k, v); x, h = x + r o(a), norm(x + r o(a));
//   x = x + r down(silu(gate(h)) * up(h))
// Gemma 3: every norm Gemma3RMSNorm ((1 + w), in fp32), q and k heads normed, a norm after each
// sublayer as well, GELU (tanh), and a layer's kind (sliding or full) picks its rope and
// visibility:
//   h = norm(x); ...; x = x + norm(o(a)); x = x + norm(down(gelu(gate(norm(x))) * up(norm(x))))
// OLMo 2: no norm before a sublayer, one after each; q and k normed over their whole width before
// they are split into heads:
//   q, k, v = qkv(x), q = norm(q), k = norm(k), rotated; x = x + norm(o(a));
//   x = x + norm(down(silu(gate(x)) * up(x)))
// and at the end, where asked, logits = head(norm(x)).
// With the functions and torch ops the Python blocks call, in their order on the same tensors:
// the row ops compiled (add_rms_norm, rope: bf16) or torch's (llama.rms_norm, rope.Rope.apply:
// fp32), the Linear kernels (Gemm below), at::silu / at::gelu, the multiply and add. Every layer's
// output is torch.equal to the Python path's (tests/test_invariant.py), the Python and dispatch
// between them gone (a dozen calls a layer from Python, 2-2.5 ms of a bundled-model forward).
// The attention is the fused one (csrc/attend.cpp, its own extension): called through the address
// of its append_attend_many (attend.cpp: append_attend_many_address), a plain C++ call; a torch
// op registered by name would be registered once a process, and a benchmark loads several builds.
typedef torch::Tensor (*AppendAttendMany)(torch::Tensor, torch::Tensor, torch::Tensor, std::vector<int64_t>,
                                          std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<int64_t>,
                                          std::vector<torch::Tensor>, std::vector<torch::Tensor>, double);

typedef c10::optional<torch::Tensor> Maybe;

// The row count kernels/dense.PackedLinear runs m rows at (dense.padded_rows: exact up to 16,
// above that one of 4 sizes an octave, so oneDNN's per-shape kernel cache stays small).
int64_t padded_rows(int64_t m) {
  if (m <= 16) return m;
  const int64_t bits = 64 - __builtin_clzll(static_cast<uint64_t>(m));
  const int64_t step = int64_t(1) << std::max<int64_t>(3, bits - 3);
  return (m + step - 1) / step * step;
}

// One of a layer's Linear layers (model/layers.Linear) by the kernel holding it, called as its
// Python forward calls it: kind "gguf" / "gguf-int8" (quants.QLinear: mm / mm8 over the packing
// w, fmt its format, then the bias), "onednn" (dense.PackedLinear:
// torch.ops.mkldnn._linear_pointwise over oneDNN's packed w, rows padded to padded_rows), "torch"
// (an nn.Linear: at::linear over the weight w); "" for a slot a joined layer covers. min_rows:
// Linear.min_rows, the calibrated least row count, fewer rows padded with zero rows first. The
// kind is read once, when Layers is built, not per call.
struct Gemm {
  enum Kind { NONE, GGUF, GGUF8, ONEDNN, TORCH };
  Kind kind;
  torch::Tensor w;
  std::string fmt;
  Maybe bias;
  int64_t min_rows;

  static Kind kind_of(const std::string& name) {
    if (name.empty()) return NONE;
    if (name == "gguf") return GGUF;
    if (name == "gguf-int8") return GGUF8;
    if (name == "onednn") return ONEDNN;
    TORCH_CHECK(name == "torch", "Layers: no Linear kernel '", name, "'");
    return TORCH;
  }

  bool empty() const { return kind == NONE; }

  torch::Tensor operator()(const torch::Tensor& x) const {
    const int64_t m = x.size(0);
    const torch::Tensor rows = m < min_rows ? at::cat({x, x.new_zeros({min_rows - m, x.size(1)})}) : x;
    torch::Tensor y;
    if (kind == GGUF || kind == GGUF8) {
      y = kind == GGUF ? mm(rows, w, fmt) : mm8(rows, w, fmt);
      if (bias.has_value()) y = y + *bias;
    } else if (kind == ONEDNN) {
      y = onednn(rows);
    } else {
      TORCH_CHECK(kind == TORCH, "Layers: a call to an empty Linear slot");
      y = at::linear(rows, w, bias);
    }
    return m < min_rows ? y.narrow(0, 0, m) : y;
  }

 private:
  torch::Tensor onednn(const torch::Tensor& x) const {
    static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    const int64_t m = x.size(0), padded = padded_rows(m);
    const torch::Tensor rows = padded != m ? at::cat({x, x.new_zeros({padded - m, x.size(1)})}) : x;
    std::vector<c10::IValue> stack{rows, w, bias.has_value() ? c10::IValue(*bias) : c10::IValue(), c10::IValue("none"),
                                   c10::IValue(c10::List<c10::optional<c10::Scalar>>()), c10::IValue("")};
    op.callBoxed(&stack);
    const torch::Tensor y = stack[0].toTensor();
    return padded != m ? y.narrow(0, 0, m) : y;
  }
};

enum Style { LLAMA = 0, GEMMA = 1, OLMO2 = 2 };

class Layers {
 public:
  // per layer i: norms[6i .. 6i + 5] = attn_norm, ffn_norm, post-attention norm, post-MLP norm
  // (Gemma, OLMo 2), q and k norms (a head's: Qwen3, Gemma; the whole width: OLMo 2), None where
  // the layer has none; Linear slots [7i .. 7i + 6] = q, k, v, o, gate, up, down (kinds, ws,
  // fmts, biases, min_rows alike: Gemm), where q holds q, k and v side by side when the layer has
  // them joined (QLinear.side_by_side, Phi-3's attn_qkv) and k, v are then empty (kind ""), and
  // gate holds gate and up alike; then one slot more, the head, with final_norm before it (an
  // empty kind: no head here); kinds[i]: which rope and visibility the layer takes (0 full, 1
  // sliding); heads hq and hkv of size d; style (Style); compiled_rows: the row ops are
  // add_rms_norm and rope (bf16), else torch's; residual_scale: Granite's multiplier (1: none);
  // the attention's address.
  Layers(std::vector<Maybe> norms, std::vector<std::string> kinds_of, std::vector<torch::Tensor> ws,
         std::vector<std::string> fmts, std::vector<Maybe> biases, std::vector<int64_t> min_rows, Maybe final_norm,
         std::vector<int64_t> kinds, int64_t hq, int64_t hkv, int64_t d, double eps, bool interleaved, int64_t style,
         bool compiled_rows, double residual_scale, int64_t attend)
      : norms_(std::move(norms)), final_norm_(std::move(final_norm)), kinds_(std::move(kinds)), hq_(hq), hkv_(hkv),
        d_(d), eps_(eps), interleaved_(interleaved), style_(static_cast<Style>(style)), compiled_rows_(compiled_rows),
        residual_scale_(residual_scale), attend_(reinterpret_cast<AppendAttendMany>(attend)) {
    const size_t n = kinds_.size(), slots = 7 * n + 1;
    TORCH_CHECK(norms_.size() == 6 * n && kinds_of.size() == slots && ws.size() == slots && fmts.size() == slots
                && biases.size() == slots && min_rows.size() == slots && attend && style >= LLAMA && style <= OLMO2,
                "Layers: 6 norm slots and 7 Linear slots a layer, the head's, and the attention");
    for (size_t i = 0; i < n; ++i) {
      const bool pre = norms_[6 * i].has_value() && norms_[6 * i + 1].has_value();
      const bool post = norms_[6 * i + 2].has_value() && norms_[6 * i + 3].has_value();
      TORCH_CHECK(style_ == OLMO2 ? post && norms_[6 * i + 4].has_value() && norms_[6 * i + 5].has_value()
                                  : pre && post == (style_ == GEMMA), "Layers: layer ", i, "'s norms are not its style's");
    }
    TORCH_CHECK(kinds_of.back().empty() || final_norm_.has_value(), "Layers: a head without its final norm");
    for (size_t j = 0; j < slots; ++j)
      gemms_.push_back({Gemm::kind_of(kinds_of[j]), ws[j], fmts[j], biases[j], min_rows[j]});
  }

  int64_t size() const { return static_cast<int64_t>(kinds_.size()); }

  // x [M, D] (every part's rows, in order) through layers 0 .. n - 1, then, where head is true
  // (n the whole model), the final norm and the head: logits [M, V], else the hidden state;
  // cos[kind], sin[kind] [M, d]; per layer i and part s (index i * P + s): start, k, kt, kt_len,
  // v1 as attend.cpp's append_attend_many takes them; vis[kind * P + s]: part s's visibility in a
  // layer of that kind; scale.
  torch::Tensor forward(torch::Tensor x, std::vector<torch::Tensor> cos, std::vector<torch::Tensor> sin, int64_t n,
                        std::vector<int64_t> start, std::vector<torch::Tensor> k, std::vector<torch::Tensor> kt,
                        std::vector<int64_t> kt_len, std::vector<torch::Tensor> v1, std::vector<torch::Tensor> vis,
                        double scale, bool head) const {
    const int64_t P = static_cast<int64_t>(start.size()) / (n > 0 ? n : 1);
    TORCH_CHECK(n >= 1 && n <= size() && (int64_t)start.size() == n * P && (int64_t)k.size() == n * P
                && (int64_t)kt.size() == n * P && (int64_t)kt_len.size() == n * P && (int64_t)v1.size() == n * P
                && cos.size() == sin.size() && (int64_t)vis.size() == (int64_t)cos.size() * P,
                "Layers.forward: a cache layer a part a layer, a visibility a part a kind");
    TORCH_CHECK(!head || (n == size() && !gemms_.back().empty()), "Layers.forward: the head after every layer, where it has one");
    const int64_t m = x.size(0), nq = hq_ * d_, nk = hkv_ * d_;
    const auto from = [&](const auto& all, int64_t at) {
      return std::vector<typename std::decay_t<decltype(all)>::value_type>(all.begin() + at * P, all.begin() + (at + 1) * P);
    };
    for (int64_t i = 0; i < n; ++i) {
      const Gemm* g = &gemms_[7 * i];
      const Maybe* w = &norms_[6 * i];
      const int64_t kind = kinds_[i];
      TORCH_CHECK(kind >= 0 && kind < (int64_t)cos.size(), "Layers.forward: no rope for layer ", i, "'s kind");
      const torch::Tensor h = style_ == OLMO2 ? x : norm(x, *w[0]);
      torch::Tensor yq, yk, yv;
      if (g[1].empty()) {                            // q, k, v in one GEMM: their columns
        const torch::Tensor y = g[0](h);
        yq = y.narrow(1, 0, nq), yk = y.narrow(1, nq, nk), yv = y.narrow(1, nq + nk, nk);
      } else {
        yq = g[0](h), yk = g[1](h), yv = g[2](h);
      }
      Maybe qn = w[4], kn = w[5];
      if (qn.has_value() && qn->numel() != d_) {     // OLMo 2: q and k normed whole, then split
        yq = norm(yq, *qn), yk = norm(yk, *kn), qn = c10::nullopt, kn = c10::nullopt;
      }
      const torch::Tensor q = rotate(yq, qn, hq_, cos[kind], sin[kind]).unsqueeze(0);
      const torch::Tensor kr = rotate(yk, kn, hkv_, cos[kind], sin[kind]).unsqueeze(0);
      const torch::Tensor vn = yv.reshape({m, hkv_, d_}).transpose(0, 1).unsqueeze(0);
      const torch::Tensor a = attend_(q, kr, vn, from(start, i), from(k, i), from(kt, i), from(kt_len, i), from(v1, i),
                                      from(vis, kind), scale).reshape({m, -1});
      torch::Tensor hm;
      if (style_ == LLAMA) {
        std::tie(x, hm) = add_norm(x, scaled(g[3](a)), *w[1]);
      } else {
        x = x + norm(g[3](a), *w[2]);
        hm = style_ == GEMMA ? norm(x, *w[1]) : x;
      }
      torch::Tensor gate, up;
      if (g[5].empty()) {                            // gate and up in one GEMM: its halves
        const torch::Tensor gu = g[4](hm);
        const int64_t half = gu.size(1) / 2;
        gate = gu.narrow(1, 0, half), up = gu.narrow(1, half, half);
      } else {
        gate = g[4](hm), up = g[5](hm);
      }
      if (style_ == GEMMA) x = x + norm(g[6](at::gelu(gate, "tanh") * up), *w[3]);
      else if (style_ == OLMO2) x = x + norm(g[6](at::silu(gate) * up), *w[3]);
      else x = x + scaled(g[6](at::silu(gate) * up));
    }
    return head ? gemms_.back()(norm(x, *final_norm_)) : x;
  }

 private:
  // A row norm as the model's row ops compute it: add_rms_norm (layers.CompiledRowOps, bf16) or
  // llama.rms_norm's torch ops (layers.RowOps: fp32, the mean of squares, rsqrt, back to the
  // dtype, times the weight) for the llama family; Gemma3RMSNorm in torch ops (gemma3.gemma_norm:
  // fp32, the mean of squares, rsqrt, times 1 + w, back to the dtype).
  torch::Tensor norm(const torch::Tensor& x, const torch::Tensor& w) const {
    if (style_ == GEMMA) return (normalised(x) * (w.to(torch::kFloat) + 1.0)).to(x.scalar_type());
    if (compiled_rows_ && x.dim() == 2) return std::get<1>(add_rms_norm(x, c10::nullopt, w, eps_));
    return w * normalised(x).to(x.scalar_type());
  }

  // (x + y, norm(x + y)): the residual add and the next norm (RowOps.add_norm)
  std::tuple<torch::Tensor, torch::Tensor> add_norm(const torch::Tensor& x, const torch::Tensor& y,
                                                    const torch::Tensor& w) const {
    if (compiled_rows_) return add_rms_norm(x, y, w, eps_);
    const torch::Tensor sum = x + y;
    return {sum, norm(sum, w)};
  }

  // a sublayer's output times Granite's residual multiplier (Block.scaled), none where it is 1
  torch::Tensor scaled(const torch::Tensor& y) const { return residual_scale_ == 1.0 ? y : y * residual_scale_; }

  // x in fp32 over the root of its mean square (plus eps), row by row: every torch-op norm's start
  torch::Tensor normalised(const torch::Tensor& x) const {
    const torch::Tensor h = x.to(torch::kFloat);
    return h * at::rsqrt(h.pow(2).mean(-1, true) + eps_);
  }

  // A q or k projection [m, heads * d] as rotated heads [heads, m, d]; with a head norm first
  // (Qwen3, Gemma) in torch ops (layers.rms_norm, Gemma's as norm above). The rotation: rope
  // where the row ops are compiled (bit-equal to rope.py's torch ops, elementwise), else those
  // ops (Rope.apply).
  torch::Tensor rotate(const torch::Tensor& y, const Maybe& w, int64_t heads, const torch::Tensor& cos,
                       const torch::Tensor& sin) const {
    const int64_t m = y.size(0);
    torch::Tensor yh = y.view({m, heads, d_});
    if (w.has_value()) yh = style_ == GEMMA ? norm(yh, *w) : *w * normalised(yh).to(y.scalar_type());
    if (compiled_rows_) return rope(w.has_value() ? yh.reshape({m, heads * d_}) : y, cos, sin, heads, interleaved_);
    const torch::Tensor t = yh.transpose(0, 1);
    torch::Tensor rot;
    if (interleaved_) {
      const torch::Tensor pairs = t.unflatten(-1, {-1, 2});
      rot = at::stack({-pairs.select(-1, 1), pairs.select(-1, 0)}, -1).flatten(-2);
    } else {
      const int64_t half = d_ / 2;
      rot = at::cat({-t.narrow(-1, half, half), t.narrow(-1, 0, half)}, -1);
    }
    return t * cos + rot * sin;
  }

  std::vector<Maybe> norms_;
  Maybe final_norm_;
  std::vector<Gemm> gemms_;
  std::vector<int64_t> kinds_;
  int64_t hq_, hkv_, d_;
  double eps_;
  bool interleaved_;
  Style style_;
  bool compiled_rows_;
  double residual_scale_;
  AppendAttendMany attend_;
};

// ------------------------------------------------------------------ the best tokens of each row

// Per row of scores [rows, V] (bf16 or fp32), the k highest-scoring indices, best first, as
// verify.top_tokens' numpy path gives them: rank r is numpy's argmax of the row with ranks 0..r-1
// set to -inf. So: a NaN above every number (argmax returns the first NaN), equal scores by
// lower index, and once only -inf is left, the lowest index whose score is -inf then (ranks set
// to -inf included). One pass a row keeping the k best, then the -inf rule; bf16 widens exactly.
// Rows with a NaN, rare, take the plain loop of k argmaxes. The pass vectorises (8 lanes of fp32,
// AVX2 where built): the lanes' running maxima say when a block holds nothing for the k best.
static bool beats(float a, float b) {   // a ranks above b (numpy's argmax order, before the index)
  return std::isnan(a) ? !std::isnan(b) : !std::isnan(b) && a > b;
}

template <typename T>
static float score_at(const T* p, int64_t i) {
  if constexpr (std::is_same_v<T, float>) return p[i];
  else return f32_of_bf16(reinterpret_cast<const uint16_t*>(p)[i]);
}

#ifdef __AVX2__
template <typename T>
static inline __m256 load8(const T* p, int64_t i) {   // 8 scores widened to fp32 (bf16: exactly)
  if constexpr (std::is_same_v<T, float>) return _mm256_loadu_ps(p + i);
  else return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(reinterpret_cast<const uint16_t*>(p) + i))), 16));
}
#endif

template <typename T>
static void top_row(const T* p, int64_t V, int k, int64_t* out) {
  std::vector<std::pair<float, int64_t>> best;   // the k best so far, best first (a tie keeps the earlier)
  best.reserve(k + 1);
  int64_t first_neg_inf = -1;
  bool nan = false;
  auto offer = [&](float v, int64_t i) {
    if (std::isnan(v)) nan = true;
    if (v == -INFINITY && first_neg_inf < 0) first_neg_inf = i;
    if (static_cast<int>(best.size()) == k && !beats(v, best.back().first)) return;
    size_t at = best.size();
    while (at > 0 && beats(v, best[at - 1].first)) --at;
    best.insert(best.begin() + at, {v, i});
    if (static_cast<int>(best.size()) > k) best.pop_back();
  };
  int64_t i = 0;
#ifdef __AVX2__
  // whole blocks of 8 below the k-th best so far are skipped (none of them can enter: a NaN is
  // not below anything, so a block with one is offered)
  for (; i + 8 <= V; i += 8) {
    const __m256 v = load8(p, i);
    if (static_cast<int>(best.size()) == k && !std::isnan(best.back().first)) {
      // every lane a number <= the k-th best (NLE_UQ: greater, or a NaN), and no -inf still to
      // note: nothing in the block changes the answer
      const int above = _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(best.back().first), _CMP_NLE_UQ));
      const int neg_inf = first_neg_inf >= 0 ? 0 : _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ));
      if ((above | neg_inf) == 0) continue;
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, v);
    for (int j = 0; j < 8; ++j) offer(lanes[j], i + j);
  }
#endif
  for (; i < V; ++i) offer(score_at(p, i), i);
  if (nan) {   // numpy's k argmaxes as they are
    std::vector<int64_t> taken;
    for (int r = 0; r < k; ++r) {
      int64_t arg = 0;
      float top = 0.0f;
      for (int64_t j = 0; j < V; ++j) {
        const float v = std::find(taken.begin(), taken.end(), j) != taken.end() ? -INFINITY : score_at(p, j);
        if (j == 0 || beats(v, top)) top = v, arg = j;
      }
      taken.push_back(arg);
      out[r] = arg;
    }
    return;
  }
  int64_t lowest_taken = V;   // the lowest index of ranks already given (set to -inf for the next)
  for (int r = 0; r < k; ++r) {
    int64_t got;
    if (r < static_cast<int>(best.size()) && best[r].first != -INFINITY) got = best[r].second;
    else got = std::min(first_neg_inf < 0 ? V : first_neg_inf, lowest_taken);   // only -inf left
    out[r] = got;
    lowest_taken = std::min(lowest_taken, got);
  }
}

// scores [rows, V] bf16 or fp32, contiguous on the CPU; returns [rows, k] int64.
torch::Tensor top_indices(torch::Tensor scores, int64_t k) {
  TORCH_CHECK(scores.dim() == 2 && scores.device().is_cpu(), "top_indices: scores [rows, V] on the CPU");
  TORCH_CHECK(scores.scalar_type() == torch::kBFloat16 || scores.scalar_type() == torch::kFloat32,
              "top_indices: bf16 or fp32 scores");
  const int64_t rows = scores.size(0), V = scores.size(1);
  TORCH_CHECK(k >= 1 && k <= V, "top_indices: 1 <= k <= V");
  auto x = scores.contiguous();
  auto out = torch::empty({rows, k}, torch::kInt64);
  int64_t* o = out.data_ptr<int64_t>();
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  const void* base = x.data_ptr();
  at::parallel_for(0, rows, 1, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      if (bf16) top_row(reinterpret_cast<const at::BFloat16*>(base) + r * V, V, static_cast<int>(k), o + r * k);
      else top_row(reinterpret_cast<const float*>(base) + r * V, V, static_cast<int>(k), o + r * k);
    }
  });
  return out;
}

// ------------------------------------------------------------------ a seeded draw from a whole row

// verify.coupled_choice without top-k or top-p: the token at uniform u of softmax(row / T), by an
// inverse CDF in a fixed order that eight sums run side by side. Per token i, in fp32:
//   z_i = x_i (1 / T) (x widened exactly from bf16), w_i = expn(z_i - max z), expn below;
// the CDF orders the tokens by lane (i % 8), then by i: lane L's sum S_L = w_L + w_{L+8} + ...
// added in that order in fp64, the lanes' bases B_0 = 0, B_{L+1} = B_L + S_L, and token i of lane
// L ends at C_i = B_L + (lane L's sum up to and including i). C never falls (every w >= 0, and
// rounding to nearest keeps order), so the first token with C_i > u * B_8 is a draw with
// P(i) = w_i / sum w, up to rounding. The AVX2 code and the scalar loop do the same operations on
// each element (no FMA: -ffp-contract=off), so every build draws the same token. Returns -1 for a
// row this does not take (a NaN, or no finite score): the caller's torch ops then draw.
// The torch ops it replaces (exp, an fp64 cumsum in token order, searchsorted) took 120-170 us a
// draw on the bundled model's 49152 logits (AMD EPYC), most of it the one long chain of fp64 adds.
// expn is attend.cpp's exp_nonpositive, the same operations: each extension is one source file,
// hashed alone into its build's name (build.extension_name), so each keeps its own copy.
static inline float expn(float x) {   // exp(x) for x <= 0: 2^k e^r, e^r by its Taylor polynomial of degree 7
  const float magic = 12582912.0f;   // 1.5 * 2^23: adding it rounds to an integer
  const float t = x * 1.44269504088896341f + magic, kf = t - magic;
  uint32_t tb, mb;   // unsigned: the bits of a score far below -87 are garbage, never UB
  std::memcpy(&tb, &t, 4);
  std::memcpy(&mb, &magic, 4);
  float r = x - kf * 0.693145751953125f;
  r = r - kf * 1.428606765330187045e-06f;
  float q = 1.0f / 5040.0f;
  q = q * r + 1.0f / 720.0f;
  q = q * r + 1.0f / 120.0f;
  q = q * r + 1.0f / 24.0f;
  q = q * r + 1.0f / 6.0f;
  q = q * r + 0.5f;
  q = q * r + 1.0f;
  q = q * r + 1.0f;
  const uint32_t sb = (tb - mb + 127u) << 23;
  float scale;
  std::memcpy(&scale, &sb, 4);
  return x < -87.0f ? 0.0f : q * scale;
}

#ifdef __AVX2__
static inline __m256 expn8(__m256 x) {   // expn on 8 lanes, operation for operation
  const __m256 magic = _mm256_set1_ps(12582912.0f);
  const __m256 t = _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), magic);
  const __m256 kf = _mm256_sub_ps(t, magic);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(kf, _mm256_set1_ps(0.693145751953125f)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(kf, _mm256_set1_ps(1.428606765330187045e-06f)));
  __m256 q = _mm256_set1_ps(1.0f / 5040.0f);
  for (float c : {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f})
    q = _mm256_add_ps(_mm256_mul_ps(q, r), _mm256_set1_ps(c));
  const __m256i k = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_castps_si256(magic));
  const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23));
  const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  return _mm256_andnot_ps(under, _mm256_mul_ps(q, scale));
}
#endif

// A row's greatest score (a max: exact in any order; a NaN ignored by it, and said in nan).
template <typename T>
static float row_max(const T* p, int64_t V, bool& nan) {
  float top = -INFINITY;
  int64_t i = 0;
#ifdef __AVX2__
  __m256 mx = _mm256_set1_ps(-INFINITY), bad = _mm256_setzero_ps();
  for (; i + 8 <= V; i += 8) {
    const __m256 x = load8(p, i);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    mx = _mm256_max_ps(mx, x);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  for (float v : lanes) top = std::max(top, v);
  nan = nan || _mm256_movemask_ps(bad) != 0;
#endif
  for (; i < V; ++i) {
    const float x = score_at(p, i);
    nan = nan || std::isnan(x);
    top = std::max(top, x);
  }
  return top;
}

template <typename T>
static int64_t draw_row(const T* p, int64_t V, float temperature, double u) {
  // C[j]: token j's cumulative sum within its lane (lane j % 8, slot j / 8): the running sums as
  // they were added, kept so that the search is a binary search in the lane
  thread_local std::vector<double> C;
  C.resize(static_cast<size_t>((V + 7) / 8 * 8));
  const float inv = 1.0f / temperature;
  // max z = (max x) inv: multiplying by inv > 0 rounds monotonically, so it keeps the order
  bool nan = false;
  const float top = row_max(p, V, nan) * inv;
  if (nan || !std::isfinite(top)) return -1;
  double S[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
#ifdef __AVX2__
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();   // lanes 0-3 and 4-7
  const __m256 iv = _mm256_set1_ps(inv), tops = _mm256_set1_ps(top);
  for (; i + 8 <= V; i += 8) {
    const __m256 e = expn8(_mm256_sub_ps(_mm256_mul_ps(load8(p, i), iv), tops));
    lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    _mm256_storeu_pd(C.data() + i, lo);
    _mm256_storeu_pd(C.data() + i + 4, hi);
  }
  _mm256_storeu_pd(S, lo);
  _mm256_storeu_pd(S + 4, hi);
#endif
  for (; i < V; ++i) {   // the rest (all of it without AVX2), lane i % 8 as above
    S[i % 8] += static_cast<double>(expn(score_at(p, i) * inv - top));
    C[i] = S[i % 8];
  }
  double B[9] = {0};
  for (int L = 0; L < 8; ++L) B[L + 1] = B[L] + S[L];
  const double t = u * B[8];
  int L = 0;
  while (L < 7 && !(B[L + 1] > t)) ++L;
  // the first slot of lane L whose B_L + C > t (B_L + C never falls along the lane)
  int64_t a = 0, b = (V - 1 - L) / 8;   // slots 0..b of the lane; slot b's B_L + C is B_{L+1} > t
  while (a < b) {
    const int64_t mid = (a + b) / 2;
    if (B[L] + C[mid * 8 + L] > t) b = mid;
    else a = mid + 1;
  }
  return a * 8 + L;
}

// Per row of scores [rows, V] (bf16 or fp32), the probabilities under softmax(row / T) of the
// tokens ids [rows, k] names: verify.top_probs, what a sampled step tells the layers that recycle
// the target's predictions (drafting estimates, never an output: any order of the sum will do).
// One pass a row for the max, one for the sum of expn (8 lanes of fp32 where built with AVX2,
// added in fp64 at the end). The torch ops (widen, divide, logsumexp, gather) took 224 us for 5
// rows of the bundled model's 49152 logits and 1.3 ms for 9 (AMD EPYC).
template <typename T>
static void probs_row(const T* p, int64_t V, float inv, const int64_t* ids, int64_t k, float* out) {
  bool nan = false;
  const float top = row_max(p, V, nan) * inv;
  double sum = 0.0;
  int64_t i = 0;
#ifdef __AVX2__
  __m256 acc = _mm256_setzero_ps();
  const __m256 iv = _mm256_set1_ps(inv), tops = _mm256_set1_ps(top);
  for (; i + 8 <= V; i += 8) acc = _mm256_add_ps(acc, expn8(_mm256_sub_ps(_mm256_mul_ps(load8(p, i), iv), tops)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float v : lanes) sum += v;
#endif
  for (; i < V; ++i) sum += expn(score_at(p, i) * inv - top);
  for (int64_t j = 0; j < k; ++j) {
    const int64_t id = ids[j];
    out[j] = id >= 0 && id < V && std::isfinite(top) && sum > 0.0
                 ? static_cast<float>(expn(score_at(p, id) * inv - top) / sum) : 0.0f;
  }
}

// scores [rows, V] bf16 or fp32 on the CPU, ids [rows, k] int64; returns [rows, k] fp32.
torch::Tensor probs_of(torch::Tensor scores, torch::Tensor ids, double temperature) {
  TORCH_CHECK(scores.dim() == 2 && scores.device().is_cpu(), "probs_of: scores [rows, V] on the CPU");
  TORCH_CHECK(scores.scalar_type() == torch::kBFloat16 || scores.scalar_type() == torch::kFloat32, "probs_of: bf16 or fp32");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == scores.size(0) && ids.scalar_type() == torch::kInt64, "probs_of: ids [rows, k] int64");
  auto x = scores.contiguous();
  auto idx = ids.contiguous();
  const int64_t rows = x.size(0), V = x.size(1), k = idx.size(1);
  auto out = torch::empty({rows, k}, torch::kFloat32);
  const float inv = 1.0f / static_cast<float>(temperature);
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  const int64_t* ip = idx.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      if (bf16) probs_row(reinterpret_cast<const at::BFloat16*>(x.data_ptr()) + r * V, V, inv, ip + r * k, k, op + r * k);
      else probs_row(x.data_ptr<float>() + r * V, V, inv, ip + r * k, k, op + r * k);
    }
  });
  return out;
}

// row [V] bf16 or fp32 on the CPU, contiguous; the token, or -1 (above).
int64_t draw(torch::Tensor row, double temperature, double u) {
  TORCH_CHECK(row.dim() == 1 && row.device().is_cpu(), "draw: a row [V] on the CPU");
  TORCH_CHECK(row.scalar_type() == torch::kBFloat16 || row.scalar_type() == torch::kFloat32, "draw: bf16 or fp32");
  auto x = row.contiguous();
  if (x.scalar_type() == torch::kBFloat16)
    return draw_row(reinterpret_cast<const at::BFloat16*>(x.data_ptr()), x.size(0), static_cast<float>(temperature), u);
  return draw_row(x.data_ptr<float>(), x.size(0), static_cast<float>(temperature), u);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mm", &mm, "weight-only GEMM on GGUF-quantized weights with bf16 dot products, the same arithmetic for any row count",
        py::arg("x"), py::arg("packed"), py::arg("fmt"), py::call_guard<py::gil_scoped_release>());
  m.def("pack", &pack, "GGUF tensors' rows, side by side, repacked for mm: (packed, fmt)", py::arg("addresses"),
        py::arg("ns"), py::arg("row_bytes"), py::arg("k"), py::arg("type"), py::arg("int8") = false, py::arg("reference") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm", &add_rms_norm, "(x + delta, RMSNorm(x + delta) w) row by row in bf16", py::arg("x"),
        py::arg("delta"), py::arg("w"), py::arg("eps"));
  m.def("rope", &rope, "a q or k projection [m, heads * hd] rotated into [heads, m, hd], bf16", py::arg("y"),
        py::arg("cos"), py::arg("sin"), py::arg("heads"), py::arg("interleaved"));
  m.def("mm8", &mm8, "GEMM on GGUF-quantized weights with int8 activations quantized row by row (VPDPBUSD), the same arithmetic for any row count",
        py::arg("x"), py::arg("packed"), py::arg("fmt"), py::call_guard<py::gil_scoped_release>());
  m.def("supported8", &supported8, "whether this CPU's build has the int8-activation GEMM (AVX512-VNNI or AVX2)");
  m.def("isa8", &isa8, "the instructions the int8-activation GEMM is built on: AVX512-VNNI, AVX2 or empty");
  m.def("padded_rows", &padded_rows, "the row count a oneDNN-packed Linear runs m rows at (kernels/dense.padded_rows)");
  m.def("supported", &supported, "whether this CPU's build has the GEMM (AVX512-BF16)");
  m.def("draw", &draw, "a seeded draw from softmax(row / T) by a fixed-order inverse CDF at u (verify.coupled_choice)",
        py::arg("row"), py::arg("temperature"), py::arg("u"));
  m.def("probs_of", &probs_of, "per row of scores, the softmax(row / T) probabilities of the tokens ids names (drafting estimates)",
        py::arg("scores"), py::arg("ids"), py::arg("temperature"), py::call_guard<py::gil_scoped_release>());
  m.def("top_indices", &top_indices, "per row of scores, the k best indices as numpy's repeated argmax gives them",
        py::arg("scores"), py::arg("k"), py::call_guard<py::gil_scoped_release>());
  py::class_<Layers>(m, "Layers", "a forward's decoder layers in one call (model/compiled.py)")
      .def(py::init<std::vector<Maybe>, std::vector<std::string>, std::vector<torch::Tensor>, std::vector<std::string>,
                    std::vector<Maybe>, std::vector<int64_t>, Maybe, std::vector<int64_t>, int64_t, int64_t, int64_t,
                    double, bool, int64_t, bool, double, int64_t>())
      .def("size", &Layers::size)
      .def("forward", &Layers::forward, py::call_guard<py::gil_scoped_release>());
}

