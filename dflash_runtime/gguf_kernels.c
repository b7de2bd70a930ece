// GGUF weights times float32 activations on an AVX2 CPU. As llama.cpp does, each activation row is quantized in
// blocks of 32 (one float scale per block) and each block's dot product taken in integers, then scaled in
// float32; but to int16, not int8: answers that stay the float32 model's (gguf_kernels.py). Built and loaded by
// gguf_kernels.py.
//
// Q4_1 weights are repacked at load, eight output rows interleaved per block (gguf_kernels.py's repacked_q4_1),
// so that one vpmaddubsw multiplies 4 elements of 8 outputs at once and the block's scale and conversion to float
// are paid once per 8 outputs, not once per output. An int16 activation is taken as 256 h + l, two int8 halves,
// each half's products summed in int16 (at most 8 * 2 * 15 * 128 = 30720: no overflow) before one vpmaddwd: the
// same integer sums as int16 times the 4-bit weights, in as many multiplications as two vpmaddwd per block took
// before, which is what bounds a verify's rows (one row is bound by memory). int8 activations (llama.cpp's
// arithmetic, the gguf-int4-a8 format) need half of them.
//
// A row's result depends on that row alone, summed in the same order whatever the number of rows or threads:
// a verify block's rows are what decoding its tokens one by one gives, so speculation stays lossless.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

#define BLOCK 32
#define TILE 4  // activation rows per pass over a weight row: each block is unpacked once for all of them
#define XMAX 32639.0f  // the int16 activations' largest magnitude: their high halves stay within int8
#define XMAX8 127.0f  // int8 activations' (llama.cpp's: one vpmaddubsw per 4 elements of 8 outputs, not two)

static float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// x [rows, k] -> xq int16 [rows, k], xd [rows, k / 32] (x ~ xd * xq), xs [rows, k / 32] (each block's float sum)
static void quantize_rows(const float *x, int64_t rows, int64_t k, float most, int16_t *xq, float *xd, float *xs) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < rows * k / BLOCK; i++) {
        const float *b = x + i * BLOCK;
        __m256 v[4], amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(b + 8 * j);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
            sum = _mm256_add_ps(sum, v[j]);
        }
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        const float d = _mm_cvtss_f32(m) / most;
        const __m256 inv = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
        __m256i q[4];
        for (int j = 0; j < 4; j++)
            q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], inv), _MM_ROUND_NEAREST));
        // int32 -> int16: packs interleaves 128-bit lanes, permute them back into element order
        for (int j = 0; j < 2; j++) {
            const __m256i q16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2 * j], q[2 * j + 1]), 0xD8);
            _mm256_storeu_si256((__m256i *)(xq + i * BLOCK + 16 * j), q16);
        }
        xd[i] = d;
        xs[i] = hsum(sum);
    }
}

// a . b over n floats: 8 lanes, then the tail (one order whatever calls it)
static inline float dot(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float sum = hsum(acc);
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

// out[i] = a[i] * b[i] over n floats
static inline void products(const float *a, const float *b, int64_t n, float *out) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
    for (; i < n; i++) out[i] = a[i] * b[i];
}

// The sum over a block of 32 int16 weights (w0: elements 0..15, w1: 16..31) times int16 activations at x, as 8
// int32 lanes in float (at most 32 * 127 * 32767 in magnitude: no overflow).
static inline __m256 block_dot(__m256i w0, __m256i w1, const int16_t *x) {
    const __m256i p0 = _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)x));
    const __m256i p1 = _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(x + 16)));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1));
}

// xq int16 [count] -> xh, xl int8 with xq = 256 * xh + xl (|xq| <= XMAX, so xh fits in int8); count % 32 == 0
static void split_halves(const int16_t *xq, int64_t count, int8_t *xh, int8_t *xl) {
    const __m256i offset = _mm256_set1_epi16(128), byte = _mm256_set1_epi16(255);
    for (int64_t i = 0; i < count; i += 32) {
        __m256i t[2], h[2], l[2];
        for (int j = 0; j < 2; j++) {
            t[j] = _mm256_add_epi16(_mm256_loadu_si256((const __m256i *)(xq + i + 16 * j)), offset);
            h[j] = _mm256_srai_epi16(t[j], 8);
            l[j] = _mm256_sub_epi16(_mm256_and_si256(t[j], byte), offset);
        }
        // int16 -> int8: packs interleaves 128-bit lanes, permute them back into element order
        _mm256_storeu_si256((__m256i *)(xh + i), _mm256_permute4x64_epi64(_mm256_packs_epi16(h[0], h[1]), 0xD8));
        _mm256_storeu_si256((__m256i *)(xl + i), _mm256_permute4x64_epi64(_mm256_packs_epi16(l[0], l[1]), 0xD8));
    }
}

// The 4 int8 at x in each 32-bit lane
static inline __m256i four_bytes(const int8_t *x) {
    int32_t v;
    memcpy(&v, x, sizeof v);
    return _mm256_set1_epi32(v);
}

// Q4_1 repacked: q uint8 [groups, blocks, 128], d and m float32 [groups, blocks, 8], a group being 8 output rows
// (the last one padded with zeros). Byte 32 i + 4 c + j of a block holds element 4 i + j of the group's row c in
// its low nibble, element 16 + 4 i + j in its high one; weight = d * q + m. y[r, 8 g + c] = x[r] . weight[8 g + c]
// for `nr` rows from r0 (a constant after inlining, so that the accumulators stay in registers) and the group's
// columns below n. wide (a constant too): the activations are int16 halves xh, xl; else int8, in xl.
static inline __attribute__((always_inline)) void q4_1_tile(
        const uint8_t *q, const float *d, const float *m, int64_t g, int64_t blocks, const int8_t *xh,
        const int8_t *xl, const float *xd, const float *xs, int64_t r0, const int nr, const int wide, float *y,
        int64_t n) {
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const int64_t k = blocks * BLOCK;
    __m256 acc[TILE];
    for (int t = 0; t < nr; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *qb = q + (g * blocks + b) * 128;
        __m256i w[8];  // w[i]: elements 4 i..4 i + 3 of the 8 rows (i < 4), 16 + 4 (i - 4).. (i >= 4)
        for (int i = 0; i < 4; i++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qb + 32 * i));
            w[i] = _mm256_and_si256(v, low), w[i + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
        const __m256 dw = _mm256_loadu_ps(d + (g * blocks + b) * 8), mw = _mm256_loadu_ps(m + (g * blocks + b) * 8);
        for (int t = 0; t < nr; t++) {
            const int64_t row = r0 + t;
            const int8_t *h = xh + row * k + b * BLOCK, *l = xl + row * k + b * BLOCK;
            __m256i sh = _mm256_setzero_si256(), sl = sh;
            for (int i = 0; i < 8; i++) {
                const int at = i < 4 ? 4 * i : 16 + 4 * (i - 4);
                if (wide) sh = _mm256_add_epi16(sh, _mm256_maddubs_epi16(w[i], four_bytes(h + at)));
                sl = _mm256_add_epi16(sl, _mm256_maddubs_epi16(w[i], four_bytes(l + at)));
            }
            __m256i sum = _mm256_madd_epi16(sl, ones);
            if (wide) sum = _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(sh, ones), 8), sum);
            const __m256 scale = _mm256_mul_ps(dw, _mm256_broadcast_ss(xd + row * blocks + b));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc[t]);
            acc[t] = _mm256_fmadd_ps(mw, _mm256_broadcast_ss(xs + row * blocks + b), acc[t]);
        }
    }
    const int64_t columns = n - 8 * g < 8 ? n - 8 * g : 8;
    for (int t = 0; t < nr; t++) {
        float out[8];
        _mm256_storeu_ps(out, acc[t]);
        memcpy(y + (r0 + t) * n + 8 * g, out, sizeof(float) * columns);
    }
}

// Q8_0: q int8 [n, k], d float32 [n, k / 32]; weight = d * q.
static inline __attribute__((always_inline)) void q8_0_tile(
        const int8_t *q, const float *d, int64_t o, int64_t blocks, const int16_t *xq, const float *xd,
        int64_t r0, const int nr, float *y, int64_t n, float *scales) {
    const float *dw = d + o * blocks;
    __m256 acc[TILE];
    for (int t = 0; t < nr; t++) {
        acc[t] = _mm256_setzero_ps();
        products(dw, xd + (r0 + t) * blocks, blocks, scales + t * blocks);
    }
    for (int64_t b = 0; b < blocks; b++) {
        const int8_t *w = q + (o * blocks + b) * BLOCK;
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w));
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 16)));
        for (int t = 0; t < nr; t++) {
            const int16_t *x = xq + ((r0 + t) * blocks + b) * BLOCK;
            acc[t] = _mm256_fmadd_ps(_mm256_broadcast_ss(scales + t * blocks + b), block_dot(w0, w1, x), acc[t]);
        }
    }
    for (int t = 0; t < nr; t++) y[(r0 + t) * n + o] = hsum(acc[t]);
}

#define TILES(call) \
    switch (nr) { case 1: call(1); break; case 2: call(2); break; case 3: call(3); break; default: call(4); }

// An activation's quantized rows: quantize_rows' xq, xd, xs and split_halves' xh, xl.
typedef struct {
    int16_t *xq;
    int8_t *xh, *xl;
    float *xd, *xs;
} quantized;

// x [rows, k] quantized into one allocation, returned (free() releases it all; NULL when out of memory). halves:
// also xh and xl (for int8 activations, |xq| <= 127, xl is xq and xh zeros).
static void *quantize(const float *x, int64_t rows, int64_t k, float most, int halves, quantized *out) {
    const int64_t count = rows * k, blocks = count / BLOCK;
    char *memory = malloc(sizeof(float) * 2 * blocks + sizeof(int16_t) * count + (halves ? 2 * count : 0));
    if (!memory) return NULL;
    out->xd = (float *)memory, out->xs = out->xd + blocks, out->xq = (int16_t *)(out->xs + blocks);
    out->xh = (int8_t *)(out->xq + count), out->xl = out->xh + count;
    quantize_rows(x, rows, k, most, out->xq, out->xd, out->xs);
    if (halves) split_halves(out->xq, count, out->xh, out->xl);
    return memory;
}

// One entry point per format: quantize x once, then split the weight's rows across OpenMP threads (torch's own
// libgomp, which is loaded first), each thread taking TILE activation rows per pass over them. Q4_1 takes int16
// activations (activation_bits 16) or int8 (8: half the multiplications, answers further from float32's). 0 on
// success.
int dflash_q4_1_matmul(const uint8_t *q, const float *d, const float *m, int64_t n, int64_t k,
                       const float *x, int64_t rows, int32_t activation_bits, float *y) {
    quantized a;
    const int wide = activation_bits == 16;
    if (k % BLOCK || (activation_bits != 16 && activation_bits != 8)) return 1;
    void *memory = quantize(x, rows, k, wide ? XMAX : XMAX8, 1, &a);
    if (!memory) return 2;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < (n + 7) / 8; g++)
        for (int64_t r0 = 0; r0 < rows; r0 += TILE) {
            const int nr = rows - r0 < TILE ? rows - r0 : TILE;
#define Q4_1(rows_) q4_1_tile(q, d, m, g, k / BLOCK, a.xh, a.xl, a.xd, a.xs, r0, rows_, 1, y, n)
#define Q4_1_8(rows_) q4_1_tile(q, d, m, g, k / BLOCK, a.xh, a.xl, a.xd, a.xs, r0, rows_, 0, y, n)
            if (wide) { TILES(Q4_1) } else { TILES(Q4_1_8) }
        }
    free(memory);
    return 0;
}

int dflash_q8_0_matmul(const int8_t *q, const float *d, int64_t n, int64_t k, const float *x, int64_t rows,
                       float *y) {
    quantized a;
    if (k % BLOCK) return 1;
    void *memory = quantize(x, rows, k, XMAX, 0, &a);
    if (!memory) return 2;
    const int64_t chunk = 16;  // weight rows per task: a few KB of weights, whole cache lines
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < (n + chunk - 1) / chunk; c++) {
        const int64_t n0 = c * chunk, n1 = n0 + chunk < n ? n0 + chunk : n;
        float scales[TILE * (k / BLOCK)];
        for (int64_t r0 = 0; r0 < rows; r0 += TILE) {
            const int nr = rows - r0 < TILE ? rows - r0 : TILE;
            for (int64_t o = n0; o < n1; o++) {
#define Q8_0(rows_) q8_0_tile(q, d, o, k / BLOCK, a.xq, a.xd, r0, rows_, y, n, scales)
                TILES(Q8_0)
            }
        }
    }
    free(memory);
    return 0;
}

// A Llama decoder layer on Q4_1 weights in one call instead of some fifty torch operations, whose dispatch cost
// more than the arithmetic at decoding's few rows. Norms, attention and the activation in float32.
typedef struct {
    const uint8_t *q;
    const float *d, *m;
} q4_1_weight;

static void rms_norm(const float *x, const float *w, float eps, int64_t rows, int64_t dim, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        const float scale = 1.0f / sqrtf(dot(xr, xr, dim) / dim + eps);
        for (int64_t i = 0; i < dim; i++) o[i] = w[i] * (xr[i] * scale);
    }
}

// HF's rotate-half rotary embedding of `heads` heads of head_dim at x (row stride `stride`); cos, sin
// [rows, head_dim].
static void rope(float *x, int64_t rows, int64_t stride, int heads, int head_dim, const float *cos,
                 const float *sin) {
    const int half = head_dim / 2;
    for (int64_t r = 0; r < rows; r++)
        for (int h = 0; h < heads; h++) {
            float *v = x + r * stride + h * head_dim;
            const float *c = cos + r * head_dim, *s = sin + r * head_dim;
            for (int i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
}

// A layer's weights and shape, set once when the layer is served (LlamaLayerKernels).
typedef struct {
    q4_1_weight qkv, o, gate_up, down;
    const float *input_norm, *post_norm;
    float eps;
    int64_t hidden, intermediate;
    int32_t heads, kv_heads, head_dim;
    int32_t activation_bits;  // its linears' (dflash_q4_1_matmul)
} llama_layer;

// One pass's attention inputs: rows = batch * tokens, a token at position p seeing its sequence's keys 0..p (its
// own and those before it: the committed context and the pass's earlier tokens), read from the paged cache
// (kv_cache.py's layout: a layer's k and v [blocks, block_size, kv_heads, head_dim], a sequence's blocks in
// table [batch, width]).
typedef struct {
    int64_t batch, tokens, block_size, table_width;
    const int64_t *positions, *table;
    const float *cos, *sin;  // [rows, head_dim], rotary's (dflash_llama_model makes them)
} llama_pass;

static float *cache_row(float *cache, const llama_pass *p, const llama_layer *l, int64_t b, int64_t position,
                        int kv_head) {
    const int64_t block = p->table[b * p->table_width + position / p->block_size];
    return cache + ((block * p->block_size + position % p->block_size) * l->kv_heads + kv_head) * l->head_dim;
}

// scores[j] = (q . k_j) * scale for n keys of d floats (d % 8 == 0), `step` floats apart from k on: four keys at a
// time, whose sums are independent chains (one dot alone waits on each FMA's latency), each summed as dot() sums it.
static void block_scores(const float *q, const float *k, int64_t step, int64_t n, int d, float scale,
                         float *scores) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        const float *k0 = k + j * step, *k1 = k0 + step, *k2 = k1 + step, *k3 = k2 + step;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int i = 0; i < d; i += 8) {
            const __m256 x = _mm256_loadu_ps(q + i);
            a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + i), a0);
            a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k1 + i), a1);
            a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k2 + i), a2);
            a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k3 + i), a3);
        }
        scores[j] = hsum(a0) * scale, scores[j + 1] = hsum(a1) * scale;
        scores[j + 2] = hsum(a2) * scale, scores[j + 3] = hsum(a3) * scale;
    }
    for (; j < n; j++) scores[j] = dot(q, k + j * step, d) * scale;
}

// acc[0:d] += w[j] * v_j over n rows of d floats (d % 8 == 0) `step` floats apart from v on, key after key (one
// FMA per key and element); four keys per pass over acc.
static void weighted_sum(const float *v, int64_t step, int64_t n, const float *w, int d, float *acc) {
    for (int64_t j = 0; j < n;) {
        const int count = j + 4 <= n ? 4 : 1;
        const float *vj = v + j * step;
        for (int i = 0; i < d; i += 8) {
            __m256 a = _mm256_loadu_ps(acc + i);
            for (int c = 0; c < count; c++)
                a = _mm256_fmadd_ps(_mm256_set1_ps(w[j + c]), _mm256_loadu_ps(vj + c * step + i), a);
            _mm256_storeu_ps(acc + i, a);
        }
        j += count;
    }
}

// softmax(q k^T / sqrt(D)) v over each token's keys, one (token, head) per task. Each sum runs over
// its keys in position order whatever the pass's shape (bit for bit the sums of one key at a time), so a
// token's output does not depend on how many tokens or sequences share its pass: float32 suffices where torch's
// attention needed float64 (cpu_weights).
static int attend(const float *qkv, float *k_cache, float *v_cache, const llama_pass *p, const llama_layer *l,
                  float *out) {
    const int64_t rows = p->batch * p->tokens, width = (int64_t)(l->heads + 2 * l->kv_heads) * l->head_dim;
    const int d = l->head_dim, group = l->heads / l->kv_heads;
    const float scale = 1.0f / sqrtf((float)d);
    const int64_t capacity = p->table_width * p->block_size;
    int64_t most = 0;  // keys a row reads at most
    for (int64_t r = 0; r < rows; r++) {
        if (p->positions[r] < 0 || p->positions[r] >= capacity) return 3;
        most = p->positions[r] + 1 > most ? p->positions[r] + 1 : most;
    }
    for (int64_t r = 0; r < rows; r++)  // the new keys and values first: the pass's tokens see each other
        for (int h = 0; h < l->kv_heads; h++) {
            const float *k = qkv + r * width + (int64_t)(l->heads + h) * d, *v = k + (int64_t)l->kv_heads * d;
            memcpy(cache_row(k_cache, p, l, r / p->tokens, p->positions[r], h), k, sizeof(float) * d);
            memcpy(cache_row(v_cache, p, l, r / p->tokens, p->positions[r], h), v, sizeof(float) * d);
        }
    int failed = 0;
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * most), *acc = malloc(sizeof(float) * d);
        if (!scores || !acc) failed = 1;
#pragma omp for schedule(static)
        for (int64_t task = 0; task < rows * l->heads; task++) {
            if (!scores || !acc) continue;
            const int64_t r = task / l->heads, b = r / p->tokens;
            const int h = task % l->heads, kv_head = h / group;
            const float *q = qkv + r * width + (int64_t)h * d;
            const int64_t keys = p->positions[r] + 1;  // a row reads its own length, not the pass's
            // block by block: no division (position / block_size) per key for its address
            const int64_t *blocks = p->table + b * p->table_width, step = (int64_t)l->kv_heads * d;
            const int64_t first = (int64_t)kv_head * d, bs = p->block_size;
            float top = -INFINITY;
            for (int64_t start = 0; start < keys; start += bs) {
                const float *k = k_cache + blocks[start / bs] * bs * step + first;
                const int64_t n = start + bs < keys ? bs : keys - start;
                block_scores(q, k, step, n, d, scale, scores + start);
                for (int64_t j = start; j < start + n; j++) top = scores[j] > top ? scores[j] : top;
            }
            float total = 0.0f;
            memset(acc, 0, sizeof(float) * d);
            for (int64_t start = 0; start < keys; start += bs) {
                const int64_t n = start + bs < keys ? bs : keys - start;
                for (int64_t j = start; j < start + n; j++) total += scores[j] = expf(scores[j] - top);
                const float *v = v_cache + blocks[start / bs] * bs * step + first;
                weighted_sum(v, step, n, scores + start, d, acc);
            }
            float *o = out + r * (int64_t)l->heads * d + (int64_t)h * d;
            for (int i = 0; i < d; i++) o[i] = total > 0.0f ? acc[i] / total : 0.0f;
        }
        free(scores), free(acc);
    }
    return failed ? 2 : 0;
}

// h [rows, hidden] replaced by the layer applied to it (each element is read before it is written), the pass's
// keys and values written into the layer's k_cache and v_cache.
static int llama_layer_forward(const llama_layer *l, const llama_pass *p, float *h, float *k_cache,
                               float *v_cache) {
    const int64_t rows = p->batch * p->tokens, hidden = l->hidden, inter = l->intermediate;
    const int64_t attn_width = (int64_t)l->heads * l->head_dim, width = attn_width + 2 * l->kv_heads * l->head_dim;
    if (l->head_dim % 8) return 1;
    float *scratch = malloc(sizeof(float) * rows * (hidden + width + attn_width + 3 * inter));
    if (!scratch) return 2;
    float *normed = scratch, *qkv = normed + rows * hidden, *attention = qkv + rows * width;
    float *gate_up = attention + rows * attn_width, *act = gate_up + rows * 2 * inter;
    rms_norm(h, l->input_norm, l->eps, rows, hidden, normed);
    const int32_t bits = l->activation_bits;
    int status = dflash_q4_1_matmul(l->qkv.q, l->qkv.d, l->qkv.m, width, hidden, normed, rows, bits, qkv);
    if (!status) {
        rope(qkv, rows, width, l->heads, l->head_dim, p->cos, p->sin);
        rope(qkv + attn_width, rows, width, l->kv_heads, l->head_dim, p->cos, p->sin);
        status = attend(qkv, k_cache, v_cache, p, l, attention);
    }
    if (!status) status = dflash_q4_1_matmul(l->o.q, l->o.d, l->o.m, hidden, attn_width, attention, rows, bits, normed);
    if (!status) {
        for (int64_t i = 0; i < rows * hidden; i++) h[i] += normed[i];
        rms_norm(h, l->post_norm, l->eps, rows, hidden, normed);
        status = dflash_q4_1_matmul(l->gate_up.q, l->gate_up.d, l->gate_up.m, 2 * inter, hidden, normed, rows, bits,
                                    gate_up);
    }
    if (!status) {
#pragma omp parallel for schedule(static) if (rows > 1)  // a prefill's SiLU: a scalar expf per element
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < inter; i++) {
                const float g = gate_up[r * 2 * inter + i], u = gate_up[r * 2 * inter + inter + i];
                act[r * inter + i] = g / (1.0f + expf(-g)) * u;
            }
        status = dflash_q4_1_matmul(l->down.q, l->down.d, l->down.m, hidden, inter, act, rows, bits, normed);
    }
    if (!status)
        for (int64_t i = 0; i < rows * hidden; i++) h[i] += normed[i];
    free(scratch);
    return status;
}

// A Llama model's embedding, decoder layers and final norm, set once when the model is served (LlamaKernels).
typedef struct {
    const llama_layer *layers;
    int32_t num_layers;
    int64_t vocab;
    const float *embedding;  // [vocab, hidden]
    const float *norm;
    float eps;  // the final norm's
    const float *inv_freq;  // [head_dim / 2]: rotary's, any scaling in it
} llama_model;

// Rotary's cos and sin [rows, head_dim] at each row's position: HF's cat(freqs, freqs) of position * inv_freq.
static void rope_tables(const llama_pass *p, const float *inv_freq, int head_dim, float *cos, float *sin) {
    const int half = head_dim / 2;
    for (int64_t r = 0; r < p->batch * p->tokens; r++)
        for (int i = 0; i < half; i++) {
            const float angle = (float)p->positions[r] * inv_freq[i];
            cos[r * head_dim + i] = cos[r * head_dim + half + i] = cosf(angle);
            sin[r * head_dim + i] = sin[r * head_dim + half + i] = sinf(angle);
        }
}

// The model over a pass's tokens [rows] in one call: a pass's dozens of layers cost one dispatch from Python, not
// one each, nor those of the embedding, rotary and final norm. h [rows, hidden] gets the final-normed output.
// Layer i's caches start layer_stride floats after layer i - 1's. Where slots[i] >= 0, layer i's output is also
// copied to features [rows, width * hidden] at column slots[i] * hidden (the drafter's target features). 0 on
// success, 1 a head_dim not a multiple of 8, 2 out of memory, 3 a position beyond the block table, 4 a token
// outside the vocabulary.
int dflash_llama_model(const llama_model *m, const llama_pass *pass, const int64_t *tokens, float *h,
                       float *k_cache, float *v_cache, int64_t layer_stride, const int32_t *slots, int32_t width,
                       float *features) {
    const int64_t rows = pass->batch * pass->tokens, hidden = m->layers[0].hidden;
    const int head_dim = m->layers[0].head_dim;
    if (!rows) return 0;
    for (int64_t r = 0; r < rows; r++) {
        if (tokens[r] < 0 || tokens[r] >= m->vocab) return 4;
        memcpy(h + r * hidden, m->embedding + tokens[r] * hidden, sizeof(float) * hidden);
    }
    float *tables = malloc(sizeof(float) * 2 * rows * head_dim);
    if (!tables) return 2;
    llama_pass p = *pass;
    p.cos = tables, p.sin = tables + rows * head_dim;
    rope_tables(&p, m->inv_freq, head_dim, tables, tables + rows * head_dim);
    int status = 0;
    for (int32_t i = 0; i < m->num_layers && !status; i++) {
        status = llama_layer_forward(m->layers + i, &p, h, k_cache + i * layer_stride, v_cache + i * layer_stride);
        if (!status && slots && slots[i] >= 0)
            for (int64_t r = 0; r < rows; r++)
                memcpy(features + (r * width + slots[i]) * hidden, h + r * hidden, sizeof(float) * hidden);
    }
    if (!status) rms_norm(h, m->norm, m->eps, rows, hidden, h);  // row by row: each read before written
    free(tables);
    return status;
}

// out[r] = the index of the first largest value of row r of x [rows, n] (the first NaN where the row has one), as
// torch.max's indices: the target's greedy token. torch's reduction took 3.6 ms for [64, 49152] floats here (a
// verify of 8 at batch 8), this 0.27 ms: eight lanes of running maxima, each keeping its first index.
void dflash_first_max(const float *x, int64_t rows, int64_t n, int64_t *out) {
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *v = x + r * n;
        __m256 best = _mm256_set1_ps(-INFINITY);
        __m256i at = _mm256_setzero_si256(), index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        int unordered = 0;
        int64_t i = 0;
        const int64_t lanes_end = n <= INT32_MAX ? n - n % 8 : 0;  // the lanes count in int32
        for (; i < lanes_end; i += 8) {
            const __m256 a = _mm256_loadu_ps(v + i), greater = _mm256_cmp_ps(a, best, _CMP_GT_OQ);
            unordered |= _mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q));
            best = _mm256_blendv_ps(best, a, greater);
            at = _mm256_blendv_epi8(at, index, _mm256_castps_si256(greater));
            index = _mm256_add_epi32(index, _mm256_set1_epi32(8));
        }
        float lane_best[8];
        int32_t lane_at[8];
        _mm256_storeu_ps(lane_best, best);
        _mm256_storeu_si256((__m256i *)lane_at, at);
        float top = -INFINITY;
        int64_t first = 0;
        for (int l = 0; l < 8; l++)
            if (lane_best[l] > top || (lane_best[l] == top && lane_at[l] < first))
                top = lane_best[l], first = lane_at[l];
        for (; i < n; i++) {
            unordered |= isnan(v[i]);
            if (v[i] > top) top = v[i], first = i;
        }
        if (unordered)
            for (int64_t j = 0; j < n; j++)
                if (isnan(v[j])) {
                    first = j;
                    break;
                }
        out[r] = first;
    }
}
