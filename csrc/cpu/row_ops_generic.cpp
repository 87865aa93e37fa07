// Row kernels for the baseline instruction set of the target (SSE2 on x86-64).
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <limits>

#include "../row_math.h"
#include "row_ops.h"

#define TPO_ISA_NS generic
#include "row_kernels.inl"
