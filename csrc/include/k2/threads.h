// The thread count of the CPU kernels' OpenMP regions. The Python side sets it to
// torch.get_num_threads() before each call, so `torch.set_num_threads(n)` governs k2's kernels
// too (their OpenMP runtime is not torch's). 0 = the OpenMP default.
#pragma once

namespace k2 {

void set_num_threads(int n);
int num_threads();  // what to pass to `#pragma omp parallel num_threads(...)`

}  // namespace k2
