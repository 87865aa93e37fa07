// Row kernels compiled for AVX-512 (F/BW/VL/DQ) with 512-bit vectors, selected at run time when
// the CPU has them. See row_ops_avx2.cpp for why the target pragma follows the headers.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <limits>

#include "../row_math.h"
#include "row_ops.h"

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,prefer-vector-width=512")
#define TPO_ISA_NS avx512
#include "row_kernels.inl"
#pragma GCC pop_options
#endif
