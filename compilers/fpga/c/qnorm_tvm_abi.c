/* The one TVM runtime function a qnorm HLS kernel calls: error reporting.
 *
 * The kernel's loops are serial and its scratch is static, so it needs no
 * workspace allocator and no parallel launcher.  In C simulation the error is
 * printed; in synthesis (__SYNTHESIS__) there is nowhere to print it, and the
 * non-zero status qnorm_top returns is the report.
 */
#include "qnorm_tvm_abi.h"

#ifndef __SYNTHESIS__
#include <stdio.h>
#endif

void TVMFFIErrorSetRaisedFromCStrParts(const char* kind, const char** message_parts,
                                       int32_t num_parts) {
#ifndef __SYNTHESIS__
  fprintf(stderr, "qnorm kernel: %s: ", kind);
  for (int32_t i = 0; i < num_parts; ++i) {
    if (message_parts[i] != NULL) {
      fputs(message_parts[i], stderr);
    }
  }
  fputc('\n', stderr);
#else
  (void)kind;
  (void)message_parts;
  (void)num_parts;
#endif
}
