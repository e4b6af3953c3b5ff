// GPU smoke test of the four program forms for one width, against an FP64 CPU reference, through
// the same argument checks the exported ABI uses (cake::bind). Independent of the Python package.
//   NV=.venv/lib/python3.11/site-packages/nvidia/cu13
//   $NV/bin/nvcc -std=c++17 -O3 --prec-div=true --prec-sqrt=true --ftz=false -DSMOKE_H=4096 \
//     -gencode arch=compute_90a,code=sm_90a -cudart static -L$NV/lib -I csrc/include -I csrc \
//     -o smoke csrc/tools/smoke_test.cu        (tests/test_csrc_tools.py builds it so)
//   ./smoke [T ...]          (default T: 1 7 128 300 4096)
// Exit status 0 = every check passed.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "bindings/export.cuh"
#include "cake_rmsnorm/programs/bwd_column_task.cuh"
#include "cake_rmsnorm/programs/bwd_pair.cuh"
#include "cake_rmsnorm/programs/bwd_single.cuh"
#include "cake_rmsnorm/programs/forward.cuh"

#ifndef SMOKE_H
#define SMOKE_H 4096
#endif
constexpr int H = SMOKE_H;
static int g_fail = 0;

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
  std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); std::exit(2); } } while (0)

static uint16_t f2bf(float f) { uint32_t u; std::memcpy(&u, &f, 4); u += 0x7fffu + ((u >> 16) & 1u); return u >> 16; }
static float bf2f(uint16_t b) { uint32_t u = uint32_t(b) << 16; float f; std::memcpy(&f, &u, 4); return f; }
static uint64_t g_rng = 88172645463325252ull;
static double urand() { g_rng ^= g_rng << 13; g_rng ^= g_rng >> 7; g_rng ^= g_rng << 17; return (g_rng >> 11) * 0x1.0p-53; }
static float nrand() { return float(std::sqrt(-2 * std::log(urand() + 1e-300)) * std::cos(6.283185307179586 * urand())); }

template <class T> struct Dev {
  T* p = nullptr; size_t n;
  explicit Dev(size_t n_) : n(n_) { CK(cudaMalloc(&p, n * sizeof(T) + 16)); }
  ~Dev() { cudaFree(p); }
  void put(const std::vector<T>& v) { CK(cudaMemcpy(p, v.data(), n * sizeof(T), cudaMemcpyHostToDevice)); }
  std::vector<T> get() const { std::vector<T> v(n); CK(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost)); return v; }
};

static void report(const char* what, bool ok, const char* detail) {
  std::printf("  %-44s %s %s\n", what, ok ? "ok  " : "FAIL", detail);
  g_fail += !ok;
}

template <class W> static float wload(const std::vector<W>& w, int j);
template <> float wload<float>(const std::vector<float>& w, int j) { return w[j]; }
template <> float wload<uint16_t>(const std::vector<uint16_t>& w, int j) { return bf2f(w[j]); }

// Runs one backward program; checks dx, dw against the FP64 reference; returns dx+dw bits.
template <class P, class Wh>
static std::vector<uint16_t> run_bwd(const char* name, int64_t T, int grid_cap, const Dev<uint16_t>& dy,
                                     const Dev<uint16_t>* dres, const Dev<uint16_t>& x, const Dev<Wh>& w,
                                     const Dev<float>& rstd, const std::vector<double>& dx_ref,
                                     const std::vector<double>& dx_scale, const std::vector<double>& dw_ref,
                                     bool check) {
  const bool bf16w = sizeof(Wh) == 2;
  int sm = 0; CK(cake::sm_count(&sm));
  size_t wsb = cake::bind::bwd_workspace<P>(T, sm);
  Dev<uint16_t> dx(size_t(T) * H + 8); Dev<Wh> dw(H); Dev<unsigned char> ws(wsb + 256);
  CK(cudaMemset(dw.p, 0xff, H * sizeof(Wh)));
  cake_bwd_args_t a{dy.p, dres ? dres->p : nullptr, x.p, w.p, rstd.p, dx.p, dw.p, ws.p, wsb, T, grid_cap};
  CK(cudaError_t(cake::bind::bwd<P>(&a, nullptr)));
  CK(cudaDeviceSynchronize());
  auto hdx = dx.get(); auto hdw = dw.get();
  std::vector<uint16_t> bits(hdx.begin(), hdx.begin() + size_t(T) * H);
  for (int j = 0; j < H; ++j) { uint32_t u = 0; std::memcpy(&u, &hdw[j], sizeof(Wh)); bits.push_back(u & 0xffff); bits.push_back(u >> 16); }
  if (!check) return bits;
  size_t bad = 0; double worst = 0;
  for (size_t i = 0; i < size_t(T) * H; ++i) {
    double err = std::fabs(bf2f(hdx[i]) - dx_ref[i]), tol = std::ldexp(std::fabs(dx_ref[i]), -8) + 1e-3 * dx_scale[i] + 1e-6;
    if (!(err <= tol)) ++bad;
    worst = std::fmax(worst, err / tol);
  }
  char d[160]; std::snprintf(d, sizeof d, "bad %zu, worst err/tol %.3g", bad, worst); 
  char what[96]; std::snprintf(what, sizeof what, "%s dx", name); report(what, bad == 0, d);
  bad = 0; worst = 0; double num = 0, den = 0;
  for (int j = 0; j < H; ++j) {
    double v = bf16w ? bf2f(uint16_t(bits[size_t(T) * H + 2 * j])) : double(reinterpret_cast<float*>(hdw.data())[j]);
    double err = std::fabs(v - dw_ref[j]);
    double tol = 1e-4 + 1e-4 * std::fabs(dw_ref[j]) + (bf16w ? std::ldexp(std::fabs(dw_ref[j]), -8) : 0.0);
    if (!(err <= tol)) ++bad;
    worst = std::fmax(worst, err / tol); num += err * err; den += dw_ref[j] * dw_ref[j];
  }
  std::snprintf(d, sizeof d, "bad %zu, worst err/tol %.3g, relL2 %.3g", bad, worst, std::sqrt(num / (den + 1e-300)));
  std::snprintf(what, sizeof what, "%s dw", name); report(what, bad == 0, d);
  return bits;
}

template <class Wh, class W, bool kRes>
static void run_case(int64_t T) {
  std::printf("H %d T %lld weight %s residual %d\n", H, (long long)T, sizeof(Wh) == 4 ? "fp32" : "bf16", kRes);
  const size_t N = size_t(T) * H;
  std::vector<uint16_t> hx(N), hr(N), hdy(N), hdres(N);
  std::vector<Wh> hw(H);
  for (size_t i = 0; i < N; ++i) { hx[i] = f2bf(nrand()); hr[i] = f2bf(nrand()); hdy[i] = f2bf(nrand()); hdres[i] = f2bf(nrand()); }
  for (int j = 0; j < H; ++j) { float v = 1.0f + 0.1f * nrand(); if (sizeof(Wh) == 4) std::memcpy(&hw[j], &v, 4); else { uint16_t b = f2bf(v); std::memcpy(&hw[j], &b, 2); } }
  Dev<uint16_t> x(N + 8), r(N + 8), dy(N + 8), dres(N + 8), y(N + 8), ro(N + 8); Dev<Wh> w(H); Dev<float> rstd(size_t(T) + 1);
  x.n = r.n = dy.n = dres.n = y.n = ro.n = N; rstd.n = size_t(T);
  x.put(hx); r.put(hr); dy.put(hdy); dres.put(hdres); w.put(hw);
  cake_fwd_args_t fa{x.p, kRes ? r.p : nullptr, w.p, y.p, kRes ? ro.p : nullptr, rstd.p, T, 1e-6f};
  CK(cudaError_t(cake::bind::fwd<cake::Forward<H, W, kRes, cake::Reduction::kFp32, 4, 0, 1, 0>>(&fa, nullptr)));
  CK(cudaDeviceSynchronize());
  auto hy = y.get(); auto hrs = rstd.get(); std::vector<uint16_t> hh = kRes ? ro.get() : hx;
  // forward reference
  size_t bad = 0, badh = 0; double num = 0, den = 0;
  for (int64_t t = 0; t < T; ++t) {
    double ss = 0;
    for (int j = 0; j < H; ++j) {
      size_t i = size_t(t) * H + j;
      float h = kRes ? bf2f(f2bf(bf2f(hx[i]) + bf2f(hr[i]))) : bf2f(hx[i]);
      if (kRes && bf2f(hh[i]) != h) ++badh;
      ss += double(h) * h;
    }
    double rs = 1.0 / std::sqrt(ss / H + 1e-6);
    num += (hrs[t] - rs) * (hrs[t] - rs); den += rs * rs;
    for (int j = 0; j < H; ++j) {
      size_t i = size_t(t) * H + j;
      double ref = double(bf2f(hh[i])) * rs * wload(hw, j);
      if (!(std::fabs(bf2f(hy[i]) - ref) <= std::ldexp(std::fabs(ref), -8) + 1e-6)) ++bad;
    }
  }
  char d[128];
  std::snprintf(d, sizeof d, "relL2 %.3g", std::sqrt(num / den)); report("fwd rstd", std::sqrt(num / den) <= 1e-5, d);
  std::snprintf(d, sizeof d, "bad %zu", bad); report("fwd y", bad == 0, d);
  if (kRes) { std::snprintf(d, sizeof d, "bad %zu", badh); report("fwd residual_out", badh == 0, d); }
  // backward reference at the forward's rstd, x = h
  std::vector<double> dx_ref(N), dx_scale(N), dw_ref(H, 0.0);
  for (int64_t t = 0; t < T; ++t) {
    double rs = hrs[t], c = 0;
    for (int j = 0; j < H; ++j) { size_t i = size_t(t) * H + j; c += double(bf2f(hdy[i])) * wload(hw, j) * bf2f(hh[i]) * rs; }
    c /= H;
    for (int j = 0; j < H; ++j) {
      size_t i = size_t(t) * H + j;
      double g = double(bf2f(hdy[i])) * wload(hw, j), xh = double(bf2f(hh[i])) * rs;
      dx_ref[i] = rs * (g - xh * c) + (kRes ? bf2f(hdres[i]) : 0.0);
      dx_scale[i] = rs * (std::fabs(g) + std::fabs(xh * c)) + (kRes ? std::fabs(bf2f(hdres[i])) : 0.0);
      dw_ref[j] += double(bf2f(hdy[i])) * bf2f(hh[i]) * rs;
    }
  }
  const Dev<uint16_t>& xin = kRes ? ro : x;
  const Dev<uint16_t>* dr = kRes ? &dres : nullptr;
  using R = cake::Reduction;
  using Pair = cake::BwdPair<H, W, kRes, R::kFp64Fold, 64>;
  using Single = cake::BwdSingle<H, W, kRes, R::kBlockedFp32, 2, 32, 3>;
  using Col = cake::BwdColumnTask<H, W, kRes, R::kTwoSum, 64, 8, 0, 1>;
  auto p0 = run_bwd<Pair>("pair", T, 0, dy, dr, xin, w, rstd, dx_ref, dx_scale, dw_ref, true);
  auto p1 = run_bwd<Pair>("pair", T, 3, dy, dr, xin, w, rstd, dx_ref, dx_scale, dw_ref, false);
  report("pair bits equal at grid_cap 0 / 3", p0 == p1, "");
  run_bwd<Single>("single", T, 0, dy, dr, xin, w, rstd, dx_ref, dx_scale, dw_ref, true);
  run_bwd<Single>("single grid_cap 1", T, 1, dy, dr, xin, w, rstd, dx_ref, dx_scale, dw_ref, true);
  if (T <= 8192) {
    auto c0 = run_bwd<Col>("column_task", T, 0, dy, dr, xin, w, rstd, dx_ref, dx_scale, dw_ref, true);
    auto c1 = run_bwd<Col>("column_task", T, 5, dy, dr, xin, w, rstd, dx_ref, dx_scale, dw_ref, false);
    report("column_task bits equal at grid_cap 0 / 5", c0 == c1, "");
  }
}

int main(int argc, char** argv) {
  std::vector<int64_t> Ts = {1, 7, 128, 300, 4096};
  if (argc > 1) { Ts.clear(); for (int i = 1; i < argc; ++i) Ts.push_back(std::atoll(argv[i])); }
  for (int64_t T : Ts) {
    run_case<float, float, false>(T);
    run_case<float, float, true>(T);
    run_case<uint16_t, __nv_bfloat16, false>(T);
    run_case<uint16_t, __nv_bfloat16, true>(T);
  }
  // T == 0: dw must be zeroed
  {
    Dev<float> dw(H); CK(cudaMemset(dw.p, 0xff, H * 4));
    cake_bwd_args_t a{}; a.dw = dw.p; a.T = 0;
    CK(cudaError_t(cake::bind::bwd<cake::BwdPair<H, float, false, cake::Reduction::kFp64Fold, 64>>(&a, nullptr)));
    CK(cudaDeviceSynchronize());
    auto v = dw.get(); bool ok = true; for (float f : v) ok &= f == 0.0f;
    report("T == 0 writes dw = 0", ok, "");
  }
  std::printf("%s: %d failed checks\n", g_fail ? "FAIL" : "PASS", g_fail);
  return g_fail ? 1 : 0;
}
