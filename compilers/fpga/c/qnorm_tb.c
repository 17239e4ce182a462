/* C testbench of a qnorm HLS project: qnorm_top on golden vectors, bit for bit.
 *
 * usage: qnorm_tb [VECTORS [OUTPUTS]]     (VECTORS defaults to vectors.bin)
 *
 * VECTORS is the file compilers/fpga/vectors.py writes (all little-endian):
 *   0  char[8]  magic "QNORMVEC"        8  uint32 version (1)
 *   12 uint32   flags (bit 0: expected outputs follow the inputs)
 *   16 uint64   count (vectors)        24  uint64 unit (elements per vector)
 *   32 uint32   input bytes/element    36  uint32 output bytes/element
 *   40 uint64   checksum: sum of payload byte i times (i + 1), modulo 2^64
 *   48 payload  count*unit inputs, then count*unit expected outputs if flagged
 * A vector is one row of QNORM_WIDTH elements, or for a time-major op (a
 * spiking neuron) one batch element's steps x QNORM_WIDTH currents, step-major.
 *
 * Vectors run QNORM_ROWS at a time (the last call padded with zero rows, which
 * every input format holds).  With OUTPUTS, every output is written there as a
 * little-endian int64.
 *
 * Exit status: 0 every output equals the expected one (or none expected);
 * 1 a mismatch (the first is printed); 2 a bad file, argument or call.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qnorm_top.h"

#define HEADER_BYTES 48u
#define FORMAT_VERSION 1u
#define HAS_EXPECTED 1u

static qnorm_in_t x_block[QNORM_BLOCK_ELEMENTS];
static qnorm_out_t y_block[QNORM_BLOCK_ELEMENTS];

static void fail(const char* path, const char* what) {
  fprintf(stderr, "qnorm_tb: %s: %s\n", path, what);
  exit(2);
}

static uint64_t le_unsigned(const unsigned char* p, unsigned bytes) {
  uint64_t v = 0;
  for (unsigned i = 0; i < bytes; ++i) {
    v |= (uint64_t)p[i] << (8u * i);
  }
  return v;
}

/* Two's complement of `bytes` bytes, sign-extended. */
static int64_t le_signed(const unsigned char* p, unsigned bytes) {
  uint64_t v = le_unsigned(p, bytes);
  if (bytes < 8u && (v >> (8u * bytes - 1u)) != 0) {
    v |= ~(uint64_t)0 << (8u * bytes);
  }
  return (int64_t)v;
}

static unsigned char* read_file(const char* path, size_t* size) {
  FILE* f = fopen(path, "rb");
  if (f == NULL) fail(path, "cannot open");
  if (fseek(f, 0, SEEK_END) != 0) fail(path, "cannot seek");
  long end = ftell(f);
  if (end < 0) fail(path, "cannot tell its size");
  rewind(f);
  unsigned char* data = malloc(end > 0 ? (size_t)end : 1u);
  if (data == NULL) fail(path, "out of memory");
  if (fread(data, 1, (size_t)end, f) != (size_t)end) fail(path, "short read");
  fclose(f);
  *size = (size_t)end;
  return data;
}

/* Offset of element `e` of the block's row `r` in x_block / y_block. */
static size_t block_index(uint64_t r, uint64_t e) {
#if QNORM_TIME_MAJOR
  uint64_t t = e / QNORM_WIDTH, c = e % QNORM_WIDTH;
  return (size_t)((t * QNORM_ROWS + r) * QNORM_WIDTH + c);
#else
  return (size_t)(r * QNORM_WIDTH + e);
#endif
}

static int32_t call_top(uint64_t unit) {
#if QNORM_TIME_MAJOR
  return qnorm_top((int32_t)(unit / QNORM_WIDTH), (const qnorm_in_t(*)[QNORM_ROWS][QNORM_WIDTH])x_block,
                   (qnorm_out_t(*)[QNORM_ROWS][QNORM_WIDTH])y_block);
#else
  (void)unit;
  return qnorm_top((const qnorm_in_t(*)[QNORM_WIDTH])x_block, (qnorm_out_t(*)[QNORM_WIDTH])y_block);
#endif
}

static void check_unit(const char* path, uint64_t unit) {
#if QNORM_TIME_MAJOR
  if (unit == 0 || unit % QNORM_WIDTH != 0 || unit / QNORM_WIDTH > QNORM_MAX_STEPS) {
    fprintf(stderr, "qnorm_tb: %s: %llu elements per vector is not 1..%d steps of %d channels\n", path,
            (unsigned long long)unit, QNORM_MAX_STEPS, QNORM_WIDTH);
    exit(2);
  }
#else
  if (unit != QNORM_WIDTH) {
    fprintf(stderr, "qnorm_tb: %s: %llu elements per vector, this top takes rows of %d\n", path,
            (unsigned long long)unit, QNORM_WIDTH);
    exit(2);
  }
#endif
}

static void print_vector(const char* label, const int64_t* v, uint64_t unit) {
  fprintf(stderr, "  %-8s [", label);
  for (uint64_t e = 0; e < unit && e < 16; ++e) {
    fprintf(stderr, "%s%lld", e ? ", " : "", (long long)v[e]);
  }
  fprintf(stderr, "%s]\n", unit > 16 ? ", ..." : "");
}

int main(int argc, char** argv) {
  const char* path = argc > 1 ? argv[1] : "vectors.bin";
  size_t size;
  unsigned char* file = read_file(path, &size);
  if (size < HEADER_BYTES) fail(path, "shorter than the 48-byte header");
  if (memcmp(file, "QNORMVEC", 8) != 0) fail(path, "not a qnorm vectors file (bad magic)");
  if (le_unsigned(file + 8, 4) != FORMAT_VERSION) fail(path, "unsupported format version");
  uint32_t flags = (uint32_t)le_unsigned(file + 12, 4);
  uint64_t count = le_unsigned(file + 16, 8), unit = le_unsigned(file + 24, 8);
  unsigned in_bytes = (unsigned)le_unsigned(file + 32, 4), out_bytes = (unsigned)le_unsigned(file + 36, 4);
  if ((flags & ~HAS_EXPECTED) != 0) fail(path, "unknown flags");
  if (in_bytes != sizeof(qnorm_in_t) || out_bytes != sizeof(qnorm_out_t)) {
    fprintf(stderr, "qnorm_tb: %s: elements of %u/%u bytes, this top takes %u/%u (input/output)\n", path,
            in_bytes, out_bytes, (unsigned)sizeof(qnorm_in_t), (unsigned)sizeof(qnorm_out_t));
    return 2;
  }
  check_unit(path, unit);
  uint64_t elements = count * unit;
  if (count != 0 && elements / count != unit) fail(path, "count x unit overflows");
  uint64_t payload = elements * in_bytes + ((flags & HAS_EXPECTED) ? elements * out_bytes : 0);
  if (size - HEADER_BYTES != payload) {
    fprintf(stderr, "qnorm_tb: %s: %llu payload bytes, the header describes %llu (truncated or padded)\n",
            path, (unsigned long long)(size - HEADER_BYTES), (unsigned long long)payload);
    return 2;
  }
  uint64_t sum = 0;
  for (uint64_t i = 0; i < payload; ++i) {
    sum += (uint64_t)file[HEADER_BYTES + i] * (i + 1);
  }
  if (sum != le_unsigned(file + 40, 8)) fail(path, "checksum mismatch: the file is corrupted");

  const unsigned char* inputs = file + HEADER_BYTES;
  const unsigned char* expected = (flags & HAS_EXPECTED) ? inputs + elements * in_bytes : NULL;
  int64_t* x = malloc((elements ? elements : 1) * sizeof(int64_t));
  int64_t* got = malloc((elements ? elements : 1) * sizeof(int64_t));
  if (x == NULL || got == NULL) fail(path, "out of memory");
  for (uint64_t i = 0; i < elements; ++i) {
    x[i] = le_signed(inputs + i * in_bytes, in_bytes);
    if (x[i] < QNORM_IN_LO || x[i] > QNORM_IN_HI) {
      fprintf(stderr, "qnorm_tb: %s: input %lld (vector %llu, element %llu) is outside the input format [%lld, %lld]\n",
              path, (long long)x[i], (unsigned long long)(i / unit), (unsigned long long)(i % unit),
              (long long)QNORM_IN_LO, (long long)QNORM_IN_HI);
      return 2;
    }
  }

  for (uint64_t b0 = 0; b0 < count; b0 += QNORM_ROWS) {
    uint64_t rows = count - b0 < QNORM_ROWS ? count - b0 : QNORM_ROWS;
    memset(x_block, 0, sizeof x_block);
    for (uint64_t r = 0; r < rows; ++r) {
      for (uint64_t e = 0; e < unit; ++e) {
        x_block[block_index(r, e)] = (qnorm_in_t)x[(b0 + r) * unit + e];
      }
    }
    int32_t status = call_top(unit);
    if (status != 0) {
      fprintf(stderr, "qnorm_tb: qnorm_top returned %d on vectors %llu..%llu\n", (int)status,
              (unsigned long long)b0, (unsigned long long)(b0 + rows - 1));
      return 2;
    }
    for (uint64_t r = 0; r < rows; ++r) {
      for (uint64_t e = 0; e < unit; ++e) {
        got[(b0 + r) * unit + e] = y_block[block_index(r, e)];
      }
    }
  }

  if (argc > 2) {
    FILE* out = fopen(argv[2], "wb");
    if (out == NULL) fail(argv[2], "cannot open for writing");
    for (uint64_t i = 0; i < elements; ++i) {
      unsigned char le[8];
      for (unsigned k = 0; k < 8; ++k) le[k] = (unsigned char)((uint64_t)got[i] >> (8u * k));
      if (fwrite(le, 1, 8, out) != 8) fail(argv[2], "short write");
    }
    if (fclose(out) != 0) fail(argv[2], "cannot close");
  }

  if (expected == NULL) {
    printf("qnorm_tb: ran %llu vectors of %llu elements (no expected outputs in %s)\n",
           (unsigned long long)count, (unsigned long long)unit, path);
    return 0;
  }
  for (uint64_t i = 0; i < elements; ++i) {
    int64_t want = le_signed(expected + i * out_bytes, out_bytes);
    if (got[i] != want) {
      uint64_t v = i / unit, e = i % unit;
      fprintf(stderr, "qnorm_tb: MISMATCH in vector %llu, element %llu", (unsigned long long)v,
              (unsigned long long)e);
#if QNORM_TIME_MAJOR
      fprintf(stderr, " (step %llu, channel %llu)", (unsigned long long)(e / QNORM_WIDTH),
              (unsigned long long)(e % QNORM_WIDTH));
#endif
      fprintf(stderr, ": expected %lld, got %lld\n", (long long)want, (long long)got[i]);
      print_vector("input", x + v * unit, unit);
      print_vector("got", got + v * unit, unit);
      return 1;
    }
  }
  printf("qnorm_tb: PASS: %llu vectors of %llu elements bit-exact against the golden outputs\n",
         (unsigned long long)count, (unsigned long long)unit);
  return 0;
}
