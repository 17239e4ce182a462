/* The part of the DLPack and TVM-FFI C ABI that a TVM-generated C kernel uses.
 *
 * Declared here so that the kernel compiles without a TVM installation, in gcc
 * C simulation and in Vitis HLS.  The layouts are those of dlpack.h (DLDevice,
 * DLDataType, DLTensor) and tvm/ffi/c_api.h (TVMFFIAny) as used by TVM 0.27.
 * The kernel checks every field it reads (type index, ndim, dtype, shape,
 * strides, device, byte offset) and returns non-zero on any difference, so a
 * layout mismatch fails the call loudly instead of computing garbage.
 */
#ifndef QNORM_TVM_ABI_H
#define QNORM_TVM_ABI_H

#include <stddef.h>
#include <stdint.h>

#define TVM_DLL /* linked statically into one program: nothing to export */

enum {
  QNORM_DL_INT = 0,           /* DLDataTypeCode kDLInt */
  QNORM_DL_CPU = 1,           /* DLDeviceType kDLCPU */
  QNORM_FFI_NONE = 0,         /* TVMFFITypeIndex kTVMFFINone */
  QNORM_FFI_DLTENSOR_PTR = 7, /* TVMFFITypeIndex kTVMFFIDLTensorPtr */
};

typedef struct {
  int32_t device_type;
  int32_t device_id;
} DLDevice;

typedef struct {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
} DLDataType;

typedef struct {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
} DLTensor;

typedef struct {
  int32_t type_index;
  uint32_t zero_padding;
  union {
    int64_t v_int64;
    void* v_ptr;
  };
} TVMFFIAny;

/* Called by the kernel's argument checks before it returns non-zero. */
void TVMFFIErrorSetRaisedFromCStrParts(const char* kind, const char** message_parts,
                                       int32_t num_parts);

/* The kernel: TVM's packed entry point of the PrimFunc "main". */
int32_t __tvm_ffi_main(void* self_handle, void* args, int32_t num_args, void* result);

#endif
