// The OpenMP API calls the kernels make, for a compiler without an OpenMP runtime (Apple's
// clang, clang without libomp): foudre/native/build.py then compiles them with
// `-Xclang -fopenmp -I<this folder>` and links omp_runtime.cpp (beside this folder), a small
// thread pool that serves the runtime calls such a compiler emits.
#pragma once

#ifdef __cplusplus
extern "C" {
#endif
int omp_get_max_threads(void);
int omp_get_thread_num(void);
int omp_get_num_threads(void);
#ifdef __cplusplus
}
#endif
