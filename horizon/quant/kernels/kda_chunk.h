// KDA's chunked prefill (kda.cpp, "The chunked prefill"), written once for vectors of L lanes and included once
// per instruction set, inside a namespace that defines the vector type and operations it uses (kda.cpp: AVX-512,
// L = 16, and AVX2, L = 8):
//   HZ_CT           the target attribute of that instruction set
//   L, vec          lanes, the vector type
//   vzero, set1, load, store, add, sub, mul, fmadd (a b + c), fnmadd (c - a b), vexp (exp of lanes <= 0)
//   own_decay(e, tiny, self)   e's lanes >= tiny, the others 0; lane `self` 1
//   upto(v, last)              v's lanes 0 .. last, the others 0
// Sums run in the same order whatever L is, except that more lanes split a row of K into fewer vectors: the two
// paths agree with the reference to fp32 rounding, not bit for bit. No include guard: included twice.

// rows [L, K] -> [K, L]: L consecutive rows with one column of each per vector
HZ_CT inline void transpose_block(const float* src, int64_t K, float* dst) {
  for (int64_t j = 0; j < L; ++j)
    for (int64_t d = 0; d < K; ++d) dst[d * L + j] = src[j * K + d];
}

// One chunk's scores (see "The chunked prefill" in kda.cpp), k, q and G [C, K] contiguous: out_k[i][j] =
// sum_d k_i[d] k_j[d] exp(G_i[d] - G_j[d]) and out_q[i][j] the same with q_i, for j <= i; 0 above. buf: 3 C K + 18 K.
HZ_CT void chunk_scores(const float* k, const float* q, const float* G, int64_t C, int64_t K, float* out_k,
                        float* out_q, float* buf) {
  // block-transposed [C / L][K][L] copies: one vector holds a column d of L consecutive rows j (ET: the
  // diagonal blocks' decays, carried from row to row)
  float *kT = buf, *ET = kT + C * K, *rT = ET + C * K, *tmp = rT + C * K, *s = tmp + 16 * K;
  const vec zero = vzero();
  for (int64_t J = 0; J < C / L; ++J) {
    const float* Gr = G + (L * J + L - 1) * K;  // block J's last row
    for (int64_t j = 0; j < L; ++j) {  // the right factor k_j exp(G_r - G_j), formed once per chunk
      const int64_t row = (L * J + j) * K;
      for (int64_t c = 0; c < K; c += L)
        store(tmp + j * K + c, mul(load(k + row + c), vexp(sub(load(Gr + c), load(G + row + c)))));
    }
    transpose_block(tmp, K, rT + J * L * K);
    transpose_block(k + J * L * K, K, kT + J * L * K);
  }
  for (int64_t i = 0; i < C; ++i) {
    const int64_t I = i / L;
    const float *Gi = G + i * K, *ki = k + i * K, *qi = q + i * K;
    float *ok = out_k + i * C, *oq = out_q + i * C;
    for (int64_t J = 0; J < I; ++J) {  // blocks before i's own: the left factor x_i exp(G_i - G_r)
      const float* Gr = G + (L * J + L - 1) * K;
      for (int64_t c = 0; c < K; c += L) {
        const vec e = vexp(sub(load(Gi + c), load(Gr + c)));
        store(s + c, mul(load(ki + c), e));
        store(s + K + c, mul(load(qi + c), e));
      }
      const float* R = rT + J * L * K;
      vec ak0 = zero, ak1 = zero, aq0 = zero, aq1 = zero;  // two chains each: half the FMA latency
      for (int64_t d = 0; d < K; d += 2) {
        const vec r0 = load(R + d * L), r1 = load(R + (d + 1) * L);
        ak0 = fmadd(set1(s[d]), r0, ak0);
        aq0 = fmadd(set1(s[K + d]), r0, aq0);
        ak1 = fmadd(set1(s[d + 1]), r1, ak1);
        aq1 = fmadd(set1(s[K + d + 1]), r1, aq1);
      }
      store(ok + L * J, add(ak0, ak1));
      store(oq + L * J, add(aq0, aq1));
    }
    // i's own block: E(i, j) = exp(G_i - G_j) = E(i - 1, j) exp(G_i - G_{i-1}) for j < i, 1 at j = i, 0 past it,
    // carried from row to row in ETI ([K][L]): one multiply per (d, L columns) where exp(G_i - G_j) took a
    // vector exponential. Values below 1e-30 are flushed to 0 (they are nothing beside 1, and would otherwise
    // go subnormal, which is slow, under strong decay).
    const int li = static_cast<int>(i % L);
    const float* KT = kT + I * L * K;
    float* ETI = ET + I * L * K;
    if (li)
      for (int64_t c = 0; c < K; c += L) store(tmp + c, vexp(sub(load(Gi + c), load(Gi - K + c))));
    const vec tiny = set1(1e-30f);
    vec ak = zero, aq = zero;
    for (int64_t d = 0; d < K; ++d) {
      const vec e = own_decay(li ? mul(load(ETI + d * L), set1(tmp[d])) : zero, tiny, li);
      store(ETI + d * L, e);
      const vec kd = mul(load(KT + d * L), e);
      ak = fmadd(set1(ki[d]), kd, ak);
      aq = fmadd(set1(qi[d]), kd, aq);
    }
    store(ok + L * I, upto(ak, li));  // lanes j <= i
    store(oq + L * I, upto(aq, li));
    std::fill(ok + L * (I + 1), ok + C, 0.0f);
    std::fill(oq + L * (I + 1), oq + C, 0.0f);
  }
}

// The vector registers a path has: it bounds the accumulators the loops below keep.
constexpr int kRegisters = L == 16 ? 32 : 16;

// out[i][:] (=, or += with add_to) alpha * sum_{d < D} a(i, d) B[d][:] for rows i < M, where
// a(i, d) = A[i * ars + d * acs] and rows of B and out are L NV wide (strides ldb, ldc). lower: A is zero past its diagonal, so row i stops at
// d = i + 1 (i + 2 for a pair of rows). Two rows at a time where 2 NV accumulators fit half the registers (2 NV
// independent chains of FMAs), else one; a row wider than that in pieces of P vectors.
template <int NV>
HZ_CT void gemm_rows(int64_t M, int64_t D, const float* A, int64_t ars, int64_t acs, const float* Bm, int64_t ldb,
                     float* out, int64_t ldc, float alpha, bool add_to, bool lower) {
  constexpr int R = 2 * NV <= kRegisters / 2 ? 2 : 1;
  constexpr int P = NV < kRegisters / 2 / R ? NV : kRegisters / 2 / R;  // divides NV (powers of two)
  const vec zero = vzero(), scale = set1(alpha);
  for (int64_t i = 0; i < M; i += R) {
    const bool two = R == 2 && i + 1 < M;
    const int64_t Di = lower ? std::min(D, i + 2) : D;
    const float *a0 = A + i * ars, *a1 = A + (two ? i + 1 : i) * ars;
    for (int c0 = 0; c0 < NV; c0 += P) {
      vec c0v[P], c1v[P];
      for (int c = 0; c < P; ++c) c0v[c] = c1v[c] = zero;
      for (int64_t d = 0; d < Di; ++d) {
        const float* b = Bm + d * ldb + L * c0;
        const vec x0 = set1(a0[d * acs]);
        if constexpr (R == 2) {
          const vec x1 = set1(a1[d * acs]);
          for (int c = 0; c < P; ++c) {
            const vec bv = load(b + L * c);
            c0v[c] = fmadd(x0, bv, c0v[c]);
            c1v[c] = fmadd(x1, bv, c1v[c]);
          }
        } else {
          for (int c = 0; c < P; ++c) c0v[c] = fmadd(x0, load(b + L * c), c0v[c]);
        }
      }
      for (int r = 0; r < (two ? 2 : 1); ++r) {
        float* o = out + (i + r) * ldc + L * c0;
        for (int c = 0; c < P; ++c) {
          vec v = mul(scale, r ? c1v[c] : c0v[c]);
          if (add_to) v = add(v, load(o + L * c));
          store(o + L * c, v);
        }
      }
    }
  }
}

// X <- (I + L)^-1 X for L strictly lower triangular [C][C] (the diagonal and above are not read) and X of C rows
// L N wide (row stride ldx): forward substitution, X_i -= sum_{j < i} L_ij X_j, row i in registers (in pieces of
// P vectors where 2 N accumulators would not fit), even and odd j in separate chains.
template <int N>
HZ_CT void forward_substitute(int64_t C, const float* Lm, float* X, int64_t ldx) {
  constexpr int P = L == 16 || N < 4 ? N : 4;  // AVX2: 8 accumulators and the two broadcasts in 16 registers
  for (int64_t i = 1; i < C; ++i) {
    float* xi = X + i * ldx;
    for (int c0 = 0; c0 < N; c0 += P) {
      vec even[P], odd[P];
      for (int c = 0; c < P; ++c) {
        even[c] = load(xi + L * (c0 + c));
        odd[c] = vzero();
      }
      int64_t j = 0;
      for (; j + 1 < i; j += 2) {
        const vec l0 = set1(Lm[i * C + j]), l1 = set1(Lm[i * C + j + 1]);
        const float *x0 = X + j * ldx + L * c0, *x1 = x0 + ldx;
        for (int c = 0; c < P; ++c) {
          even[c] = fnmadd(l0, load(x0 + L * c), even[c]);
          odd[c] = fnmadd(l1, load(x1 + L * c), odd[c]);
        }
      }
      if (j < i) {
        const vec l0 = set1(Lm[i * C + j]);
        for (int c = 0; c < P; ++c) even[c] = fnmadd(l0, load(X + j * ldx + L * (c0 + c)), even[c]);
      }
      for (int c = 0; c < P; ++c) store(xi + L * (c0 + c), add(even[c], odd[c]));
    }
  }
}

// Every chunk of sequence b, head h, in order (K = V). buf: chunk_buffer_floats(C, K).
template <int K>
HZ_CT void chunked_head(const Chunked& p, int64_t b, int64_t h, float* buf) {
  constexpr int NV = K / L;  // vectors a row of K
  constexpr int64_t V = K, W = K + V;
  const int64_t C = p.C, H = p.H, T = p.T;
  float *qc = buf, *kc = qc + C * K, *G = kc + C * K, *dec = G + C * K, *gl = dec + C * K;
  float *X = gl + C * K, *A = X + C * W, *Aq = A + C * C, *sbuf = Aq + C * C, *beta = sbuf + 3 * C * K + 18 * K;
  float* S = p.S + (b * H + h) * K * V;
  const vec zero = vzero(), scale = set1(p.scale);
  for (int64_t t0 = 0; t0 < T; t0 += C) {
    const int64_t n = std::min(C, T - t0);
    // the chunk's rows, contiguous; past n zeros with g = beta = 0 (the state passes through them unchanged)
    for (int64_t i = 0; i < C; ++i) {
      const int64_t row = (b * T + t0 + i) * H + h;
      const bool real = i < n;
      for (int c = 0; c < NV; ++c) {
        const int64_t o = L * c;
        const vec gi = real ? load(p.g + row * K + o) : zero;
        store(G + i * K + o, i ? add(load(G + (i - 1) * K + o), gi) : gi);
        store(qc + i * K + o, real ? mul(load(p.q + row * K + o), scale) : zero);
        store(kc + i * K + o, real ? load(p.k + row * K + o) : zero);
        store(X + i * W + K + o, real ? load(p.v + row * V + o) : zero);
      }
      beta[i] = real ? p.beta[row] : 0.0f;
    }
    chunk_scores(kc, qc, G, C, K, A, Aq, sbuf);
    // (I + diag(beta) A) [W | U] = diag(beta) [k exp(G) | v]
    for (int64_t i = 0; i < C; ++i) {
      const vec bi = set1(beta[i]);
      for (int64_t j = 0; j < i; j += L) store(A + i * C + j, mul(bi, load(A + i * C + j)));
      for (int c = 0; c < NV; ++c) {
        const int64_t o = L * c;
        const vec e = vexp(load(G + i * K + o));
        store(X + i * W + o, mul(bi, mul(load(kc + i * K + o), e)));
        store(X + i * W + K + o, mul(bi, load(X + i * W + K + o)));
        store(dec + i * K + o, mul(load(qc + i * K + o), e));  // q exp(G)
        const vec last = load(G + (C - 1) * K + o);  // k exp(G_last - G)
        store(gl + i * K + o, mul(load(kc + i * K + o), vexp(sub(last, load(G + i * K + o)))));
      }
    }
    forward_substitute<2 * NV>(C, A, X, W);
    float *U = X + K, *out = p.o + ((b * T + t0) * H + h) * V;
    gemm_rows<NV>(C, K, X, W, 1, S, V, U, W, -1.0f, true, false);           // v_new = U - W S, in U's place
    gemm_rows<NV>(n, K, dec, K, 1, S, V, out, H * V, 1.0f, false, false);  // o = q exp(G) S
    gemm_rows<NV>(n, C, Aq, C, 1, U, W, out, H * V, 1.0f, true, true);     //   + Aqk v_new
    for (int c = 0; c < NV; ++c)  // S <- exp(G_last) S + (k exp(G_last - G))^T v_new
      store(sbuf + L * c, vexp(load(G + (C - 1) * K + L * c)));
    for (int64_t d = 0; d < K; ++d) {
      const vec a = set1(sbuf[d]);
      for (int c = 0; c < NV; ++c) store(S + d * V + L * c, mul(a, load(S + d * V + L * c)));
    }
    gemm_rows<NV>(K, C, gl, 1, K, U, W, S, V, 1.0f, true, false);
  }
}

ChunkedFn chunked_head_for(int64_t K) {
  switch (K) {
    case 16: return chunked_head<16>;
    case 32: return chunked_head<32>;
    case 64: return chunked_head<64>;
    case 128: return chunked_head<128>;
    default: return nullptr;
  }
}
