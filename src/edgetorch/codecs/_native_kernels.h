/* Kernels of the edgetorch codecs for ONE element width and ONE instruction set.
 *
 * A template by inclusion: _native.c includes this file once per (WB, ISA) pair after defining
 *   WB        16, 32 or 64: bits per element (the integer view of float16/bfloat16, float32, float64)
 *   ISA         generic, avx2 or avx512: the suffix of every function defined here
 *   ISA_AVX2    0 or 1: whether explicit SIMD loops are compiled in (x86-64 only, inside a region
 *               compiled for AVX2; the dispatcher uses them only where the CPU has AVX2)
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

#undef ELEM
#undef SELEM
#undef ABSMASK
#undef NAME
#undef NAME2_
#undef NAME3_
