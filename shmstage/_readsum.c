/*
 * Reads that checksum their bytes while they are still in the core's cache (see
 * shmstage/readsum.py, which loads this library with ctypes; the module object below only
 * lets the build and the import system find it).
 *
 * CRC-32C with the SSE4.2 instruction, three lanes of LANE bytes at a time so that the
 * instruction's latency is hidden, the lanes joined by advancing a lane's register past
 * the bytes after it: a linear map on the register's 32 bits, tabulated per byte of the
 * register once (shmstage_readsum_init).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define READSUM_X86 1
#include <nmmintrin.h>
#endif

/* Bytes per lane of the interleaved CRC, and per block read before it is checksummed:
   1 MiB stays in a core's L2 cache and costs one system call per MiB (256 KiB and 4 MiB
   were slower on an H200 VM; readsum.txt in the history of docs/perf/). */
#define LANE 4096
#define BLOCK ((size_t)1 << 20)

static uint32_t past_one_lane[4][256];
static uint32_t past_two_lanes[4][256];
static int tables_ready;

#ifdef READSUM_X86
__attribute__((target("sse4.2"))) static uint32_t advance(uint32_t crc, size_t zeros)
{
    uint64_t value = crc;
    for (size_t i = 0; i < zeros / 8; i++)
        value = _mm_crc32_u64(value, 0);
    return (uint32_t)value;
}

static void tabulate(uint32_t table[4][256], size_t zeros)
{
    uint32_t bit[32];
    for (int i = 0; i < 32; i++)
        bit[i] = advance(1u << i, zeros);
    for (int k = 0; k < 4; k++)
        for (int b = 0; b < 256; b++) {
            uint32_t value = 0;
            for (int j = 0; j < 8; j++)
                if (b & (1 << j))
                    value ^= bit[8 * k + j];
            table[k][b] = value;
        }
}

static inline uint32_t apply(const uint32_t table[4][256], uint32_t crc)
{
    return table[0][crc & 255] ^ table[1][(crc >> 8) & 255] ^ table[2][(crc >> 16) & 255] ^
           table[3][crc >> 24];
}

/* The CRC register (no initial or final inversion) after n more bytes. */
__attribute__((target("sse4.2"))) static uint32_t update(uint32_t crc, const unsigned char *p,
                                                        size_t n)
{
    while (n && ((uintptr_t)p & 7)) {
        crc = _mm_crc32_u8(crc, *p++);
        n--;
    }
    while (n >= 3 * LANE) {
        uint64_t a = crc, b = 0, c = 0;
        for (size_t i = 0; i < LANE; i += 8) {
            uint64_t wa, wb, wc;
            memcpy(&wa, p + i, 8);
            memcpy(&wb, p + LANE + i, 8);
            memcpy(&wc, p + 2 * LANE + i, 8);
            a = _mm_crc32_u64(a, wa);
            b = _mm_crc32_u64(b, wb);
            c = _mm_crc32_u64(c, wc);
        }
        crc = apply(past_two_lanes, (uint32_t)a) ^ apply(past_one_lane, (uint32_t)b) ^ (uint32_t)c;
        p += 3 * LANE;
        n -= 3 * LANE;
    }
    uint64_t value = crc;
    while (n >= 8) {
        uint64_t word;
        memcpy(&word, p, 8);
        value = _mm_crc32_u64(value, word);
        p += 8;
        n -= 8;
    }
    crc = (uint32_t)value;
    while (n--)
        crc = _mm_crc32_u8(crc, *p++);
    return crc;
}
#endif

/* 0 once the tables are made, -1 where this processor (or build) has no CRC-32C
   instruction: the caller then reads and checksums in two passes. */
int shmstage_readsum_init(void)
{
#ifdef READSUM_X86
    if (!__builtin_cpu_supports("sse4.2"))
        return -1;
    if (!tables_ready) {
        tabulate(past_one_lane, LANE);
        tabulate(past_two_lanes, 2 * LANE);
        tables_ready = 1;
    }
    return 0;
#else
    return -1;
#endif
}

/*
 * Read n bytes into dst — from descriptor fd at offset with pread, or, with fd < 0, from
 * src + offset with memcpy — a block at a time, and continue the CRC-32C of each span:
 * spans holds nspans (lo, hi) pairs of offsets into dst, ascending and not overlapping;
 * values holds each span's CRC so far (0 to start) and is updated. Returns n, or -errno
 * (-ENODATA: the file ended first); on an error the values are the spans' so far.
 */
long shmstage_read_sum(int fd, const unsigned char *src, unsigned char *dst, size_t n,
                       int64_t offset, const uint64_t *spans, size_t nspans, uint32_t *values)
{
#ifdef READSUM_X86
    size_t done = 0, first = 0;
    long result = (long)n;
    for (size_t i = 0; i < nspans; i++)
        values[i] = ~values[i];
    while (done < n) {
        size_t want = n - done < BLOCK ? n - done : BLOCK;
        size_t got = want;
        if (fd >= 0) {
            ssize_t r = pread(fd, dst + done, want, (off_t)(offset + (int64_t)done));
            if (r < 0 && errno == EINTR)
                continue;
            if (r <= 0) {
                result = r < 0 ? -errno : -ENODATA;
                break;
            }
            got = (size_t)r;
        } else {
            memcpy(dst + done, src + offset + (int64_t)done, want);
        }
        size_t end = done + got;
        while (first < nspans && spans[2 * first + 1] <= done)
            first++;
        for (size_t i = first; i < nspans && spans[2 * i] < end; i++) {
            size_t lo = spans[2 * i] > done ? spans[2 * i] : done;
            size_t hi = spans[2 * i + 1] < end ? spans[2 * i + 1] : end;
            if (hi > lo)
                values[i] = update(values[i], dst + lo, hi - lo);
        }
        done = end;
    }
    for (size_t i = 0; i < nspans; i++)
        values[i] = ~values[i];
    return result;
#else
    (void)fd, (void)src, (void)dst, (void)n, (void)offset, (void)spans, (void)nspans, (void)values;
    return -ENOSYS;
#endif
}

static struct PyModuleDef readsum_module = {
    PyModuleDef_HEAD_INIT, "_readsum",
    "Reads that checksum while the bytes are cached; called through ctypes (shmstage.readsum).",
    -1, NULL,
};

PyMODINIT_FUNC PyInit__readsum(void)
{
    return PyModule_Create(&readsum_module);
}
