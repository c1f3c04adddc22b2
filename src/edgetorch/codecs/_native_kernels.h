/* Kernels of the edgetorch codecs for ONE element width and ONE instruction set.
 *
 * A template by inclusion: _native.c includes this file once per (WB, ISA) pair after defining
 *   WB        16, 32 or 64: bits per element (the integer view of float16/bfloat16, float32, float64)
 *   ISA         generic, avx2 or avx512: the suffix of every function defined here
 *   ISA_AVX2    0 or 1: whether explicit SIMD loops are compiled in (x86-64 only, inside a region
 *               compiled for AVX2 and F16C; the dispatcher uses them only where the CPU has both)
 *   ISA_AVX512  0 or 1: the 32- and 64-bit loops use AVX-512F/BW instead (compress and expand
 *               instructions; 16-bit elements keep the AVX2 loops); implies ISA_AVX2
 * Every function name gets the suffix _<WB>_<ISA> (NAME(build_range) -> build_range_32_avx2).
 *
 * Conventions shared by all kernels:
 * - elements are bit patterns (ELEM, unsigned), the sign is the top bit, |v| is bits & ABSMASK;
 * - element i is bit i % 8 of bitmap byte i / 8; a byte range [b0, b1) covers elements
 *   [8 b0, min(8 b1, n)); only the tensor's last byte can be partial, and its unused high bits
 *   are written as 0 (and ignored when read);
 * - the SIMD loops handle a prefix of whole bytes and return where they stopped; the portable
 *   loops after them finish the job, so every instruction set gives identical bytes.
 */

#if WB == 16
#define ELEM uint16_t
#define SELEM int16_t
#elif WB == 32
#define ELEM uint32_t
#define SELEM int32_t
#elif WB == 64
#define ELEM uint64_t
#define SELEM int64_t
#else
#error "WB must be 16, 32 or 64"
#endif

#define ABSMASK ((ELEM)(((ELEM)~(ELEM)0) >> 1))
#define NAME3_(f, w, i) f##_##w##_##i
#define NAME2_(f, w, i) NAME3_(f, w, i)
#define NAME(f) NAME2_(f, WB, ISA)


/* The order key of a float's bits for "low < v < high": +|v| or -|v| as a signed integer of the
 * element's width (-0.0 and +0.0 both map to 0). NaN maps beyond +-Inf, so comparing with the
 * keys of finite-or-infinite bounds excludes it, as a float comparison does. */
static inline SELEM NAME(order_key)(ELEM v) {
    ELEM sign = (ELEM)(v >> (WB - 1));
    return (SELEM)(ELEM)(((v & ABSMASK) ^ (ELEM)(0 - sign)) + sign);
}

#if ISA_AVX512 && WB == 32
static int64_t NAME(build_simd)(const ELEM *x, int64_t i, int64_t end, ELEM limit, uint8_t *bm) {
    const __m512i mask = _mm512_set1_epi32(0x7FFFFFFF), lim = _mm512_set1_epi32((int32_t)limit);
    for (; i + 64 <= end; i += 64) {
        uint64_t bits = 0;
        for (int q = 0; q < 4; q++) {
            __m512i v = _mm512_and_si512(_mm512_loadu_si512((const void *)(x + i + 16 * q)), mask);
            bits |= (uint64_t)_mm512_cmpgt_epi32_mask(v, lim) << (16 * q);
        }
        memcpy(bm + (i >> 3), &bits, 8);
    }
    for (; i + 16 <= end; i += 16) {
        __m512i v = _mm512_and_si512(_mm512_loadu_si512((const void *)(x + i)), mask);
        uint16_t bits = (uint16_t)_mm512_cmpgt_epi32_mask(v, lim);
        memcpy(bm + (i >> 3), &bits, 2);
    }
    return i;
}

static int64_t NAME(mask_simd)(const ELEM *x, int64_t b, int64_t bend, SELEM lo, SELEM hi, uint8_t *bm) {
    const __m512i mask = _mm512_set1_epi32(0x7FFFFFFF);
    const __m512i vlo = _mm512_set1_epi32(lo), vhi = _mm512_set1_epi32(hi);
    for (; b + 2 <= bend; b += 2) {
        __m512i v = _mm512_loadu_si512((const void *)(x + 8 * b));
        __m512i s = _mm512_srai_epi32(v, 31);
        __m512i key = _mm512_sub_epi32(_mm512_xor_si512(_mm512_and_si512(v, mask), s), s);
        uint16_t bits = (uint16_t)(_mm512_cmpgt_epi32_mask(key, vlo) & _mm512_cmpgt_epi32_mask(vhi, key));
        memcpy(bm + b, &bits, 2);
    }
    return b;
}

/* 16 elements (two bitmap bytes) per step: compress the kept lanes, store 16, advance by the count */
static void NAME(compact_simd)(const ELEM *x, const uint8_t *bm, int64_t *pb, int64_t bend, ELEM *out,
                               int64_t *po, int64_t count) {
    int64_t b = *pb, o = *po;
    for (; b + 2 <= bend && o + 16 <= count; b += 2) {
        uint16_t k;
        memcpy(&k, bm + b, 2);
        __m512i v = _mm512_loadu_si512((const void *)(x + 8 * b));
        _mm512_storeu_si512((void *)(out + o), _mm512_maskz_compress_epi32(k, v));
        o += __builtin_popcount(k);
    }
    *pb = b;
    *po = o;
}

static void NAME(scatter_simd)(const uint8_t *bm, int64_t *pb, int64_t bend, const ELEM *vals, int64_t *po,
                               int64_t nvals, ELEM *out) {
    int64_t b = *pb, o = *po;
    for (; b + 2 <= bend && o + 16 <= nvals; b += 2) {
        uint16_t k;
        memcpy(&k, bm + b, 2);
        __m512i v = _mm512_loadu_si512((const void *)(vals + o));
        _mm512_storeu_si512((void *)(out + 8 * b), _mm512_maskz_expand_epi32(k, v));
        o += __builtin_popcount(k);
    }
    *pb = b;
    *po = o;
}

static int64_t NAME(select_simd)(const uint8_t *bm, int64_t b, int64_t bend, ELEM a, ELEM c, ELEM *out) {
    const __m512i va = _mm512_set1_epi32((int32_t)a), vc = _mm512_set1_epi32((int32_t)c);
    for (; b + 2 <= bend; b += 2) {
        uint16_t k;
        memcpy(&k, bm + b, 2);
        _mm512_storeu_si512((void *)(out + 8 * b), _mm512_mask_blend_epi32(k, vc, va));
    }
    return b;
}
#elif ISA_AVX512 && WB == 64
static int64_t NAME(build_simd)(const ELEM *x, int64_t i, int64_t end, ELEM limit, uint8_t *bm) {
    const __m512i mask = _mm512_set1_epi64(0x7FFFFFFFFFFFFFFFLL), lim = _mm512_set1_epi64((int64_t)limit);
    for (; i + 8 <= end; i += 8) {
        __m512i v = _mm512_and_si512(_mm512_loadu_si512((const void *)(x + i)), mask);
        bm[i >> 3] = (uint8_t)_mm512_cmpgt_epi64_mask(v, lim);
    }
    return i;
}

static int64_t NAME(mask_simd)(const ELEM *x, int64_t b, int64_t bend, SELEM lo, SELEM hi, uint8_t *bm) {
    const __m512i mask = _mm512_set1_epi64(0x7FFFFFFFFFFFFFFFLL);
    const __m512i vlo = _mm512_set1_epi64(lo), vhi = _mm512_set1_epi64(hi);
    for (; b < bend; b++) {
        __m512i v = _mm512_loadu_si512((const void *)(x + 8 * b));
        __m512i s = _mm512_srai_epi64(v, 63);
        __m512i key = _mm512_sub_epi64(_mm512_xor_si512(_mm512_and_si512(v, mask), s), s);
        bm[b] = (uint8_t)(_mm512_cmpgt_epi64_mask(key, vlo) & _mm512_cmpgt_epi64_mask(vhi, key));
    }
    return b;
}

static void NAME(compact_simd)(const ELEM *x, const uint8_t *bm, int64_t *pb, int64_t bend, ELEM *out,
                               int64_t *po, int64_t count) {
    int64_t b = *pb, o = *po;
    for (; b < bend && o + 8 <= count; b++) {
        __mmask8 k = bm[b];
        __m512i v = _mm512_loadu_si512((const void *)(x + 8 * b));
        _mm512_storeu_si512((void *)(out + o), _mm512_maskz_compress_epi64(k, v));
        o += POP8[k];
    }
    *pb = b;
    *po = o;
}

static void NAME(scatter_simd)(const uint8_t *bm, int64_t *pb, int64_t bend, const ELEM *vals, int64_t *po,
                               int64_t nvals, ELEM *out) {
    int64_t b = *pb, o = *po;
    for (; b < bend && o + 8 <= nvals; b++) {
        __mmask8 k = bm[b];
        __m512i v = _mm512_loadu_si512((const void *)(vals + o));
        _mm512_storeu_si512((void *)(out + 8 * b), _mm512_maskz_expand_epi64(k, v));
        o += POP8[k];
    }
    *pb = b;
    *po = o;
}

static int64_t NAME(select_simd)(const uint8_t *bm, int64_t b, int64_t bend, ELEM a, ELEM c, ELEM *out) {
    const __m512i va = _mm512_set1_epi64((int64_t)a), vc = _mm512_set1_epi64((int64_t)c);
    for (; b < bend; b++) _mm512_storeu_si512((void *)(out + 8 * b), _mm512_mask_blend_epi64(bm[b], vc, va));
    return b;
}
#elif ISA_AVX2
#if WB == 32
static int64_t NAME(build_simd)(const ELEM *x, int64_t i, int64_t end, ELEM limit, uint8_t *bm) {
    const __m256i mask = _mm256_set1_epi32(0x7FFFFFFF), lim = _mm256_set1_epi32((int32_t)limit);
    for (; i + 32 <= end; i += 32) {
        uint32_t bits = 0;
        for (int q = 0; q < 4; q++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(x + i + 8 * q));
            __m256i keep = _mm256_cmpgt_epi32(_mm256_and_si256(v, mask), lim);
            bits |= (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(keep)) << (8 * q);
        }
        memcpy(bm + (i >> 3), &bits, 4);
    }
    return i;
}

static int64_t NAME(mask_simd)(const ELEM *x, int64_t b, int64_t bend, SELEM lo, SELEM hi, uint8_t *bm) {
    const __m256i mask = _mm256_set1_epi32(0x7FFFFFFF);
    const __m256i vlo = _mm256_set1_epi32(lo), vhi = _mm256_set1_epi32(hi);
    for (; b + 4 <= bend; b += 4) {
        uint32_t bits = 0;
        for (int q = 0; q < 4; q++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(x + 8 * b + 8 * q));
            __m256i s = _mm256_srai_epi32(v, 31);
            __m256i key = _mm256_sub_epi32(_mm256_xor_si256(_mm256_and_si256(v, mask), s), s);
            __m256i in = _mm256_and_si256(_mm256_cmpgt_epi32(key, vlo), _mm256_cmpgt_epi32(vhi, key));
            bits |= (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(in)) << (8 * q);
        }
        memcpy(bm + b, &bits, 4);
    }
    return b;
}

static void NAME(compact_simd)(const ELEM *x, const uint8_t *bm, int64_t *pb, int64_t bend, ELEM *out,
                               int64_t *po, int64_t count) {
    int64_t b = *pb, o = *po;
    for (; b < bend && o + 8 <= count; b++) {
        unsigned byte = bm[b];
        __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)COMPRESS8[byte]));
        __m256i v = _mm256_loadu_si256((const __m256i *)(x + 8 * b));
        _mm256_storeu_si256((__m256i *)(out + o), _mm256_permutevar8x32_epi32(v, idx));
        o += POP8[byte];
    }
    *pb = b;
    *po = o;
}

static void NAME(scatter_simd)(const uint8_t *bm, int64_t *pb, int64_t bend, const ELEM *vals, int64_t *po,
                               int64_t nvals, ELEM *out) {
    const __m256i bitv = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    int64_t b = *pb, o = *po;
    for (; b < bend && o + 8 <= nvals; b++) {
        unsigned byte = bm[b];
        __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)RANK8[byte]));
        __m256i v = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)(vals + o)), idx);
        __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)byte), bitv), bitv);
        _mm256_storeu_si256((__m256i *)(out + 8 * b), _mm256_and_si256(v, set));
        o += POP8[byte];
    }
    *pb = b;
    *po = o;
}

static int64_t NAME(select_simd)(const uint8_t *bm, int64_t b, int64_t bend, ELEM a, ELEM c, ELEM *out) {
    const __m256i bitv = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i va = _mm256_set1_epi32((int32_t)a), vc = _mm256_set1_epi32((int32_t)c);
    for (; b < bend; b++) {
        __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(bm[b]), bitv), bitv);
        _mm256_storeu_si256((__m256i *)(out + 8 * b), _mm256_blendv_epi8(vc, va, set));
    }
    return b;
}
#elif WB == 16
static int64_t NAME(build_simd)(const ELEM *x, int64_t i, int64_t end, ELEM limit, uint8_t *bm) {
    const __m256i mask = _mm256_set1_epi16(0x7FFF), lim = _mm256_set1_epi16((int16_t)limit);
    for (; i + 32 <= end; i += 32) {
        __m256i a = _mm256_cmpgt_epi16(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + i)), mask), lim);
        __m256i c = _mm256_cmpgt_epi16(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + i + 16)), mask), lim);
        /* packs interleaves 128-bit lanes: a0-7 c0-7 a8-15 c8-15; the permute restores order */
        __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi16(a, c), 0xD8);
        uint32_t bits = (uint32_t)_mm256_movemask_epi8(p);
        memcpy(bm + (i >> 3), &bits, 4);
    }
    return i;
}

static int64_t NAME(mask_simd)(const ELEM *x, int64_t b, int64_t bend, SELEM lo, SELEM hi, uint8_t *bm) {
    const __m256i mask = _mm256_set1_epi16(0x7FFF), vlo = _mm256_set1_epi16(lo), vhi = _mm256_set1_epi16(hi);
    for (; b + 4 <= bend; b += 4) {
        __m256i in[2];
        for (int q = 0; q < 2; q++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(x + 8 * b + 16 * q));
            __m256i s = _mm256_srai_epi16(v, 15);
            __m256i key = _mm256_sub_epi16(_mm256_xor_si256(_mm256_and_si256(v, mask), s), s);
            in[q] = _mm256_and_si256(_mm256_cmpgt_epi16(key, vlo), _mm256_cmpgt_epi16(vhi, key));
        }
        __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi16(in[0], in[1]), 0xD8);
        uint32_t bits = (uint32_t)_mm256_movemask_epi8(p);
        memcpy(bm + b, &bits, 4);
    }
    return b;
}

static void NAME(compact_simd)(const ELEM *x, const uint8_t *bm, int64_t *pb, int64_t bend, ELEM *out,
                               int64_t *po, int64_t count) {
    int64_t b = *pb, o = *po;
    for (; b < bend && o + 8 <= count; b++) {
        unsigned byte = bm[b];
        __m128i v = _mm_loadu_si128((const __m128i *)(x + 8 * b));
        __m128i s = _mm_loadu_si128((const __m128i *)SHUF16C[byte]);
        _mm_storeu_si128((__m128i *)(out + o), _mm_shuffle_epi8(v, s));
        o += POP8[byte];
    }
    *pb = b;
    *po = o;
}

static void NAME(scatter_simd)(const uint8_t *bm, int64_t *pb, int64_t bend, const ELEM *vals, int64_t *po,
                               int64_t nvals, ELEM *out) {
    int64_t b = *pb, o = *po;
    for (; b < bend && o + 8 <= nvals; b++) {
        unsigned byte = bm[b];
        __m128i v = _mm_loadu_si128((const __m128i *)(vals + o));
        __m128i s = _mm_loadu_si128((const __m128i *)SHUF16E[byte]); /* unset bits: 0x80 = zero */
        _mm_storeu_si128((__m128i *)(out + 8 * b), _mm_shuffle_epi8(v, s));
        o += POP8[byte];
    }
    *pb = b;
    *po = o;
}

static int64_t NAME(select_simd)(const uint8_t *bm, int64_t b, int64_t bend, ELEM a, ELEM c, ELEM *out) {
    const __m128i bitv = _mm_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128);
    const __m128i va = _mm_set1_epi16((int16_t)a), vc = _mm_set1_epi16((int16_t)c);
    for (; b < bend; b++) {
        __m128i set = _mm_cmpeq_epi16(_mm_and_si128(_mm_set1_epi16(bm[b]), bitv), bitv);
        _mm_storeu_si128((__m128i *)(out + 8 * b), _mm_blendv_epi8(vc, va, set));
    }
    return b;
}
#else /* WB == 64 */
static int64_t NAME(build_simd)(const ELEM *x, int64_t i, int64_t end, ELEM limit, uint8_t *bm) {
    const __m256i mask = _mm256_set1_epi64x(0x7FFFFFFFFFFFFFFFLL), lim = _mm256_set1_epi64x((int64_t)limit);
    for (; i + 32 <= end; i += 32) {
        uint32_t bits = 0;
        for (int q = 0; q < 8; q++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(x + i + 4 * q));
            __m256i keep = _mm256_cmpgt_epi64(_mm256_and_si256(v, mask), lim);
            bits |= (uint32_t)_mm256_movemask_pd(_mm256_castsi256_pd(keep)) << (4 * q);
        }
        memcpy(bm + (i >> 3), &bits, 4);
    }
    return i;
}

static int64_t NAME(mask_simd)(const ELEM *x, int64_t b, int64_t bend, SELEM lo, SELEM hi, uint8_t *bm) {
    const __m256i mask = _mm256_set1_epi64x(0x7FFFFFFFFFFFFFFFLL), zero = _mm256_setzero_si256();
    const __m256i vlo = _mm256_set1_epi64x(lo), vhi = _mm256_set1_epi64x(hi);
    for (; b + 4 <= bend; b += 4) {
        uint32_t bits = 0;
        for (int q = 0; q < 8; q++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(x + 8 * b + 4 * q));
            __m256i s = _mm256_cmpgt_epi64(zero, v);
            __m256i key = _mm256_sub_epi64(_mm256_xor_si256(_mm256_and_si256(v, mask), s), s);
            __m256i in = _mm256_and_si256(_mm256_cmpgt_epi64(key, vlo), _mm256_cmpgt_epi64(vhi, key));
            bits |= (uint32_t)_mm256_movemask_pd(_mm256_castsi256_pd(in)) << (4 * q);
        }
        memcpy(bm + b, &bits, 4);
    }
    return b;
}

static void NAME(compact_simd)(const ELEM *x, const uint8_t *bm, int64_t *pb, int64_t bend, ELEM *out,
                               int64_t *po, int64_t count) {
    int64_t b = *pb, o = *po;
    for (; b < bend && o + 8 <= count; b++) {
        unsigned byte = bm[b];
        for (int h = 0; h < 2; h++) {
            unsigned nib = (byte >> (4 * h)) & 15;
            __m256i idx = _mm256_loadu_si256((const __m256i *)IDX64C[nib]);
            __m256i v = _mm256_loadu_si256((const __m256i *)(x + 8 * b + 4 * h));
            _mm256_storeu_si256((__m256i *)(out + o), _mm256_permutevar8x32_epi32(v, idx));
            o += POP8[nib];
        }
    }
    *pb = b;
    *po = o;
}

static void NAME(scatter_simd)(const uint8_t *bm, int64_t *pb, int64_t bend, const ELEM *vals, int64_t *po,
                               int64_t nvals, ELEM *out) {
    const __m256i bitv = _mm256_setr_epi64x(1, 2, 4, 8);
    int64_t b = *pb, o = *po;
    for (; b < bend && o + 8 <= nvals; b++) {
        unsigned byte = bm[b];
        for (int h = 0; h < 2; h++) {
            unsigned nib = (byte >> (4 * h)) & 15;
            __m256i idx = _mm256_loadu_si256((const __m256i *)IDX64E[nib]);
            __m256i v = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)(vals + o)), idx);
            __m256i set = _mm256_cmpeq_epi64(_mm256_and_si256(_mm256_set1_epi64x(nib), bitv), bitv);
            _mm256_storeu_si256((__m256i *)(out + 8 * b + 4 * h), _mm256_and_si256(v, set));
            o += POP8[nib];
        }
    }
    *pb = b;
    *po = o;
}

static int64_t NAME(select_simd)(const uint8_t *bm, int64_t b, int64_t bend, ELEM a, ELEM c, ELEM *out) {
    const __m256i bitv = _mm256_setr_epi64x(1, 2, 4, 8);
    const __m256i va = _mm256_set1_epi64x((int64_t)a), vc = _mm256_set1_epi64x((int64_t)c);
    for (; b < bend; b++) {
        for (int h = 0; h < 2; h++) {
            __m256i nib = _mm256_set1_epi64x((bm[b] >> (4 * h)) & 15);
            __m256i set = _mm256_cmpeq_epi64(_mm256_and_si256(nib, bitv), bitv);
            _mm256_storeu_si256((__m256i *)(out + 8 * b + 4 * h), _mm256_blendv_epi8(vc, va, set));
        }
    }
    return b;
}
#endif
#endif /* ISA_AVX2 */

/* Bits of [s, e) for "keep iff (x & ABSMASK) > limit". Whole bytes inside the range are written;
 * a byte the range covers only partly is OR-ed into, so the caller zeroes such bytes first. */
static void NAME(build_range)(const void *xv, int64_t s, int64_t e, uint64_t limit64, uint8_t *bm) {
    const ELEM *x = (const ELEM *)xv;
    const ELEM limit = (ELEM)limit64;
    int64_t i = s;
    int64_t head = (s + 7) & ~(int64_t)7;
    if (head > e) head = e;
    for (; i < head; i++) bm[i >> 3] |= (uint8_t)(((x[i] & ABSMASK) > limit) << (i & 7));
    int64_t body = e & ~(int64_t)7;
#if ISA_AVX2
    if (i < body) i = NAME(build_simd)(x, i, body, limit, bm);
#endif
    /* One 0/1 byte per element first (a loop compilers vectorise), then eight flags at a time
     * into a bitmap byte. */
    uint8_t flags[FLAG_BLOCK];
    while (i < body) {
        int64_t len = body - i < FLAG_BLOCK ? body - i : FLAG_BLOCK;
        const ELEM *xs = x + i;
        /* both sides are below the sign bit: a signed compare, which every SIMD unit has */
        for (int64_t k = 0; k < len; k++) flags[k] = (uint8_t)((SELEM)(xs[k] & ABSMASK) > (SELEM)limit);
        uint8_t *out = bm + (i >> 3);
        for (int64_t k = 0; k < len; k += 8) out[k >> 3] = flags_to_byte(flags + k);
        i += len;
    }
    for (; i < e; i++) bm[i >> 3] |= (uint8_t)(((x[i] & ABSMASK) > limit) << (i & 7));
}

/* The kept elements of bytes [b0, b1) written in order to out[0 .. count). Branch-free while
 * eight more slots fit (a write past the last kept element lands on a slot a later element
 * fills); near the end of the range only kept elements are written, so nothing lands beyond
 * out[count - 1], where the next chunk's values begin. */
static void NAME(compact)(const void *xv, const uint8_t *bm, int64_t b0, int64_t b1, int64_t n, void *outv,
                          int64_t count) {
    const ELEM *x = (const ELEM *)xv;
    ELEM *out = (ELEM *)outv;
    int64_t full = n >> 3, bend = b1 < full ? b1 : full, b = b0, o = 0;
#if ISA_AVX2
    NAME(compact_simd)(x, bm, &b, bend, out, &o, count);
#endif
    for (; b < bend; b++) {
        unsigned byte = bm[b];
        const ELEM *xs = x + 8 * b;
        if (o + 8 <= count) {
            for (int j = 0; j < 8; j++) {
                out[o] = xs[j];
                o += (byte >> j) & 1;
            }
        } else {
            for (int j = 0; j < 8; j++)
                if ((byte >> j) & 1) out[o++] = xs[j];
        }
    }
    if (b < b1) { /* the tensor's partial last byte */
        unsigned byte = bm[b];
        for (int64_t i = 8 * b; i < n; i++)
            if ((byte >> (i & 7)) & 1) out[o++] = x[i];
    }
}

/* Dense elements of bytes [b0, b1): vals[o], vals[o + 1], ... where a bit is set, 0 elsewhere.
 * Branch-free (each element reads the value at its rank inside the byte) while eight values
 * remain to read, so no read passes vals[nvals - 1]. */
static void NAME(scatter)(const uint8_t *bm, int64_t b0, int64_t b1, int64_t n, const void *vv, int64_t o,
                          int64_t nvals, void *outv) {
    const ELEM *vals = (const ELEM *)vv;
    ELEM *out = (ELEM *)outv;
    int64_t full = n >> 3, bend = b1 < full ? b1 : full, b = b0;
#if ISA_AVX2
    NAME(scatter_simd)(bm, &b, bend, vals, &o, nvals, out);
#endif
    for (; b < bend; b++) {
        unsigned byte = bm[b];
        ELEM *os = out + 8 * b;
        if (o + 8 <= nvals) {
            const ELEM *vs = vals + o;
            const uint8_t *rank = RANK8[byte];
            for (int j = 0; j < 8; j++) os[j] = vs[rank[j]] & (ELEM)(0 - (ELEM)((byte >> j) & 1));
            o += POP8[byte];
        } else if (o == nvals) {
            /* every value is placed; the caller checked that the bitmap has exactly nvals bits
             * set, so the rest of the range is zeros (an all-zero tensor is one memset) */
            int64_t end = 8 * b1 < n ? 8 * b1 : n;
            memset(os, 0, (size_t)(end - 8 * b) * sizeof(ELEM));
            return;
        } else {
            for (int j = 0; j < 8; j++) os[j] = ((byte >> j) & 1) ? vals[o++] : 0;
        }
    }
    if (b < b1) {
        unsigned byte = bm[b];
        for (int64_t i = 8 * b; i < n; i++) out[i] = ((byte >> (i & 7)) & 1) ? vals[o++] : 0;
    }
}

/* Bits of bytes [b0, b1) for "lo < v < hi", compared as order keys (see order_key). */
static void NAME(mask_pack)(const void *xv, int64_t b0, int64_t b1, int64_t n, int64_t lo64, int64_t hi64,
                            uint8_t *bm) {
    const ELEM *x = (const ELEM *)xv;
    const SELEM lo = (SELEM)lo64, hi = (SELEM)hi64;
    int64_t full = n >> 3, bend = b1 < full ? b1 : full, b = b0;
#if ISA_AVX2
    b = NAME(mask_simd)(x, b, bend, lo, hi, bm);
#endif
    uint8_t flags[FLAG_BLOCK];
    while (b < bend) {
        int64_t nb = bend - b < FLAG_BLOCK / 8 ? bend - b : FLAG_BLOCK / 8;
        const ELEM *xs = x + 8 * b;
        for (int64_t k = 0; k < 8 * nb; k++) {
            SELEM key = NAME(order_key)(xs[k]);
            flags[k] = (uint8_t)((key > lo) & (key < hi));
        }
        for (int64_t k = 0; k < nb; k++) bm[b + k] = flags_to_byte(flags + 8 * k);
        b += nb;
    }
    if (b < b1) {
        unsigned byte = 0;
        for (int64_t i = 8 * b; i < n; i++) {
            SELEM k = NAME(order_key)(x[i]);
            byte |= (unsigned)((k > lo) & (k < hi)) << (i & 7);
        }
        bm[b] = (uint8_t)byte;
    }
}

/* Elements of bytes [b0, b1): a where the bit is set, c elsewhere. */
static void NAME(mask_unpack)(const uint8_t *bm, int64_t b0, int64_t b1, int64_t n, uint64_t a64, uint64_t c64,
                              void *outv) {
    ELEM *out = (ELEM *)outv;
    const ELEM a = (ELEM)a64, c = (ELEM)c64, d = (ELEM)(a ^ c);
    int64_t full = n >> 3, bend = b1 < full ? b1 : full, b = b0;
#if ISA_AVX2
    b = NAME(select_simd)(bm, b, bend, a, c, out);
#endif
    for (; b < bend; b++) {
        unsigned byte = bm[b];
        for (int j = 0; j < 8; j++) out[8 * b + j] = (ELEM)(c ^ (d & (ELEM)(0 - (ELEM)((byte >> j) & 1))));
    }
    if (b < b1) {
        unsigned byte = bm[b];
        for (int64_t i = 8 * b; i < n; i++) out[i] = ((byte >> (i & 7)) & 1) ? a : c;
    }
}

/* Smallest and largest of the signed elements [s, e), s < e. */
static void NAME(minmax)(const void *xv, int64_t s, int64_t e, int64_t *lo, int64_t *hi) {
    const SELEM *x = (const SELEM *)xv;
    SELEM mn = x[s], mx = x[s];
    for (int64_t i = s; i < e; i++) {
        mn = x[i] < mn ? x[i] : mn;
        mx = x[i] > mx ? x[i] : mx;
    }
    *lo = mn;
    *hi = mx;
}

/* y[i] = x[i] for i in [s, e), into a signed integer of out_bits (narrowing only values that fit). */
static void NAME(convert)(const void *xv, int64_t s, int64_t e, void *yv, int out_bits) {
    const SELEM *x = (const SELEM *)xv;
    switch (out_bits) {
    case 8: { int8_t *y = (int8_t *)yv; for (int64_t i = s; i < e; i++) y[i] = (int8_t)x[i]; break; }
    case 16: { int16_t *y = (int16_t *)yv; for (int64_t i = s; i < e; i++) y[i] = (int16_t)x[i]; break; }
    case 32: { int32_t *y = (int32_t *)yv; for (int64_t i = s; i < e; i++) y[i] = (int32_t)x[i]; break; }
    default: { int64_t *y = (int64_t *)yv; for (int64_t i = s; i < e; i++) y[i] = (int64_t)x[i]; break; }
    }
}

/* The k-th smallest (1-indexed, 1 <= k <= n) magnitude key of x[0 .. n) (key = bits & ABSMASK,
 * an unsigned integer that orders like |v|, NaN above Inf) into *thr, and the number of keys
 * above it into *above. Returns -1 when out of memory.
 *
 * Radix select: a histogram of the top digit finds the bin holding the k-th smallest key; the
 * keys in that bin are collected and the next digit refines it, until every bit is fixed.
 * Linear in n whatever the data; equal keys are counted, not sorted. */
static int NAME(radix_kth)(const ELEM *x, int64_t n, int64_t k, ELEM *thr, int64_t *above_out) {
    uint64_t hist[1 << 11]; /* 64-bit: a row may hold more than 2^32 elements */
    const int digit = n >= 16384 ? 11 : 8;
    int64_t above = 0; /* keys known to be above the threshold's bin */
    int rem = WB - 1;  /* key bits not yet fixed */
    int width = rem < digit ? rem : digit;
    int shift = rem - width;
    ELEM prefix = 0;
    int64_t bin_count = 0;

    if (digit == 11 && n <= ((int64_t)1 << 32)) {
        /* Magnitudes pile up in few bins (a float's exponent varies little), and increments of
         * one counter wait on each other; four interleaved copies keep four in flight (the
         * three extra count at most n / 4 < 2^32 each). */
        uint32_t sub[3][1 << 11];
        memset(hist, 0, sizeof(uint64_t) << width);
        memset(sub, 0, sizeof(sub));
        int64_t i = 0;
        for (; i + 4 <= n; i += 4) {
            hist[(x[i] & ABSMASK) >> shift]++;
            sub[0][(x[i + 1] & ABSMASK) >> shift]++;
            sub[1][(x[i + 2] & ABSMASK) >> shift]++;
            sub[2][(x[i + 3] & ABSMASK) >> shift]++;
        }
        for (; i < n; i++) hist[(x[i] & ABSMASK) >> shift]++;
        for (int b = 0; b < (1 << width); b++) hist[b] += sub[0][b] + sub[1][b] + sub[2][b];
    } else {
        memset(hist, 0, sizeof(uint64_t) << width);
        for (int64_t i = 0; i < n; i++) hist[(x[i] & ABSMASK) >> shift]++;
    }
    ELEM *cand = NULL;
    int64_t m = n;
    for (;;) {
        int64_t before = 0;
        ELEM b = 0;
        while (before + (int64_t)hist[b] < k) before += (int64_t)hist[b++];
        bin_count = (int64_t)hist[b];
        k -= before;
        above += m - before - bin_count;
        prefix = (ELEM)((prefix << width) | b);
        rem = shift;
        if (rem == 0) break;
        width = rem < digit ? rem : digit;
        shift = rem - width;
        const ELEM low_mask = (ELEM)(((ELEM)1 << width) - 1);
        memset(hist, 0, sizeof(uint64_t) << width);
        int64_t j = 0;
        if (cand == NULL) { /* first refinement: collect the bin's keys from the row */
            cand = (ELEM *)malloc((size_t)(bin_count > 0 ? bin_count : 1) * sizeof(ELEM));
            if (cand == NULL) return -1;
            /* branch-free: each key is written, the count advances on a match (a branch would
             * mispredict on every few percent of the row that match) */
            ELEM block[256];
            for (int64_t i0 = 0; i0 < n; i0 += 256) {
                int64_t len = n - i0 < 256 ? n - i0 : 256, t = 0;
                for (int64_t i = 0; i < len; i++) {
                    ELEM key = x[i0 + i] & ABSMASK;
                    block[t] = key;
                    t += (key >> rem) == prefix;
                }
                memcpy(cand + j, block, (size_t)t * sizeof(ELEM));
                j += t;
            }
            for (int64_t i = 0; i < j; i++) hist[(cand[i] >> shift) & low_mask]++;
        } else { /* later ones: filter the candidates in place */
            for (int64_t i = 0; i < m; i++) {
                ELEM key = cand[i];
                if ((key >> rem) == prefix) {
                    cand[j++] = key;
                    hist[(key >> shift) & low_mask]++;
                }
            }
        }
        m = j;
    }
    free(cand);
    *thr = prefix;
    *above_out = above;
    return 0;
}

/* The element of rank r (0-indexed) of a[0 .. n) once sorted, reordering a (quickselect,
 * median of three; n is a few hundred, so even a bad pivot run costs little). */
static ELEM NAME(small_nth)(ELEM *a, int64_t n, int64_t r) {
    int64_t lo = 0, hi = n - 1;
    while (hi - lo > 16) {
        int64_t mid = lo + (hi - lo) / 2;
        ELEM x0 = a[lo], x1 = a[mid], x2 = a[hi], p;
        p = x0 < x1 ? (x1 < x2 ? x1 : (x0 < x2 ? x2 : x0)) : (x0 < x2 ? x0 : (x1 < x2 ? x2 : x1));
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] < p) i++;
            while (a[j] > p) j--;
            if (i <= j) {
                ELEM t = a[i];
                a[i] = a[j];
                a[j] = t;
                i++;
                j--;
            }
        }
        if (r <= j) hi = j;
        else if (r >= i) lo = i;
        else return a[r]; /* between the two halves: equal to the pivot */
    }
    for (int64_t i = lo + 1; i <= hi; i++) { /* insertion sort of the last few */
        ELEM v = a[i];
        int64_t j = i - 1;
        while (j >= lo && a[j] > v) a[j + 1] = a[j], j--;
        a[j + 1] = v;
    }
    return a[r];
}

/* Rows at least this long try the sampled bracket first; SAMPLE_SIZE keys are sampled. */
#ifndef SAMPLE_MIN_ROW
#define SAMPLE_MIN_ROW 8192
#define SAMPLE_SIZE 2048
#endif

/* The k-th smallest key of a long row from a bracket found on a sample (Floyd-Rivest style).
 *
 * Why: a radix select reads the row twice (histogram, then collecting the threshold's bin) and
 * its histogram increments are scattered, dependent stores; the thresholds of a long row are
 * well predicted by a small deterministic strided sample. Two sample order statistics around
 * the expected rank of the k-th smallest, a few standard deviations apart, bracket it with high
 * probability: one branch-free pass over the row counts the keys above the upper bound and
 * copies the keys inside [lo, hi] (a few percent of the row) into a scratch buffer, and the
 * exact k-th key is then selected among those (radix_kth on the small buffer). The result is
 * exact whatever the sample says: when the bracket misses (the k-th key lies outside it) or
 * holds too many keys (ties, skewed data), it returns 1 and the caller runs the exact radix
 * select on the whole row. Returns 0 on success, -1 when out of memory. */
static int NAME(sample_kth)(const ELEM *x, int64_t n, int64_t k, ELEM *thr, int64_t *above_out) {
    ELEM sample[SAMPLE_SIZE];
    const int64_t s = SAMPLE_SIZE, stride = n / s;
    for (int64_t i = 0; i < s; i++) sample[i] = x[i * stride + stride / 2] & ABSMASK;
    /* expected (0-indexed) sample rank of the k-th smallest key, and a margin of ~3.5 sigma */
    int64_t r = (int64_t)(((double)k * (double)s) / (double)n) - 1;
    double p = (double)k / (double)n, var = (double)s * p * (1.0 - p);
    int64_t d = 8, d2 = 0;
    while ((double)(d2 + 1) * (double)(d2 + 1) <= var) d2++; /* floor(sqrt(var)) */
    d += (7 * d2 + 1) / 2;
    int64_t rlo = r - d, rhi = r + d;
    ELEM lo = 0, hi = ABSMASK;
    if (rhi < s) hi = NAME(small_nth)(sample, s, rhi);
    if (rlo >= 0) lo = NAME(small_nth)(sample, rhi < s ? rhi : s, rlo); /* rank rlo lies below rhi */
    /* scratch: the expected candidates are ~2d/s of the row; more means the sample misled */
    int64_t cap = n / 4 + 256;
    ELEM *cand = (ELEM *)malloc((size_t)cap * sizeof(ELEM));
    if (cand == NULL) return -1;
    int64_t j = 0, above = 0, i00 = 0;
#if ISA_AVX2 && WB == 32
    if (n < ((int64_t)1 << 32)) {
        /* eight keys a step: count those above hi, compress those inside [lo, hi] to cand[j..]
         * (always a full store of eight; the cap check leaves room for it) */
        const __m256i vm = _mm256_set1_epi32(0x7FFFFFFF), vlo = _mm256_set1_epi32((int32_t)lo - 1),
                      vhi = _mm256_set1_epi32((int32_t)hi);
        __m256i acc = _mm256_setzero_si256();
        for (; i00 + 8 <= n; i00 += 8) {
            __m256i key = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + i00)), vm);
            __m256i gt = _mm256_cmpgt_epi32(key, vhi);
            __m256i in = _mm256_andnot_si256(gt, _mm256_cmpgt_epi32(key, vlo));
            acc = _mm256_sub_epi32(acc, gt);
            unsigned msk = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(in));
            if (j + 8 > cap) {
                free(cand);
                return 1;
            }
            __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)COMPRESS8[msk]));
            _mm256_storeu_si256((__m256i *)(cand + j), _mm256_permutevar8x32_epi32(key, idx));
            j += POP8[msk];
        }
        uint32_t lanes[8];
        _mm256_storeu_si256((__m256i *)lanes, acc);
        for (int q = 0; q < 8; q++) above += lanes[q];
    }
#endif
    ELEM block[256];
    for (int64_t i0 = i00; i0 < n; i0 += 256) {
        int64_t len = n - i0 < 256 ? n - i0 : 256, t = 0, a = 0;
        const ELEM *xs = x + i0;
        for (int64_t i = 0; i < len; i++) { /* counts (vectorised by the compiler) */
            SELEM key = (SELEM)(xs[i] & ABSMASK);
            t += ((key >= (SELEM)lo) & (key <= (SELEM)hi));
            a += key > (SELEM)hi;
        }
        if (t) {
            int64_t u = 0;
            for (int64_t i = 0; i < len; i++) {
                ELEM key = xs[i] & ABSMASK;
                block[u] = key;
                u += (key >= lo) & (key <= hi);
            }
        }
        if (j + t > cap) {
            free(cand);
            return 1;
        }
        memcpy(cand + j, block, (size_t)t * sizeof(ELEM));
        j += t;
        above += a;
    }
    int64_t below = n - j - above; /* keys < lo */
    if (k <= below || k > below + j) {
        free(cand);
        return 1;
    }
    int64_t cabove = 0;
    ELEM t;
    int rc = NAME(radix_kth)(cand, j, k - below, &t, &cabove);
    free(cand);
    if (rc < 0) return -1;
    *thr = t;
    *above_out = above + cabove;
    return 0;
}

/* Per-row top-k threshold of one row of n elements, keeping `keep` (0 < keep < n) magnitudes:
 * the threshold is the (n - keep)-th smallest key (sample_kth on long rows, radix_kth on short
 * ones or when the sample's bracket missed).
 *
 * Writes st[0..2] = (split, L1, L2): the row keeps position p iff key > (p < split ? L1 : L2).
 * Ties at the threshold thr are taken by position: the first `keep - #(key > thr)` of them,
 * i.e. L1 = thr - 1 up to the last tie taken and L2 = thr after it. A zero threshold keeps
 * the non-zeros only (zeros are never stored). Returns -1 when out of memory. */
static int NAME(select_row)(const void *xv, int64_t n, int64_t keep, int64_t *st) {
    const ELEM *x = (const ELEM *)xv;
    int64_t k = n - keep, above = 0;
    ELEM thr = 0;
    int rc = 1;
    if (n >= SAMPLE_MIN_ROW) rc = NAME(sample_kth)(x, n, k, &thr, &above);
    if (rc > 0) rc = NAME(radix_kth)(x, n, k, &thr, &above);
    if (rc < 0) return -1;
    if (thr == 0) { /* at least n - keep zeros: every non-zero survives */
        st[0] = 0;
        st[1] = 0;
        st[2] = 0;
        return 0;
    }
    int64_t ties = keep - above; /* 0 <= ties < #(key == thr) */
    int64_t split = 0;
    if (ties > 0) {
        for (int64_t i = 0, seen = 0; i < n; i++) {
            if ((x[i] & ABSMASK) == thr && ++seen == ties) {
                split = i + 1;
                break;
            }
        }
    }
    st[0] = split;
    st[1] = (int64_t)(thr - 1);
    st[2] = (int64_t)thr;
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * The quantized codec: groups of a [rows, n] tensor, numbered row-major (group g is column block
 * g % groups of row g / groups). A group starts on a code byte (group is a multiple of 8), so
 * groups are independent tasks. The functions taking `bf16` are always inlined into callers that
 * pass a constant, so each element format gets its own vectorised loops.
 */

#if ISA_AVX2 && WB != 64
/* AVX2 loops for float32, float16 and bfloat16 elements (float64 takes the portable loops, which
 * compilers vectorise too): each does a prefix of a group and returns where it stopped. The
 * float operations are the portable loops' (no FMA: AVX2 regions are compiled without it). */

/* 8 elements as float32 bit patterns (a bfloat16 is the top half of its float32; F16C widens a
 * float16 exactly) */
ALWAYS_INLINE __m256i NAME(q_bits8)(const ELEM *x, int bf16) {
#if WB == 32
    (void)bf16;
    return _mm256_loadu_si256((const __m256i *)x);
#else
    __m128i h = _mm_loadu_si128((const __m128i *)x);
    return bf16 ? _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16) : _mm256_castps_si256(_mm256_cvtph_ps(h));
#endif
}

/* 8 codes, not yet packed: (x - lo) * inv plus 0.5, or under stochastic rounding plus a uniform
 * in [0, 1) from 24 bits of the hash of h (the elements' indices xor the seed); clamped into
 * [0, levels] when clamp is set (max(w, 0) returns its second operand for a NaN w: NaN -> 0, as
 * nan_to_num); truncated to int32. */
ALWAYS_INLINE __m256i NAME(q_code8)(__m256 xv, __m256 vlo, __m256 vinv, __m256 vlevels, __m256i h,
                                    int stochastic, int clamp) {
    __m256 off = _mm256_set1_ps(0.5f);
    if (stochastic) {
        h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
        h = _mm256_mullo_epi32(h, _mm256_set1_epi32(0x7FEB352D));
        h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 15));
        h = _mm256_mullo_epi32(h, _mm256_set1_epi32(0x2C1B3C6D));
        h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
        off = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(h, 8)), _mm256_set1_ps(0x1p-24f));
    }
    __m256 w = _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(xv, vlo), vinv), off);
    if (clamp) w = _mm256_min_ps(_mm256_max_ps(w, _mm256_setzero_ps()), vlevels);
    return _mm256_cvttps_epi32(w);
}

/* Pass 1 over x[0 .. j), j = m rounded down to 8, folded into the raw-bit extremes (see
 * group_range): the largest as signed, the largest and smallest as unsigned 32-bit integers. Two
 * sets of accumulators: with one, a 1024-element group took about twice as long. */
ALWAYS_INLINE int64_t NAME(q_extremes_simd)(const ELEM *x, int64_t m, int bf16, uint32_t *smax, uint32_t *umax,
                                            uint32_t *umin) {
    __m256i sx = _mm256_set1_epi32(INT32_MIN), ux = _mm256_setzero_si256(), un = _mm256_set1_epi32(-1);
    __m256i sx2 = sx, ux2 = ux, un2 = un;
    int64_t j = 0;
    for (; j + 16 <= m; j += 16) {
        __m256i b = NAME(q_bits8)(x + j, bf16), b2 = NAME(q_bits8)(x + j + 8, bf16);
        sx = _mm256_max_epi32(sx, b);
        ux = _mm256_max_epu32(ux, b);
        un = _mm256_min_epu32(un, b);
        sx2 = _mm256_max_epi32(sx2, b2);
        ux2 = _mm256_max_epu32(ux2, b2);
        un2 = _mm256_min_epu32(un2, b2);
    }
    for (; j + 8 <= m; j += 8) {
        __m256i b = NAME(q_bits8)(x + j, bf16);
        sx = _mm256_max_epi32(sx, b);
        ux = _mm256_max_epu32(ux, b);
        un = _mm256_min_epu32(un, b);
    }
    sx = _mm256_max_epi32(sx, sx2);
    ux = _mm256_max_epu32(ux, ux2);
    un = _mm256_min_epu32(un, un2);
    __m128i a = _mm_max_epi32(_mm256_castsi256_si128(sx), _mm256_extracti128_si256(sx, 1));
    __m128i c = _mm_max_epu32(_mm256_castsi256_si128(ux), _mm256_extracti128_si256(ux, 1));
    __m128i e = _mm_min_epu32(_mm256_castsi256_si128(un), _mm256_extracti128_si256(un, 1));
    a = _mm_max_epi32(a, _mm_shuffle_epi32(a, 0x4E));
    c = _mm_max_epu32(c, _mm_shuffle_epi32(c, 0x4E));
    e = _mm_min_epu32(e, _mm_shuffle_epi32(e, 0x4E));
    a = _mm_max_epi32(a, _mm_shuffle_epi32(a, 0xB1));
    c = _mm_max_epu32(c, _mm_shuffle_epi32(c, 0xB1));
    e = _mm_min_epu32(e, _mm_shuffle_epi32(e, 0xB1));
    int32_t sa = _mm_cvtsi128_si32(a);
    uint32_t uc = (uint32_t)_mm_cvtsi128_si32(c), ue = (uint32_t)_mm_cvtsi128_si32(e);
    *smax = sa > (int32_t)*smax ? (uint32_t)sa : *smax;
    *umax = uc > *umax ? uc : *umax;
    *umin = ue < *umin ? ue : *umin;
    return j;
}

/* Codes of x[0 .. j), j = m rounded down to 32, packed into out (see codes_of for the rules). */
ALWAYS_INLINE int64_t NAME(q_codes_simd)(const ELEM *x, int64_t m, float lo, float inv, float levels,
                                         const quant_params *q, uint32_t idx0, int bf16, uint8_t *out) {
    const __m256 vlo = _mm256_set1_ps(lo), vinv = _mm256_set1_ps(inv), vlevels = _mm256_set1_ps(levels);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), seed = _mm256_set1_epi32((int32_t)q->seed_mix);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7), low8 = _mm256_set1_epi32(0xFF);
    const int bits = q->bits, stochastic = q->stochastic;
    /* Rounding to nearest with a finite inv needs no clamp: x - lo <= d, so v <= d * (L / d) up
     * to two roundings, within 2^-15 of L, and floor(v + 0.5) <= L; v >= 0 and is never NaN. A
     * stochastic offset can reach L + 1, and inv = Inf (d < L / FLT_MAX) gives Inf and NaN. */
    const int clamp = stochastic || (f32_bits(inv) & 0x7F800000u) == 0x7F800000u;
    int64_t j = 0;
    for (; j + 32 <= m; j += 32) {
        __m256i c[4];
        for (int t = 0; t < 4; t++) {
            __m256i index = _mm256_add_epi32(_mm256_set1_epi32((int32_t)(idx0 + (uint32_t)(j + 8 * t))), lane);
            c[t] = NAME(q_code8)(_mm256_castsi256_ps(NAME(q_bits8)(x + j + 8 * t, bf16)), vlo, vinv, vlevels,
                                 _mm256_xor_si256(index, seed), stochastic, clamp);
        }
        /* 32 codes as bytes in order: the packs interleave 128-bit lanes, the permute undoes it */
        __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
        b = _mm256_permutevar8x32_epi32(b, order);
        if (bits == 8) {
            _mm256_storeu_si256((__m256i *)(out + j), b);
        } else if (bits == 4) { /* each 16-bit lane's low byte: even code | odd code << 4 */
            __m256i p = _mm256_and_si256(_mm256_or_si256(b, _mm256_srli_epi16(b, 4)), _mm256_set1_epi16(0xFF));
            p = _mm256_permute4x64_epi64(_mm256_packus_epi16(p, p), 0x08);
            _mm_storeu_si128((__m128i *)(out + j / 2), _mm256_castsi256_si128(p));
        } else { /* each 32-bit lane's low byte: its four codes, 2 bits each */
            __m256i p = _mm256_or_si256(_mm256_or_si256(b, _mm256_srli_epi32(b, 6)),
                                        _mm256_or_si256(_mm256_srli_epi32(b, 12), _mm256_srli_epi32(b, 18)));
            p = _mm256_packus_epi32(_mm256_and_si256(p, low8), p);
            p = _mm256_packus_epi16(p, p);
            p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
            _mm_storel_epi64((__m128i *)(out + j / 4), _mm256_castsi256_si128(p));
        }
    }
    return j;
}

/* 8 decoded float32 values as this width's elements at out */
ALWAYS_INLINE void NAME(q_store8)(ELEM *out, __m256 v, uint32_t nan16, int bf16) {
#if WB == 32
    (void)nan16, (void)bf16;
    _mm256_storeu_ps((float *)out, v);
#else
    __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    if (!bf16) { /* F16C rounds to nearest even as f32_to_f16; NaN lanes get nan16 */
        __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m128i n16 = _mm_packs_epi32(_mm256_castsi256_si128(_mm256_castps_si256(nan)),
                                      _mm256_extracti128_si256(_mm256_castps_si256(nan), 1));
        _mm_storeu_si128((__m128i *)out, _mm_blendv_epi8(h, _mm_set1_epi16((int16_t)nan16), n16));
        return;
    }
    /* bfloat16, rounded to nearest even as f32_to_bf16 */
    __m256i b = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32((int32_t)nan16), _mm256_castps_si256(nan));
    _mm_storeu_si128((__m128i *)out, _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
#endif
}

/* Codes 8j' .. 8j' + 7 as int32 lanes, j' = j / 8 (bits constant after inlining): 8-bit codes
 * widened from 8 bytes; 4- and 2-bit codes from their 4 or 2 bytes broadcast to every lane, each
 * lane shifted to its field (a broadcast from memory is a plain load). */
ALWAYS_INLINE __m256i NAME(q_codes8)(const uint8_t *in, int64_t j, int bits) {
    if (bits == 8) return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(in + j)));
    if (bits == 4) {
        int32_t w;
        memcpy(&w, in + j / 2, 4);
        return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                _mm256_set1_epi32(15));
    }
    int16_t h;
    memcpy(&h, in + j / 4, 2);
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi16(h), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                            _mm256_set1_epi32(3));
}

/* Elements [0, j) of a group, j = m rounded down to 8: lo + code * scale, as this width's element
 * (bits constant after inlining; 32 elements a step, then 8). */
ALWAYS_INLINE int64_t NAME(q_decode_simd)(const uint8_t *in, int64_t m, float lo, float scale, int bits,
                                          uint32_t nan16, int bf16, ELEM *out) {
    const __m256 vlo = _mm256_set1_ps(lo), vscale = _mm256_set1_ps(scale);
    int64_t j = 0;
    for (; j + 32 <= m; j += 32) {
        __m256i c0 = NAME(q_codes8)(in, j, bits), c1 = NAME(q_codes8)(in, j + 8, bits);
        __m256i c2 = NAME(q_codes8)(in, j + 16, bits), c3 = NAME(q_codes8)(in, j + 24, bits);
        NAME(q_store8)(out + j, _mm256_add_ps(vlo, _mm256_mul_ps(_mm256_cvtepi32_ps(c0), vscale)), nan16, bf16);
        NAME(q_store8)(out + j + 8, _mm256_add_ps(vlo, _mm256_mul_ps(_mm256_cvtepi32_ps(c1), vscale)), nan16, bf16);
        NAME(q_store8)(out + j + 16, _mm256_add_ps(vlo, _mm256_mul_ps(_mm256_cvtepi32_ps(c2), vscale)), nan16, bf16);
        NAME(q_store8)(out + j + 24, _mm256_add_ps(vlo, _mm256_mul_ps(_mm256_cvtepi32_ps(c3), vscale)), nan16, bf16);
    }
    for (; j + 8 <= m; j += 8)
        NAME(q_store8)(out + j, _mm256_add_ps(vlo, _mm256_mul_ps(_mm256_cvtepi32_ps(NAME(q_codes8)(in, j, bits)), vscale)),
                       nan16, bf16);
    return j;
}
#endif /* ISA_AVX2 && WB != 64 */

/* Element j as the float32 the reference computes with (x.float()): exact from float16 and
 * bfloat16, rounded to nearest from float64. */
ALWAYS_INLINE float NAME(load_f32)(const ELEM *x, int64_t j, int bf16) {
#if WB == 16
    return bf16 ? f32_from((uint32_t)x[j] << 16) : f16_to_f32(x[j]);
#elif WB == 32
    (void)bf16;
    return f32_from(x[j]);
#else
    (void)bf16;
    double d;
    memcpy(&d, &x[j], 8);
    return (float)d;
#endif
}

/* A decoded float32 as this width's element: rounded to nearest even for 16 bits (torch's
 * .to()), NaN as torch writes it (nan16); widened exactly to float64. */
ALWAYS_INLINE ELEM NAME(store_f32)(float v, uint32_t nan16, int bf16) {
#if WB == 16
    return bf16 ? f32_to_bf16(v, nan16) : f32_to_f16(v, nan16);
#elif WB == 32
    (void)nan16, (void)bf16;
    return f32_bits(v);
#else
    (void)nan16, (void)bf16;
    double d = (double)v;
    ELEM b;
    memcpy(&b, &d, 8);
    return b;
#endif
}

/* One unpacked code byte per element of xs[0 .. m): v = (x - lo) * inv, then floor(v + 0.5) or
 * floor(v + u) (u: the hash of the element's row-major index idx0 + j), clamped to [0, L]. The
 * operations and their order are the reference's. v + offset is never negative (x >= lo), so
 * truncation is floor; it is NaN only as 0 * Inf (x == lo where d is so small that L / d
 * overflowed), which the reference's nan_to_num makes 0, as `w >= 0 ? w : 0` does here. */
ALWAYS_INLINE void NAME(codes_of)(const ELEM *xs, int64_t m, float lo, float inv, float levels,
                                  const quant_params *q, uint32_t idx0, int bf16, uint8_t *out) {
    if (q->stochastic) {
        const uint32_t seed_mix = q->seed_mix;
        for (int64_t j = 0; j < m; j++) {
            float v = (NAME(load_f32)(xs, j, bf16) - lo) * inv;
            float w = v + hash_uniform(idx0 + (uint32_t)j, seed_mix);
            w = w >= 0.0f ? w : 0.0f;
            w = w < levels ? w : levels;
            out[j] = (uint8_t)(int32_t)w;
        }
    } else {
        for (int64_t j = 0; j < m; j++) {
            float v = (NAME(load_f32)(xs, j, bf16) - lo) * inv;
            float w = v + 0.5f;
            w = w >= 0.0f ? w : 0.0f;
            w = w < levels ? w : levels;
            out[j] = (uint8_t)(int32_t)w;
        }
    }
}

/* len one-byte codes (c has room for a multiple of 4) as 4- or 2-bit fields, least significant
 * first; the last byte's unused fields are 0. */
static void NAME(pack_codes)(uint8_t *c, int64_t len, int bits, uint8_t *out) {
    int64_t per = 8 / bits, nb = (len + per - 1) / per;
    for (int64_t k = len; k < nb * per; k++) c[k] = 0;
    if (bits == 4) {
        for (int64_t b = 0; b < nb; b++) out[b] = (uint8_t)(c[2 * b] | c[2 * b + 1] << 4);
    } else {
        for (int64_t b = 0; b < nb; b++)
            out[b] = (uint8_t)(c[4 * b] | c[4 * b + 1] << 2 | c[4 * b + 2] << 4 | c[4 * b + 3] << 6);
    }
}

/* lo and d = hi - lo of the group xs[0 .. m), with d NaN for a group holding NaN or +-Inf
 * (d = Inf: the range overflows). Pass 1 reduces raw float32 bits as integers, an exact reduction
 * compilers vectorise (a float min/max loop they leave scalar: its NaN and signed-zero rules are
 * not associative): unsigned, a larger negative float has larger bits, so the minimum is the
 * largest unsigned bits if any sign bit is set, else the smallest; the maximum is the largest
 * signed bits if any sign bit is clear, else the smallest unsigned. */
ALWAYS_INLINE void NAME(group_range)(const ELEM *xs, int64_t m, int bf16, float *lo_out, float *d_out) {
    uint32_t smax = (uint32_t)INT32_MIN, umax = 0, umin = UINT32_MAX;
    int64_t j = 0;
#if ISA_AVX2 && WB != 64
    j = NAME(q_extremes_simd)(xs, m, bf16, &smax, &umax, &umin);
#endif
    for (; j < m; j++) {
        uint32_t b = f32_bits(NAME(load_f32)(xs, j, bf16));
        smax = (int32_t)b > (int32_t)smax ? b : smax;
        umax = b > umax ? b : umax;
        umin = b < umin ? b : umin;
    }
    if ((int32_t)smax >= 0x7F800000 || umax >= 0xFF800000u) { /* +Inf/NaN, or -Inf/NaN */
        *lo_out = 0.0f;
        *d_out = f32_from(F32_NAN);
        return;
    }
    uint32_t lo = umax >= 0x80000000u ? umax : umin, hi = (int32_t)smax >= 0 ? smax : umin;
    if (lo == 0x80000000u) {
        /* the minimum is zero and a -0.0 is there: torch's aminmax keeps the first zero it
         * meets (ties never replace), and that zero's sign is lo's */
        for (j = 0; j < m; j++) {
            uint32_t b = f32_bits(NAME(load_f32)(xs, j, bf16));
            if ((b & 0x7FFFFFFFu) == 0) {
                lo = b;
                break;
            }
        }
    }
    *lo_out = f32_from(lo);
    *d_out = f32_from(hi) - f32_from(lo);
}

/* One group (group g, column block k of row r): two passes, the second while the group is in L1:
 * its range, then its codes. */
ALWAYS_INLINE void NAME(quantize_one)(const ELEM *x, const quant_params *q, int64_t g, int64_t r, int64_t k, int bf16) {
    const int bits = q->bits;
    const float levels = (float)((1 << bits) - 1);
    uint8_t block[QBLOCK];
    const int64_t s = k * q->group, m = q->n - s < q->group ? q->n - s : q->group;
    const ELEM *xs = x + r * q->n + s;
    uint8_t *out = q->codes + r * q->row_bytes + s * bits / 8;
    float lo, d;
    NAME(group_range)(xs, m, bf16, &lo, &d);
    if ((f32_bits(d) & 0x7F800000u) == 0x7F800000u) { /* non-finite: lo = scale = NaN, codes 0 */
        q->lo[g] = q->scale[g] = f32_from(F32_NAN);
        memset(out, 0, (size_t)((m * bits + 7) / 8));
        return;
    }
    q->lo[g] = lo;
    if (!(d > 0.0f)) { /* constant: every code 0 (v = 0 whatever the offset) */
        q->scale[g] = 0.0f;
        memset(out, 0, (size_t)((m * bits + 7) / 8));
        return;
    }
    q->scale[g] = d / levels;
    const float inv = levels / d;
    const uint32_t idx0 = (uint32_t)(r * q->n + s); /* the hash reads the index mod 2^32 */
    int64_t j = 0;
#if ISA_AVX2 && WB != 64
    j = NAME(q_codes_simd)(xs, m, lo, inv, levels, q, idx0, bf16, out);
#endif
    if (bits == 8) {
        NAME(codes_of)(xs + j, m - j, lo, inv, levels, q, idx0 + (uint32_t)j, bf16, out + j);
        return;
    }
    for (int64_t j0 = j; j0 < m; j0 += QBLOCK) {
        int64_t n0 = m - j0 < QBLOCK ? m - j0 : QBLOCK;
        NAME(codes_of)(xs + j0, n0, lo, inv, levels, q, idx0 + (uint32_t)j0, bf16, block);
        NAME(pack_codes)(block, n0, bits, out + j0 * bits / 8);
    }
}

#if ISA_AVX2 && WB != 64
/* ---- Batched groups (AVX2; group a multiple of 32) ---------------------------------------------
 * Per group the work is a few dozen vector operations a pass, so what a group costs besides them
 * (reducing the extremes across lanes, two dependent divisions, the checks) was as much again.
 * Here the ranges of up to 8 consecutive whole groups are found together: each group's extremes
 * stay vectors, one transposed reduction gives the 8 groups' extremes in the lanes of one vector,
 * and lo, d, scale and inv of all 8 come from one vector division each (the same IEEE operations,
 * so the same bits, as group_range and quantize_groups). The codes pass then reads each group
 * again, from L1. */

/* Lane i of the result: the reduction of a[i]'s 8 lanes (a transpose folded into the reduction). */
#define Q_LANE_REDUCE(fn, OP)                                                                       \
    ALWAYS_INLINE __m256i NAME(fn)(const __m256i *a) {                                              \
        __m256i t0 = OP(_mm256_unpacklo_epi32(a[0], a[1]), _mm256_unpackhi_epi32(a[0], a[1]));      \
        __m256i t1 = OP(_mm256_unpacklo_epi32(a[2], a[3]), _mm256_unpackhi_epi32(a[2], a[3]));      \
        __m256i t2 = OP(_mm256_unpacklo_epi32(a[4], a[5]), _mm256_unpackhi_epi32(a[4], a[5]));      \
        __m256i t3 = OP(_mm256_unpacklo_epi32(a[6], a[7]), _mm256_unpackhi_epi32(a[6], a[7]));      \
        __m256i u0 = OP(_mm256_unpacklo_epi64(t0, t1), _mm256_unpackhi_epi64(t0, t1));              \
        __m256i u1 = OP(_mm256_unpacklo_epi64(t2, t3), _mm256_unpackhi_epi64(t2, t3));              \
        return OP(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31)); \
    }
Q_LANE_REDUCE(q_lanes_smax, _mm256_max_epi32)
Q_LANE_REDUCE(q_lanes_umax, _mm256_max_epu32)
Q_LANE_REDUCE(q_lanes_umin, _mm256_min_epu32)
#undef Q_LANE_REDUCE

/* 32 codes (int32, 8 a vector, in order) as bytes in the order of the elements */
ALWAYS_INLINE __m256i NAME(q_bytes32)(__m256i c0, __m256i c1, __m256i c2, __m256i c3) {
    /* the packs interleave 128-bit lanes: 4-byte units come out as 0 2 4 6 | 1 3 5 7 */
    return _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
}

/* The codes of one whole group (m a multiple of 32), bits / stochastic / clamp constant after
 * inlining. clamp: min(max(w, 0), L) as codes_of, for inv = Inf (Inf and 0 * Inf = NaN). Without
 * it the unsigned saturating packs clamp: w >= 0, a NaN w (a non-finite group's x * 0) truncates to
 * INT32_MIN, which they make 0, and w < L + 2 (v <= d * (L / d) up to two roundings), so a
 * stochastic offset's L + 1 saturates to 255 at 8 bits and takes a byte minimum at 4 and 2. */
ALWAYS_INLINE void NAME(q_codes_group)(const ELEM *x, int64_t m, float lo, float inv, uint32_t seed_mix,
                                       uint32_t idx0, int bf16, int bits, int stochastic, int clamp,
                                       uint8_t *out, const ELEM *pf) {
    const __m256 vlo = _mm256_set1_ps(lo), vinv = _mm256_set1_ps(inv), vlevels = _mm256_set1_ps((float)((1 << bits) - 1));
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), seed = _mm256_set1_epi32((int32_t)seed_mix);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i pair4 = _mm256_set1_epi16(0x1001), pair2 = _mm256_set1_epi16(0x0401);
    const __m256i quad2 = _mm256_set1_epi32(0x00100001), top = _mm256_set1_epi8((char)((1 << bits) - 1));
    const __m256i eight = _mm256_set1_epi32(8);
    __m256i ctr = _mm256_add_epi32(_mm256_set1_epi32((int32_t)idx0), lane); /* the hash's element indices */
    for (int64_t j = 0; j < m; j += 32) {
        /* the next batch's same group, into L1 while this one computes (a prefetch never faults) */
        _mm_prefetch((const char *)(pf + j), _MM_HINT_T0);
        if (WB == 32) _mm_prefetch((const char *)(pf + j) + 64, _MM_HINT_T0);
        __m256i c[4];
        for (int t = 0; t < 4; t++) {
            c[t] = NAME(q_code8)(_mm256_castsi256_ps(NAME(q_bits8)(x + j + 8 * t, bf16)), vlo, vinv, vlevels,
                                 _mm256_xor_si256(ctr, seed), stochastic, clamp);
            ctr = _mm256_add_epi32(ctr, eight);
        }
        __m256i b = NAME(q_bytes32)(c[0], c[1], c[2], c[3]); /* units 0 2 4 6 | 1 3 5 7 */
        if (stochastic && !clamp && bits < 8) b = _mm256_min_epu8(b, top);
        if (bits == 8) {
            _mm256_storeu_si256((__m256i *)(out + j), _mm256_permutevar8x32_epi32(b, order));
        } else if (bits == 4) {
            /* byte pairs (even, odd) of one unit -> even | odd << 4; a unit is now 2 bytes, the
             * lanes hold units 0 2 4 6 and 1 3 5 7: interleaving them gives the order */
            __m256i p = _mm256_maddubs_epi16(b, pair4);
            p = _mm256_packus_epi16(p, p);
            _mm_storeu_si128((__m128i *)(out + j / 2),
                             _mm_unpacklo_epi16(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1)));
        } else {
            /* four codes of a unit -> one byte: c0 + 4 c1 per pair, then pair0 + 16 pair1 */
            __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(b, pair2), quad2);
            p = _mm256_packus_epi32(p, p);
            p = _mm256_packus_epi16(p, p);
            _mm_storel_epi64((__m128i *)(out + j / 4),
                             _mm_unpacklo_epi8(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1)));
        }
    }
}

/* Groups [g, g + cnt) (1 <= cnt <= 8), whole and consecutive in memory at x, codes at out; the
 * hash index of x[0] is idx0. */
ALWAYS_INLINE void NAME(q_batch)(const ELEM *x, int64_t cnt, int64_t group, const quant_params *q, int64_t g,
                                 uint32_t idx0, int bf16, int bits, int stochastic, uint8_t *out) {
    __m256i SX[8], UX[8], UN[8];
    if (cnt < 1) return;
    for (int64_t i = 0; i < cnt; i++) {
        const ELEM *xs = x + i * group;
        __m256i sx = _mm256_set1_epi32(INT32_MIN), ux = _mm256_setzero_si256(), un = _mm256_set1_epi32(-1);
        /* 32 elements a step (group is a multiple of 32), folded as a tree into one accumulator
         * per extreme: with 16 a step and two sets, gcc copied every accumulator between
         * registers each step, as many instructions as the reduction's */
        for (int64_t j = 0; j < group; j += 32) {
            __m256i b0 = NAME(q_bits8)(xs + j, bf16), b1 = NAME(q_bits8)(xs + j + 8, bf16);
            __m256i b2 = NAME(q_bits8)(xs + j + 16, bf16), b3 = NAME(q_bits8)(xs + j + 24, bf16);
            sx = _mm256_max_epi32(sx, _mm256_max_epi32(_mm256_max_epi32(b0, b1), _mm256_max_epi32(b2, b3)));
            ux = _mm256_max_epu32(ux, _mm256_max_epu32(_mm256_max_epu32(b0, b1), _mm256_max_epu32(b2, b3)));
            un = _mm256_min_epu32(un, _mm256_min_epu32(_mm256_min_epu32(b0, b1), _mm256_min_epu32(b2, b3)));
        }
        SX[i] = sx;
        UX[i] = ux;
        UN[i] = un;
    }
    for (int64_t i = cnt; i < 8; i++) SX[i] = SX[0], UX[i] = UX[0], UN[i] = UN[0];
    const __m256i smax = NAME(q_lanes_smax)(SX), umax = NAME(q_lanes_umax)(UX), umin = NAME(q_lanes_umin)(UN);
    /* as group_range: +Inf/NaN makes smax >= 0x7F800000, -Inf/NaN umax >= 0xFF800000 */
    __m256i bad = _mm256_or_si256(_mm256_cmpgt_epi32(smax, _mm256_set1_epi32(0x7F7FFFFF)),
                                  _mm256_cmpeq_epi32(_mm256_max_epu32(umax, _mm256_set1_epi32((int32_t)0xFF800000u)), umax));
    /* lo = umax if its sign is set, else umin; hi = smax if its sign is clear, else umin */
    __m256 lo = _mm256_blendv_ps(_mm256_castsi256_ps(umin), _mm256_castsi256_ps(umax), _mm256_castsi256_ps(umax));
    __m256 hi = _mm256_blendv_ps(_mm256_castsi256_ps(smax), _mm256_castsi256_ps(umin), _mm256_castsi256_ps(smax));
    const int live = (1 << cnt) - 1;
    int negzero = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_andnot_si256(
                      bad, _mm256_cmpeq_epi32(_mm256_castps_si256(lo), _mm256_set1_epi32(INT32_MIN))))) & live;
    if (negzero) { /* a -0.0 minimum: the first zero's sign, as group_range */
        float los[8];
        _mm256_storeu_ps(los, lo);
        for (int i = 0; i < 8; i++) {
            if (!((negzero >> i) & 1)) continue;
            for (int64_t j = 0; j < group; j++) {
                uint32_t b = f32_bits(NAME(load_f32)(x + i * group, j, bf16));
                if ((b & 0x7FFFFFFFu) == 0) {
                    los[i] = f32_from(b);
                    break;
                }
            }
        }
        lo = _mm256_loadu_ps(los);
    }
    const __m256 d = _mm256_sub_ps(hi, lo), levels = _mm256_set1_ps((float)((1 << bits) - 1));
    const __m256i expo = _mm256_set1_epi32(0x7F800000);
    bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(d), expo), expo));
    const __m256 badf = _mm256_castsi256_ps(bad), nan = _mm256_castsi256_ps(_mm256_set1_epi32((int32_t)F32_NAN));
    const __m256 pos = _mm256_andnot_ps(badf, _mm256_cmp_ps(d, _mm256_setzero_ps(), _CMP_GT_OQ));
    const __m256 scale = _mm256_and_ps(_mm256_div_ps(d, levels), pos);
    const __m256 inv = _mm256_and_ps(_mm256_div_ps(levels, d), pos);
    const __m256 lo_out = _mm256_blendv_ps(lo, nan, badf), scale_out = _mm256_blendv_ps(scale, nan, badf);
    float los[8], invs[8];
    if (cnt == 8) {
        _mm256_storeu_ps(q->lo + g, lo_out);
        _mm256_storeu_ps(q->scale + g, scale_out);
    } else {
        float a[8], b[8];
        _mm256_storeu_ps(a, lo_out);
        _mm256_storeu_ps(b, scale_out);
        memcpy(q->lo + g, a, (size_t)cnt * sizeof(float));
        memcpy(q->scale + g, b, (size_t)cnt * sizeof(float));
    }
    /* codes: a non-finite group's x goes through lo = 0, inv = 0 (codes 0, as a constant group's) */
    _mm256_storeu_ps(los, _mm256_andnot_ps(badf, lo));
    _mm256_storeu_ps(invs, inv);
    const int infinite = _mm256_movemask_ps(_mm256_cmp_ps(inv, _mm256_set1_ps(INFINITY), _CMP_EQ_OQ));
    const int64_t gbytes = group * bits / 8;
    for (int64_t i = 0; i < cnt; i++) {
        const ELEM *xs = x + i * group;
        const uint32_t id = idx0 + (uint32_t)(i * group);
        if (stochastic && ((infinite >> i) & 1))
            NAME(q_codes_group)(xs, group, los[i], invs[i], q->seed_mix, id, bf16, bits, 1, 1, out + i * gbytes, xs + 8 * group);
        else if (stochastic)
            NAME(q_codes_group)(xs, group, los[i], invs[i], q->seed_mix, id, bf16, bits, 1, 0, out + i * gbytes, xs + 8 * group);
        else if ((infinite >> i) & 1)
            NAME(q_codes_group)(xs, group, los[i], invs[i], 0, id, bf16, bits, 0, 1, out + i * gbytes, xs + 8 * group);
        else
            NAME(q_codes_group)(xs, group, los[i], invs[i], 0, id, bf16, bits, 0, 0, out + i * gbytes, xs + 8 * group);
    }
}

/* Groups [g0, g1): whole groups in batches of up to 8, a row's short last group as quantize_groups */
ALWAYS_INLINE void NAME(quantize_batched)(const ELEM *x, const quant_params *q, int64_t g0, int64_t g1, int bf16,
                                          int bits, int stochastic) {
    const int64_t group = q->group, whole = q->n / group; /* whole groups a row */
    int64_t r = g0 / q->groups, k = g0 - r * q->groups;
    for (int64_t g = g0; g < g1;) {
        if (k == q->groups) k = 0, r++;
        if (k < whole) {
            int64_t cnt = whole - k;
            cnt = cnt < 8 ? cnt : 8;
            cnt = cnt < g1 - g ? cnt : g1 - g;
            const int64_t s = k * group;
            NAME(q_batch)(x + r * q->n + s, cnt, group, q, g, (uint32_t)(r * q->n + s), bf16, bits, stochastic,
                          q->codes + r * q->row_bytes + s * bits / 8);
            g += cnt, k += cnt;
        } else {
            NAME(quantize_one)(x, q, g, r, k, bf16);
            g++, k++;
        }
    }
}
#endif /* ISA_AVX2 && WB != 64 */

/* Groups [g0, g1): with AVX2 and groups of a multiple of 32 elements, whole groups in batches (a
 * specialised copy per width and rounding); otherwise one group at a time. */
ALWAYS_INLINE void NAME(quantize_groups)(const ELEM *x, const quant_params *q, int64_t g0, int64_t g1, int bf16) {
#if ISA_AVX2 && WB != 64
    if (q->group % 32 == 0) {
        if (q->stochastic) {
            if (q->bits == 8) NAME(quantize_batched)(x, q, g0, g1, bf16, 8, 1);
            else if (q->bits == 4) NAME(quantize_batched)(x, q, g0, g1, bf16, 4, 1);
            else NAME(quantize_batched)(x, q, g0, g1, bf16, 2, 1);
        } else {
            if (q->bits == 8) NAME(quantize_batched)(x, q, g0, g1, bf16, 8, 0);
            else if (q->bits == 4) NAME(quantize_batched)(x, q, g0, g1, bf16, 4, 0);
            else NAME(quantize_batched)(x, q, g0, g1, bf16, 2, 0);
        }
        return;
    }
#endif
    int64_t r = g0 / q->groups, k = g0 - r * q->groups; /* stepped, not divided, per group */
    for (int64_t g = g0; g < g1; g++, k++) {
        if (k == q->groups) k = 0, r++;
        NAME(quantize_one)(x, q, g, r, k, bf16);
    }
}

/* Codes, lo and scale of groups [g0, g1) of the tensor at x. */
static void NAME(quantize)(const void *x, const quant_params *q, int64_t g0, int64_t g1) {
#if WB == 16
    if (q->bf16) {
        NAME(quantize_groups)((const ELEM *)x, q, g0, g1, 1);
        return;
    }
#endif
    NAME(quantize_groups)((const ELEM *)x, q, g0, g1, 0);
}

ALWAYS_INLINE void NAME(dequantize_bits)(const quant_params *q, ELEM *out, int64_t g0, int64_t g1, int bf16,
                                        const int bits) {
    const uint32_t nan16 = q->nan16;
    uint8_t block[QBLOCK];
    int64_t r = g0 / q->groups, k = g0 - r * q->groups;
    for (int64_t g = g0; g < g1; g++, k++) {
        if (k == q->groups) k = 0, r++;
        int64_t s = k * q->group, m = q->n - s < q->group ? q->n - s : q->group, j = 0;
        const uint8_t *in = q->codes + r * q->row_bytes + s * bits / 8;
        ELEM *o = out + r * q->n + s;
        const float lo = q->lo[g], scale = q->scale[g];
#if ISA_AVX2 && WB != 64
        j = NAME(q_decode_simd)(in, m, lo, scale, bits, nan16, bf16, o);
#endif
        for (int64_t j0 = j; j0 < m; j0 += QBLOCK) {
            int64_t len = m - j0 < QBLOCK ? m - j0 : QBLOCK;
            const uint8_t *c = in + j0;
            if (bits != 8) { /* unpack the fields of the len codes' bytes */
                const uint8_t *p = in + j0 * bits / 8;
                int64_t nb = (len * bits + 7) / 8;
                if (bits == 4) {
                    for (int64_t b = 0; b < nb; b++) block[2 * b] = p[b] & 15, block[2 * b + 1] = p[b] >> 4;
                } else {
                    for (int64_t b = 0; b < nb; b++)
                        block[4 * b] = p[b] & 3, block[4 * b + 1] = (p[b] >> 2) & 3,
                        block[4 * b + 2] = (p[b] >> 4) & 3, block[4 * b + 3] = p[b] >> 6;
                }
                c = block;
            }
            for (int64_t i = 0; i < len; i++) {
                float v = lo + (float)c[i] * scale;
                o[j0 + i] = NAME(store_f32)(v, nan16, bf16);
            }
        }
    }
}

/* bits constant in each copy, so the decoding loops are specialised */
ALWAYS_INLINE void NAME(dequantize_groups)(const quant_params *q, ELEM *out, int64_t g0, int64_t g1, int bf16) {
    if (q->bits == 8) NAME(dequantize_bits)(q, out, g0, g1, bf16, 8);
    else if (q->bits == 4) NAME(dequantize_bits)(q, out, g0, g1, bf16, 4);
    else NAME(dequantize_bits)(q, out, g0, g1, bf16, 2);
}

/* out = lo + code * scale in float32, as this width's element, for groups [g0, g1). */
static void NAME(dequantize)(const quant_params *q, void *out, int64_t g0, int64_t g1) {
#if WB == 16
    if (q->bf16) {
        NAME(dequantize_groups)(q, (ELEM *)out, g0, g1, 1);
        return;
    }
#endif
    NAME(dequantize_groups)(q, (ELEM *)out, g0, g1, 0);
}

#undef ELEM
#undef SELEM
#undef ABSMASK
#undef NAME
#undef NAME2_
#undef NAME3_
