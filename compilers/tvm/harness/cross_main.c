/*
 * Standalone runner for one TVM-generated kernel object, without libtvm.
 *
 *   kernel_exe ARGS_FILE OUT_FILE
 *
 * ARGS_FILE (little endian, written by compilers/tvm/cross.py):
 *   "QNXT", uint32 count                          the kernel's arguments, output last
 *   count x { uint32 bits, uint32 ndim, int64 shape[ndim] }   signed integer tensors
 *   the data of every argument but the output, in order, densely packed
 * OUT_FILE receives the output tensor's data.
 *
 * The kernel is TVM's packed entry `__tvm_ffi_main` (TVMFFISafeCallType): each
 * argument is a TVMFFIAny holding a DLTensor pointer.  The object reaches the
 * runtime through TVM's context pointers (`__TVMBackend*`, weak definitions in
 * the object, filled by libtvm when it loads a library); here main() fills the
 * ones the object defines with the functions below.  Parallel loops run as one
 * task on this thread: TVM's parallel lambdas split their loop by
 * penv->num_task, so one task covers the whole loop and the result is the same.
 *
 * Exit status: 0 ok, 2 bad arguments or file, 3 the kernel raised an error
 * (its message on stderr).
 */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <dlpack/dlpack.h>
#include <tvm/ffi/c_api.h>
#include <tvm/runtime/c_backend_api.h>

#define MAX_ARGS 16
#define MAX_NDIM 8
#define ALIGN 64 /* TVM's kernels assume 64-byte aligned buffers */

int __tvm_ffi_main(void* self, const TVMFFIAny* args, int32_t num_args, TVMFFIAny* result);

extern void* __TVMBackendAllocWorkspace __attribute__((weak));
extern void* __TVMBackendFreeWorkspace __attribute__((weak));
extern void* __TVMBackendParallelLaunch __attribute__((weak));
extern void* __TVMBackendParallelBarrier __attribute__((weak));

static char raised[4096];

static void fail(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("cross_main: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  exit(2);
}

/* ---------------------------------------------------------------- runtime */

void TVMFFIErrorSetRaisedFromCStrParts(const char* kind, const char** parts, int32_t num_parts) {
  size_t used = (size_t)snprintf(raised, sizeof raised, "%s: ", kind);
  for (int32_t i = 0; i < num_parts && used < sizeof raised; ++i) {
    if (parts[i] != NULL) used += (size_t)snprintf(raised + used, sizeof raised - used, "%s", parts[i]);
  }
}

static size_t round_up(size_t n) { return (n + ALIGN - 1) / ALIGN * ALIGN; }

void* TVMBackendAllocWorkspace(int device_type, int device_id, uint64_t nbytes, int dtype_code_hint,
                               int dtype_bits_hint) {
  (void)device_type, (void)device_id, (void)dtype_code_hint, (void)dtype_bits_hint;
  return aligned_alloc(ALIGN, round_up(nbytes == 0 ? 1 : (size_t)nbytes));
}

int TVMBackendFreeWorkspace(int device_type, int device_id, void* ptr) {
  (void)device_type, (void)device_id;
  free(ptr);
  return 0;
}

int TVMBackendParallelLaunch(FTVMParallelLambda flambda, void* cdata, int num_task) {
  (void)num_task; /* a request, not a requirement: the lambda reads penv->num_task */
  TVMParallelGroupEnv env = {NULL, 1};
  return flambda(0, &env, cdata);
}

int TVMBackendParallelBarrier(int task_id, TVMParallelGroupEnv* penv) {
  (void)task_id, (void)penv; /* one task: nothing to wait for */
  return 0;
}

static void install_runtime(void) {
  if (&__TVMBackendAllocWorkspace) __TVMBackendAllocWorkspace = (void*)TVMBackendAllocWorkspace;
  if (&__TVMBackendFreeWorkspace) __TVMBackendFreeWorkspace = (void*)TVMBackendFreeWorkspace;
  if (&__TVMBackendParallelLaunch) __TVMBackendParallelLaunch = (void*)TVMBackendParallelLaunch;
  if (&__TVMBackendParallelBarrier) __TVMBackendParallelBarrier = (void*)TVMBackendParallelBarrier;
}

/* ---------------------------------------------------------------- tensors */

typedef struct {
  DLTensor t;
  int64_t shape[MAX_NDIM];
  size_t nbytes;
} Arg;

static void read_exact(FILE* f, void* dst, size_t n, const char* what) {
  if (fread(dst, 1, n, f) != n) fail("truncated arguments file while reading %s", what);
}

static uint32_t read_u32(FILE* f, const char* what) {
  uint32_t v;
  read_exact(f, &v, sizeof v, what);
  return v;
}

static void read_header(FILE* f, Arg* a, uint32_t index) {
  uint32_t bits = read_u32(f, "a dtype");
  uint32_t ndim = read_u32(f, "a rank");
  if (bits != 8 && bits != 16 && bits != 32 && bits != 64)
    fail("argument %u: %u-bit integers are not supported", index, bits);
  if (ndim > MAX_NDIM) fail("argument %u: rank %u exceeds %d", index, ndim, MAX_NDIM);
  size_t count = 1;
  for (uint32_t d = 0; d < ndim; ++d) {
    read_exact(f, &a->shape[d], sizeof a->shape[d], "a shape");
    if (a->shape[d] < 0) fail("argument %u: negative extent %lld", index, (long long)a->shape[d]);
    if (a->shape[d] > 0 && count > SIZE_MAX / 8 / (size_t)a->shape[d])
      fail("argument %u: too many elements", index);
    count *= (size_t)a->shape[d];
  }
  a->nbytes = count * (bits / 8);
  a->t.data = aligned_alloc(ALIGN, round_up(a->nbytes == 0 ? 1 : a->nbytes));
  if (a->t.data == NULL) fail("argument %u: cannot allocate %zu bytes", index, a->nbytes);
  a->t.device = (DLDevice){kDLCPU, 0};
  a->t.ndim = (int32_t)ndim;
  a->t.dtype = (DLDataType){kDLInt, (uint8_t)bits, 1};
  a->t.shape = a->shape;
  a->t.strides = NULL; /* compact, row major */
  a->t.byte_offset = 0;
}

static uint32_t read_args(const char* path, Arg* args) {
  FILE* f = fopen(path, "rb");
  if (f == NULL) fail("cannot open %s", path);
  char magic[4];
  read_exact(f, magic, sizeof magic, "the magic");
  if (memcmp(magic, "QNXT", 4) != 0) fail("%s is not a qnorm arguments file", path);
  uint32_t count = read_u32(f, "the argument count");
  if (count < 2 || count > MAX_ARGS) fail("%u arguments; expected 2 to %d", count, MAX_ARGS);
  for (uint32_t i = 0; i < count; ++i) read_header(f, &args[i], i);
  for (uint32_t i = 0; i + 1 < count; ++i) read_exact(f, args[i].t.data, args[i].nbytes, "tensor data");
  if (fgetc(f) != EOF) fail("%s has bytes after the last tensor", path);
  fclose(f);
  return count;
}

static void write_out(const char* path, const Arg* out) {
  FILE* f = fopen(path, "wb");
  if (f == NULL) fail("cannot create %s", path);
  if (fwrite(out->t.data, 1, out->nbytes, f) != out->nbytes || fclose(f) != 0)
    fail("cannot write %s", path);
}

int main(int argc, char** argv) {
  if (argc != 3) fail("usage: %s ARGS_FILE OUT_FILE", argv[0]);
  static Arg args[MAX_ARGS];
  uint32_t count = read_args(argv[1], args);

  TVMFFIAny packed[MAX_ARGS];
  for (uint32_t i = 0; i < count; ++i) {
    memset(&packed[i], 0, sizeof packed[i]);
    packed[i].type_index = kTVMFFIDLTensorPtr;
    packed[i].v_ptr = &args[i].t;
  }
  TVMFFIAny result;
  memset(&result, 0, sizeof result);
  result.type_index = kTVMFFINone;

  install_runtime();
  if (__tvm_ffi_main(NULL, packed, (int32_t)count, &result) != 0) {
    fprintf(stderr, "cross_main: kernel raised %s\n", raised[0] ? raised : "an error without a message");
    return 3;
  }
  write_out(argv[2], &args[count - 1]);
  return 0;
}
