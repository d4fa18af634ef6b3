/* CRC32C (Castagnoli) in C, for the bytes the queue threads land in staging (fuse/ring_landing.c,
 * ck_fring_sum_landed: summed before the trio thread records them, with no Python per slice),
 * and the arithmetic the trio thread needs to join such checksums into a run's
 * (staging.Checksums). The values are those of the `crc32c` package: ck_crc32c(0, p, n) is
 * crc32c(p[:n]), ck_crc32c(c, p, n) continues c over p.
 *
 * With SSE4.2 (x86-64) the CPU's crc32 instruction does the work in three independent
 * streams (one stream waits for each instruction's result: a third of the speed), whose
 * registers are joined by shifting one over the other's length. Where there is no such
 * instruction ck_crc32c_hw() is 0 and nothing is summed here: the trio thread sums the bytes
 * itself, as it does those of a WRITE it landed.
 *
 * A register is the CRC's raw state (no inversion), a polynomial over GF(2) in the reflected
 * bit order: bit 31 is the coefficient of x^0. Taking n zero bytes into a register is a
 * multiplication by x^(8n) modulo the polynomial, which is linear: so the CRC of A then B
 * is crc(A) * x^(8|B|) + crc(B) (the inversions at both ends cancel). */

#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include <pthread.h>

#define CRC_POLY 0x82F63B78u  /* the Castagnoli polynomial, reflected */
#define CRC_ONE 0x80000000u   /* x^0 */
#define CRC_LANE 4096         /* bytes per stream and round of the three-stream loop */

static uint32_t crc_table[256];             /* one byte at a time (the software path) */
static uint32_t crc_pow[64];               /* x^(8*2^k) */
static uint32_t crc_lane_shift[4][256];     /* a register times x^(8*CRC_LANE), by byte */
static int crc_hw_ok;
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

/* a * b modulo the polynomial */
static uint32_t crc_mul(uint32_t a, uint32_t b)
{
    uint32_t product = 0;
    for (uint32_t bit = CRC_ONE; bit; bit >>= 1) {
        if (a & bit)
            product ^= b;
        b = b & 1 ? (b >> 1) ^ CRC_POLY : b >> 1;  /* b * x */
    }
    return product;
}

static uint32_t crc_sw(uint32_t reg, const unsigned char *p, size_t n)
{
    while (n--)
        reg = (reg >> 8) ^ crc_table[(reg ^ *p++) & 0xff];
    return reg;
}

/* reg times x^(8n) */
static uint32_t crc_shift_by(uint32_t reg, uint64_t n)
{
    for (int k = 0; n && k < 64; k++, n >>= 1)
        if (n & 1)
            reg = crc_mul(crc_pow[k], reg);
    return reg;
}

static __attribute__((unused)) uint32_t crc_lane(uint32_t reg)
{
    return crc_lane_shift[0][reg & 0xff] ^ crc_lane_shift[1][(reg >> 8) & 0xff]
        ^ crc_lane_shift[2][(reg >> 16) & 0xff] ^ crc_lane_shift[3][reg >> 24];
}

#if defined(__x86_64__)
#include <nmmintrin.h>

__attribute__((target("sse4.2")))
static uint32_t crc_hw_one(uint32_t reg, const unsigned char *p, size_t n)
{
    uint64_t r = reg;
    while (n && ((uintptr_t)p & 7)) {
        r = _mm_crc32_u8((uint32_t)r, *p++);
        n--;
    }
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        r = _mm_crc32_u64(r, v);
    }
    while (n--)
        r = _mm_crc32_u8((uint32_t)r, *p++);
    return (uint32_t)r;
}

__attribute__((target("sse4.2")))
static uint32_t crc_hw(uint32_t reg, const unsigned char *p, size_t n)
{
    while (n && ((uintptr_t)p & 7)) {
        reg = _mm_crc32_u8(reg, *p++);
        n--;
    }
    while (n >= 3 * CRC_LANE) {
        uint64_t a = reg, b = 0, c = 0;
#pragma GCC unroll 8
        for (size_t i = 0; i < CRC_LANE; i += 8) {
            uint64_t va, vb, vc;
            memcpy(&va, p + i, 8);
            memcpy(&vb, p + CRC_LANE + i, 8);
            memcpy(&vc, p + 2 * CRC_LANE + i, 8);
            a = _mm_crc32_u64(a, va);
            b = _mm_crc32_u64(b, vb);
            c = _mm_crc32_u64(c, vc);
        }
        /* (a register started at 0 over a lane is that lane's own contribution) */
        reg = crc_lane(crc_lane((uint32_t)a) ^ (uint32_t)b) ^ (uint32_t)c;
        p += 3 * CRC_LANE;
        n -= 3 * CRC_LANE;
    }
    return crc_hw_one(reg, p, n);
}

static int crc_have_hw(void)
{
    __builtin_cpu_init();
    return !!__builtin_cpu_supports("sse4.2");
}
#else
static uint32_t crc_hw(uint32_t reg, const unsigned char *p, size_t n)
{
    return crc_sw(reg, p, n);
}

static int crc_have_hw(void) { return 0; }
#endif

static void crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t r = i;
        for (int k = 0; k < 8; k++)
            r = r & 1 ? (r >> 1) ^ CRC_POLY : r >> 1;
        crc_table[i] = r;
    }
    uint32_t x8 = CRC_ONE;
    for (int k = 0; k < 8; k++)
        x8 = x8 & 1 ? (x8 >> 1) ^ CRC_POLY : x8 >> 1;
    crc_pow[0] = x8;
    for (int k = 1; k < 64; k++)
        crc_pow[k] = crc_mul(crc_pow[k - 1], crc_pow[k - 1]);
    uint32_t lane = crc_shift_by(CRC_ONE, CRC_LANE);
    for (int j = 0; j < 4; j++)
        for (uint32_t b = 0; b < 256; b++)
            crc_lane_shift[j][b] = crc_mul(lane, b << (8 * j));
    crc_hw_ok = crc_have_hw();
}

/* Whether the CPU's own instruction takes the checksums (else none are taken in C). */
int ck_crc32c_hw(void)
{
    pthread_once(&crc_once, crc_init);
    return crc_hw_ok;
}

/* The CRC32C of n bytes at p, continuing crc (0: from the start). */
uint32_t ck_crc32c(uint32_t crc, const void *p, size_t n)
{
    pthread_once(&crc_once, crc_init);
    uint32_t reg = ~crc;
    reg = crc_hw_ok ? crc_hw(reg, p, n) : crc_sw(reg, p, n);
    return ~reg;
}

/* crc times x^(8n): ck_crc32c_shift(crc(A), |B|) ^ crc(B) is crc(A then B). */
uint32_t ck_crc32c_shift(uint32_t crc, uint64_t n)
{
    pthread_once(&crc_once, crc_init);
    return crc_shift_by(crc, n);
}
