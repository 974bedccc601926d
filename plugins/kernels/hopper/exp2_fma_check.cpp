// Checks exp2_fma.h's fma_exp2 on the CPU against exp2 in double precision: its largest relative
// error over [-126, 127] (every x a multiple of 2^-12, the ends of the polynomial's interval and
// their float neighbours), exact zeros below -126.5 and at -inf, NaN kept. Prints one line per
// fact and "result: ok" or "result: FAIL"; exits 1 on a failure. Run by tests/test_kernel_build.py.
#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <limits>

#include "exp2_fma.h"

int main() {
  constexpr double kBound = 4e-6;  // the polynomial's 2.6e-6 and float32 rounding in Horner's steps
  bool ok = true;
  double worst = 0, worst_x = 0;
  auto measure = [&](float x) {
    const double err = std::fabs(double(diffx::fma_exp2(x)) / std::exp2(double(x)) - 1.0);
    if (!(err <= worst)) worst = err, worst_x = x;  // NaN counts as the worst
  };
  for (int i = -126 * 4096; i <= 127 * 4096; ++i) measure(float(i) / 4096.f);
  for (int j = -125; j <= 126; ++j)
    for (float edge : {j - 0.5f, j + 0.5f}) {
      measure(edge);
      measure(std::nextafter(edge, -1e9f));
      measure(std::nextafter(edge, 1e9f));
    }
  std::printf("max relative error %.3g at x = %.9g (bound %.1g)\n", worst, worst_x, kBound);
  ok &= worst <= kBound;
  int nonzero = 0;
  for (int i = -300 * 64; i < int(-126.5 * 64); ++i) nonzero += diffx::fma_exp2(float(i) / 64.f) != 0.f;
  nonzero += diffx::fma_exp2(-std::numeric_limits<float>::infinity()) != 0.f;
  nonzero += diffx::fma_exp2(-std::numeric_limits<float>::max()) != 0.f;
  std::printf("non-zero results below -126.5 or at -inf: %d\n", nonzero);
  ok &= nonzero == 0;
  const bool nan_kept = std::isnan(diffx::fma_exp2(std::numeric_limits<float>::quiet_NaN()));
  std::printf("NaN in, NaN out: %s\n", nan_kept ? "yes" : "no");
  ok &= nan_kept;
  std::printf("result: %s\n", ok ? "ok" : "FAIL");
  return ok ? 0 : 1;
}
