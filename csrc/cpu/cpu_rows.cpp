// The row primitives of k2/cpu_rows.h, one clone per ISA (k2/cpu_math.h's K2_ISA_CLONES).
#include "k2/cpu_rows.h"

#include "k2/cpu_math.h"

namespace k2 {

K2_ISA_CLONES void scale_row(float* out, const float* x, int64_t n, float a) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(out + i, load8(x + i) * a);
  for (; i < n; ++i) out[i] = x[i] * a;
}

K2_ISA_CLONES void scaled_add_row(float* acc, const float* x, int64_t n, float a) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(acc + i, load8(acc + i) + load8(x + i) * a);
  for (; i < n; ++i) acc[i] += x[i] * a;
}

K2_ISA_CLONES float dot_row(const float* x, const float* y, int64_t n) {
  v8f acc{};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc += load8(x + i) * load8(y + i);
  float s = hsum8(acc);
  for (; i < n; ++i) s += x[i] * y[i];
  return s;
}

}  // namespace k2
