// Weight-only GEMMs on a GGUF's quantized weights, kept in (nearly) their own bits: see
// hdcli/engine/quants.py. csrc/int4mm.cpp generalised from Q4_0/Q4_1 to Q8_0 and the K-quants
// Q4_K, Q5_K and Q6_K.
//
// y[m, n] = sum over groups g of GK k: scale[n, g] * (sum over k in g of x[m, k] * q[n, k])
//                                      + low[n, g] * (sum over k in g of x[m, k])
// which is sum over k of x[m, k] * (scale q + low): the GGUF's weights exactly (q an integer of
// at most 8 bits, which a bf16 holds exactly; scale and low exact in fp32), the activations as
// they come (bf16). The formats (quants.py's `pack` makes them):
//   "q4h"  4-bit codes 0..15, fp16 scale and low, GK 32 (Q4_0: d, -8 d; Q4_1: d, m): int4mm's
//          layout and arithmetic, byte for byte;
//   "q4f"  the same codes, fp32 scale and low, GK 32 (Q4_K: d sc and -dmin m, exact in fp32 but
//          not in fp16);
//   "q8s"  int8 codes, fp32 scale, no low, GK 32 (Q8_0: d) or 16 (Q6_K: q - 32 in -32..31, d sc);
//   "q8f"  int8 codes, fp32 scale and low, GK 32 (Q5_K: 0..31, d sc and -dmin m).
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
// (engine/invariant.py) exact. Needs AVX512-BF16; without it the extension has no GEMM
// (`supported()` false) and quants.py dequantizes to bf16 instead.
//
// Layout: packed [N/16][K/GK][BYTES] uint8, a block of 16 columns by a group of GK k, so that a
// block's weights are one stream read front to back: GK/2 pairs of codes, lane L of a pair =
// (column L / 2 of the block, k = GK g + 2 p + L % 2), then the 16 columns' scales, then (if the
// format has one) their lows. A 4-bit pair is 16 bytes, byte j holding lane j in its low nibble
// and lane j + 16 in its high one (int4mm's); an 8-bit pair is 32 bytes, byte L lane L.
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// Blocks ahead to ask the cache for (int4mm's measurement: a tile of many rows computes long
// enough on a block that the hardware prefetcher alone left it waiting for the next one).
constexpr int64_t PREFETCH = 8;

// A format: W bits a code (4 or 8), GK k a group, the block constants of type C (uint16_t: fp16
// bits, or float), with or without a low.
template <int W_, int GK_, typename C_, bool LOW_>
struct Fmt {
  static constexpr int W = W_, GK = GK_;
  using C = C_;
  static constexpr bool LOW = LOW_;
  static constexpr int PAIRS = GK / 2;
  static constexpr int PAIR_BYTES = W == 4 ? 16 : 32;
  static constexpr int64_t CODES = PAIRS * PAIR_BYTES;
  static constexpr int64_t CONSTS = 16 * static_cast<int64_t>(sizeof(C));
  static constexpr int64_t BYTES = CODES + CONSTS * (LOW ? 2 : 1);
  static_assert(BYTES % 64 == 0, "a block is whole cache lines");
};

// 16 constants of a block as fp32 (fp16 ones are exact in fp32)
template <typename C>
static inline __m512 consts(const uint8_t* p) {
  if constexpr (sizeof(C) == 2)
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  else
    return _mm512_loadu_ps(p);
}

// A pair's 32 codes as bf16 (exact: integers of at most 8 significant bits), lane L of the pair
// in lane L.
template <typename F>
static inline __m512bh codes(const uint8_t* pair) {
  if constexpr (F::W == 4) {
    // bf16 bits of 0..15, twice (one table a 256-bit half), picked by VPERMW
    const __m512i table = _mm512_set_epi16(
        0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000,
        0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000);
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair)));
    const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(w, _mm256_set1_epi16(0x0F))),
                                         _mm256_srli_epi16(w, 4), 1);
    return (__m512bh)_mm512_permutexvar_epi16(q, table);
  } else {
    // int8 -> int32 -> fp32 -> bf16, each step exact; VCVTNE2PS2BF16 puts its second operand in lanes 0..15
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair))));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);
  }
}

// GI groups g.. of TR rows of column block cb, added to the rows' running outputs (out: in
// registers, or outm: in L1). Each group's s1 is its own chain of VDPBF16PS, so GI groups side by
// side are GI x TR independent sums in flight; the outputs still take the groups in order.
template <typename F, int TR, int GI, bool REG>
static inline __attribute__((always_inline)) void groups(const uint16_t* x, const float* s0, int64_t G,
                                                         const uint8_t* pk, int64_t cb, int64_t g,
                                                         __m512* out, float* outm) {
  constexpr int GK = F::GK;
  const uint8_t* pg = pk + (cb * G + g) * F::BYTES;
  for (int l = 0; l < GI * F::BYTES / 64; ++l)   // past the end: a hint, never a fault
    _mm_prefetch(reinterpret_cast<const char*>(pg + PREFETCH * F::BYTES + 64 * l), _MM_HINT_T0);
  __m512 s1[GI][TR];
  for (int i = 0; i < GI; ++i)
    for (int r = 0; r < TR; ++r) s1[i][r] = _mm512_setzero_ps();
  for (int p = 0; p < F::PAIRS; ++p)
    for (int i = 0; i < GI; ++i) {
      const __m512bh wb = codes<F>(pg + i * F::BYTES + p * F::PAIR_BYTES);
      for (int r = 0; r < TR; ++r) {
        uint32_t pair;
        std::memcpy(&pair, x + ((g + i) * TR + r) * GK + 2 * p, 4);
        s1[i][r] = _mm512_dpbf16_ps(s1[i][r], wb, (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)));
      }
    }
  for (int i = 0; i < GI; ++i) {
    const uint8_t* pc = pg + i * F::BYTES + F::CODES;
    const __m512 dv = consts<typename F::C>(pc);
    __m512 lv = _mm512_setzero_ps();
    if constexpr (F::LOW) lv = consts<typename F::C>(pc + F::CONSTS);
    for (int r = 0; r < TR; ++r) {
      __m512 o;
      if constexpr (REG) o = out[r]; else o = _mm512_load_ps(outm + r * 16);
      o = _mm512_fmadd_ps(s1[i][r], dv, o);
      if constexpr (F::LOW) o = _mm512_fmadd_ps(_mm512_set1_ps(s0[r * G + g + i]), lv, o);
      if constexpr (REG) out[r] = o; else _mm512_store_ps(outm + r * 16, o);
    }
  }
}

// Groups side by side for few rows: a row's chain of VDPBF16PS waits 6 cycles on each sum and
// two can start a cycle (AMD EPYC), so a tile's TR rows and GI groups are what keeps the unit
// busy. Two groups for up to 4 rows (N = K = 2048, one thread, 1 row: Q4_0 149 -> 130 us, Q5_K
// 180 -> 181, 4 rows: Q4_0 234 -> 223 us; four groups for 1-2 rows were no faster for 4-bit codes
// and slower for 8-bit ones, Q5_K 192 us; 8 rows and more no faster).
constexpr int interleave(int TR) { return TR <= 4 ? 2 : 1; }

// TR rows of one column block of 16. x: the tile's rows interleaved by group, [G][TR][GK] (`run`);
// s0 [TR][G].
template <typename F, int TR>
static inline void block(const uint16_t* x, const float* s0, int64_t G, const uint8_t* pk,
                         uint16_t* y, int64_t N, int64_t cb) {
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
  for (; g + GI <= G; g += GI) groups<F, TR, GI, REG>(x, s0, G, pk, cb, g, out, outm);
  for (; g < G; ++g) groups<F, TR, 1, REG>(x, s0, G, pk, cb, g, out, outm);
  for (int r = 0; r < TR; ++r) {   // to bf16, rounded to nearest even
    __m512 o;
    if constexpr (REG) o = out[r]; else o = _mm512_load_ps(outm + r * 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * N + cb * 16), (__m256i)_mm512_cvtneps_pbh(o));
  }
}

// block<rows> for rows 1..16
template <typename F, int TR = 1>
static inline void tile(int rows, const uint16_t* x, const float* s0, int64_t G, const uint8_t* pk,
                        uint16_t* y, int64_t N, int64_t cb) {
  if constexpr (TR < 16) {
    if (rows > TR) return tile<F, TR + 1>(rows, x, s0, G, pk, y, N, cb);
  }
  block<F, TR>(x, s0, G, pk, y, N, cb);
}

template <typename F>
static torch::Tensor run(const torch::Tensor& x, const torch::Tensor& packed) {
  constexpr int GK = F::GK;
  const int64_t M = x.size(0), K = x.size(1), G = K / GK, N = packed.size(0) * 16;
  TORCH_CHECK(packed.size(2) == F::BYTES, "GGUF GEMM: the packing's blocks are ", packed.size(2),
              " bytes, the format's ", F::BYTES);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* pk = packed.data_ptr<uint8_t>();
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  // Tiles of up to 16 rows, as even as they go: each streams the weights once (int4mm's choice).
  const int64_t tiles = (M + 15) / 16, NB = N / 16;
  std::vector<int64_t> first(static_cast<size_t>(M)), height(static_cast<size_t>(M));   // a row's tile
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t m = t * M / tiles; m < (t + 1) * M / tiles; ++m) {
      first[m] = t * M / tiles;
      height[m] = (t + 1) * M / tiles - t * M / tiles;
    }
  // Each tile's rows interleaved by group ([G][rows][GK]), so that a group's x is a few
  // consecutive cache lines: rows K apart, with K a power of 2 (2048), fall in one L1 set, and 16 of
  // them overran its ways (AMD EPYC, N = K = 2048, 16 rows, one thread: 688 us against 1556 in int4mm's
  // layout). One row is its own layout already.
  std::vector<uint16_t> xt(M > 1 ? static_cast<size_t>(M * K) : 0);
  uint16_t* xtp = M > 1 ? xt.data() : const_cast<uint16_t*>(xp);
  std::vector<float> s0(F::LOW ? static_cast<size_t>(M * G) : 0);
  float* s0p = s0.data();
  // A group of a row: its copy into the tile's layout and its sum (in order).
  auto prepare = [&](int64_t i) {
    const int64_t m = i / G, g = i % G;
    const uint16_t* xg = xp + m * K + g * GK;
    if (M > 1)
      std::memcpy(xtp + first[m] * K + (g * height[m] + m - first[m]) * GK, xg, GK * sizeof(uint16_t));
    if constexpr (F::LOW) {
      float s = 0.0f;
      for (int k = 0; k < GK; ++k) {
        const uint32_t bits = static_cast<uint32_t>(xg[k]) << 16;
        float f;
        std::memcpy(&f, &bits, 4);
        s += f;
      }
      s0p[i] = s;
    }
  };
  // A few thousand x (a decode step's row) are prepared before the threads start (a microsecond
  // or two), more by the threads before the tiles: a barrier more, which costs most where the
  // threads share the cores with other work.
  const bool any = M > 1 || F::LOW, alone = M * K <= 4096;
  if (any && alone)
    for (int64_t i = 0; i < M * G; ++i) prepare(i);
#pragma omp parallel
  {
    if (any && !alone) {
#pragma omp for schedule(static)
      for (int64_t i = 0; i < M * G; ++i) prepare(i);
    }
#pragma omp for schedule(static) collapse(2)
    for (int64_t cb = 0; cb < NB; ++cb)
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t m0 = t * M / tiles, m1 = (t + 1) * M / tiles;
        tile<F>(static_cast<int>(m1 - m0), xtp + m0 * K, s0p + m0 * G, G, pk, yp + m0 * N, N, cb);
      }
  }
  return y;
}

// x [M, K] bf16, packed [N/16, K/GK, BYTES] uint8 in format fmt (above). Returns [M, N] bf16.
torch::Tensor mm(torch::Tensor x, torch::Tensor packed, const std::string& fmt) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "GGUF GEMM: x must be [M, K] bf16");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(),
              "GGUF GEMM: packed must be [N/16, K/GK, bytes] uint8, contiguous");
  const int64_t K = x.size(1), G = packed.size(1);
  TORCH_CHECK(G > 0 && K % G == 0, "GGUF GEMM: K = ", K, " is not a whole number of the packing's ", G, " groups");
  const int64_t GK = K / G;
  auto xs = x.contiguous();
  if (fmt == "q4h" && GK == 32) return run<Fmt<4, 32, uint16_t, true>>(xs, packed);
  if (fmt == "q4f" && GK == 32) return run<Fmt<4, 32, float, true>>(xs, packed);
  if (fmt == "q8s" && GK == 32) return run<Fmt<8, 32, float, false>>(xs, packed);
  if (fmt == "q8s" && GK == 16) return run<Fmt<8, 16, float, false>>(xs, packed);
  if (fmt == "q8f" && GK == 32) return run<Fmt<8, 32, float, true>>(xs, packed);
  TORCH_CHECK(false, "GGUF GEMM: no format ", fmt, " with groups of ", GK);
  return x;
}
#else
torch::Tensor mm(torch::Tensor x, torch::Tensor packed, const std::string& fmt) {
  TORCH_CHECK(false, "GGUF GEMM: built without AVX512-BF16");
  return x;
}
#endif

bool supported() {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mm", &mm, "weight-only GEMM on GGUF-quantized weights with bf16 dot products, the same arithmetic for any row count",
        py::arg("x"), py::arg("packed"), py::arg("fmt"), py::call_guard<py::gil_scoped_release>());
  m.def("supported", &supported, "whether this CPU's build has the GEMM (AVX512-BF16)");
}
