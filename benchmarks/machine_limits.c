/* The machine's own limits for benchmarks/machine_limits.py: how fast its cores read memory, and
 * how many float32 multiply-adds they retire, in the widest vectors this build has. */
#include <immintrin.h>
#include <stdint.h>

#include <omp.h>

/* the sum of n floats (n a multiple of 64), read by `threads` threads in contiguous parts: the
 * sum is returned so that no compiler drops the reads */
float read_sum(const float *data, int64_t n, int threads) {
    float total = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        const int64_t count = omp_get_num_threads(), thread = omp_get_thread_num();
        const int64_t first = n / 64 * thread / count * 64, last = n / 64 * (thread + 1) / count * 64;
#if defined(__AVX512F__)
        __m512 a = _mm512_setzero_ps(), b = a, c = a, d = a;
        for (int64_t i = first; i < last; i += 64) {
            a = _mm512_add_ps(a, _mm512_loadu_ps(data + i));
            b = _mm512_add_ps(b, _mm512_loadu_ps(data + i + 16));
            c = _mm512_add_ps(c, _mm512_loadu_ps(data + i + 32));
            d = _mm512_add_ps(d, _mm512_loadu_ps(data + i + 48));
        }
        total += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a, b), _mm512_add_ps(c, d)));
#elif defined(__AVX__)
        __m256 a = _mm256_setzero_ps(), b = a, c = a, d = a, e = a, f = a, g = a, h = a;
        for (int64_t i = first; i < last; i += 64) {
            a = _mm256_add_ps(a, _mm256_loadu_ps(data + i));
            b = _mm256_add_ps(b, _mm256_loadu_ps(data + i + 8));
            c = _mm256_add_ps(c, _mm256_loadu_ps(data + i + 16));
            d = _mm256_add_ps(d, _mm256_loadu_ps(data + i + 24));
            e = _mm256_add_ps(e, _mm256_loadu_ps(data + i + 32));
            f = _mm256_add_ps(f, _mm256_loadu_ps(data + i + 40));
            g = _mm256_add_ps(g, _mm256_loadu_ps(data + i + 48));
            h = _mm256_add_ps(h, _mm256_loadu_ps(data + i + 56));
        }
        __m256 sum = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d)),
                                   _mm256_add_ps(_mm256_add_ps(e, f), _mm256_add_ps(g, h)));
        float lanes[8];
        _mm256_storeu_ps(lanes, sum);
        for (int i = 0; i < 8; i++)
            total += lanes[i];
#else
        for (int64_t i = first; i < last; i++)
            total += data[i];
#endif
    }
    return total;
}

/* `rounds` x 12 independent chains of vector multiply-adds on each of `threads` threads (12: more
 * than two FMA units x their latency); returns the float32 operations done. `seed` comes from the
 * caller so the chains are not constants. */
double fma_work(int64_t rounds, int threads, float seed, float *sink) {
    double lanes = 0;
#pragma omp parallel num_threads(threads) reduction(+ : lanes)
    {
#if defined(__AVX512F__)
#define VEC __m512
#define SET1 _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define WIDTH 16
#elif defined(__FMA__)
#define VEC __m256
#define SET1 _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define WIDTH 8
#endif
#ifdef WIDTH
        const VEC m = SET1(0.999999f), add = SET1(1e-7f);
        VEC acc[12];
        for (int i = 0; i < 12; i++)
            acc[i] = SET1(seed + (float)i);
        for (int64_t r = 0; r < rounds; r++)
            _Pragma("GCC unroll 12") for (int i = 0; i < 12; i++) acc[i] = FMA(acc[i], m, add);
        float out[WIDTH];
        VEC sum = acc[0];
        for (int i = 1; i < 12; i++)
            sum = sum + acc[i];
        __builtin_memcpy(out, &sum, sizeof out);
        float s = 0;
        for (int i = 0; i < WIDTH; i++)
            s += out[i];
#pragma omp critical
        *sink += s;
        lanes += (double)rounds * 12 * WIDTH * 2;
#else
        float a = seed;
        for (int64_t r = 0; r < rounds; r++)
            a = a * 0.999999f + 1e-7f;
#pragma omp critical
        *sink += a;
        lanes += (double)rounds * 2;
#endif
    }
    return lanes;
}
