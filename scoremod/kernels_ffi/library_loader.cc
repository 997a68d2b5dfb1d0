// Run-time loading of libcudnn / libcudart; see library_loader.h.

#include "library_loader.h"

#include <dlfcn.h>
#include <link.h>
#include <unistd.h>

#include <cstddef>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

namespace cudnn_frontend {
// Declared `extern` by cudnn_frontend_shim.h when the frontend is built with
// NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING: every cuDNN backend call the frontend
// makes is dlsym(cudnn_dlhandle, "<name>"). The frontend never sets it itself
// (the Python `cudnn` package sets its own private copy), so we must. The
// extension is compiled with -fvisibility=hidden, so this definition is private
// to our .so and can never be confused with the Python package's.
void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace scoremod_ffi {
namespace {

struct State {
  bool loaded = false;
  LoadedLibraries libs;
  std::string hint_cudnn;
  std::string hint_cudart;
};

// Leaked on purpose: no destructor may run during process teardown while
// another thread (or an atexit handler of XLA) still executes a handler.
std::mutex& Mutex() {
  static auto* mu = new std::mutex;
  return *mu;
}

State& GetState() {
  static auto* state = new State;
  return *state;
}

std::string DlError() {
  const char* e = dlerror();
  return e != nullptr ? std::string(e) : std::string("not found");
}

std::string Basename(const std::string& path) {
  const auto pos = path.rfind('/');
  return pos == std::string::npos ? path : path.substr(pos + 1);
}

// True for "<stem>.so" and "<stem>.so.<anything>" (libcudnn.so.9 but not
// libcudnn_graph.so.9).
bool IsLibrary(const std::string& base, const std::string& stem) {
  const std::string so = stem + ".so";
  return base == so || base.rfind(so + ".", 0) == 0;
}

// Major version encoded in the file name ("libcudart.so.13.0.96" -> 13), or -1.
int MajorFromName(const std::string& base, const std::string& stem) {
  const std::string prefix = stem + ".so.";
  if (base.rfind(prefix, 0) != 0) return -1;
  const char* digits = base.c_str() + prefix.size();
  if (*digits < '0' || *digits > '9') return -1;
  return std::atoi(digits);
}

// Paths of the shared objects already mapped into this process whose file
// name is <stem>.so[.*].
std::vector<std::string> LoadedLibrariesNamed(const std::string& stem) {
  struct Query {
    const std::string* stem;
    std::vector<std::string> found;
  } query{&stem, {}};
  dl_iterate_phdr(
      [](struct dl_phdr_info* info, size_t, void* data) -> int {
        auto* q = static_cast<Query*>(data);
        if (info->dlpi_name != nullptr && info->dlpi_name[0] != '\0') {
          std::string path(info->dlpi_name);
          if (IsLibrary(Basename(path), *q->stem)) q->found.push_back(path);
        }
        return 0;
      },
      &query);
  return query.found;
}

// The file a dlopen handle refers to, for messages.
std::string PathOfHandle(void* handle, const std::string& fallback) {
  struct link_map* map = nullptr;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr &&
      map->l_name != nullptr && map->l_name[0] != '\0') {
    return map->l_name;
  }
  return fallback;
}

std::string Join(const std::vector<std::string>& items, const char* sep) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out += sep;
    out += items[i];
  }
  return out;
}

}  // namespace

void SetLibraryHints(const char* cudnn_path, const char* cudart_path) {
  std::lock_guard<std::mutex> lock(Mutex());
  State& state = GetState();
  state.hint_cudnn = cudnn_path != nullptr ? cudnn_path : "";
  state.hint_cudart = cudart_path != nullptr ? cudart_path : "";
}

LoadedLibraries GetLoadedLibraries() {
  std::lock_guard<std::mutex> lock(Mutex());
  return GetState().libs;
}

std::string EnsureCudaLibrariesLoaded(int compiled_cudnn_major,
                                      int compiled_cudart_major) {
  std::lock_guard<std::mutex> lock(Mutex());
  State& state = GetState();
  if (state.loaded) return {};

  LoadedLibraries libs;

  // ---- cuDNN --------------------------------------------------------------
  const std::string soname = "libcudnn.so." + std::to_string(compiled_cudnn_major);
  void* handle = nullptr;
  std::vector<std::string> tried;
  auto attempt = [&](const std::string& name, int flags, const char* source) {
    dlerror();
    void* h = dlopen(name.c_str(), flags);
    if (h == nullptr) {
      tried.push_back(std::string(source) + " '" + name + "': " + DlError());
      return false;
    }
    handle = h;
    libs.cudnn_path = PathOfHandle(h, name);
    libs.cudnn_source = source;
    return true;
  };

  const char* explicit_cudnn = std::getenv("SCOREMOD_CUDNN_LIBRARY");
  if (explicit_cudnn != nullptr && explicit_cudnn[0] != '\0') {
    // An explicit choice is never silently replaced by another library.
    attempt(explicit_cudnn, RTLD_NOW | RTLD_LOCAL, "SCOREMOD_CUDNN_LIBRARY");
  } else {
    // 1. The copy JAX's CUDA plugin (or anyone else) already loaded: using the
    //    same cuDNN as XLA avoids two cuDNN builds in one process.
    bool ok = attempt(soname, RTLD_NOW | RTLD_NOLOAD, "already loaded (by soname)");
    if (!ok) {
      for (const auto& path : LoadedLibrariesNamed("libcudnn")) {
        if ((ok = attempt(path, RTLD_NOW | RTLD_NOLOAD, "already loaded"))) break;
      }
    }
    // 2. The pip wheel next to jax (nvidia/cudnn/lib), found by the Python loader.
    if (!ok && !state.hint_cudnn.empty()) {
      ok = attempt(state.hint_cudnn, RTLD_NOW | RTLD_LOCAL, "site-packages");
    }
    // 3. The dynamic linker's search path (LD_LIBRARY_PATH, ld.so.cache).
    if (!ok) attempt(soname, RTLD_NOW | RTLD_LOCAL, "library search path");
  }
  if (handle == nullptr) {
    return "could not load cuDNN (" + soname + "). Tried: " + Join(tried, "; ") +
           ". JAX's CUDA plugin normally loads it from the nvidia-cudnn-cu12/cu13 "
           "pip package; set SCOREMOD_CUDNN_LIBRARY=/path/to/" + soname +
           " to choose one explicitly.";
  }

  dlerror();
  using GetVersionFn = size_t (*)();
  auto get_version = reinterpret_cast<GetVersionFn>(dlsym(handle, "cudnnGetVersion"));
  if (get_version == nullptr) {
    const std::string msg = libs.cudnn_path + " has no cudnnGetVersion: " + DlError();
    dlclose(handle);
    return msg;
  }
  libs.cudnn_version = static_cast<int64_t>(get_version());
  if (libs.cudnn_version / 10000 != compiled_cudnn_major) {
    const std::string msg =
        "cuDNN major version mismatch: " + libs.cudnn_path + " is version " +
        std::to_string(libs.cudnn_version) + " but the extension was compiled against cuDNN " +
        std::to_string(compiled_cudnn_major) + ".x headers";
    dlclose(handle);
    return msg;
  }

  // ---- CUDA runtime ---------------------------------------------------------
  // The frontend dlopens "libcudart.so.12" and "libcudart.so.13" by soname and
  // takes the first that opens, unless CUDNN_FRONTEND_CUDART_LIB_NAME names one.
  // With JAX's pip CUDA the runtime usually lives in site-packages, outside
  // the linker's search path, so point the frontend at the copy in the process.
  const char* user_cudart = std::getenv("CUDNN_FRONTEND_CUDART_LIB_NAME");
  if (user_cudart != nullptr && user_cudart[0] != '\0') {
    libs.cudart_path = user_cudart;
    libs.cudart_source = "CUDNN_FRONTEND_CUDART_LIB_NAME (set by the user)";
  } else {
    const auto loaded = LoadedLibrariesNamed("libcudart");
    std::string chosen;
    for (const auto& path : loaded) {
      if (MajorFromName(Basename(path), "libcudart") == compiled_cudart_major) {
        chosen = path;
        libs.cudart_source = "already loaded, same major as the compile-time headers";
        break;
      }
    }
    if (chosen.empty() && !loaded.empty()) {
      chosen = loaded.front();
      libs.cudart_source = "already loaded";
    }
    if (chosen.empty() && !state.hint_cudart.empty() &&
        access(state.hint_cudart.c_str(), R_OK) == 0) {
      chosen = state.hint_cudart;
      libs.cudart_source = "site-packages";
    }
    if (!chosen.empty()) {
      // Done once, under our lock and before the frontend's first CUDA call,
      // which is when the frontend reads the variable.
      setenv("CUDNN_FRONTEND_CUDART_LIB_NAME", chosen.c_str(), 1);
      libs.cudart_path = chosen;
    } else {
      libs.cudart_source = "frontend default (libcudart.so.12 / libcudart.so.13 by soname)";
    }
  }

  cudnn_frontend::cudnn_dlhandle = handle;
  state.libs = libs;
  state.loaded = true;
  return {};
}

}  // namespace scoremod_ffi
