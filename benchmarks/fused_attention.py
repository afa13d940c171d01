"""A prototype, not used by hd: the M-invariant attention as one C++ loop per (row, head) instead of
torch ops, measured against invariant.attend_kv / attend_many on the same inputs.

Why: in a forward of several requests the invariant attention is 40-53% of the time (docs/serve.md),
and a fifth of a one-token forward, though it does little arithmetic: its time is the count of small
ops and small batched GEMMs the fixed summation order needs. A loop that computes each (row, head)
alone, over its visible keys in index order (scores with a fixed 16-lane dot product, max, exp, the
weighted sum of values in key order), is invariant by construction: a row's result cannot depend on
the other rows or on how many there are. It is another summation order than the torch path, so it
would be its own reference (as a kernel set is).

Measured (AMD EPYC, 2 threads, caches of 250 + 37 i tokens, per layer): 1 request 1 token: 52 us
against 151; 4 requests 1 token: 223 against 741; 4 requests 3-token chains: 547 against 545. The
last is bound by std::exp, scalar per key and head: a vectorised exp of our own (plain arithmetic,
compiled with -ffp-contract=off so vector and scalar code round alike) is what it lacks. Compiling
takes ~30 s once (torch.utils.cpp_extension, g++ and ninja); machines without them would keep the
torch path. Max |difference| to the torch path: ~1e-5 (another order).

    python benchmarks/fused_attention.py
"""
import time

import torch
from torch.utils.cpp_extension import load_inline
src = r'''
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>
torch::Tensor attend(torch::Tensor q, torch::Tensor k, torch::Tensor v1, torch::Tensor vis, double scale) {
  const int64_t m = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t hkv = k.size(0), n = vis.size(1), g = hq / hkv;
  TORCH_CHECK(q.is_contiguous() && vis.is_contiguous() && k.stride(2) == 1 && v1.stride(2) == 1);
  auto out = torch::empty({m, hq, d}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v1.data_ptr<float>();
  const bool* visp = vis.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v1.stride(0), vs1 = v1.stride(1);
  const float sc = (float)scale;
  at::parallel_for(0, m * hq, 1, [&](int64_t b, int64_t e) {
    std::vector<float> s(n);
    std::vector<float> o(d);
    for (int64_t t = b; t < e; ++t) {
      const int64_t r = t / hq, h = t % hq, kv = h / g;
      const float* qr = qp + t * d;
      const bool* vr = visp + r * n;
      float mx = -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        if (!vr[j]) continue;
        const float* kj = kp + kv * ks0 + j * ks1;
        float acc[16] = {0};
        int64_t i = 0;
        for (; i + 16 <= d; i += 16)
          for (int l = 0; l < 16; ++l) acc[l] += qr[i + l] * kj[i + l];
        for (; i < d; ++i) acc[i & 15] += qr[i] * kj[i];
        for (int w = 8; w > 0; w >>= 1)
          for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
        s[j] = acc[0] * sc;
        if (s[j] > mx) mx = s[j];
      }
      float lsum = 0.f;
      for (int64_t i = 0; i < d; ++i) o[i] = 0.f;
      for (int64_t j = 0; j < n; ++j) {
        if (!vr[j]) continue;
        const float p = std::exp(s[j] - mx);
        const float* vj = vp + kv * vs0 + j * vs1;
        lsum += p;
        for (int64_t i = 0; i < d; ++i) o[i] += p * vj[i];
      }
      float* orow = op + t * d;
      for (int64_t i = 0; i < d; ++i) orow[i] = o[i] / lsum;
    }
  });
  return out;
}
'''
t0 = time.time()
mod = load_inline("hd_attend_proto", cpp_sources=src, functions=["attend"], extra_cflags=["-O3", "-march=native"], verbose=False)
print("compiled in %.1f s" % (time.time() - t0))
def bench(f, reps=300):
    for _ in range(20): f()
    t = time.perf_counter()
    for _ in range(reps): f()
    return (time.perf_counter() - t) / reps * 1e6
from hdcli.engine import invariant as inv
hq, hkv, d = 9, 3, 64
torch.manual_seed(0)
for S, m in [(1, 1), (4, 1), (4, 3)]:
    ctxs = [250 + 37 * i for i in range(S)]
    lays, kvs, viss = [], [], []
    for c in ctxs:
        n = c + m
        vis = inv._visible(None, m, n, "cpu")
        lay = inv._Layout(vis, hq // hkv)
        lays.append(lay); viss.append(vis.contiguous())
        buf_k = torch.zeros(hkv, 512, d); buf_v = torch.zeros(hkv, 512, d + 1)
        buf_k[:, :n] = torch.randn(hkv, n, d); buf_v[:, :n, :d] = torch.randn(hkv, n, d); buf_v[:, :n, d] = 1
        kvs.append((buf_k, buf_v))
    q = torch.randn(1, hq, S * m, d).to(torch.bfloat16)
    with torch.inference_mode():
        if S > 1:
            many = inv.Many(lays, [m] * S, hq, hkv, "cpu")
            kv_rows = [(k[:, :many.key_rows(i)], v[:, :many.key_rows(i)]) for i, (k, v) in enumerate(kvs)]
            ref = lambda: inv.attend_many(q, kv_rows, many, 0.125)
        else:
            ref = lambda: inv.attend_kv(q, kvs[0][0][:, :lays[0].rows], kvs[0][1][:, :lays[0].rows], lays[0], 0.125)
        def fused():
            qf = q[0].float().transpose(0, 1).contiguous()   # [M, hq, d]
            outs = [mod.attend(qf[i * m:(i + 1) * m], kvs[i][0], kvs[i][1], viss[i], 0.125) for i in range(S)]
            return torch.cat(outs).to(torch.bfloat16)[None]
        a, b = ref(), fused()
        print(S, m, "torch path %.0f us" % bench(ref), "fused %.0f us" % bench(fused), "max diff %.2e" % (a.float() - b.float()).abs().max())
