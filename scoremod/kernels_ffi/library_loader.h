// Run-time loading of libcudnn / libcudart for the scoremod FFI extension.
//
// The extension is compiled with NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING, so it
// has no link-time dependency on cuDNN or the CUDA runtime. The cuDNN frontend
// then reaches cuDNN through the global `cudnn_frontend::cudnn_dlhandle` (which
// this module owns and fills) and the CUDA runtime through its own dlopen of
// libcudart.so.{12,13}, steered by CUDNN_FRONTEND_CUDART_LIB_NAME (which this
// module sets, once, to the copy already loaded in the process).
//
// This header deliberately does not include any CUDA/cuDNN header so the
// loader compiles quickly and stays independent of the frontend.
#pragma once

#include <cstdint>
#include <string>

namespace scoremod_ffi {

// What EnsureCudaLibrariesLoaded found. Paths are empty when unknown.
struct LoadedLibraries {
  std::string cudnn_path;       // the libcudnn actually used
  std::string cudnn_source;     // how it was found (env, in-process, hint, ...)
  int64_t cudnn_version = 0;    // cudnnGetVersion() of that library
  std::string cudart_path;      // value given to CUDNN_FRONTEND_CUDART_LIB_NAME
  std::string cudart_source;    // how it was chosen
};

// Paths Python found in site-packages, used only when nothing suitable is
// loaded in the process yet. Either may be null or empty. Thread-safe.
void SetLibraryHints(const char* cudnn_path, const char* cudart_path);

// Loads libcudnn (once per process, on success), checks that its major
// version equals `compiled_cudnn_major`, publishes the handle to the cuDNN
// frontend and picks the libcudart the frontend will use. Thread-safe and
// cheap after the first success. Returns an empty string on success, else a
// human-readable error (and retries on the next call).
std::string EnsureCudaLibrariesLoaded(int compiled_cudnn_major,
                                      int compiled_cudart_major);

// A copy of what was loaded (meaningful after a successful Ensure...).
LoadedLibraries GetLoadedLibraries();

}  // namespace scoremod_ffi
