// C++ CPU implementations of the engine's fused ops (twins: spd_fast/ops.py, spd_fast/ops_explicit.py).
//
// Registered as spd_fast::{aggregate,verify_greedy,verify_sampling,draft_sample}_cpp; built just in
// time by spd_fast/cpp_ops.py. Logit processing is the twin's (ops_explicit.processed_probs: divide
// by the temperature in fp32, top-k on the scaled logits, top-p on the top-k softmax, ties at the
// top-p boundary kept or dropped together); exp is a ~1-ulp polynomial so the loops vectorise.
// Random numbers come in as tensors (u), so every op is deterministic given its inputs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <bit>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <functional>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Cephes-style expf: range reduction to [-ln2/2, ln2/2], degree-6 polynomial, 2^n by exponent bits.
// Branch-free so `#pragma omp simd` loops vectorise; exp(-inf) and underflow give exactly 0.
inline __attribute__((always_inline)) float fast_exp(float x) {
  const float lo = -87.3365478515625f, hi = 88.3762626647949f;
  float xc = std::min(std::max(x, lo), hi);
  float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  float r = xc - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float y = p * r * r + r + 1.0f;
  const float scale = std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
  return x < lo ? 0.0f : y * scale;
}

// GCC vectorises no float max reduction without -ffast-math (which would also assume no -inf logits),
// hence the intrinsics.
float max_of(const float* __restrict x, int64_t n) {
  float mx = kNegInf;
  int64_t i = 0;
#if defined(__AVX2__)
  __m256 m = _mm256_set1_ps(kNegInf);
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  for (float v : lanes) mx = std::max(mx, v);
#endif
  for (; i < n; ++i) mx = std::max(mx, x[i]);
  return mx;
}

// ---- aggregation --------------------------------------------------------------------------------

// out[g, n] = sum_k w[n, k] * x[g, k] for a few rows g: each weight row is read from memory once and
// reused from L1 for every row of the group; bf16/fp16 weights are widened on the fly, fp32 accumulate.
// Four weight rows at a time give four independent FMA chains (one chain is latency-bound).
template <typename T>
void gemv_rows(const T* w, int64_t ldw, const float* x, int64_t G, int64_t K, int64_t H, float* out) {
  at::parallel_for(0, (H + 3) / 4, 16, [&](int64_t q0, int64_t q1) {
    for (int64_t n = 4 * q0; n < std::min(H, 4 * q1); n += 4) {
      const int64_t rows = std::min<int64_t>(4, H - n);
      const T* __restrict w0 = w + n * ldw;
      const T* __restrict w1 = w + (n + std::min<int64_t>(1, rows - 1)) * ldw;  // repeats a row past H
      const T* __restrict w2 = w + (n + std::min<int64_t>(2, rows - 1)) * ldw;
      const T* __restrict w3 = w + (n + std::min<int64_t>(3, rows - 1)) * ldw;
      for (int64_t g = 0; g < G; ++g) {
        const float* __restrict xg = x + g * K;
        float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
        for (int64_t k = 0; k < K; ++k) {
          const float xv = xg[k];
          a0 += static_cast<float>(w0[k]) * xv;
          a1 += static_cast<float>(w1[k]) * xv;
          a2 += static_cast<float>(w2[k]) * xv;
          a3 += static_cast<float>(w3[k]) * xv;
        }
        const float acc[4] = {a0, a1, a2, a3};
        for (int64_t j = 0; j < rows; ++j) out[g * H + n + j] = acc[j];
      }
    }
  });
}

at::Tensor aggregate(const at::Tensor& rows, const at::Tensor& types, const at::Tensor& w) {
  TORCH_CHECK(rows.dim() == 3, "aggregate_cpp: anchor_rows must be [R, m, H], got ", rows.sizes());
  const int64_t R = rows.size(0), m = rows.size(1), H = rows.size(2);
  TORCH_CHECK(types.dim() == 1 && types.size(0) == R, "aggregate_cpp: types must be [R=", R, "], got ",
              types.sizes());
  TORCH_CHECK(w.dim() == 3 && w.size(0) == m && w.size(1) == H && w.size(2) == m * H,
              "aggregate_cpp: w_padded must be [m, H, m*H] = [", m, ", ", H, ", ", m * H, "], got ", w.sizes());
  TORCH_CHECK(rows.device().is_cpu() && types.device().is_cpu() && w.device().is_cpu(),
              "aggregate_cpp: CPU tensors only");
  const at::Tensor x = rows.reshape({R, m * H});
  const at::Tensor wc = w.contiguous();
  const at::Tensor t = types.to(at::kLong).contiguous();
  const int64_t* tp = t.data_ptr<int64_t>();
  // Group rows by type: each W_t = w[t, :, :(t+1)H] is read once per call, however many rows share it
  // (prefill: R rows of one type), and only the anchors 0..t are ever read (stale ones may be NaN).
  std::vector<std::vector<int64_t>> groups(m);
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(tp[r] >= 0 && tp[r] < m, "aggregate_cpp: types[", r, "] = ", tp[r], " is outside [0, ", m, ")");
    groups[tp[r]].push_back(r);
  }
  at::Tensor out = at::empty({R, H}, rows.options().dtype(at::kFloat));
  for (int64_t ty = 0; ty < m; ++ty) {
    const auto& g = groups[ty];
    if (g.empty()) continue;
    const int64_t K = (ty + 1) * H, G = static_cast<int64_t>(g.size());
    const at::Tensor idx = at::tensor(g, at::kLong);
    const at::Tensor xs = x.index_select(0, idx).narrow(1, 0, K).to(at::kFloat).contiguous();  // [G, K]
    at::Tensor og;
    if (G <= 8) {  // decode: a memory-bound GEMV, the weight's own dtype streamed once
      og = at::empty({G, H}, out.options());
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, wc.scalar_type(), "aggregate_cpp", [&] {
        gemv_rows(wc.data_ptr<scalar_t>() + ty * H * m * H, m * H, xs.data_ptr<float>(), G, K, H,
                  og.data_ptr<float>());
      });
    } else {  // prefill: compute-bound, BLAS in fp32
      og = at::mm(xs, wc.select(0, ty).narrow(1, 0, K).to(at::kFloat).t());
    }
    out.index_copy_(0, idx, og);
  }
  return out.to(rows.scalar_type());
}

// ---- argmax / greedy verification ---------------------------------------------------------------

// First NaN of x, or -1.
int64_t first_nan(const float* __restrict x, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__)
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    if (hit) return i + __builtin_ctz(hit);
  }
#endif
  for (; i < n; ++i)
    if (x[i] != x[i]) return i;
  return -1;
}

// First index of the maximum, as torch.argmax: ties go to the first, and a NaN counts as the maximum
// (the vector max would drop it and return an ordinary index instead).
template <typename T>
int64_t argmax_row(const T* x, int64_t V) {
  const float* xf;
  thread_local std::vector<float> buf;
  if constexpr (std::is_same_v<T, float>) {
    xf = x;
  } else {
    buf.resize(V);
    for (int64_t i = 0; i < V; ++i) buf[i] = static_cast<float>(x[i]);
    xf = buf.data();
  }
  if (const int64_t nan_at = first_nan(xf, V); nan_at >= 0) return nan_at;
  const float mx = max_of(xf, V);
  int64_t i = 0;
#if defined(__AVX2__)
  const __m256 vm = _mm256_set1_ps(mx);
  for (; i + 8 <= V; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(xf + i), vm, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(hit);
  }
#endif
  for (; i < V; ++i)
    if (xf[i] == mx) return i;
  return 0;
}

std::tuple<at::Tensor, at::Tensor> verify_greedy(const at::Tensor& logits, const at::Tensor& draft) {
  TORCH_CHECK(logits.dim() == 1 || logits.dim() == 2, "verify_greedy_cpp: target_logits must be [V] or [B, V]");
  TORCH_CHECK(logits.device().is_cpu(), "verify_greedy_cpp: CPU tensors only");
  const at::Tensor l = logits.reshape({-1, logits.size(-1)}).contiguous();
  const int64_t B = l.size(0), V = l.size(1);
  TORCH_CHECK(draft.numel() == B, "verify_greedy_cpp: draft_token must have one entry per row (", B, ")");
  const at::Tensor d = draft.to(at::kLong).reshape({B}).contiguous();
  at::Tensor tok = at::empty({B}, l.options().dtype(at::kLong));
  at::Tensor acc = at::empty({B}, l.options().dtype(at::kBool));
  int64_t* tp = tok.data_ptr<int64_t>();
  bool* ap = acc.data_ptr<bool>();
  const int64_t* dp = d.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, l.scalar_type(), "verify_greedy_cpp", [&] {
    const scalar_t* base = l.data_ptr<scalar_t>();
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        tp[b] = argmax_row(base + b * V, V);
        ap[b] = tp[b] == dp[b];
      }
    });
  });
  const auto shape = logits.sizes().slice(0, logits.dim() - 1);
  return {acc.reshape(shape), tok.reshape(shape)};
}

// ---- logit processing (temperature, top-k, top-p) -----------------------------------------------
// The hot loops are plain functions over __restrict float arrays with fp32 partial sums per block of
// kBlock (added up in double), so GCC vectorises them without -ffast-math.
constexpr int64_t kBlock = 1024;

// e[i] = exp(x[i] - mx) where x[i] >= thr, else 0; returns the sum of e.
double exp_masked(const float* __restrict x, float* __restrict e, int64_t n, float mx, float thr) {
  double total = 0.0;
  for (int64_t b0 = 0; b0 < n; b0 += kBlock) {
    const int64_t b1 = std::min(n, b0 + kBlock);
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = b0; i < b1; ++i) {
      const float v = fast_exp(x[i] - mx);
      e[i] = x[i] >= thr ? v : 0.0f;
      s += e[i];
    }
    total += s;
  }
  return total;
}

// r[i] = max(p[i] - q[i], 0); returns the sum of r.
double residual(const float* __restrict p, const float* __restrict q, float* __restrict r, int64_t n) {
  double total = 0.0;
  for (int64_t b0 = 0; b0 < n; b0 += kBlock) {
    const int64_t b1 = std::min(n, b0 + kBlock);
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = b0; i < b1; ++i) {
      r[i] = std::max(p[i] - q[i], 0.0f);
      s += r[i];
    }
    total += s;
  }
  return total;
}

double sum_of(const float* __restrict w, int64_t n) {
  double total = 0.0;
  for (int64_t b0 = 0; b0 < n; b0 += kBlock) {
    const int64_t b1 = std::min(n, b0 + kBlock);
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = b0; i < b1; ++i) s += w[i];
    total += s;
  }
  return total;
}

// The k-th largest value (ties counted, like torch.topk). For small k a min-heap of the k largest so
// far: past the first few thousand entries nearly every entry fails its one comparison with the
// heap's minimum, so this is one predictable pass instead of nth_element's shuffling of a copy.
float kth_largest(const float* x, int64_t V, int64_t k) {
  thread_local std::vector<float> buf;
  if (k > 4096) {
    buf.assign(x, x + V);
    std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end(), std::greater<float>());
    return buf[k - 1];
  }
  buf.assign(x, x + k);
  std::make_heap(buf.begin(), buf.end(), std::greater<float>());
  for (int64_t i = k; i < V; ++i) {
    if (x[i] > buf.front()) {
      std::pop_heap(buf.begin(), buf.end(), std::greater<float>());
      buf.back() = x[i];
      std::push_heap(buf.begin(), buf.end(), std::greater<float>());
    }
  }
  return buf.front();
}

// The top-p cut: the smallest logit whose run of ties starts before the mass reaches top_p (keep x >= cut).
float top_p_cut(const float* x, int64_t V, float mx, float thr, double z, double top_p) {
  // Usually a few hundred tokens cover top_p, so sort a growing prefix, not the whole vocabulary.
  thread_local std::vector<float> kept;
  kept.clear();
  for (int64_t i = 0; i < V; ++i)
    if (x[i] >= thr) kept.push_back(x[i]);
  const size_t n = kept.size();
  for (size_t k = std::min<size_t>(n, 256);; k = std::min(n, k * 8)) {
    std::partial_sort(kept.begin(), kept.begin() + k, kept.end(), std::greater<float>());
    double before = 0.0;
    const float cut = static_cast<float>(top_p);  // fp32 (the twin sums in fp64: they differ only within ~1e-7)
    for (size_t j = 0; j < k; ++j) {
      if (j > 0 && static_cast<float>(before) >= cut) return kept[j - 1];  // the last kept token; its ties are kept too
      before += fast_exp(kept[j] - mx) / z;
    }
    if (k == n) return thr;
  }
}

// Fills p[0..V) with the processed distribution of one row of logits (x: scratch for the scaled
// logits); serves verification (target p) and drafting (q over the draft vocabulary).
template <typename T>
void process_row(const T* l, int64_t V, float temperature, int64_t top_k, double top_p, std::vector<float>& x,
                 std::vector<float>& p) {
  x.resize(V);
  p.resize(V);
  float* __restrict xp = x.data();
  float* __restrict pp = p.data();
  const T* __restrict lr = l;
  for (int64_t i = 0; i < V; ++i) xp[i] = static_cast<float>(lr[i]) / temperature;  // a true division, like the twin
  const float mx = max_of(xp, V);
  float thr = kNegInf;  // keep x >= thr
  if (top_k > 0 && top_k < V) thr = kth_largest(xp, V, top_k);
  double z = exp_masked(xp, pp, V, mx, thr);
  if (top_p < 1.0) {
    thr = std::max(thr, top_p_cut(xp, V, mx, thr, z, top_p));
    z = exp_masked(xp, pp, V, mx, thr);
  }
  const float inv = static_cast<float>(1.0 / z);
#pragma omp simd
  for (int64_t i = 0; i < V; ++i) pp[i] *= inv;
}

// Inverse-CDF draw: the first index whose running sum exceeds u * total, never a zero-weight index.
// Block sums are vectorised; only the block where the target falls is scanned one by one.
int64_t sample_cdf(const float* w, int64_t V, float u, double total) {
  constexpr int64_t kBlock = 256;
  const double target = static_cast<double>(u) * total;
  double run = 0.0;
  for (int64_t b0 = 0; b0 < V; b0 += kBlock) {
    const int64_t b1 = std::min(V, b0 + kBlock);
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = b0; i < b1; ++i) s += w[i];
    if (run + s * (1.0 + 1e-4) + 1e-30 <= target) {  // surely not in this block (margin for the fp32 sum)
      run += s;
      continue;
    }
    for (int64_t i = b0; i < b1; ++i) {
      run += w[i];
      if (run > target && w[i] > 0) return i;
    }
  }
  for (int64_t i = V - 1; i > 0; --i)  // rounding put the target past the total: the last positive index
    if (w[i] > 0) return i;
  return 0;
}

void check_sampling(const at::Tensor& logits, const at::Tensor& u, int64_t B, int64_t nu, const char* op,
                    double top_p) {
  TORCH_CHECK(logits.device().is_cpu() && u.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(top_p > 0.0 && top_p <= 1.0, op, ": top_p must be in (0, 1], got ", top_p);
  TORCH_CHECK(u.scalar_type() == at::kFloat && u.numel() == B * nu, op, ": u must be float32 with ", nu,
              " uniforms per row");
}

// One row of speculative rejection sampling; returns (accept, token to commit).
template <typename T>
std::pair<bool, int64_t> verify_row(const T* l, const float* q, const float* u, int64_t xd, int64_t V, float temperature,
                                    int64_t top_k, double top_p, std::vector<float>& x, std::vector<float>& p,
                                    std::vector<float>& r) {
  process_row(l, V, temperature, top_k, top_p, x, p);
  r.resize(V);
  float* rp = r.data();
  const float* pp = p.data();
  // u * q(x) < p(x)  <=>  u < p(x) / q(x), without dividing by a zero q(x)
  const bool accept = u[0] * q[xd] < pp[xd];
  const double mass = residual(pp, q, rp, V);
  const int64_t y = mass > 0 ? sample_cdf(rp, V, u[1], mass) : sample_cdf(pp, V, u[1], sum_of(pp, V));
  return {accept, accept ? xd : y};
}

std::tuple<at::Tensor, at::Tensor> verify_sampling(const at::Tensor& logits, const at::Tensor& draft,
                                                   const at::Tensor& q, double temperature, int64_t top_k,
                                                   double top_p, const at::Tensor& u) {
  TORCH_CHECK(logits.dim() == 1 || logits.dim() == 2, "verify_sampling_cpp: target_logits must be [V] or [B, V]");
  TORCH_CHECK(temperature > 0, "verify_sampling_cpp: temperature must be > 0 (greedy uses verify_greedy)");
  const at::Tensor l = logits.reshape({-1, logits.size(-1)}).contiguous();
  const int64_t B = l.size(0), V = l.size(1);
  check_sampling(l, u, B, 2, "verify_sampling_cpp", top_p);
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.numel() == B * V, "verify_sampling_cpp: q must be float32 [B, V]");
  TORCH_CHECK(draft.numel() == B, "verify_sampling_cpp: draft_token must have one entry per row");
  const at::Tensor qc = q.reshape({B, V}).contiguous(), uc = u.reshape({B, 2}).contiguous();
  const at::Tensor d = draft.to(at::kLong).reshape({B}).contiguous();
  const int64_t* dp = d.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(dp[b] >= 0 && dp[b] < V, "verify_sampling_cpp: draft token ", dp[b], " is outside the vocabulary");
  at::Tensor tok = at::empty({B}, l.options().dtype(at::kLong));
  at::Tensor acc = at::empty({B}, l.options().dtype(at::kBool));
  int64_t* tp = tok.data_ptr<int64_t>();
  bool* ap = acc.data_ptr<bool>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, l.scalar_type(), "verify_sampling_cpp", [&] {
    const scalar_t* base = l.data_ptr<scalar_t>();
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      thread_local std::vector<float> x, p, r;  // reused: fresh 100 KB+ buffers cost page faults per call
      for (int64_t b = b0; b < b1; ++b) {
        const auto res = verify_row(base + b * V, qc.data_ptr<float>() + b * V, uc.data_ptr<float>() + b * 2, dp[b],
                                    V, static_cast<float>(temperature), top_k, top_p, x, p, r);
        ap[b] = res.first;
        tp[b] = res.second;
      }
    });
  });
  const auto shape = logits.sizes().slice(0, logits.dim() - 1);
  return {acc.reshape(shape), tok.reshape(shape)};
}

std::tuple<at::Tensor, at::Tensor> draft_sample(const at::Tensor& logits_d, const at::Tensor& draft_vocab,
                                                int64_t vocab_size, double temperature, int64_t top_k,
                                                double top_p, const at::Tensor& u) {
  TORCH_CHECK(logits_d.dim() == 1 || logits_d.dim() == 2, "draft_sample_cpp: logits_d must be [V_d] or [B, V_d]");
  TORCH_CHECK(temperature > 0, "draft_sample_cpp: temperature must be > 0 (greedy drafting is an argmax)");
  const at::Tensor l = logits_d.reshape({-1, logits_d.size(-1)}).contiguous();
  const int64_t B = l.size(0), Vd = l.size(1);
  check_sampling(l, u, B, 1, "draft_sample_cpp", top_p);
  TORCH_CHECK(draft_vocab.dim() == 1 && draft_vocab.size(0) == Vd, "draft_sample_cpp: draft_vocab must be [V_d]");
  const at::Tensor dv = draft_vocab.to(at::kLong).contiguous(), uc = u.reshape({B}).contiguous();
  const int64_t* dvp = dv.data_ptr<int64_t>();
  int64_t lo = 0, hi = 0;
  for (int64_t j = 0; j < Vd; ++j) {  // min/max reductions vectorise; a per-entry check would not
    lo = std::min(lo, dvp[j]);
    hi = std::max(hi, dvp[j]);
  }
  TORCH_CHECK(lo >= 0 && hi < vocab_size, "draft_sample_cpp: draft_vocab has ids outside [0, ", vocab_size, ")");
  at::Tensor q = at::zeros({B, vocab_size}, l.options().dtype(at::kFloat));
  at::Tensor tok = at::empty({B}, l.options().dtype(at::kLong));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, l.scalar_type(), "draft_sample_cpp", [&] {
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      thread_local std::vector<float> x, p;  // reused: fresh 100 KB+ buffers cost page faults per call
      for (int64_t b = b0; b < b1; ++b) {
        process_row(l.data_ptr<scalar_t>() + b * Vd, Vd, static_cast<float>(temperature), top_k, top_p, x, p);
        float* qr = q.data_ptr<float>() + b * vocab_size;
        for (int64_t j = 0; j < Vd; ++j) qr[dvp[j]] = p[j];
        tok.data_ptr<int64_t>()[b] = dvp[sample_cdf(p.data(), Vd, uc.data_ptr<float>()[b], sum_of(p.data(), Vd))];
      }
    });
  });
  if (logits_d.dim() == 1) return {tok.reshape({}), q.reshape({vocab_size})};
  return {tok, q};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spd_fast, m) {
  m.def("aggregate_cpp(Tensor anchor_rows, Tensor types, Tensor w_padded) -> Tensor");
  m.def("verify_greedy_cpp(Tensor target_logits, Tensor draft_token) -> (Tensor, Tensor)");
  m.def("verify_sampling_cpp(Tensor target_logits, Tensor draft_token, Tensor q, float temperature, int top_k, "
        "float top_p, Tensor u) -> (Tensor, Tensor)");
  m.def("draft_sample_cpp(Tensor logits_d, Tensor draft_vocab, int vocab_size, float temperature, int top_k, "
        "float top_p, Tensor u) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(spd_fast, CPU, m) {
  m.impl("aggregate_cpp", &aggregate);
  m.impl("verify_greedy_cpp", &verify_greedy);
  m.impl("verify_sampling_cpp", &verify_sampling);
  m.impl("draft_sample_cpp", &draft_sample);
}
