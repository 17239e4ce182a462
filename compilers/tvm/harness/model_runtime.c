/*
 * The C API of a compiled qnorm model (qnorm_model.h), over the static plan
 * that compilers/tvm/c_api.py generates (model_plan.h): no libtvm, no heap.
 *
 * One sample at a time: its integers become the model's float32 input
 * (k * 2^e, exact), every TVM kernel runs in the plan's order on the static
 * arena, and the float32 output becomes integers on the output grid the
 * exactness proof gave (exact: the proof bounds every output to that grid; a
 * value off it is reported as an error, never rounded).
 *
 * The kernels reach the runtime through TVM's context pointers
 * (__TVMBackend*, weak definitions in the kernels' object that libtvm fills
 * when it loads a library); qnorm_model_run fills the ones the object defines.
 * Parallel loops run as one task on the calling thread: TVM's parallel lambdas
 * split their loop by penv->num_task, so one task covers the whole loop.
 */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model_plan.h"
#include "qnorm_model.h"

extern void* __TVMBackendAllocWorkspace __attribute__((weak));
extern void* __TVMBackendFreeWorkspace __attribute__((weak));
extern void* __TVMBackendParallelLaunch __attribute__((weak));
extern void* __TVMBackendParallelBarrier __attribute__((weak));

static char raised[512];
static char message[768];

/* ---------------------------------------------------------------- runtime */

/* Called by a kernel that fails a check (a shape, an alignment): its message. */
void TVMFFIErrorSetRaisedFromCStrParts(const char* kind, const char** parts, int32_t num_parts) {
  size_t used = (size_t)snprintf(raised, sizeof raised, "%s: ", kind);
  for (int32_t i = 0; i < num_parts && used < sizeof raised; ++i) {
    if (parts[i] != NULL) used += (size_t)snprintf(raised + used, sizeof raised - used, "%s", parts[i]);
  }
}

static size_t round_up(size_t n) { return (n + QNORM_PLAN_ALIGN - 1) / QNORM_PLAN_ALIGN * QNORM_PLAN_ALIGN; }

static void* alloc_workspace(int device_type, int device_id, uint64_t nbytes, int dtype_code_hint,
                             int dtype_bits_hint) {
  (void)device_type, (void)device_id, (void)dtype_code_hint, (void)dtype_bits_hint;
  return aligned_alloc(QNORM_PLAN_ALIGN, round_up(nbytes == 0 ? 1 : (size_t)nbytes));
}

static int free_workspace(int device_type, int device_id, void* ptr) {
  (void)device_type, (void)device_id;
  free(ptr);
  return 0;
}

static int parallel_launch(FTVMParallelLambda flambda, void* cdata, int num_task) {
  (void)num_task; /* a request, not a requirement: the lambda reads penv->num_task */
  TVMParallelGroupEnv env = {NULL, 1};
  return flambda(0, &env, cdata);
}

static int parallel_barrier(int task_id, TVMParallelGroupEnv* penv) {
  (void)task_id, (void)penv; /* one task: nothing to wait for */
  return 0;
}

static void install_runtime(void) {
  if (&__TVMBackendAllocWorkspace) __TVMBackendAllocWorkspace = (void*)alloc_workspace;
  if (&__TVMBackendFreeWorkspace) __TVMBackendFreeWorkspace = (void*)free_workspace;
  if (&__TVMBackendParallelLaunch) __TVMBackendParallelLaunch = (void*)parallel_launch;
  if (&__TVMBackendParallelBarrier) __TVMBackendParallelBarrier = (void*)parallel_barrier;
}

static int fail(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(message, sizeof message, fmt, ap);
  va_end(ap);
  return -1;
}

/* ---------------------------------------------------------------- one sample */

static int invoke(const qnorm_plan_step* step) {
  TVMFFIAny packed[QNORM_PLAN_MAX_ARGS];
  for (uint32_t i = 0; i < step->num_args; ++i) {
    memset(&packed[i], 0, sizeof packed[i]);
    packed[i].type_index = kTVMFFIDLTensorPtr;
    packed[i].v_ptr = &qnorm_plan_tensors[step->args[i]];
  }
  TVMFFIAny result;
  memset(&result, 0, sizeof result);
  result.type_index = kTVMFFINone;
  raised[0] = '\0';
  if (step->kernel(NULL, packed, (int32_t)step->num_args, &result) != 0)
    return fail("kernel %s raised %s", step->name, raised[0] ? raised : "an error without a message");
  return 0;
}

static int run_sample(const qnorm_model_input_t* in, int32_t* out) {
  float* x = (float*)qnorm_plan_tensors[QNORM_PLAN_INPUT].data;
  const float* y = (const float*)qnorm_plan_tensors[QNORM_PLAN_OUTPUT].data;
  for (size_t i = 0; i < QNORM_MODEL_INPUT_SIZE; ++i) x[i] = (float)in[i] * QNORM_PLAN_INPUT_SCALE;
  for (size_t s = 0; s < QNORM_PLAN_NUM_STEPS; ++s) {
    if (invoke(&qnorm_plan_steps[s]) != 0) return -1;
  }
  for (size_t j = 0; j < QNORM_MODEL_OUTPUT_SIZE; ++j) {
    float v = y[j] * QNORM_PLAN_OUTPUT_INV_SCALE;
    if (!(v >= -QNORM_PLAN_OUTPUT_MAX_ABS && v <= QNORM_PLAN_OUTPUT_MAX_ABS) || v != (float)(int32_t)v)
      return fail("output %zu is %.9g units of the output grid: not an integer within the proven bound %.0f",
                  j, (double)v, (double)QNORM_PLAN_OUTPUT_MAX_ABS);
    out[j] = (int32_t)v;
  }
  return 0;
}

/* ---------------------------------------------------------------- the API */

int qnorm_model_run(const qnorm_model_input_t* in, size_t batch, int32_t* out) {
  message[0] = '\0';
  if ((in == NULL || out == NULL) && batch > 0) return fail("qnorm_model_run: NULL input or output");
  install_runtime();
  for (size_t b = 0; b < batch; ++b) {
    if (run_sample(in + b * QNORM_MODEL_INPUT_SIZE, out + b * QNORM_MODEL_OUTPUT_SIZE) != 0) {
      char sample[sizeof message];
      memcpy(sample, message, sizeof sample);
      return fail("sample %zu: %s", b, sample);
    }
  }
  return 0;
}

const char* qnorm_model_error(void) { return message; }

const char* qnorm_model_target(void) { return QNORM_MODEL_TARGET; }

const char* qnorm_model_version(void) { return QNORM_MODEL_VERSION; }

size_t qnorm_model_input_shape(const int64_t** dims) {
  *dims = qnorm_plan_input_dims;
  return QNORM_MODEL_INPUT_RANK;
}

size_t qnorm_model_output_shape(const int64_t** dims) {
  *dims = qnorm_plan_output_dims;
  return QNORM_MODEL_OUTPUT_RANK;
}

double qnorm_model_input_scale(void) { return (double)QNORM_PLAN_INPUT_SCALE; }

double qnorm_model_output_scale(void) { return 1.0 / (double)QNORM_PLAN_OUTPUT_INV_SCALE; }
