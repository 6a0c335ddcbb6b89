// Decode-time linear layers straight from GGUF-quantised weights (Q4_1, Q8_0) on the CPU.
//
// At batch 1 a decode step is bound by how many weight bytes it streams. The default model's GGUF
// stores Q4_1 (0.625 bytes per weight) and Q8_0 (1.0625 bytes per weight); the fp32 copy we
// dequantise at load streams 4 bytes per weight. These ops read the packed blocks and dequantise
// in registers with exactly the GGUF formula (Q4_1: w = d*q + m, Q8_0: w = d*q, all in fp32, where
// d*q is exact), so every weight equals the fp32 copy bit for bit; only the summation order of the
// dot products differs from a BLAS GEMV.
//
// Each output element is a sequential sum over K in a fixed order that depends neither on the
// number of rows M nor on the thread count: row i of an M-row call equals a 1-row call on row i,
// bit for bit. The SPD engine relies on that (stage steps of 1..n rows vs the AR baseline's 1 row).
//
// Layout (repacked at load from the GGUF blocks, see spd_fast/packed.py), K a multiple of 32:
//   q4_1: qs uint8 [N, K/2] (block b of row n: bytes 16b..16b+15, element j = low nibble of byte j,
//         element j+16 = high nibble), d fp32 [N, K/32], m fp32 [N, K/32]
//   q8_0: qs int8 [N, K], d fp32 [N, K/32]
// x: fp32 [M, K] contiguous, M <= 16. Output: fp32 [M, N].
// Kernels: AVX-512, else AVX2 + FMA, else portable C++ (chosen at compile time, -march=native).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxRows = 16;
constexpr int64_t kBlock = 32;

void check_common(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "gguf linear: x must be a contiguous fp32 [M, K] tensor");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "gguf linear: 1 <= M <= ", kMaxRows, ", got ", x.size(0));
  TORCH_CHECK(x.size(1) == K && K % kBlock == 0, "gguf linear: x has K=", x.size(1), ", weights K=", K,
              " (a multiple of 32)");
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.is_contiguous() && d.dim() == 2 && d.size(1) == K / kBlock,
              "gguf linear: d must be a contiguous fp32 [N, K/32] tensor");
  TORCH_CHECK(qs.is_contiguous() && qs.size(0) == d.size(0), "gguf linear: qs and d disagree on N");
}

#if defined(__AVX512F__)
// The dot products of R output rows (n..n+R-1) with all M rows of x, given a dequantiser that
// writes block b of output row n+i as two vectors (elements 0-15, 16-31). R rows at once give
// independent FMA chains that hide the FMA latency; there are two accumulators per (output row,
// x row), and row n's result is always reduce(acc_lo + acc_hi) over the blocks in order, whatever
// R and M are.
template <int R, typename Dequant>
inline void dot_rows(const float* xp, int64_t M, int64_t K, int64_t n, int64_t N, float* yp, Dequant deq) {
  const int64_t NB = K / kBlock;
  __m512 lo[R][kMaxRows], hi[R][kMaxRows];
  for (int i = 0; i < R; ++i)
    for (int64_t r = 0; r < M; ++r) lo[i][r] = hi[i][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < NB; ++b) {
    __m512 w0[R], w1[R];
    for (int i = 0; i < R; ++i) deq(n + i, b, w0[i], w1[i]);
    for (int64_t r = 0; r < M; ++r) {
      const __m512 x0 = _mm512_loadu_ps(xp + r * K + b * kBlock), x1 = _mm512_loadu_ps(xp + r * K + b * kBlock + 16);
      for (int i = 0; i < R; ++i) {
        lo[i][r] = _mm512_fmadd_ps(w0[i], x0, lo[i][r]);
        hi[i][r] = _mm512_fmadd_ps(w1[i], x1, hi[i][r]);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int64_t r = 0; r < M; ++r) yp[r * N + n + i] = _mm512_reduce_add_ps(_mm512_add_ps(lo[i][r], hi[i][r]));
}

// Output rows in pairs over the thread pool (a last odd row alone).
template <typename Dequant>
void dot_all_rows(const float* xp, int64_t M, int64_t K, int64_t N, float* yp, Dequant deq) {
  at::parallel_for(0, (N + 1) / 2, 8, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      if (2 * p + 1 < N) dot_rows<2>(xp, M, K, 2 * p, N, yp, deq);
      else dot_rows<1>(xp, M, K, 2 * p, N, yp, deq);
    }
  });
}

auto q4_1_dequant(const uint8_t* qp, const float* dp, const float* mp, int64_t K) {
  const int64_t NB = K / kBlock;
  return [=](int64_t n, int64_t b, __m512& w0, __m512& w1) {
    // the block's 16 possible weights d*q + m (q = 0..15), then a register permute per nibble
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 lut = _mm512_fmadd_ps(_mm512_set1_ps(dp[n * NB + b]), iota, _mm512_set1_ps(mp[n * NB + b]));
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qp + n * (K / 2) + b * 16)));
    w0 = _mm512_permutexvar_ps(idx, lut);                         // low nibbles (permute reads bits 0-3)
    w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), lut);  // high nibbles
  };
}

auto q8_0_dequant(const int8_t* qp, const float* dp, int64_t K) {
  const int64_t NB = K / kBlock;
  return [=](int64_t n, int64_t b, __m512& w0, __m512& w1) {
    const __m512 vd = _mm512_set1_ps(dp[n * NB + b]);
    const int8_t* q = qp + n * K + b * kBlock;
    w0 = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)))));
    w1 = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)))));
  };
}
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 + FMA: a block of 32 is four 8-float quarters, and every (output row, x row) pair keeps one
// accumulator per quarter. Row n's result is hsum((q0 + q1) + (q2 + q3)) over the blocks in order,
// whatever R (output rows per call) and MM (x rows per call) are, so it does not depend on M.
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Output rows n..n+R-1 against x rows 0..MM-1 (xp and yp already point at the first x / y row).
template <int R, int MM, typename Dequant>
inline void dot_rows(const float* xp, int64_t K, int64_t n, int64_t N, float* yp, Dequant deq) {
  const int64_t NB = K / kBlock;
  __m256 acc[R][MM][4];
  for (int i = 0; i < R; ++i)
    for (int r = 0; r < MM; ++r)
      for (int q = 0; q < 4; ++q) acc[i][r][q] = _mm256_setzero_ps();
  for (int64_t b = 0; b < NB; ++b) {
    for (int i = 0; i < R; ++i) {
      __m256 w[4];
      deq(n + i, b, w);
      for (int r = 0; r < MM; ++r) {
        const float* xr = xp + r * K + b * kBlock;
        for (int q = 0; q < 4; ++q) acc[i][r][q] = _mm256_fmadd_ps(w[q], _mm256_loadu_ps(xr + 8 * q), acc[i][r][q]);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int r = 0; r < MM; ++r)
      yp[r * N + n + i] = hsum8(_mm256_add_ps(_mm256_add_ps(acc[i][r][0], acc[i][r][1]),
                                              _mm256_add_ps(acc[i][r][2], acc[i][r][3])));
}

// One output row against all M x rows, at most 4 x rows per pass (register budget).
template <typename Dequant>
inline void dot_row_all_x(const float* xp, int64_t M, int64_t K, int64_t n, int64_t N, float* yp, Dequant deq) {
  for (int64_t r0 = 0; r0 < M; r0 += 4) {
    const float* xr = xp + r0 * K;
    float* yr = yp + r0 * N;
    switch (std::min<int64_t>(M - r0, 4)) {
      case 4: dot_rows<1, 4>(xr, K, n, N, yr, deq); break;
      case 3: dot_rows<1, 3>(xr, K, n, N, yr, deq); break;
      case 2: dot_rows<1, 2>(xr, K, n, N, yr, deq); break;
      default: dot_rows<1, 1>(xr, K, n, N, yr, deq); break;
    }
  }
}

// Output rows in pairs over the thread pool; one x row (decode) takes both output rows in one pass.
template <typename Dequant>
void dot_all_rows(const float* xp, int64_t M, int64_t K, int64_t N, float* yp, Dequant deq) {
  at::parallel_for(0, (N + 1) / 2, 8, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n = 2 * p;
      if (M == 1 && n + 1 < N) {
        dot_rows<2, 1>(xp, K, n, N, yp, deq);
        continue;
      }
      for (int64_t i = n; i < std::min(n + 2, N); ++i) dot_row_all_x(xp, M, K, i, N, yp, deq);
    }
  });
}

auto q4_1_dequant(const uint8_t* qp, const float* dp, const float* mp, int64_t K) {
  const int64_t NB = K / kBlock;
  return [=](int64_t n, int64_t b, __m256* w) {
    // d*q is exact in fp32, so the fused d*q + m equals the loader's d*q then + m
    const __m256 vd = _mm256_set1_ps(dp[n * NB + b]), vm = _mm256_set1_ps(mp[n * NB + b]);
    const uint8_t* q = qp + n * (K / 2) + b * 16;
    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));      // bytes 0-7
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8)));  // bytes 8-15
    const __m256i low = _mm256_set1_epi32(0x0F);
    w[0] = _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_and_si256(a, low)), vm);  // elements 0-7
    w[1] = _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_and_si256(c, low)), vm);  // 8-15
    w[2] = _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), vm);   // 16-23 (high nibbles)
    w[3] = _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4)), vm);   // 24-31
  };
}

auto q8_0_dequant(const int8_t* qp, const float* dp, int64_t K) {
  const int64_t NB = K / kBlock;
  return [=](int64_t n, int64_t b, __m256* w) {
    const __m256 vd = _mm256_set1_ps(dp[n * NB + b]);
    const int8_t* q = qp + n * K + b * kBlock;
    for (int j = 0; j < 4; ++j)
      w[j] = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                   _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * j)))));
  };
}
#else
// Portable fallback, same per-row order: elements 0-15 and 16-31 of each block in two partial sums.
template <typename Dequant>
void dot_all_rows(const float* xp, int64_t M, int64_t K, int64_t N, float* yp, Dequant deq) {
  const int64_t NB = K / kBlock;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      float lo[kMaxRows][16] = {}, hi[kMaxRows][16] = {};
      for (int64_t b = 0; b < NB; ++b) {
        float w[32];
        deq(n, b, w);
        for (int64_t r = 0; r < M; ++r) {
          const float* xr = xp + r * K + b * kBlock;
          for (int j = 0; j < 16; ++j) lo[r][j] += w[j] * xr[j];
          for (int j = 0; j < 16; ++j) hi[r][j] += w[j + 16] * xr[j + 16];
        }
      }
      for (int64_t r = 0; r < M; ++r) {
        float s = 0.f;
        for (int j = 0; j < 16; ++j) s += lo[r][j] + hi[r][j];
        yp[r * N + n] = s;
      }
    }
  });
}

auto q4_1_dequant(const uint8_t* qp, const float* dp, const float* mp, int64_t K) {
  const int64_t NB = K / kBlock;
  return [=](int64_t n, int64_t b, float* w) {
    const uint8_t* q = qp + n * (K / 2) + b * 16;
    for (int j = 0; j < 16; ++j) {
      w[j] = dp[n * NB + b] * float(q[j] & 0x0F) + mp[n * NB + b];
      w[j + 16] = dp[n * NB + b] * float(q[j] >> 4) + mp[n * NB + b];
    }
  };
}

auto q8_0_dequant(const int8_t* qp, const float* dp, int64_t K) {
  const int64_t NB = K / kBlock;
  return [=](int64_t n, int64_t b, float* w) {
    for (int j = 0; j < 32; ++j) w[j] = dp[n * NB + b] * float(qp[n * K + b * kBlock + j]);
  };
}
#endif

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m) {
  const int64_t N = d.size(0), K = d.size(1) * kBlock, M = x.size(0);
  check_common(x, qs, d, K);
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.dim() == 2 && qs.size(1) == K / 2,
              "q4_1 linear: qs must be uint8 [N, K/2]");
  TORCH_CHECK(m.scalar_type() == at::kFloat && m.is_contiguous() && m.sizes() == d.sizes(),
              "q4_1 linear: m must be fp32 like d");
  at::Tensor y = at::empty({M, N}, x.options());
  dot_all_rows(x.data_ptr<float>(), M, K, N, y.data_ptr<float>(),
               q4_1_dequant(qs.data_ptr<uint8_t>(), d.data_ptr<float>(), m.data_ptr<float>(), K));
  return y;
}

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d) {
  const int64_t N = d.size(0), K = d.size(1) * kBlock, M = x.size(0);
  check_common(x, qs, d, K);
  TORCH_CHECK(qs.scalar_type() == at::kChar && qs.dim() == 2 && qs.size(1) == K, "q8_0 linear: qs must be int8 [N, K]");
  at::Tensor y = at::empty({M, N}, x.options());
  dot_all_rows(x.data_ptr<float>(), M, K, N, y.data_ptr<float>(), q8_0_dequant(qs.data_ptr<int8_t>(), d.data_ptr<float>(), K));
  return y;
}

// ---- the rest of a decode step: one op instead of a dozen small ones ------------------------------

// RMSNorm in transformers' op order: y = w * (x * rsqrt(mean(x^2) + eps)), fp32, rows of H.
at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && w.scalar_type() == at::kFloat &&
              w.is_contiguous() && w.dim() == 1 && x.size(-1) == w.size(0),
              "rms_norm_rows: contiguous fp32 x [..., H] and w [H]");
  TORCH_CHECK(w.size(0) >= 1, "rms_norm_rows: H must be >= 1");
  const int64_t H = w.size(0), R = x.numel() / H;
  at::Tensor y = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    const float* xr = xp + r * H;
    float ss[16] = {};
    int64_t j = 0;
    for (; j + 16 <= H; j += 16)
      for (int k = 0; k < 16; ++k) ss[k] += xr[j + k] * xr[j + k];
    float s = 0.f;
    for (int k = 0; k < 16; ++k) s += ss[k];
    for (; j < H; ++j) s += xr[j] * xr[j];
    const float inv = 1.0f / std::sqrt(s / float(H) + float(eps));
    float* yr = yp + r * H;
    for (j = 0; j < H; ++j) yr[j] = wp[j] * (xr[j] * inv);
  }
  return y;
}

// q.k in eight fixed lanes (j mod 8), then a fixed pairwise sum: a vector FMA per 8 elements instead of
// one serial chain of D FMAs, and the same order for every row, batch size and thread count.
inline float dot8(const float* a, const float* b, int64_t D) {
  float part[8] = {};
  int64_t j = 0;
  for (; j + 8 <= D; j += 8)
    for (int l = 0; l < 8; ++l) part[l] += a[j + l] * b[j + l];
  for (int l = 0; j < D; ++j, ++l) part[l] += a[j] * b[j];
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

// Few-query attention over a static KV cache with GQA: q [B, T, nh, D], caches [Bc, nkv, S, D]
// (slot == position), positions [B, T]; a query at position p reads slots 0..min(p, bound-1).
// Scores and softmax in fp32; one (b, t, head) per task; the sums run over slots in order.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                            const at::Tensor& positions, int64_t kv_bound) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && kc.scalar_type() == at::kFloat && vc.scalar_type() == at::kFloat,
              "decode_attention: fp32 tensors");
  TORCH_CHECK(q.dim() == 4 && kc.dim() == 4 && kc.sizes() == vc.sizes() && kc.is_contiguous() && vc.is_contiguous(),
              "decode_attention: q [B, T, nh, D], contiguous caches [Bc, nkv, S, D]");
  const int64_t B = q.size(0), T = q.size(1), nh = q.size(2), D = q.size(3);
  const int64_t nkv = kc.size(1), S = kc.size(2);
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 2 && positions.size(0) == B &&
              positions.size(1) == T, "decode_attention: int64 positions [B, T] = [", B, ", ", T, "], got ",
              positions.scalar_type(), " ", positions.sizes());
  TORCH_CHECK(kc.size(0) >= B && kc.size(3) == D && nkv >= 1 && nh % nkv == 0 && kv_bound >= 1 && kv_bound <= S,
              "decode_attention: shapes disagree");
  at::Tensor qc = q.contiguous();
  at::Tensor pos = positions.contiguous();
  at::Tensor o = at::empty({B, T, nh, D}, q.options());
  const float* qp = qc.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  float* op = o.data_ptr<float>();
  const int64_t g = nh / nkv;
  const float scale = 1.0f / std::sqrt(float(D));
  at::parallel_for(0, B * T * nh, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> sc(kv_bound);
    std::vector<float> acc(D);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t h = i % nh, bt = i / nh, b = bt / T;
      const int64_t kvh = h / g;
      const int64_t last = std::min<int64_t>(pp[bt], kv_bound - 1);
      const float* qr = qp + i * D;
      const float* kbase = kp + (b * nkv + kvh) * S * D;
      const float* vbase = vp + (b * nkv + kvh) * S * D;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s <= last; ++s) {
        const float* kr = kbase + s * D;
        sc[s] = dot8(qr, kr, D) * scale;
        mx = std::max(mx, sc[s]);
      }
      float den = 0.f;
      for (int64_t s = 0; s <= last; ++s) {
        sc[s] = std::exp(sc[s] - mx);
        den += sc[s];
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t s = 0; s <= last; ++s) {
        const float* vr = vbase + s * D;
        const float pr = sc[s];
        for (int64_t j = 0; j < D; ++j) acc[j] += pr * vr[j];
      }
      float* orow = op + i * D;
      const float inv = 1.0f / den;
      for (int64_t j = 0; j < D; ++j) orow[j] = acc[j] * inv;
    }
  });
  return o;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spd_fast, m) {
  m.def("q4_1_linear(Tensor x, Tensor qs, Tensor d, Tensor m) -> Tensor");
  m.def("q8_0_linear(Tensor x, Tensor qs, Tensor d) -> Tensor");
  m.def("rms_norm_rows(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor positions, int kv_bound) -> Tensor");
}

TORCH_LIBRARY_IMPL(spd_fast, CPU, m) {
  m.impl("q4_1_linear", &q4_1_linear);
  m.impl("q8_0_linear", &q8_0_linear);
  m.impl("rms_norm_rows", &rms_norm_rows);
  m.impl("decode_attention", &decode_attention);
}
