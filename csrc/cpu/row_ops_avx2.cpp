// Row kernels compiled for AVX2 + FMA, selected at run time when the CPU has them. The target
// pragma comes after every header, so only the kernels below (in their own namespace) use AVX2;
// shared inline helpers stay baseline code and portable wheels stay portable.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <limits>

#include "../row_math.h"
#include "row_ops.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define TPO_HAVE_AVX2_KERNELS 1
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define TPO_ISA_NS avx2
#include "row_kernels.inl"
#pragma GCC pop_options
#endif
