/* Load smoke test for cross-built provider libraries, run under user-mode emulation
 * (ci/cross/smoke.sh): dlopen each library as the loader does (RTLD_NOW: every symbol bound,
 * libcudart found through the library's RUNPATH), call cake_info, check it against the ABI.
 * No GPU: it loads and asks, it never launches. Exit 0 only when every library passes. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include "cake_rmsnorm/abi.h"

int main(int argc, char** argv) {
  int failed = 0;
  setvbuf(stdout, NULL, _IONBF, 0);
  for (int i = 1; i < argc; ++i) {
    void* lib = dlopen(argv[i], RTLD_NOW | RTLD_LOCAL);
    if (!lib) { printf("FAIL %s: dlopen: %s\n", argv[i], dlerror()); failed = 1; continue; }
    int (*info)(cake_info_t*) = (int (*)(cake_info_t*))dlsym(lib, "cake_info");
    cake_info_t got = {0};
    int rc = info ? info(&got) : -1;
    if (!info || rc != 0 || got.abi_version != CAKE_ABI_VERSION || !got.program) {
      printf("FAIL %s: cake_info %s rc %d abi %d\n", argv[i], info ? "found" : "missing", rc,
             (int)got.abi_version);
      failed = 1;
    } else {
      printf("ok   %s: %s H %d %s\n", argv[i], got.program, (int)got.hidden,
             got.direction == CAKE_DIRECTION_FWD ? "fwd" : "bwd");
    }
    /* no dlclose: CUDA host code registers exit handlers in the library (the loader never
     * unloads a provider library either) */
  }
  return failed;
}
