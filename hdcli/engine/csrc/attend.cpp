// The M-invariant attention as one loop per (query row, head): see hdcli/engine/fused.py.
// Every (row, head) is computed alone, by the same code, over its visible keys in index order,
// so its result cannot depend on the other rows or on how many there are. Built with
// -ffp-contract=off and no -ffast-math: vector and scalar code round alike, and no sum is
// reordered, whatever the compiler vectorises.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// exp(x) for x <= 0 (a score minus the row's max): 2^k * e^r, k = round(x / ln 2), |r| <= ln 2 / 2,
// e^r by its Taylor polynomial of degree 7 (relative error < 1e-8 there); 0 below -87 (under FLT_MIN).
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
  int32_t sb = (k + 127) << 23;
  float scale;
  std::memcpy(&scale, &sb, 4);
  return x < -87.0f ? 0.0f : p * scale;
}

// q [m, hq, d] fp32 contiguous; k [hkv, >= n, d], v1 [hkv, >= n, d + 1] fp32 (rows contiguous);
// vis [m, n] bool: the keys each row sees. Returns [m, hq, d] fp32.
torch::Tensor attend(torch::Tensor q, torch::Tensor k, torch::Tensor v1, torch::Tensor vis, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat && k.dtype() == torch::kFloat && v1.dtype() == torch::kFloat);
  TORCH_CHECK(q.is_contiguous() && vis.is_contiguous() && vis.dtype() == torch::kBool);
  TORCH_CHECK(k.stride(2) == 1 && v1.stride(2) == 1);
  const int64_t m = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t hkv = k.size(0), n = vis.size(1), g = hq / hkv;
  TORCH_CHECK(vis.size(0) == m && k.size(1) >= n && v1.size(1) >= n && k.size(2) == d && v1.size(2) == d + 1);
  auto out = torch::empty({m, hq, d}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v1.data_ptr<float>();
  const bool* visp = vis.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v1.stride(0), vs1 = v1.stride(1);
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, m * hq, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> keys;
    std::vector<float> s, o(d);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r = t / hq, h = t % hq, kv = h / g;
      const float* qr = qp + t * d;
      keys.clear();
      for (int64_t j = 0; j < n; ++j)
        if (visp[r * n + j]) keys.push_back(j);
      const int64_t nv = static_cast<int64_t>(keys.size());
      s.resize(nv);
      float mx = -INFINITY;
      for (int64_t a = 0; a < nv; ++a) {               // scores: 16 partial sums, then a fixed tree
        const float* kj = kp + kv * ks0 + keys[a] * ks1;
        float acc[16] = {0.0f};
        int64_t i = 0;
        for (; i + 16 <= d; i += 16)
          for (int l = 0; l < 16; ++l) acc[l] += qr[i + l] * kj[i + l];
        for (; i < d; ++i) acc[i & 15] += qr[i] * kj[i];
        for (int w = 8; w > 0; w >>= 1)
          for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
        s[a] = acc[0] * sc;
        mx = s[a] > mx ? s[a] : mx;
      }
      for (int64_t a = 0; a < nv; ++a) s[a] = exp_nonpositive(s[a] - mx);
      float total = 0.0f;
      for (int64_t i = 0; i < d; ++i) o[i] = 0.0f;
      for (int64_t a = 0; a < nv; ++a) {               // in key order
        const float p = s[a];
        const float* vj = vp + kv * vs0 + keys[a] * vs1;
        total += p;
        for (int64_t i = 0; i < d; ++i) o[i] += p * vj[i];
      }
      float* orow = op + t * d;
      for (int64_t i = 0; i < d; ++i) orow[i] = o[i] / total;
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, "M-invariant attention, one loop per (row, head)");
}
