// A 4-bit weight-only GEMM with bf16 dot products: see hdcli/engine/int4.py ("hd's GEMM").
//
// y[m, n] = sum over groups g of 32 k: d[n, g] * (sum over k in g of x[m, k] * q[n, k])
//                                     + lo[n, g] * (sum over k in g of x[m, k])
// which is sum over k of x[m, k] * (d q + lo): the GGUF's Q4_0/Q4_1 weights exactly (q in 0..15,
// an integer bf16 holds exactly; d and lo fp32), the activations as they come (bf16).
//
// Per output the arithmetic is fixed, whatever the number of rows M and wherever the row sits:
//   s1 = 0; for k-pairs p = 0..15 of the group in order: s1 = dpbf16(s1, (x[2p], x[2p+1]), (q, q'))
//   (VDPBF16PS: the two products exact in fp32, added to s1 in turn, each add rounded);
//   s0 = x[m, k] of the group summed in order in fp32 (scalar);
//   out = fma(s1, d, out); out = fma(s0, lo, out), group by group in order; y = bf16(out) (VCVTNEPS2BF16).
// Rows are computed side by side in tiles of up to 16 (a pair's weights are unpacked once a
// tile), but no sum crosses rows: a row's result is the same in any M, which keeps the M-invariant forward (engine/invariant.py) exact.
// Needs AVX512-BF16; without it the extension is not built (int4.py keeps torch's kernel).
//
// Layout (int4.py, hd_pack): packed [N/16][K/32][320 bytes], a block of 16 columns by a group of 32
// k, so that a block's weights are one stream: 16 pairs of 16 bytes, byte j of pair p holding lane
// j in its low nibble and lane j + 16 in its high one, lane L = (column L / 2 of the block,
// k = 32 g + 2 p + L % 2); then d and then lo of the 16 columns as fp16 (32 bytes each), which the
// GGUF's are exactly (Q4_0's lo = -8 d too). fp32 constants beside the codes were a third of the
// bytes read, and the one-token forward reads every weight from memory.
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr int64_t BYTES = 320;   // a (column block, group): 256 bytes of codes, 16 fp16 d, 16 fp16 lo
// Blocks ahead to ask the cache for: a tile of many rows computes long enough on a block that the
// hardware prefetcher alone left it waiting for the next one (AMD EPYC, the bundled model's 120
// GEMMs of a forward with every weight from memory: 16 rows 6.30 -> 4.87 ms, 8 rows 3.54 -> 2.99,
// 1 and 4 rows unchanged; 4 blocks ahead 4.91 ms at 16 rows, 16 ahead 5.24).
constexpr int64_t PREFETCH = 8;

// TR rows of one column block of 16. A VDPBF16PS takes 6 cycles to give its sum and two can
// start a cycle (AMD EPYC), so the TR rows' independent sums are what keeps the unit busy; a
// pair's weights are unpacked once for all of them.
template <int TR>
static inline void block(const uint16_t* x, int64_t K, const float* s0, int64_t G, const uint8_t* pk,
                         uint16_t* y, int64_t N, int64_t cb) {
  // bf16 bits of 0..15, twice (one table a 256-bit half)
  const __m512i table = _mm512_set_epi16(
      0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000,
      0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000);
  const __m256i low4 = _mm256_set1_epi16(0x0F);
  constexpr bool REG = TR <= 8;          // the running outputs in registers, else in L1 (32 registers in all)
  __m512 out[REG ? TR : 1];
  alignas(64) float outm[REG ? 16 : TR * 16];
  if constexpr (REG) {
    for (int r = 0; r < TR; ++r) out[r] = _mm512_setzero_ps();
  } else {
    std::memset(outm, 0, sizeof(outm));
  }
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* pg = pk + (cb * G + g) * BYTES;
    for (int l = 0; l < 5; ++l)   // its 320 bytes: 5 cache lines (past the end: a hint, never a fault)
      _mm_prefetch(reinterpret_cast<const char*>(pg + PREFETCH * BYTES + 64 * l), _MM_HINT_T0);
    __m512 s1[TR];
    for (int r = 0; r < TR; ++r) s1[r] = _mm512_setzero_ps();
    for (int p = 0; p < 16; ++p) {
      const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pg + p * 16)));
      const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(w, low4)), _mm256_srli_epi16(w, 4), 1);
      const __m512bh wb = (__m512bh)_mm512_permutexvar_epi16(q, table);
      for (int r = 0; r < TR; ++r) {
        uint32_t pair;
        std::memcpy(&pair, x + r * K + g * 32 + 2 * p, 4);
        s1[r] = _mm512_dpbf16_ps(s1[r], wb, (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)));
      }
    }
    // d and lo: fp16, exactly the GGUF's (fp32 of them is exact)
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pg + 256)));
    const __m512 lv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pg + 288)));
    for (int r = 0; r < TR; ++r) {
      __m512 o;
      if constexpr (REG) o = out[r]; else o = _mm512_load_ps(outm + r * 16);
      o = _mm512_fmadd_ps(s1[r], dv, o);
      o = _mm512_fmadd_ps(_mm512_set1_ps(s0[r * G + g]), lv, o);
      if constexpr (REG) out[r] = o; else _mm512_store_ps(outm + r * 16, o);
    }
  }
  for (int r = 0; r < TR; ++r) {   // to bf16, rounded to nearest even
    __m512 o;
    if constexpr (REG) o = out[r]; else o = _mm512_load_ps(outm + r * 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * N + cb * 16), (__m256i)_mm512_cvtneps_pbh(o));
  }
}

// block<rows> for rows 1..16
template <int TR = 1>
static inline void tile(int rows, const uint16_t* x, int64_t K, const float* s0, int64_t G, const uint8_t* pk,
                        uint16_t* y, int64_t N, int64_t cb) {
  if constexpr (TR < 16) {
    if (rows > TR) return tile<TR + 1>(rows, x, K, s0, G, pk, y, N, cb);
  }
  block<TR>(x, K, s0, G, pk, y, N, cb);
}

// x [M, K] bf16, packed as above. Returns [M, N] bf16.
torch::Tensor mm(torch::Tensor x, torch::Tensor packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "int4 GEMM: x must be [M, K] bf16");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous()
              && packed.size(2) == BYTES, "int4 GEMM: packed must be [N/16, K/32, 320] uint8");
  const int64_t M = x.size(0), K = x.size(1), G = K / 32, N = packed.size(0) * 16;
  TORCH_CHECK(K % 32 == 0 && packed.size(1) == G, "int4 GEMM: K must be 32 per group of the packing");
  auto xs = x.contiguous();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xs.data_ptr<at::BFloat16>());
  std::vector<float> s0(static_cast<size_t>(std::max<int64_t>(M, 1) * G));
  float* s0p = s0.data();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.0f;
      for (int k = 0; k < 32; ++k) {
        const uint32_t bits = static_cast<uint32_t>(xp[m * K + g * 32 + k]) << 16;
        float f;
        std::memcpy(&f, &bits, 4);
        s += f;
      }
      s0p[m * G + g] = s;
    }
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* pk = packed.data_ptr<uint8_t>();
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  // Tiles of up to 16 rows, as even as they go: each streams the weights once. (AMD EPYC, the
  // bundled model's products a forward, weights from memory: 16 rows in one tile 6.2 ms against
  // 6.9 in tiles of 8; groups of several column blocks a tile, for more sums in flight, were
  // faster on weights in cache and slower from memory, 2.6 ms against 1.55 at one row.)
  const int64_t tiles = (M + 15) / 16, NB = N / 16;
#pragma omp parallel for schedule(static) collapse(2)
  for (int64_t cb = 0; cb < NB; ++cb)
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t m0 = t * M / tiles, m1 = (t + 1) * M / tiles;
      tile(static_cast<int>(m1 - m0), xp + m0 * K, K, s0p + m0 * G, G, pk, yp + m0 * N, N, cb);
    }
  return y;
}
#else
torch::Tensor mm(torch::Tensor x, torch::Tensor packed) {
  TORCH_CHECK(false, "int4 GEMM: built without AVX512-BF16");
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
  m.def("mm", &mm, "4-bit weight-only GEMM with bf16 dot products, the same arithmetic for any row count", py::call_guard<py::gil_scoped_release>());
  m.def("supported", &supported, "whether this CPU's build has the GEMM (AVX512-BF16)");
}
