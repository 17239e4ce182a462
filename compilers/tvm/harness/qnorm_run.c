/*
 * qnorm_run: runs a compiled qnorm model through its C API (qnorm_model.h) on a
 * file of input integers; linked statically with libqnorm_model.a.
 *
 *   qnorm_run [--target NAME] INPUT OUTPUT     run; print each sample's class (argmax)
 *   qnorm_run --info                           print what the model takes and gives
 *
 * INPUT is a .npy file of the model's input integer type, shaped (batch, ...)
 * or one sample's shape, or a raw file of such integers (native byte order):
 * whole samples back to back.  OUTPUT gets the output integers: a .npy file
 * (int32, (batch, ...)) when its name ends in .npy, else raw int32.
 * --target refuses to run unless the library was compiled for NAME.
 *
 * Exit status: 0 ok, 2 bad arguments or file, 3 the model reported an error.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qnorm_model.h"

#define MAX_RANK 8

static void fail(const char* fmt, const char* a, const char* b) {
  fputs("qnorm_run: ", stderr);
  fprintf(stderr, fmt, a, b);
  fputc('\n', stderr);
  exit(2);
}

static int ends_with(const char* s, const char* suffix) {
  size_t n = strlen(s), m = strlen(suffix);
  return n >= m && strcmp(s + n - m, suffix) == 0;
}

static size_t per_sample(void) {
  const int64_t* dims;
  size_t rank = qnorm_model_input_shape(&dims), n = 1;
  for (size_t d = 0; d < rank; ++d) n *= (size_t)dims[d];
  return n;
}

static unsigned char* read_file(const char* path, size_t* size) {
  FILE* f = fopen(path, "rb");
  if (f == NULL) fail("cannot open %s%s", path, "");
  size_t cap = 1 << 16, used = 0;
  unsigned char* data = malloc(cap);
  size_t got;
  while (data != NULL && (got = fread(data + used, 1, cap - used, f)) > 0) {
    used += got;
    if (used == cap) data = realloc(data, cap *= 2);
  }
  if (data == NULL) fail("out of memory reading %s%s", path, "");
  fclose(f);
  *size = used;
  return data;
}

/* The value of 'key': in a .npy header dict, or NULL. */
static const char* npy_field(const char* header, const char* key) {
  const char* at = strstr(header, key);
  if (at == NULL) return NULL;
  at = strchr(at + strlen(key), ':');
  if (at == NULL) return NULL;
  while (*++at == ' ') {
  }
  return at;
}

/* The samples of a .npy file; checks its dtype and that its shape ends in a sample's. */
static const unsigned char* npy_samples(const char* path, const unsigned char* data, size_t size, size_t* batch) {
  if (size < 10 || memcmp(data, "\x93NUMPY", 6) != 0) fail("%s is not a .npy file%s", path, "");
  size_t header_len, start;
  if (data[6] == 1) {
    header_len = (size_t)data[8] | (size_t)data[9] << 8;
    start = 10;
  } else {
    if (size < 12) fail("%s: truncated .npy header%s", path, "");
    header_len = (size_t)data[8] | (size_t)data[9] << 8 | (size_t)data[10] << 16 | (size_t)data[11] << 24;
    start = 12;
  }
  if (start + header_len > size) fail("%s: truncated .npy header%s", path, "");
  char* header = malloc(header_len + 1);
  memcpy(header, data + start, header_len);
  header[header_len] = '\0';
  const char* descr = npy_field(header, "'descr'");
  char want[8];
  snprintf(want, sizeof want, "%c%d", QNORM_MODEL_INPUT_KIND, (int)sizeof(qnorm_model_input_t));
  if (descr == NULL || descr[0] != '\'' || strchr("<|=", descr[1]) == NULL || strncmp(descr + 2, want, strlen(want)) != 0 ||
      descr[2 + strlen(want)] != '\'')
    fail("%s: the model takes %s integers (numpy dtype " QNORM_MODEL_INPUT_DTYPE ")", path, want);
  const char* order = npy_field(header, "'fortran_order'");
  if (order == NULL || strncmp(order, "False", 5) != 0) fail("%s: not a C-ordered array%s", path, "");
  const char* shape = npy_field(header, "'shape'");
  if (shape == NULL || *shape != '(') fail("%s: no shape in the .npy header%s", path, "");
  int64_t dims[MAX_RANK];
  size_t rank = 0;
  for (const char* p = shape + 1; *p != ')' && rank < MAX_RANK;) {
    char* end;
    long long v = strtoll(p, &end, 10);
    if (end == p) break;
    dims[rank++] = v;
    p = end;
    while (*p == ',' || *p == ' ') ++p;
  }
  const int64_t* want_dims;
  size_t want_rank = qnorm_model_input_shape(&want_dims);
  int has_batch = rank == want_rank + 1;
  if (rank != want_rank && !has_batch) fail("%s: an array of rank %s does not hold samples of this model", path, "");
  for (size_t d = 0; d < want_rank; ++d) {
    if (dims[d + (size_t)has_batch] != want_dims[d]) fail("%s: samples of the wrong shape%s", path, "");
  }
  *batch = has_batch ? (size_t)dims[0] : 1;
  free(header);
  if (size - start - header_len != *batch * per_sample() * sizeof(qnorm_model_input_t))
    fail("%s: the data size does not match the header's shape%s", path, "");
  return data + start + header_len;
}

static void write_output(const char* path, const int32_t* out, size_t batch) {
  FILE* f = fopen(path, "wb");
  if (f == NULL) fail("cannot create %s%s", path, "");
  const int64_t* dims;
  size_t rank = qnorm_model_output_shape(&dims);
  if (ends_with(path, ".npy")) {
    char header[256];
    int n = snprintf(header, sizeof header, "{'descr': '<i4', 'fortran_order': False, 'shape': (%zu,", batch);
    for (size_t d = 0; d < rank; ++d) n += snprintf(header + n, sizeof header - (size_t)n, " %lld,", (long long)dims[d]);
    n += snprintf(header + n, sizeof header - (size_t)n, "), }");
    size_t total = 10 + (size_t)n + 1, pad = (64 - total % 64) % 64;
    unsigned char preamble[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, 0, 0};
    size_t header_len = (size_t)n + pad + 1;
    preamble[8] = (unsigned char)(header_len & 0xff);
    preamble[9] = (unsigned char)(header_len >> 8);
    fwrite(preamble, 1, sizeof preamble, f);
    fwrite(header, 1, (size_t)n, f);
    for (size_t i = 0; i < pad; ++i) fputc(' ', f);
    fputc('\n', f);
  }
  size_t count = batch * QNORM_MODEL_OUTPUT_SIZE;
  if (fwrite(out, sizeof *out, count, f) != count || fclose(f) != 0) fail("cannot write %s%s", path, "");
}

static void print_info(void) {
  const int64_t* dims;
  size_t rank = qnorm_model_input_shape(&dims);
  printf("target %s\nversion %s\ninput " QNORM_MODEL_INPUT_DTYPE " (batch", qnorm_model_target(), qnorm_model_version());
  for (size_t d = 0; d < rank; ++d) printf(", %lld", (long long)dims[d]);
  printf(") scale %.17g\noutput int32 (batch", qnorm_model_input_scale());
  rank = qnorm_model_output_shape(&dims);
  for (size_t d = 0; d < rank; ++d) printf(", %lld", (long long)dims[d]);
  printf(") scale %.17g\n", qnorm_model_output_scale());
}

int main(int argc, char** argv) {
  const char* target = NULL;
  int arg = 1;
  if (argc == 2 && strcmp(argv[1], "--info") == 0) {
    print_info();
    return 0;
  }
  if (argc == 5 && strcmp(argv[1], "--target") == 0) {
    target = argv[2];
    arg = 3;
  } else if (argc != 3) {
    fail("usage: qnorm_run [--target NAME] INPUT OUTPUT | qnorm_run --info%s%s", "", "");
  }
  if (target != NULL && strcmp(target, qnorm_model_target()) != 0)
    fail("this model was compiled for %s, not %s", qnorm_model_target(), target);
  size_t size, batch;
  unsigned char* data = read_file(argv[arg], &size);
  const unsigned char* samples = data;
  if (ends_with(argv[arg], ".npy")) {
    samples = npy_samples(argv[arg], data, size, &batch);
  } else {
    size_t bytes = per_sample() * sizeof(qnorm_model_input_t);
    if (size % bytes != 0) fail("%s does not hold whole samples of this model's input%s", argv[arg], "");
    batch = size / bytes;
  }
  /* copied: the API takes an aligned array of the input type, the file's data need not be one */
  qnorm_model_input_t* in = malloc(batch * per_sample() * sizeof *in + 1);
  int32_t* out = malloc(batch * QNORM_MODEL_OUTPUT_SIZE * sizeof *out + 1);
  if (in == NULL || out == NULL) fail("out of memory for %s%s", argv[arg], "");
  memcpy(in, samples, batch * per_sample() * sizeof *in);
  if (qnorm_model_run(in, batch, out) != 0) {
    fprintf(stderr, "qnorm_run: %s\n", qnorm_model_error());
    return 3;
  }
  write_output(argv[arg + 1], out, batch);
  for (size_t b = 0; b < batch; ++b) {
    const int32_t* row = out + b * QNORM_MODEL_OUTPUT_SIZE;
    size_t best = 0;
    for (size_t j = 1; j < QNORM_MODEL_OUTPUT_SIZE; ++j) best = row[j] > row[best] ? j : best;
    printf("%zu\n", best);
  }
  free(in), free(out), free(data);
  return 0;
}
