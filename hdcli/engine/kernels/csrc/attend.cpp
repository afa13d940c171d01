// The M-invariant attention as one compiled function: see hdcli/engine/kernels/fused.py.
//
// Per query row (token r, head h) the arithmetic is fixed:
//   score_j = scale * sum over i = 0..d-1 of q[i] * k_j[i], summed in that order;
//   p_j     = exp(score_j - max over the keys the row sees), 0 for keys it does not see;
//   out     = (sum over j in index order of p_j * v_j) / (sum over j in the same order of p_j).
// Rows are computed side by side in tiles of TR rows and keys in blocks of KB (one vector of
// scores), for vector throughput, but no sum ever crosses rows or changes order with the tile,
// and unseen keys add exact zeros: a row's result is the same in any tile, for any number of
// rows, and alone. That is what makes it M-invariant, for chains, trees and sliding windows alike.
//
// Keys and values are stored as fp32 or as bf16 (a bf16 model's keys and values are bf16 to begin
// with, so keeping them so is exact and halves what the attention reads); either is widened to
// fp32 as it is read, so a row's arithmetic is the same whichever way its keys are stored.
//
// Built with -ffp-contract=off and no -ffast-math: a product and a sum round separately, in
// vector and scalar code alike, and no sum is reordered. Vectors are GCC/Clang vector extensions
// of VW floats: 16 (one AVX-512 register) where the build has AVX-512, else 8 (one AVX2
// register). The width is chosen at compile time because GCC lowers a vector wider than the
// machine's registers to memory: built for AVX2 (-march=x86-64-v3), 16-float vectors made this
// kernel 7.7x slower than its AVX-512 build (986 stack accesses in one tile against 128; 135M,
// as AVX2 on a Zen 5). A key block stays 16 keys (the cache's transposed layout, KB), scored as
// KB / VW vectors; the sums over the values run over the head in chunks of columns that fit the
// registers (REGS accumulators), every chunk over all keys in key order. Each element's
// arithmetic is the same at either width and in any chunk: both builds give the same bits.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
constexpr int VW = 16;       // floats a vector
constexpr int REGS = 24;     // value accumulators a tile keeps in registers (32 zmm)
#else
constexpr int VW = 8;
constexpr int REGS = 12;     // of 16 ymm: the rest hold the values being read and p_j
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef uint8_t vb __attribute__((vector_size(VW)));
typedef uint16_t vh __attribute__((vector_size(VW * 2)));
constexpr int KB = 16;       // keys a block (the transposed keys' layout: kvcache.InvariantLayer.transposed)
constexpr int NV = KB / VW;  // vectors of scores a block
constexpr int MAX_D = 271;   // head size (fused.MAX_HEAD: fused.py falls back above)

// exp(x) for x <= 0 (a score minus the row's max): 2^k * e^r, k = round(x / ln 2), |r| <= ln 2 / 2,
// e^r by its Taylor polynomial of degree 7 (relative error < 1e-8 there); 0 below -87 (under
// FLT_MIN) and for -inf (a key the row does not see).
static inline float exp_nonpositive(float x) {
  const float magic = 12582912.0f;                  // 1.5 * 2^23: adding it rounds to an integer
  float t = x * 1.44269504088896341f + magic;
  float kf = t - magic;
  int32_t tb;
  std::memcpy(&tb, &t, 4);
  int32_t magic_bits;
  std::memcpy(&magic_bits, &magic, 4);
  int32_t k = tb - magic_bits;
  float r = x - kf * 0.693145751953125f;            // ln 2, high part (exact product for |k| < 2^11)
  r = r - kf * 1.428606765330187045e-06f;           // ln 2, low part
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t sb = ((x < -87.0f ? 0 : k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &sb, 4);
  return x < -87.0f ? 0.0f : p * scale;
}

// Stored keys and values: float, or bf16 as its 16 bits (uint16_t). Widening bf16 to fp32 is
// exact (the bits move up 16 places); narrowing rounds to nearest even, as torch does, and is
// exact for values that came from bf16.
static inline vf loadv(const float* p) {
  vf x;
  std::memcpy(&x, p, sizeof(vf));
  return x;
}
static inline vf loadv(const uint16_t* p) {
  vh h;
  std::memcpy(&h, p, sizeof(vh));
  const vi w = __builtin_convertvector(h, vi) << 16;
  vf x;
  std::memcpy(&x, &w, sizeof(vf));
  return x;
}
static inline float widen(float x) { return x; }
static inline float widen(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  float x;
  std::memcpy(&x, &w, 4);
  return x;
}
template <typename S> static inline S narrow(float x);
template <> inline float narrow<float>(float x) { return x; }
template <> inline uint16_t narrow<uint16_t>(float x) { return c10::BFloat16(x).x; }

// One sequence's attention: its rows of q and out start at row0. k, kt and v are stored as
// float or, where bf16, as uint16_t (one type a sequence).
struct Args {
  const float* q;            // [M, hq, d]
  const void *k, *kt, *v;    // k [hkv, >= n, d]; kt [hkv, >= nb, d, KB]: keys transposed by block; v [hkv, >= n, d + 1]
  bool bf16;
  const bool* vis;           // [m, n]
  float* out;                // [M, hq, d]
  int64_t row0, m, hq, d, hkv, g, n, nb, ks0, ks1, kts0, vs0, vs1, kt_from;
  float scale;
};

// Columns c0 * VW .. (c0 + W) * VW - 1 of a tile's outputs: for each of its rows, the sum over
// the keys jlo .. jhi - 1 in key order of p_j * v_j, over the sum of p (total). SUM: the first
// call also sums p, in the same key order, into total (one pass less over p).
template <int TR, int W, bool SUM, typename S>
static inline void values(const Args& A, int64_t kv, int64_t c0, int64_t jlo, int64_t jhi, const float* p,
                          float* total, float* const* orow, int64_t tr) {
  const int64_t nbk = A.nb * KB;
  vf o[TR][W];
  float t[TR];
  for (int a = 0; a < TR; ++a) {
    t[a] = 0.0f;
    for (int c = 0; c < W; ++c) o[a][c] = vf{};
  }
  for (int64_t j = jlo; j < jhi; ++j) {
    const S* vj = static_cast<const S*>(A.v) + kv * A.vs0 + j * A.vs1 + c0 * VW;
    vf vv[W];
    for (int c = 0; c < W; ++c) vv[c] = loadv(vj + c * VW);
    for (int a = 0; a < TR; ++a) {
      const float pj = p[a * nbk + j];
      if constexpr (SUM) t[a] += pj;
      for (int c = 0; c < W; ++c) o[a][c] += pj * vv[c];
    }
  }
  if constexpr (SUM)
    for (int a = 0; a < TR; ++a) total[a] = t[a];
  for (int a = 0; a < tr; ++a)
    for (int c = 0; c < W; ++c)
      for (int l = 0; l < VW; ++l) orow[a][(c0 + c) * VW + l] = o[a][c][l] / total[a];
}

// Query rows x0 .. x0 + TR - 1 of kv head kv (row x: token x / g, head kv * g + x % g); rows past
// `rows` repeat the last one and are not written. p: TR * nb * KB floats of scratch. DV: the head
// size in vectors where it is known at compile time (64, 128, 256), 0 for any other: with it the
// sums over the values stay in registers (without, they went through memory and the call took
// 1.4-1.8x as long: 4 requests of 4 tokens, 72 against 123 us a layer, AMD EPYC, AVX-512).
template <int TR, int DV, typename S>
static void tile(const Args& A, int64_t kv, int64_t x0, int64_t rows, float* p) {
  const int64_t tr = rows - x0 < TR ? rows - x0 : TR;
  const int64_t d = A.d, n = A.n, nb = A.nb;
  const float* qr[TR];
  const bool* vr[TR];
  float* orow[TR];
  for (int a = 0; a < TR; ++a) {
    const int64_t x = x0 + (a < tr ? a : tr - 1), r = x / A.g, h = kv * A.g + x % A.g;
    qr[a] = A.q + ((A.row0 + r) * A.hq + h) * d;
    vr[a] = A.vis + r * n;
    orow[a] = A.out + ((A.row0 + r) * A.hq + h) * d;
  }
  float mx[TR];
  const vf neg_inf = vf{} - INFINITY;
  vf vmx[TR][NV];                                    // the max over whole blocks, lane by lane
  for (int a = 0; a < TR; ++a) {
    mx[a] = -INFINITY;
    for (int u = 0; u < NV; ++u) vmx[a][u] = neg_inf;
  }
  int64_t jlo = n, jhi = 0;                          // the keys any row of the tile sees
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * KB, hi = lo + KB < n ? lo + KB : n;
    bool any = false;
    if (hi - lo == KB) {
      uint64_t seen = 0;
      for (int a = 0; a < TR; ++a) {
        uint64_t w[2];
        std::memcpy(w, vr[a] + lo, sizeof(w));
        seen |= w[0] | w[1];
      }
      any = seen != 0;
    } else {
      for (int a = 0; a < TR; ++a)
        for (int64_t j = lo; j < hi; ++j) any |= vr[a][j];
    }
    if (!any) continue;                              // a block no row of the tile sees
    // blocks no row saw between seen ones (token trees) score -inf; those before the first seen
    // block and after the last are never read (a prompt's rows see a prefix of its keys: most
    // of a long prompt's blocks are past a tile's rows)
    for (int64_t j = jhi > 0 ? jhi : lo; j < lo; ++j)
      for (int a = 0; a < TR; ++a) p[a * nb * KB + j] = -INFINITY;
    jlo = lo < jlo ? lo : jlo;
    jhi = hi;
    const S* kb = static_cast<const S*>(A.kt) + kv * A.kts0 + b * d * KB;
    vf acc[TR][NV];
    for (int a = 0; a < TR; ++a)
      for (int u = 0; u < NV; ++u) acc[a][u] = vf{};
    for (int64_t i = 0; i < (DV ? DV * VW : d); ++i) {   // each score: its d products summed in order
      vf kv_[NV];
      for (int u = 0; u < NV; ++u) kv_[u] = loadv(kb + i * KB + u * VW);
      for (int a = 0; a < TR; ++a) {
        const float qi = qr[a][i];
        for (int u = 0; u < NV; ++u) acc[a][u] += qi * kv_[u];
      }
    }
    if (hi - lo == KB) {                             // a whole block: its 16 scores in vector ops
      for (int a = 0; a < TR; ++a)
        for (int u = 0; u < NV; ++u) {
          vb seen;
          std::memcpy(&seen, vr[a] + lo + u * VW, sizeof(vb));
          const vf s = __builtin_convertvector(seen, vi) != 0 ? acc[a][u] * A.scale : neg_inf;
          std::memcpy(p + a * nb * KB + lo + u * VW, &s, sizeof(vf));
          vmx[a][u] = s > vmx[a][u] ? s : vmx[a][u];
        }
    } else {
      for (int a = 0; a < TR; ++a)
        for (int64_t j = lo; j < hi; ++j) {
          const int64_t l = j - lo;
          const float s = vr[a][j] ? acc[a][l / VW][l % VW] * A.scale : -INFINITY;
          p[a * nb * KB + j] = s;
          mx[a] = s > mx[a] ? s : mx[a];
        }
    }
  }
  for (int a = 0; a < TR; ++a)                      // a max is the same in any order
    for (int u = 0; u < NV; ++u)
      for (int l = 0; l < VW; ++l) mx[a] = vmx[a][u][l] > mx[a] ? vmx[a][u][l] : mx[a];
  for (int a = 0; a < TR; ++a) {
    float* pa = p + a * nb * KB;
    for (int64_t j = jlo; j < jhi; ++j) pa[j] = exp_nonpositive(pa[j] - mx[a]);   // unseen: -inf -> 0
  }
  // the values: out[c] = sum over j in key order of p_j * v_j[c], W vectors of columns at a time
  // (their TR x W sums in registers): chunks of CH, as wide as the registers allow and as even as
  // the head allows (a chunk wider than the head did W - DV vectors of work for nothing: 1.6x the
  // time at 1.7B, one row a tile), what is left in chunks of 8, 4, 2, 1, then the scalar tail
  constexpr int CHR = REGS / TR < 1 ? 1 : REGS / TR;
  constexpr int CH = DV ? DV / ((DV + CHR - 1) / CHR) : CHR;
  const int64_t dv = DV ? DV : d / VW, dt = DV ? 0 : d - dv * VW;
  float total[TR];                                   // the sum of p in key order, by the first chunk
  int64_t c0 = 0;
  if (dv >= CH) values<TR, CH, true, S>(A, kv, 0, jlo, jhi, p, total, orow, tr), c0 = CH;
  else {                                             // a head narrower than a chunk (no DV)
    for (int a = 0; a < TR; ++a) {
      float t = 0.0f;
      for (int64_t j = jlo; j < jhi; ++j) t += p[a * nb * KB + j];
      total[a] = t;
    }
  }
  for (; c0 + CH <= dv; c0 += CH) values<TR, CH, false, S>(A, kv, c0, jlo, jhi, p, total, orow, tr);
  if constexpr (CH > 8) for (; c0 + 8 <= dv; c0 += 8) values<TR, 8, false, S>(A, kv, c0, jlo, jhi, p, total, orow, tr);
  if constexpr (CH > 4) if (c0 + 4 <= dv) values<TR, 4, false, S>(A, kv, c0, jlo, jhi, p, total, orow, tr), c0 += 4;
  if constexpr (CH > 2) if (c0 + 2 <= dv) values<TR, 2, false, S>(A, kv, c0, jlo, jhi, p, total, orow, tr), c0 += 2;
  if constexpr (CH > 1) if (c0 + 1 <= dv) values<TR, 1, false, S>(A, kv, c0, jlo, jhi, p, total, orow, tr), c0 += 1;
  if (dt > 0) {
    float ot[TR][VW];
    for (int a = 0; a < TR; ++a)
      for (int64_t i = 0; i < dt; ++i) ot[a][i] = 0.0f;
    for (int64_t j = jlo; j < jhi; ++j) {
      const S* vt = static_cast<const S*>(A.v) + kv * A.vs0 + j * A.vs1 + dv * VW;
      for (int a = 0; a < TR; ++a) {
        const float pj = p[a * nb * KB + j];
        for (int64_t i = 0; i < dt; ++i) ot[a][i] += pj * widen(vt[i]);
      }
    }
    for (int a = 0; a < tr; ++a)
      for (int64_t i = 0; i < dt; ++i) orow[a][dv * VW + i] = ot[a][i] / total[a];
  }
}

template <int DV, typename S>
static void run(int tr, const Args& A, int64_t kv, int64_t x0, int64_t rows, float* p) {
  if (tr == 6) tile<6, DV, S>(A, kv, x0, rows, p);
  else if (tr == 4) tile<4, DV, S>(A, kv, x0, rows, p);
  else if (tr == 3) tile<3, DV, S>(A, kv, x0, rows, p);
  else if (tr == 2) tile<2, DV, S>(A, kv, x0, rows, p);
  else tile<1, DV, S>(A, kv, x0, rows, p);
}

template <typename S>
static void run_any(int tr, const Args& A, int64_t kv, int64_t x0, int64_t rows, float* p) {
  if (A.d == 64) run<64 / VW, S>(tr, A, kv, x0, rows, p);
  else if (A.d == 128) run<128 / VW, S>(tr, A, kv, x0, rows, p);
  else if (A.d == 256) run<256 / VW, S>(tr, A, kv, x0, rows, p);
  else run<0, S>(tr, A, kv, x0, rows, p);
}

// kt[kv][b][i][l] = k[kv][b * KB + l][i] for the keys from kt_from on, 0 past n.
template <typename S>
static void transpose_block(const Args& A, int64_t kv, int64_t b) {
  const int64_t d = A.d;
  S* dst = const_cast<S*>(static_cast<const S*>(A.kt)) + kv * A.kts0 + b * d * KB;
  const int64_t lo = b * KB > A.kt_from ? b * KB : A.kt_from;
  for (int64_t j = lo; j < (b + 1) * KB; ++j) {
    const int64_t l = j - b * KB;
    const S* row = static_cast<const S*>(A.k) + kv * A.ks0 + j * A.ks1;
    for (int64_t i = 0; i < d; ++i) dst[i * KB + l] = j < A.n ? row[i] : S(0);
  }
}

// The sequences' attention, their Args filled in (all but q, out, row0): one parallel region,
// the transposed copies brought up to date first, then tiles of all sequences shared out
// dynamically among the threads. q [M, hq, d] fp32 contiguous; returns [M, hq, d] fp32.
// A tile height forced from outside (0: chosen per call, below).
static int forced_tile = 0;
void set_tile(int64_t tr) { forced_tile = static_cast<int>(tr); }

static torch::Tensor attend_seqs(const torch::Tensor& q, std::vector<Args>& seqs) {
  const int64_t hq = q.size(1), d = q.size(2);
  TORCH_CHECK(d <= MAX_D, "fused attention: head size above 271");
  auto out = torch::empty_like(q);
  struct Job { int64_t s, kv, b; };                 // a block of keys to transpose
  std::vector<Job> moves;
  int64_t row0 = 0;
  for (size_t s = 0; s < seqs.size(); ++s) {
    Args& A = seqs[s];
    A.q = q.data_ptr<float>(); A.out = out.data_ptr<float>(); A.row0 = row0; A.hq = hq; A.d = d;
    A.g = hq / A.hkv; A.nb = (A.n + KB - 1) / KB;
    A.kt_from = A.kt_from < 0 ? 0 : (A.kt_from > A.n ? A.n : A.kt_from);
    for (int64_t kv = 0; kv < A.hkv; ++kv)
      for (int64_t b = A.kt_from / KB; b < A.nb; ++b) moves.push_back({(int64_t)s, kv, b});
    row0 += A.m;
  }
  TORCH_CHECK(row0 == q.size(0), "fused attention: q's rows are not the sequences' rows");
  // tile height: of 6 (head size up to 64: its 6 x 4 sums over the values fit the registers), 4,
  // 3, 2, 1 rows, among those that make a tile for each thread at least, the one that repeats the
  // fewest rows to fill its tiles, the taller on a tie (one token: g rows a kv head, 3 in the
  // bundled model; 2 tokens: 6). A tile reads its kv head's keys and values once, so taller tiles
  // read less: 4 requests of 2 tokens (bundled model, AMD EPYC) 85 us a layer in tiles of 3, 68 in
  // tiles of 6. It changes how rows share the loops, never a row's arithmetic: set_tile (fused.py
  // passes HD_FUSED_TILE) forces a height, for tests (tests/test_invariant.py) and timing.
  const int64_t threads = at::get_num_threads();
  int tr = 1;
  int64_t least = -1;
  const int forced = forced_tile;
  const int tallest = d <= 64 ? 6 : 4;
  for (int c : {6, 4, 3, 2, 1}) {                   // the heights run() has
    if (c > tallest) continue;
    if (c == forced) { tr = c; break; }
    int64_t count = 0, waste = 0;
    for (auto& A : seqs) {
      const int64_t t = (A.m * A.g + c - 1) / c;
      count += A.hkv * t;
      waste += A.hkv * (t * c - A.m * A.g);
    }
    if ((count >= threads || c == 1) && (least < 0 || waste < least)) { tr = c; least = waste; }
  }
  struct Tile { int64_t s, kv, x0; };
  std::vector<Tile> tiles;
  for (size_t s = 0; s < seqs.size(); ++s)
    for (int64_t kv = 0; kv < seqs[s].hkv; ++kv)
      for (int64_t x0 = 0; x0 < seqs[s].m * seqs[s].g; x0 += tr) tiles.push_back({(int64_t)s, kv, x0});
  const int64_t nmoves = moves.size(), ntiles = tiles.size();
  int64_t pmax = 0;
  for (auto& A : seqs) pmax = A.nb > pmax ? A.nb : pmax;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < nmoves; ++t) {
      const Job& J = moves[t];
      const Args& A = seqs[J.s];
      if (A.bf16) transpose_block<uint16_t>(A, J.kv, J.b);
      else transpose_block<float>(A, J.kv, J.b);
    }
    std::vector<float> p(6 * pmax * KB);
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < ntiles; ++t) {
      const Tile& T = tiles[t];
      const Args& A = seqs[T.s];
      if (A.bf16) run_any<uint16_t>(tr, A, T.kv, T.x0, A.m * A.g, p.data());
      else run_any<float>(tr, A, T.kv, T.x0, A.m * A.g, p.data());
    }
  }
  return out;
}

static bool stored_bf16(const torch::Tensor& t) {
  TORCH_CHECK(t.dtype() == torch::kFloat || t.dtype() == torch::kBFloat16, "fused attention: keys and values are fp32 or bf16");
  return t.dtype() == torch::kBFloat16;
}

// Several sequences' attention in one call. q [M, hq, d] fp32 contiguous: sequence s's m_s rows
// follow the rows of the sequences before it. Per sequence s, in one dtype (fp32 or bf16):
//   k[s]   [hkv, >= n, d], rows contiguous: its keys;
//   kt[s]  [hkv, >= ceil(n / KB), d, KB] contiguous: the same keys transposed by block, valid
//          for the first kt_len[s] keys; this call writes keys kt_len[s] .. n - 1 into it (the
//          caller then holds n valid). An undefined kt[s]: a scratch copy, transposed whole;
//   v1[s]  [hkv, >= n, d + 1], rows contiguous: [V | 1];
//   vis[s] [m_s, n] bool contiguous: the keys each row sees (every row sees one at least).
// Returns [M, hq, d] fp32.
torch::Tensor attend_many(torch::Tensor q, std::vector<torch::Tensor> k, std::vector<c10::optional<torch::Tensor>> kt,
                          std::vector<int64_t> kt_len, std::vector<torch::Tensor> v1, std::vector<torch::Tensor> vis,
                          double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat && q.is_contiguous() && q.dim() == 3);
  const size_t ns = k.size();
  TORCH_CHECK(kt.size() == ns && kt_len.size() == ns && v1.size() == ns && vis.size() == ns);
  const int64_t d = q.size(2);
  std::vector<Args> seqs(ns);
  std::vector<torch::Tensor> scratch(ns);
  for (size_t s = 0; s < ns; ++s) {
    Args& A = seqs[s];
    A.bf16 = stored_bf16(k[s]);
    TORCH_CHECK(v1[s].dtype() == k[s].dtype() && vis[s].dtype() == torch::kBool);
    TORCH_CHECK(k[s].stride(2) == 1 && v1[s].stride(2) == 1 && vis[s].is_contiguous());
    A.m = vis[s].size(0); A.n = vis[s].size(1); A.hkv = k[s].size(0);
    TORCH_CHECK(k[s].size(1) >= A.n && v1[s].size(1) >= A.n && k[s].size(2) == d && v1[s].size(2) == d + 1);
    const int64_t nb = (A.n + KB - 1) / KB;
    A.kt_from = kt_len[s];
    torch::Tensor t;
    if (kt[s].has_value() && kt[s]->defined()) {
      t = *kt[s];
      TORCH_CHECK(t.dtype() == k[s].dtype() && t.is_contiguous() && t.size(0) == A.hkv && t.size(1) >= nb
                  && t.size(2) == d && t.size(3) == KB);
    } else {
      t = torch::zeros({A.hkv, nb, d, KB}, k[s].options());
      A.kt_from = 0;
    }
    scratch[s] = t;
    A.kt = t.data_ptr(); A.kts0 = t.stride(0);
    A.k = k[s].data_ptr(); A.ks0 = k[s].stride(0); A.ks1 = k[s].stride(1);
    A.v = v1[s].data_ptr(); A.vs0 = v1[s].stride(0); A.vs1 = v1[s].stride(1);
    A.vis = vis[s].data_ptr<bool>();
    A.scale = static_cast<float>(scale);
  }
  return attend_seqs(q, seqs);
}

// attend_many after writing each sequence's new keys and values into its cache, for the owned
// forward's layers (hdcli/engine/model/, kvcache.InvariantLayer): one call a layer for all
// sequences in place of per-sequence copies and conversions in Python.
//   query [1, hq, M, d], key and value [1, hkv, M, d], any float dtype: every sequence's new rows
//          in order (sequence s's are vis[s]'s m_s rows);
//   k[s] [1, hkv, C, d], v1[s] [1, hkv, C, d + 1], kt[s] [1, hkv, >= ceil(C / KB), d, KB], in one
//          dtype a sequence (fp32 or bf16): the layer's keys, [V | 1] and transposed keys; rows
//          start[s] .. start[s] + m_s - 1 of k and v1 are written here (the ones column too), kt is
//          valid for kt_len[s] keys.
// Returns [1, M, hq, d] in the query's dtype.
// t [1, h, M, d] as [M, h, d] fp32 contiguous, in one copy (.to() then .contiguous() made two).
static torch::Tensor rows_fp32(const torch::Tensor& t) {
  auto out = torch::empty({t.size(2), t.size(1), t.size(3)}, t.options().dtype(torch::kFloat));
  out.copy_(t.select(0, 0).transpose(0, 1));
  return out;
}

// m new rows (fp32 src [m, hkv, d]) into a layer's keys or [V | 1] (ones: write the ones column).
template <typename S>
static void write_rows(void* dst, int64_t s0, int64_t s1, const float* src, int64_t m, int64_t hkv, int64_t d,
                       int64_t start, bool ones) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t h = 0; h < hkv; ++h) {
      S* row = static_cast<S*>(dst) + h * s0 + (start + r) * s1;
      const float* from = src + (r * hkv + h) * d;
      for (int64_t i = 0; i < d; ++i) row[i] = narrow<S>(from[i]);
      if (ones) row[d] = narrow<S>(1.0f);
    }
}

torch::Tensor append_attend_many(torch::Tensor query, torch::Tensor key, torch::Tensor value, std::vector<int64_t> start,
                                 std::vector<torch::Tensor> k, std::vector<torch::Tensor> kt,
                                 std::vector<int64_t> kt_len, std::vector<torch::Tensor> v1,
                                 std::vector<torch::Tensor> vis, double scale) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && key.sizes() == value.sizes() && key.size(2) == query.size(2));
  const size_t ns = k.size();
  TORCH_CHECK(start.size() == ns && kt.size() == ns && kt_len.size() == ns && v1.size() == ns && vis.size() == ns);
  auto q = rows_fp32(query);   // [M, hq, d]
  auto kn = rows_fp32(key);    // [M, hkv, d]
  auto vn = rows_fp32(value);
  const int64_t hkv = kn.size(1), d = kn.size(2);
  std::vector<Args> seqs(ns);
  int64_t row0 = 0;
  for (size_t s = 0; s < ns; ++s) {
    Args& A = seqs[s];
    const torch::Tensor &K = k[s], &V = v1[s], &T = kt[s];
    A.bf16 = stored_bf16(K);
    A.m = vis[s].size(0); A.n = vis[s].size(1); A.hkv = hkv;
    TORCH_CHECK(V.dtype() == K.dtype() && T.dtype() == K.dtype() && vis[s].dtype() == torch::kBool && vis[s].is_contiguous()
                && K.dim() == 4 && V.dim() == 4 && T.dim() == 5 && T.is_contiguous()
                && K.size(1) == hkv && K.size(3) == d && V.size(3) == d + 1 && K.stride(3) == 1 && V.stride(3) == 1
                && T.size(1) == hkv && T.size(3) == d && T.size(4) == KB && T.size(2) * KB >= A.n
                && K.size(2) >= A.n && V.size(2) >= A.n
                && start[s] >= 0 && start[s] + A.m <= K.size(2) && start[s] + A.m <= V.size(2)
                && row0 + A.m <= kn.size(0), "fused attention: no room for the new keys");
    A.k = K.data_ptr(); A.ks0 = K.stride(1); A.ks1 = K.stride(2);
    A.v = V.data_ptr(); A.vs0 = V.stride(1); A.vs1 = V.stride(2);
    A.kt = T.data_ptr(); A.kts0 = T.stride(1); A.kt_from = kt_len[s];
    A.vis = vis[s].data_ptr<bool>();
    A.scale = static_cast<float>(scale);
    const float* ksrc = kn.data_ptr<float>() + row0 * hkv * d;
    const float* vsrc = vn.data_ptr<float>() + row0 * hkv * d;
    void* kp = const_cast<void*>(A.k);
    void* vp = const_cast<void*>(A.v);
    if (A.bf16) {
      write_rows<uint16_t>(kp, A.ks0, A.ks1, ksrc, A.m, hkv, d, start[s], false);
      write_rows<uint16_t>(vp, A.vs0, A.vs1, vsrc, A.m, hkv, d, start[s], true);
    } else {
      write_rows<float>(kp, A.ks0, A.ks1, ksrc, A.m, hkv, d, start[s], false);
      write_rows<float>(vp, A.vs0, A.vs1, vsrc, A.m, hkv, d, start[s], true);
    }
    row0 += A.m;
  }
  TORCH_CHECK(row0 == kn.size(0), "fused attention: the new keys are not the sequences' rows");
  return attend_seqs(q, seqs).to(query.scalar_type()).unsqueeze(0);
}

// One sequence, its keys transposed into scratch: attend_many of one.
torch::Tensor attend(torch::Tensor q, torch::Tensor k, torch::Tensor v1, torch::Tensor vis, double scale) {
  return attend_many(q, {k}, {c10::nullopt}, {0}, {v1}, {vis}, scale);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_tile", &set_tile, "force the tile height (1-4, 6; 0: chosen per call): rows share loops otherwise, never a sum");
  m.def("attend", &attend, "M-invariant attention of one sequence: fixed arithmetic per (row, head)", py::call_guard<py::gil_scoped_release>());
  m.def("attend_many", &attend_many, "M-invariant attention of several sequences in one call", py::call_guard<py::gil_scoped_release>());
  m.def("append_attend_many", &append_attend_many, "attend_many after appending new keys and values", py::call_guard<py::gil_scoped_release>());
  m.def("append_attend_many_address", [] { return reinterpret_cast<int64_t>(&append_attend_many); },
        "append_attend_many's address, for compiled code that calls it (csrc/qmm.cpp's Layers)");
}
