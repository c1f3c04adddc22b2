/* One instruction set's kernels at every element width. _native.c defines ISA, ISA_AVX2 and
 * ISA_AVX512, then includes this file once per instruction set: it instantiates _native_kernels.h
 * for 16-, 32- and 64-bit elements (float16/bfloat16, float32, float64 bit patterns) and clears
 * the ISA macros for the next one. */
#define WB 16
#include "_native_kernels.h"
#undef WB
#define WB 32
#include "_native_kernels.h"
#undef WB
#define WB 64
#include "_native_kernels.h"
#undef WB
#undef ISA
#undef ISA_AVX2
#undef ISA_AVX512
