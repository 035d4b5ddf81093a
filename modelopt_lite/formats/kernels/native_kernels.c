/* One-pass CPU fake-quant kernels of modelopt_lite (see native.py, which builds and loads this file).
 *
 * Every element goes through the float32 operations of the eager reference formulas (formats/fp8.py,
 * integer.py, nvfp4.py, rounding.py) in the same order, so that results are equal bit for bit. That needs
 * IEEE arithmetic as written: native.py compiles with -ffp-contract=off (no fused multiply-add) and never
 * with -ffast-math. The clamps are written as compares so that NaN passes through, as in torch.clamp.
 *
 * Layout: contiguous input and output of `rows` x `cols`, float32 or (`nan16` >= 0) bfloat16; a scale is
 * one value for all rows (`per_row` = 0) or one per row (`per_row` = 1). Rows are split between OpenMP
 * threads when the library was built with OpenMP and the tensor is large enough.
 *
 * bfloat16 input and output: each element is widened to float32 (exact), goes through the same float32
 * operations, and is rounded back to nearest even as PyTorch's CPU cast rounds; a NaN becomes `nan16`, the
 * bits PyTorch's cast gives a NaN on this machine (native_build.py checks the cast against PyTorch's before it
 * uses it). The values pass through float32 chunks of CHUNK elements on the stack: one pass over memory, no
 * float32 copy of the tensor.
 */
#include <stdint.h>
#include <string.h>

/* elements from which a kernel splits its rows between threads. Measured on a 2-core VM (2026-12-02): a
 * second thread bought nothing below ~2M elements (the kernels run near the memory system's speed on one
 * core) and waking a sleeping thread (OMP_WAIT_POLICY=PASSIVE) cost ~50 us; from 4M elements FP8 took
 * 0.6x the one-thread time, NVFP4 0.7x from 2M */
#ifndef PARALLEL_MIN_ELEMENTS
#define PARALLEL_MIN_ELEMENTS (1 << 22)
#endif
#ifndef PARALLEL_MIN_BLOCK_ELEMENTS
#define PARALLEL_MIN_BLOCK_ELEMENTS (1 << 21)
#endif

static inline uint32_t bits_of(float v) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return u;
}

static inline float float_of(uint32_t u) {
    float v;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* bfloat16 <-> float32: widening is exact; narrowing rounds to nearest even (c10's round_to_nearest_even,
 * which PyTorch's vectorized CPU cast computes too), a NaN gives `nan16` */
#define CHUNK 256
static inline float bf16_load(uint16_t h) { return float_of((uint32_t)h << 16); }

static inline uint16_t bf16_store(float v, uint16_t nan16) {
    const uint32_t u = bits_of(v);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return nan16;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline void bf16_widen(const uint16_t *h, float *f, int64_t n) {
    for (int64_t c = 0; c < n; c++) f[c] = bf16_load(h[c]);
}

static inline void bf16_narrow(const float *f, uint16_t *h, int64_t n, uint16_t nan16) {
    for (int64_t c = 0; c < n; c++) h[c] = bf16_store(f[c], nan16);
}

/* the cast alone, for native_build.py's check against PyTorch's */
void mol_bf16_narrow(const float *f, uint16_t *h, int64_t n, int nan16) { bf16_narrow(f, h, n, (uint16_t)nan16); }

/* split the rows (blocks) between threads only when there is enough work to pay for waking them */
static inline int parallel(int64_t units, int64_t per_unit, int64_t min_elements) {
    return units > 1 && units * per_unit >= min_elements;
}

/* clamp that keeps NaN (torch.clamp) */
static inline float clamp_keep_nan(float v, float lo, float hi) {
    v = v < lo ? lo : v;
    return v > hi ? hi : v;
}

/* `v` rounded half to even to a multiple of the power of two whose float32 exponent field is `step_field`,
 * for |v| < 2**22 steps: adding and subtracting 1.5 * 2**23 * step leaves exactly that rounding (the sum's
 * spacing is `step`); the sign is v's, so that -0.3 steps gives -0.0 as torch.round does. Vectorizes where
 * a rounding call and a division do not. */
static inline float round_to_step(float v, uint32_t step_field) {
    const float magic = float_of(step_field + ((23u << 23) | (1u << 22)));
    return float_of(bits_of((v + magic) - magic) | (bits_of(v) & 0x80000000u));
}

/* rounding.minifloat_round of a value already clamped to the format's range (the reference clamps after
 * rounding: the same, as rounding is monotonic and the maximum is on the grid); the spacing is
 * 2**(max(e, min_exp) - man_bits) for 2**e <= |a| */
static inline float minifloat_round(float a, uint32_t min_exp_field, uint32_t man_shift) {
    uint32_t exp_field = bits_of(a) & 0x7F800000u;
    exp_field = exp_field < min_exp_field ? min_exp_field : exp_field;
    return round_to_step(a, exp_field - man_shift);
}

int mol_version(void) { return 2; }

int mol_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* The amax of row r's block b: one for the tensor (AMAX_TENSOR), one per row (AMAX_ROW), one per block of
 * `block` elements along each row, the last one possibly shorter (AMAX_BLOCK: blocks numbered row-major,
 * ceil(cols / block) per row, the order of BlockLayout's zero-padded blocks), or each block's own max |x|
 * (AMAX_DYNAMIC; `amax` unused). */
enum { AMAX_TENSOR = 0, AMAX_ROW = 1, AMAX_BLOCK = 2, AMAX_DYNAMIC = 3 };

/* max |x| of n floats from their bit patterns (sign cleared): non-negative floats order as their bits do,
 * and a NaN (bits above inf's) wins, as torch's amax propagates NaN */
static inline float abs_max(const float *x, int64_t n) {
    uint32_t m = 0;
    for (int64_t c = 0; c < n; c++) {
        uint32_t u = bits_of(x[c]) & 0x7FFFFFFFu;
        m = u > m ? u : m;
    }
    return float_of(m);
}

/* the same for bfloat16: its bits are the top half of the float32's */
static inline float abs_max_bf16(const uint16_t *x, int64_t n) {
    uint32_t m = 0;
    for (int64_t c = 0; c < n; c++) {
        uint32_t u = x[c] & 0x7FFFu;
        m = u > m ? u : m;
    }
    return float_of(m << 16);
}

/* a stored amax (not AMAX_DYNAMIC) */
static inline float amax_at(const float *amax, int mode, int64_t r, int64_t b, int64_t blocks_per_row) {
    return amax[mode == AMAX_TENSOR ? 0 : mode == AMAX_ROW ? r : r * blocks_per_row + b];
}

/* the element formula of one segment of n elements sharing the amax `a` */
enum { KIND_FP8 = 0, KIND_INT = 1 };
typedef struct {
    int kind;
    uint32_t min_field, man_shift; /* FP8: the element format */
    float max_value;               /* FP8: its largest value; INT: max_bound */
    float lo;                      /* INT: min_bound */
} element_params;

/* fp8.fp8_scales + fp8.fp8_apply: scale = (1 / amax) * max (amax <= 2**-24 replaced by 1),
 * inv = 1 / scale, out = minifloat_round(clamp(x * scale, -max, max)) * inv */
static inline void fp8_segment(const float *xs, float *ys, int64_t n, float a, const element_params *p) {
    a = a <= 0x1p-24f ? 1.0f : a;
    const float max_value = p->max_value, s = (1.0f / a) * max_value, inv = 1.0f / s;
    const uint32_t min_field = p->min_field, man_shift = p->man_shift;
    for (int64_t c = 0; c < n; c++) {
        float y = clamp_keep_nan(xs[c] * s, -max_value, max_value);
        ys[c] = minifloat_round(y, min_field, man_shift) * inv;
    }
}

static inline float round_int(float v) { return round_to_step(v, 127u << 23); }

/* integer.int_scale_keep + integer.int_apply: scale = max_bound / amax (amax <= 2**-24: amax 1 and the
 * output times 0), out = round_half_even(clamp(x * scale, lo, hi)) / scale (* keep): clamping first is the
 * same for integer bounds and keeps |v| small enough for round_to_step */
static inline void int_segment(const float *xs, float *ys, int64_t n, float a, const element_params *p) {
    const float lo = p->lo, hi = p->max_value;
    const int tiny = a <= 0x1p-24f;
    const float s = hi / (tiny ? 1.0f : a);
    if (tiny) {
        for (int64_t c = 0; c < n; c++) ys[c] = round_int(clamp_keep_nan(xs[c] * s, lo, hi)) / s * 0.0f;
    } else {
        for (int64_t c = 0; c < n; c++) ys[c] = round_int(clamp_keep_nan(xs[c] * s, lo, hi)) / s;
    }
}

static inline void segment(const float *xs, float *ys, int64_t n, float a, const element_params *p) {
    if (p->kind == KIND_FP8)
        fp8_segment(xs, ys, n, a, p);
    else
        int_segment(xs, ys, n, a, p);
}

/* rows x cols, each row in blocks of `block` (the last one possibly shorter), each block with its amax;
 * bfloat16 (nan16 >= 0): a block's amax from its bits, then its elements in float32 chunks (the formula
 * is element-wise once the amax is known) */
static void quantize_rows(const void *x, void *out, int64_t rows, int64_t cols, int64_t block,
                          const float *amax, int mode, const element_params *p, int threads, int nan16) {
    const int64_t nb = (cols + block - 1) / block;
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel(rows, cols, PARALLEL_MIN_ELEMENTS))
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const int64_t start = r * cols + b * block, n = b + 1 < nb ? block : cols - b * block;
            if (nan16 < 0) {
                const float *xs = (const float *)x + start;
                const float a = mode == AMAX_DYNAMIC ? abs_max(xs, n) : amax_at(amax, mode, r, b, nb);
                segment(xs, (float *)out + start, n, a, p);
                continue;
            }
            const uint16_t *xs = (const uint16_t *)x + start;
            uint16_t *ys = (uint16_t *)out + start;
            const float a = mode == AMAX_DYNAMIC ? abs_max_bf16(xs, n) : amax_at(amax, mode, r, b, nb);
            float chunk[CHUNK];
            for (int64_t c = 0; c < n; c += CHUNK) {
                const int64_t m = n - c < CHUNK ? n - c : CHUNK;
                bf16_widen(xs + c, chunk, m);
                segment(chunk, chunk, m, a, p);
                bf16_narrow(chunk, ys + c, m, (uint16_t)nan16);
            }
        }
    }
}

void mol_fp8(const void *x, void *out, int64_t rows, int64_t cols, int64_t block, const float *amax,
             int mode, int min_exp, int man_bits, float max_value, int threads, int nan16) {
    const element_params p = {KIND_FP8, (uint32_t)(min_exp + 127) << 23, (uint32_t)man_bits << 23, max_value, 0};
    quantize_rows(x, out, rows, cols, block, amax, mode, &p, threads, nan16);
}

void mol_int(const void *x, void *out, int64_t rows, int64_t cols, int64_t block, const float *amax,
             int mode, float lo, float hi, int threads, int nan16) {
    const element_params p = {KIND_INT, 0, 0, hi, lo};
    quantize_rows(x, out, rows, cols, block, amax, mode, &p, threads, nan16);
}

/* one NVFP4 block: its amax, FP8 scale (nvfp4.nvfp4_block_scales) times s2 = step, then
 * e2m1_round(|x| / step) with x's sign, times step */
static inline void nvfp4_block(const float *xb, float *yb, int64_t block, float s2, float denom) {
    const uint32_t e4m3_min = (uint32_t)(-6 + 127) << 23, e4m3_shift = 3u << 23;
    float s = abs_max(xb, block) / denom;
    s = s == 0.0f ? 1.0f : s;
    s = minifloat_round(clamp_keep_nan(s, 0x1p-9f, 448.0f), e4m3_min, e4m3_shift);
    const float step = s * s2;
    for (int64_t c = 0; c < block; c++) {
        const uint32_t v = bits_of(xb[c]);
        float m = float_of(v & 0x7FFFFFFFu) / step;
        m = m > 6.0f ? 6.0f : m;
        /* rounding.e2m1_round: E2M1 = a minifloat with min_exp 0 and one mantissa bit */
        m = minifloat_round(m, 127u << 23, 1u << 23);
        yb[c] = float_of(bits_of(m) | (v & 0x80000000u)) * step;
    }
}

/* nvfp4.nvfp4_fake_quant, blocks of `block` contiguous elements (`blocks` of them) in groups of
 * `group_blocks` sharing one global amax (one group: the tensor's; several: one per expert of a batch).
 * s2 = global_amax / 2688; per block the amax from |x|'s bit patterns, its FP8 scale
 * (nvfp4.nvfp4_block_scales) times s2 = step; out = e2m1_round(|x| / step) with x's sign, times step.
 * A group whose global amax is at or below 2**-24 is all zero. bfloat16 (nan16 >= 0): block <= CHUNK. */
void mol_nvfp4(const void *x, void *out, int64_t blocks, int64_t block, const float *global_amax,
               int64_t group_blocks, int threads, int nan16) {
    const int64_t groups = blocks / group_blocks;
    /* every thread walks the groups (one global scale each, computed once) and shares each group's blocks */
#pragma omp parallel num_threads(threads) if (parallel(blocks, block, PARALLEL_MIN_BLOCK_ELEMENTS))
    for (int64_t grp = 0; grp < groups; grp++) {
        const float g = global_amax[grp];
        const float s2 = g / 2688.0f, denom = s2 * 6.0f;
        const int64_t first = grp * group_blocks * block, n = group_blocks * block;
        if (g <= 0x1p-24f) { /* all zero */
#pragma omp for schedule(static)
            for (int64_t i = first; i < first + n; i++) {
                if (nan16 < 0)
                    ((float *)out)[i] = 0.0f;
                else
                    ((uint16_t *)out)[i] = 0;
            }
            continue;
        }
#pragma omp for schedule(static)
        for (int64_t b = grp * group_blocks; b < (grp + 1) * group_blocks; b++) {
            if (nan16 < 0) {
                nvfp4_block((const float *)x + b * block, (float *)out + b * block, block, s2, denom);
                continue;
            }
            float chunk[CHUNK];
            bf16_widen((const uint16_t *)x + b * block, chunk, block);
            nvfp4_block(chunk, chunk, block, s2, denom);
            bf16_narrow(chunk, (uint16_t *)out + b * block, block, (uint16_t)nan16);
        }
    }
}

/* one MX block of n elements (x and y may be the same) */
static inline void mx_block(const float *xs, float *ys, int64_t n, int man_bits, uint32_t min_field,
                            uint32_t man_shift, float max_value, int emax) {
    const float a = abs_max(xs, n);
    const uint32_t ab = bits_of(a);
    int e;
    if (!(a > 0.0f)) e = -127;                             /* zero or NaN */
    else if (ab >= 0x7F800000u) e = -1 - emax;             /* inf: frexp's exponent 0 */
    else if (ab >= 0x00800000u) e = (int)(ab >> 23) - 127 - emax;
    else e = -127;                                         /* subnormal: below -126 - emax */
    e = e < -127 ? -127 : (e > 127 ? 127 : e);
    const float scale = e >= -126 ? float_of((uint32_t)(e + 127) << 23) : 0x1p-127f;
    if (man_bits < 0) {
        for (int64_t c = 0; c < n; c++) {
            float v = clamp_keep_nan((xs[c] / scale) * 64.0f, -127.0f, 127.0f);
            ys[c] = (round_int(v) / 64.0f) * scale;
        }
    } else {
        for (int64_t c = 0; c < n; c++) {
            const uint32_t v = bits_of(xs[c] / scale);
            float m = float_of(v & 0x7FFFFFFFu);
            m = minifloat_round(m > max_value ? max_value : m, min_field, man_shift);
            ys[c] = float_of(bits_of(m) | (v & 0x80000000u)) * scale;
        }
    }
}

/* mx.mx_fake_quant, blocks of `block` along each row (the last one possibly shorter): the E8M0 exponent
 * floor(log2(block amax)) - emax (torch.frexp's: an inf amax counts as 2**-1, a NaN or zero amax gives
 * -127), clamped to [-127, 127]; elements x / 2**exp rounded in the element format (min_exp, man_bits,
 * saturating at max_value; man_bits < 0: MXINT8, round(x * 64) clamped to +-127, / 64), times 2**exp.
 * bfloat16 (nan16 >= 0): block <= CHUNK. */
void mol_mx(const void *x, void *out, int64_t rows, int64_t cols, int64_t block, int min_exp, int man_bits,
            float max_value, int emax, int threads, int nan16) {
    const int64_t nb = (cols + block - 1) / block;
    const uint32_t min_field = (uint32_t)(min_exp + 127) << 23, man_shift = (uint32_t)(man_bits < 0 ? 0 : man_bits) << 23;
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel(rows, cols, PARALLEL_MIN_BLOCK_ELEMENTS))
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const int64_t start = r * cols + b * block, n = b + 1 < nb ? block : cols - b * block;
            if (nan16 < 0) {
                mx_block((const float *)x + start, (float *)out + start, n, man_bits, min_field, man_shift,
                         max_value, emax);
                continue;
            }
            float chunk[CHUNK];
            bf16_widen((const uint16_t *)x + start, chunk, n);
            mx_block(chunk, chunk, n, man_bits, min_field, man_shift, max_value, emax);
            bf16_narrow(chunk, (uint16_t *)out + start, n, (uint16_t)nan16);
        }
    }
}
