// The M-invariant attention as one compiled function: see hdcli/engine/fused.py.
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
// Built with -ffp-contract=off and no -ffast-math: a product and a sum round separately, in
// vector and scalar code alike, and no sum is reordered. Vectors are GCC/Clang vector extensions
// (16 floats), which the compiler maps to what -march=native has: one AVX-512 register, two AVX
// ones, four SSE ones; the arithmetic per element is the same in each.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

typedef float v16 __attribute__((vector_size(64)));
constexpr int KB = 16;       // keys a block
constexpr int MAX_DV = 16;   // head size up to 16 * 16 + 15 = 271 (fused.py falls back above)

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

struct Args {
  const float *q, *kt, *v;   // q [m, hq, d]; kt [hkv, nb, d, KB]: keys transposed by block; v [hkv, >= n, d + 1]
  const bool* vis;           // [m, n]
  float* out;                // [m, hq, d]
  int64_t m, hq, d, hkv, g, n, nb, vs0, vs1;
  float scale;
};

// Query rows x0 .. x0 + TR - 1 of kv head kv (row x: token x / g, head kv * g + x % g); rows past
// `rows` repeat the last one and are not written. p: TR * nb * KB floats of scratch.
template <int TR>
static void tile(const Args& A, int64_t kv, int64_t x0, int64_t rows, float* p) {
  const int64_t tr = rows - x0 < TR ? rows - x0 : TR;
  const int64_t d = A.d, n = A.n, nb = A.nb;
  const float* qr[TR];
  const bool* vr[TR];
  float* orow[TR];
  for (int a = 0; a < TR; ++a) {
    const int64_t x = x0 + (a < tr ? a : tr - 1), r = x / A.g, h = kv * A.g + x % A.g;
    qr[a] = A.q + (r * A.hq + h) * d;
    vr[a] = A.vis + r * n;
    orow[a] = A.out + (r * A.hq + h) * d;
  }
  float mx[TR];
  for (int a = 0; a < TR; ++a) mx[a] = -INFINITY;
  int64_t jlo = n, jhi = 0;                          // the keys any row of the tile sees
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * KB, hi = lo + KB < n ? lo + KB : n;
    bool any = false;
    for (int a = 0; a < TR; ++a)
      for (int64_t j = lo; j < hi; ++j) any |= vr[a][j];
    if (!any) {                                      // a block no row of the tile sees
      for (int a = 0; a < TR; ++a)
        for (int64_t j = lo; j < hi; ++j) p[a * nb * KB + j] = -INFINITY;
      continue;
    }
    jlo = lo < jlo ? lo : jlo;
    jhi = hi;
    const float* kb = A.kt + (kv * nb + b) * d * KB;
    v16 acc[TR];
    for (int a = 0; a < TR; ++a) acc[a] = v16{};
    for (int64_t i = 0; i < d; ++i) {                // each score: its d products summed in order
      v16 kv16;
      std::memcpy(&kv16, kb + i * KB, sizeof(v16));
      for (int a = 0; a < TR; ++a) acc[a] += qr[a][i] * kv16;
    }
    for (int a = 0; a < TR; ++a)
      for (int64_t j = lo; j < hi; ++j) {
        const float s = vr[a][j] ? acc[a][j - lo] * A.scale : -INFINITY;
        p[a * nb * KB + j] = s;
        mx[a] = s > mx[a] ? s : mx[a];
      }
  }
  for (int a = 0; a < TR; ++a) {
    float* pa = p + a * nb * KB;
    for (int64_t j = jlo; j < jhi; ++j) pa[j] = exp_nonpositive(pa[j] - mx[a]);   // unseen: -inf -> 0
  }
  const int64_t dv = d / 16, dt = d - dv * 16;       // whole vectors, then a scalar tail
  v16 o[TR][MAX_DV];
  float ot[TR][16];
  float total[TR];
  for (int a = 0; a < TR; ++a) {
    total[a] = 0.0f;
    for (int64_t c = 0; c < dv; ++c) o[a][c] = v16{};
    for (int64_t i = 0; i < dt; ++i) ot[a][i] = 0.0f;
  }
  for (int64_t j = jlo; j < jhi; ++j) {              // values in key order, the sum of p alike
    const float* vj = A.v + kv * A.vs0 + j * A.vs1;
    v16 vv[MAX_DV];
    for (int64_t c = 0; c < dv; ++c) std::memcpy(&vv[c], vj + c * 16, sizeof(v16));
    const float* vt = vj + dv * 16;
    for (int a = 0; a < TR; ++a) {
      const float pj = p[a * nb * KB + j];
      total[a] += pj;
      for (int64_t c = 0; c < dv; ++c) o[a][c] += pj * vv[c];
      for (int64_t i = 0; i < dt; ++i) ot[a][i] += pj * vt[i];
    }
  }
  for (int a = 0; a < tr; ++a) {
    for (int64_t i = 0; i < dv * 16; ++i) orow[a][i] = o[a][i / 16][i % 16] / total[a];
    for (int64_t i = 0; i < dt; ++i) orow[a][dv * 16 + i] = ot[a][i] / total[a];
  }
}

// q [m, hq, d] fp32 contiguous; k [hkv, >= n, d], v1 [hkv, >= n, d + 1] fp32 (rows contiguous);
// vis [m, n] bool: the keys each row sees (every row sees one at least). Returns [m, hq, d] fp32.
torch::Tensor attend(torch::Tensor q, torch::Tensor k, torch::Tensor v1, torch::Tensor vis, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat && k.dtype() == torch::kFloat && v1.dtype() == torch::kFloat);
  TORCH_CHECK(q.is_contiguous() && vis.is_contiguous() && vis.dtype() == torch::kBool);
  TORCH_CHECK(k.stride(2) == 1 && v1.stride(2) == 1);
  Args A;
  A.m = q.size(0); A.hq = q.size(1); A.d = q.size(2);
  A.hkv = k.size(0); A.n = vis.size(1); A.g = A.hq / A.hkv;
  const int64_t d = A.d, n = A.n;
  TORCH_CHECK(vis.size(0) == A.m && k.size(1) >= n && v1.size(1) >= n && k.size(2) == d && v1.size(2) == d + 1);
  TORCH_CHECK(d <= 16 * MAX_DV + 15, "fused attention: head size above 271");
  auto out = torch::empty({A.m, A.hq, d}, q.options());
  A.nb = (n + KB - 1) / KB;
  const int64_t nb = A.nb;
  std::vector<float> kt(A.hkv * nb * d * KB);        // kt[kv][b][i][l] = k[kv][b * KB + l][i]; 0 past n
  const float* kp = k.data_ptr<float>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1);
  at::parallel_for(0, A.hkv * nb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t kv = t / nb, b = t % nb;
      float* dst = kt.data() + t * d * KB;
      for (int64_t l = 0; l < KB; ++l) {
        const int64_t j = b * KB + l;
        const float* src = kp + kv * ks0 + j * ks1;
        for (int64_t i = 0; i < d; ++i) dst[i * KB + l] = j < n ? src[i] : 0.0f;
      }
    }
  });
  A.q = q.data_ptr<float>(); A.kt = kt.data(); A.v = v1.data_ptr<float>();
  A.vis = vis.data_ptr<bool>(); A.out = out.data_ptr<float>();
  A.vs0 = v1.stride(0); A.vs1 = v1.stride(1); A.scale = static_cast<float>(scale);
  // tile height: 4 rows where there are enough tiles for the threads, fewer where not (one token:
  // g rows a kv head). It changes how rows share the loops, never a row's arithmetic.
  const int64_t rows = A.m * A.g;
  const int64_t threads = at::get_num_threads();
  const int tr = rows >= 4 && A.hkv * (rows / 4) >= threads ? 4 : rows >= 2 && A.hkv * (rows / 2) >= threads ? 2 : 1;
  const int64_t tiles = (rows + tr - 1) / tr;
  at::parallel_for(0, A.hkv * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p(4 * nb * KB);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t kv = t / tiles, x0 = (t % tiles) * tr;
      if (tr == 4) tile<4>(A, kv, x0, rows, p.data());
      else if (tr == 2) tile<2>(A, kv, x0, rows, p.data());
      else tile<1>(A, kv, x0, rows, p.data());
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, "M-invariant attention: fixed arithmetic per (row, head), rows in tiles");
}
