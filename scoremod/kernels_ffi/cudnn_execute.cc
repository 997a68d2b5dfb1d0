// XLA FFI handler that executes a serialized cuDNN frontend graph.
//
// Target name: "scoremod_cudnn_execute" (platform CUDA), registered from
// Python by scoremod.kernels_ffi.register(). The Python side builds a cuDNN
// frontend graph, fixes every tensor UID with set_uid, runs build_plans and
// serializes it; this handler deserializes it once per device and executes it
// on XLA's stream. The Python docstring of scoremod.kernels_ffi.call is the
// authoritative description of the calling contract.
//
// Operands, results and attributes:
//   args            one buffer per entry of `in_uids`, in that order
//   rets            one buffer per entry of `out_uids`, then ONE extra uint8
//                   workspace buffer of at least the graph's workspace size
//   graph           u8[]  the bytes of graph.serialize() (after build_plans)
//   graph_id        i64   a hash of those bytes computed in Python
//   frontend_version i64  version of the Python cudnn frontend that built the
//                   graph, major*10000+minor*100+patch; must equal the
//                   CUDNN_FRONTEND_VERSION of the headers compiled in here
//   in_uids, out_uids, scalar_uids  i64[]  (may be empty); an in_uid of -1
//                   marks a carried operand: not read by the graph, present
//                   only so that XLA aliases its buffer with a result
//                   (input_output_aliases), whose untouched bytes it keeps
//   scalar_bits     i32[] raw 4-byte patterns (float32 or int32) of the
//                   pass-by-value scalars, parallel to scalar_uids
//   offsets         i64[] empty, or a byte offset per in_uid then per
//                   out_uid: where in its buffer the graph tensor starts
//                   (a block of rows inside a larger array)
//
// Every failure is returned to XLA as an ffi::Error with a message naming
// what went wrong; nothing here aborts the process or silently does nothing.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <cudnn_frontend.h>

#include "library_loader.h"
#include "xla/ffi/api/ffi.h"

#if !defined(NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING)
#error "scoremod's FFI extension must be compiled with -DNV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING"
#endif

#define SCOREMOD_FFI_EXPORT extern "C" __attribute__((visibility("default")))

namespace ffi = xla::ffi;
namespace fe = cudnn_frontend;

namespace scoremod_ffi {
namespace {

constexpr char kTargetName[] = "scoremod_cudnn_execute";
constexpr int kCompiledCudnnMajor = CUDNN_MAJOR;
constexpr int kCompiledCudartMajor = CUDART_VERSION / 1000;

ffi::Error MakeError(ffi::ErrorCode code, const std::string& message) {
  return ffi::Error(code, std::string(kTargetName) + ": " + message);
}

std::string VersionString(int64_t v) {
  return std::to_string(v / 10000) + "." + std::to_string((v / 100) % 100) + "." +
         std::to_string(v % 100);
}

std::string FrontendError(fe::error_t status) {
  std::ostringstream os;
  os << status.get_code() << ": " << status.get_message();
  return os.str();
}

std::string CudnnStatusString(cudnnStatus_t status) {
  const char* s = fe::detail::get_error_string(status);
  return std::string(s != nullptr ? s : "unknown cuDNN status") + " (" +
         std::to_string(static_cast<int>(status)) + ")";
}

std::string CudaErrorString(cudaError_t err) {
  const char* s = fe::detail::cuda_get_error_string(err);
  return std::string(s != nullptr ? s : "unknown CUDA error") + " (" +
         std::to_string(static_cast<int>(err)) + ")";
}

// ---------------------------------------------------------------------------
// dtype / size bookkeeping for validating XLA buffers against the graph.

struct DtypeInfo {
  bool known = false;
  ffi::DataType ffi_type = ffi::DataType::INVALID;
  int64_t bytes = 0;  // 0: size check impossible (sub-byte or unknown type)
};

DtypeInfo Describe(fe::DataType_t t) {
  using D = fe::DataType_t;
  switch (t) {
    case D::FLOAT: return {true, ffi::DataType::F32, 4};
    case D::DOUBLE: return {true, ffi::DataType::F64, 8};
    case D::HALF: return {true, ffi::DataType::F16, 2};
    case D::BFLOAT16: return {true, ffi::DataType::BF16, 2};
    case D::INT8: return {true, ffi::DataType::S8, 1};
    case D::UINT8: return {true, ffi::DataType::U8, 1};
    case D::INT32: return {true, ffi::DataType::S32, 4};
    case D::INT64: return {true, ffi::DataType::S64, 8};
    case D::BYTE_BOOLEAN: return {true, ffi::DataType::PRED, 1};
    case D::FP8_E4M3: return {true, ffi::DataType::F8E4M3FN, 1};
    case D::FP8_E5M2: return {true, ffi::DataType::F8E5M2, 1};
    case D::FP8_E8M0: return {true, ffi::DataType::F8E8M0FNU, 1};
    case D::COMPLEX_FP32: return {true, ffi::DataType::C64, 8};
    case D::COMPLEX_FP64: return {true, ffi::DataType::C128, 16};
    default: return {};
  }
}

const char* FfiTypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::PRED: return "bool";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U16: return "uint16";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::U64: return "uint64";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::C64: return "complex64";
    case ffi::DataType::C128: return "complex128";
    case ffi::DataType::F8E5M2: return "float8_e5m2";
    case ffi::DataType::F8E4M3FN: return "float8_e4m3fn";
    case ffi::DataType::F8E8M0FNU: return "float8_e8m0fnu";
    default: return "other";
  }
}

// What the graph expects for one user-supplied UID of the variant pack.
// `known` is false when the serialized graph does not describe the tensor:
// its structure lists the tensors on the ports of top-level nodes (SDPA's
// q/k/v/o/stats...), not those created inside a score_mod callback (a
// pass-by-value constant, a bias or slope tensor). Those are only checked for
// being expected by the graph; dtype, size and kind checks need `known`.
struct TensorSpec {
  bool known = false;
  std::string name;
  bool pass_by_value = false;
  DtypeInfo dtype;
  int64_t required_bytes = -1;  // -1: unknown, skip the size check
};

// ---------------------------------------------------------------------------
// Process-wide cache of deserialized graphs, one per (device, graph).

struct CacheKey {
  int32_t device;
  int64_t graph_id;
  size_t size;
  bool operator==(const CacheKey& o) const {
    return device == o.device && graph_id == o.graph_id && size == o.size;
  }
};

struct CacheKeyHash {
  size_t operator()(const CacheKey& k) const {
    uint64_t h = static_cast<uint64_t>(k.graph_id);
    h ^= (static_cast<uint64_t>(k.size) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2));
    h ^= (static_cast<uint64_t>(static_cast<uint32_t>(k.device)) + 0x9e3779b97f4a7c15ull +
          (h << 6) + (h >> 2));
    return static_cast<size_t>(h);
  }
};

struct GraphEntry {
  // Guards every field below and serializes deserialize/execute of this graph
  // (Graph::execute is not documented as thread-safe).
  std::mutex mu;
  std::shared_ptr<fe::graph::Graph> graph;  // null until deserialized
  std::vector<uint8_t> blob;                // the bytes it was built from
  std::vector<const uint8_t*> verified;     // attribute buffers known == blob
  int64_t workspace_size = 0;
  std::unordered_map<int64_t, TensorSpec> tensors;  // UIDs the caller supplies
};

// Leaked on purpose (see library_loader.cc): cached graphs own cuDNN objects
// that must not be destroyed after cuDNN / the driver shut down at exit.
std::mutex& CacheMutex() {
  static auto* mu = new std::mutex;
  return *mu;
}
std::unordered_map<CacheKey, std::shared_ptr<GraphEntry>, CacheKeyHash>& Cache() {
  static auto* cache = new std::unordered_map<CacheKey, std::shared_ptr<GraphEntry>, CacheKeyHash>;
  return *cache;
}

std::shared_ptr<GraphEntry> FindOrInsertEntry(const CacheKey& key) {
  std::lock_guard<std::mutex> lock(CacheMutex());
  auto& slot = Cache()[key];
  if (!slot) slot = std::make_shared<GraphEntry>();
  return slot;
}

// ---------------------------------------------------------------------------
// cuDNN handles: one per (thread, device), created lazily, never destroyed
// (XLA's executor threads live as long as the process; destroying handles in
// thread-exit destructors races with cuDNN/driver teardown).

ffi::Error HandleFor(int32_t device, cudnnHandle_t* out) {
  thread_local auto* handles = new std::unordered_map<int32_t, cudnnHandle_t>();
  auto it = handles->find(device);
  if (it != handles->end()) {
    *out = it->second;
    return ffi::Error::Success();
  }
  cudnnHandle_t handle = nullptr;
  cudnnStatus_t status = fe::detail::create_handle(&handle);
  if (status != CUDNN_STATUS_SUCCESS) {
    return MakeError(ffi::ErrorCode::kInternal,
                     "cudnnCreate failed on device " + std::to_string(device) + ": " +
                         CudnnStatusString(status));
  }
  handles->emplace(device, handle);
  *out = handle;
  return ffi::Error::Success();
}

// Makes `device` the calling thread's current CUDA device for the scope of
// one call (XLA normally has it current already; then this costs one
// cudaGetDevice). A cuDNN handle is bound to the device current when it is
// created, so this is what guarantees a plan is never built or run with
// another device's handle.
class ScopedDevice {
 public:
  ffi::Error Activate(int32_t device) {
    int current = -1;
    cudaError_t err = fe::detail::cuda_get_device(&current);
    if (err != cudaSuccess) {
      return MakeError(ffi::ErrorCode::kInternal, "cudaGetDevice failed: " + CudaErrorString(err));
    }
    if (current == device) return ffi::Error::Success();
    err = SetDevice(device);
    if (err != cudaSuccess) {
      return MakeError(ffi::ErrorCode::kInternal, "cudaSetDevice(" + std::to_string(device) +
                                                      ") failed: " + CudaErrorString(err));
    }
    previous_ = current;
    return ffi::Error::Success();
  }
  ~ScopedDevice() {
    if (previous_ >= 0) SetDevice(previous_);
  }

 private:
  static cudaError_t SetDevice(int device) {
    using Fn = cudaError_t (*)(int);
    auto fn = reinterpret_cast<Fn>(
        fe::detail::get_cuda_symbol(fe::detail::CudaLibrary::CUDART, "cudaSetDevice"));
    return fn(device);
  }
  int previous_ = -1;
};

// Deserializes `blob` into `entry` (caller holds entry->mu).
ffi::Error Deserialize(GraphEntry* entry, cudnnHandle_t handle, ffi::Span<const uint8_t> blob,
                       int32_t device) {
  std::vector<uint8_t> data(blob.begin(), blob.end());
  auto graph = std::make_shared<fe::graph::Graph>();
  // enforce_precompiled: the blob must carry a built plan (serialize() after
  // build_plans). run_warmup=false: the warmup does a throwaway CUDA-graph
  // capture on the handle's stream, i.e. on XLA's compute stream; not wanted.
  std::string failure;
  try {
    auto status = graph->deserialize(handle, data, /*enforce_precompiled=*/true,
                                     /*run_warmup=*/false);
    if (status.is_bad()) failure = FrontendError(status);
  } catch (const std::exception& e) {  // e.g. nlohmann::json parse errors on bad bytes
    failure = e.what();
  }
  if (!failure.empty()) {
    return MakeError(ffi::ErrorCode::kInvalidArgument,
                     "deserializing the cuDNN graph (" + std::to_string(data.size()) +
                         " bytes) on device " + std::to_string(device) + " failed: " + failure +
                         ". The graph must be serialized with graph.serialize() after "
                         "build_plans() by the same cuDNN frontend version, for a GPU of "
                         "this architecture.");
  }
  int64_t workspace = 0;
  auto status = graph->get_workspace_size(workspace);
  if (status.is_bad()) {
    return MakeError(ffi::ErrorCode::kInternal,
                     "querying the workspace size failed: " + FrontendError(status));
  }

  std::unordered_map<int64_t, TensorSpec> tensors;
  for (int64_t uid : graph->get_variant_pack_uids_sorted()) {
    TensorSpec spec;
    fe::graph::Tensor_attributes attrs;
    if (graph->query_tensor_attributes_of_uid(uid, attrs).is_good()) {
      spec.known = true;
      spec.name = attrs.get_name();
      spec.pass_by_value = attrs.get_is_pass_by_value();
      spec.dtype = Describe(attrs.get_data_type());
      const auto& dims = attrs.get_dim();
      const auto& strides = attrs.get_stride();
      // A ragged tensor's extent is set at run time by its offsets (its dims
      // bound each sequence, not the buffer): no size check for it.
      const bool ragged = attrs.get_ragged_offset() != nullptr;
      if (!ragged && spec.dtype.bytes > 0 && !dims.empty() && dims.size() == strides.size()) {
        int64_t last = 0;
        bool empty = false;
        for (size_t i = 0; i < dims.size(); ++i) {
          if (dims[i] <= 0) empty = true;
          else last += (dims[i] - 1) * strides[i];
        }
        spec.required_bytes = empty ? 0 : (last + 1) * spec.dtype.bytes;
      }
    }
    tensors.emplace(uid, std::move(spec));
  }

  entry->graph = std::move(graph);
  entry->blob = std::move(data);
  entry->verified.assign(1, blob.begin());
  entry->workspace_size = workspace;
  entry->tensors = std::move(tensors);
  return ffi::Error::Success();
}

// Checks that the `graph` attribute really is the blob this cache entry was
// built from (a graph_id collision would otherwise run the wrong graph).
// Full comparison, but only once per distinct attribute buffer: XLA keeps an
// executable's attributes at a fixed address. Caller holds entry->mu.
ffi::Error VerifyBlob(GraphEntry* entry, ffi::Span<const uint8_t> blob, int64_t graph_id) {
  const uint8_t* ptr = blob.begin();
  if (std::find(entry->verified.begin(), entry->verified.end(), ptr) != entry->verified.end()) {
    return ffi::Error::Success();
  }
  if (entry->blob.size() != blob.size() ||
      (blob.size() != 0 && std::memcmp(entry->blob.data(), ptr, blob.size()) != 0)) {
    return MakeError(ffi::ErrorCode::kInvalidArgument,
                     "graph_id " + std::to_string(graph_id) +
                         " was already used for a different serialized graph of the same "
                         "size; graph_id must be a hash of the graph bytes");
  }
  if (entry->verified.size() >= 16) entry->verified.erase(entry->verified.begin());
  entry->verified.push_back(ptr);
  return ffi::Error::Success();
}

std::string ListUids(const std::unordered_map<int64_t, TensorSpec>& tensors,
                     const std::unordered_map<int64_t, void*>* exclude) {
  std::vector<int64_t> uids;
  for (const auto& kv : tensors) {
    if (exclude == nullptr || exclude->count(kv.first) == 0) uids.push_back(kv.first);
  }
  std::sort(uids.begin(), uids.end());
  std::string out = "[";
  for (size_t i = 0; i < uids.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(uids[i]);
    const auto& name = tensors.at(uids[i]).name;
    if (!name.empty()) out += " '" + name + "'";
  }
  return out + "]";
}

// Validates one XLA buffer against the graph's tensor `uid` and adds it to the
// variant pack.
ffi::Error AddBuffer(const GraphEntry& entry, const char* kind, size_t index, int64_t uid,
                     ffi::AnyBuffer buffer, int64_t offset,
                     std::unordered_map<int64_t, void*>* pack) {
  const std::string where = std::string(kind) + " " + std::to_string(index) + " (uid " +
                            std::to_string(uid) + ")";
  auto it = entry.tensors.find(uid);
  if (it == entry.tensors.end()) {
    return MakeError(ffi::ErrorCode::kInvalidArgument,
                     where + " is not a tensor the graph reads or writes; its tensor uids are " +
                         ListUids(entry.tensors, nullptr));
  }
  const TensorSpec& spec = it->second;
  if (!spec.known) {
    // Not described by the serialized graph (made inside a score_mod): the
    // UID is expected, nothing more can be checked.
  } else if (spec.pass_by_value) {
    return MakeError(ffi::ErrorCode::kInvalidArgument,
                     where + " is the pass-by-value scalar '" + spec.name +
                         "'; pass it through scalar_uids/scalar_bits, not as a buffer");
  }
  if (spec.dtype.known && buffer.element_type() != spec.dtype.ffi_type) {
    return MakeError(ffi::ErrorCode::kInvalidArgument,
                     where + " has dtype " + FfiTypeName(buffer.element_type()) +
                         " but graph tensor '" + spec.name + "' is " +
                         FfiTypeName(spec.dtype.ffi_type));
  }
  const int64_t size = static_cast<int64_t>(buffer.size_bytes());
  if (offset < 0 || offset > size) {
    return MakeError(ffi::ErrorCode::kInvalidArgument,
                     where + ": byte offset " + std::to_string(offset) +
                         " is outside its buffer of " + std::to_string(size) + " bytes");
  }
  if (spec.required_bytes >= 0 && size - offset < spec.required_bytes) {
    return MakeError(ffi::ErrorCode::kInvalidArgument,
                     where + " has " + std::to_string(size - offset) +
                         " bytes after its offset of " + std::to_string(offset) +
                         " but graph tensor '" + spec.name + "' spans " +
                         std::to_string(spec.required_bytes) + " bytes (dims/strides)");
  }
  void* data = static_cast<char*>(buffer.untyped_data()) + offset;
  if (!pack->emplace(uid, data).second) {
    return MakeError(ffi::ErrorCode::kInvalidArgument, where + ": uid given more than once");
  }
  return ffi::Error::Success();
}

ffi::Error ExecuteImpl(cudaStream_t stream, int32_t device, ffi::RemainingArgs args,
                       ffi::RemainingRets rets, ffi::Span<const uint8_t> blob, int64_t graph_id,
                       int64_t frontend_version, ffi::Span<const int64_t> in_uids,
                       ffi::Span<const int64_t> out_uids, ffi::Span<const int64_t> scalar_uids,
                       ffi::Span<const int32_t> scalar_bits, ffi::Span<const int64_t> offsets) {
  // ---- cheap checks of the call itself ------------------------------------
  if (frontend_version != CUDNN_FRONTEND_VERSION) {
    return MakeError(
        ffi::ErrorCode::kFailedPrecondition,
        "the graph was built by cuDNN frontend " + VersionString(frontend_version) +
            " (Python package) but this extension was compiled against frontend " +
            VersionString(CUDNN_FRONTEND_VERSION) +
            " headers; install matching versions (pip install nvidia-cudnn-frontend==" +
            VersionString(CUDNN_FRONTEND_VERSION) +
            ", or rebuild scoremod with `pip install --no-build-isolation --no-deps -e .` "
            "against the installed frontend)");
  }
  if (blob.size() == 0) {
    return MakeError(ffi::ErrorCode::kInvalidArgument, "the `graph` attribute is empty");
  }
  if (args.size() != in_uids.size()) {
    return MakeError(ffi::ErrorCode::kInvalidArgument,
                     "got " + std::to_string(args.size()) + " operands but " +
                         std::to_string(in_uids.size()) + " in_uids");
  }
  if (rets.size() != out_uids.size() + 1) {
    return MakeError(ffi::ErrorCode::kInvalidArgument,
                     "got " + std::to_string(rets.size()) + " results but expected " +
                         std::to_string(out_uids.size()) +
                         " (one per out_uid) + 1 (the trailing uint8 workspace)");
  }
  if (scalar_uids.size() != scalar_bits.size()) {
    return MakeError(ffi::ErrorCode::kInvalidArgument,
                     "got " + std::to_string(scalar_uids.size()) + " scalar_uids but " +
                         std::to_string(scalar_bits.size()) + " scalar_bits");
  }
  if (offsets.size() != 0 && offsets.size() != in_uids.size() + out_uids.size()) {
    return MakeError(ffi::ErrorCode::kInvalidArgument,
                     "got " + std::to_string(offsets.size()) + " offsets but " +
                         std::to_string(in_uids.size() + out_uids.size()) +
                         " in_uids + out_uids (or none)");
  }
  auto offset_of = [&](size_t i) { return offsets.size() == 0 ? int64_t{0} : offsets[i]; };

  // ---- libraries, device, handle -------------------------------------------
  const std::string load_error =
      EnsureCudaLibrariesLoaded(kCompiledCudnnMajor, kCompiledCudartMajor);
  if (!load_error.empty()) return MakeError(ffi::ErrorCode::kFailedPrecondition, load_error);

  ScopedDevice scoped_device;
  if (auto err = scoped_device.Activate(device); err.failure()) return err;

  cudnnHandle_t handle = nullptr;
  if (auto err = HandleFor(device, &handle); err.failure()) return err;
  if (cudnnStatus_t st = fe::detail::set_stream(handle, stream); st != CUDNN_STATUS_SUCCESS) {
    return MakeError(ffi::ErrorCode::kInternal, "cudnnSetStream failed: " + CudnnStatusString(st));
  }

  // ---- the graph for this device -------------------------------------------
  std::shared_ptr<GraphEntry> entry = FindOrInsertEntry({device, graph_id, blob.size()});
  std::lock_guard<std::mutex> entry_lock(entry->mu);
  if (!entry->graph) {
    if (auto err = Deserialize(entry.get(), handle, blob, device); err.failure()) return err;
  } else if (auto err = VerifyBlob(entry.get(), blob, graph_id); err.failure()) {
    return err;
  }

  // ---- variant pack -----------------------------------------------------------
  std::unordered_map<int64_t, void*> pack;
  pack.reserve(in_uids.size() + out_uids.size() + scalar_uids.size());
  for (size_t i = 0; i < in_uids.size(); ++i) {
    if (in_uids[i] == -1) continue;  // carried for aliasing only
    auto buffer = args.get<ffi::AnyBuffer>(i);
    if (buffer.has_error()) {
      return MakeError(ffi::ErrorCode::kInvalidArgument,
                       "operand " + std::to_string(i) + ": " + buffer.error().message());
    }
    if (auto err = AddBuffer(*entry, "operand", i, in_uids[i], *buffer, offset_of(i),
                             &pack); err.failure()) {
      return err;
    }
  }
  for (size_t i = 0; i < out_uids.size(); ++i) {
    auto buffer = rets.get<ffi::AnyBuffer>(i);
    if (buffer.has_error()) {
      return MakeError(ffi::ErrorCode::kInvalidArgument,
                       "result " + std::to_string(i) + ": " + buffer.error().message());
    }
    if (auto err = AddBuffer(*entry, "result", i, out_uids[i], **buffer,
                             offset_of(in_uids.size() + i), &pack); err.failure()) {
      return err;
    }
  }
  // Pass-by-value scalars: cuDNN reads them through host pointers during
  // execute(); give it pointers into a copy that lives for this call.
  std::vector<int32_t> scalars(scalar_bits.begin(), scalar_bits.end());
  for (size_t i = 0; i < scalar_uids.size(); ++i) {
    const int64_t uid = scalar_uids[i];
    auto it = entry->tensors.find(uid);
    const std::string where = "scalar " + std::to_string(i) + " (uid " + std::to_string(uid) + ")";
    if (it == entry->tensors.end()) {
      return MakeError(ffi::ErrorCode::kInvalidArgument,
                       where + " is not a tensor of the graph; its tensor uids are " +
                           ListUids(entry->tensors, nullptr));
    }
    if (it->second.known && !it->second.pass_by_value) {
      return MakeError(ffi::ErrorCode::kInvalidArgument,
                       where + " names graph tensor '" + it->second.name +
                           "', which is not pass-by-value; pass it as an operand");
    }
    if (it->second.known && it->second.dtype.bytes != 4) {
      return MakeError(ffi::ErrorCode::kInvalidArgument,
                       where + ": pass-by-value tensor '" + it->second.name +
                           "' must be float32 or int32 (4 bytes) to be passed as scalar_bits");
    }
    if (!pack.emplace(uid, &scalars[i]).second) {
      return MakeError(ffi::ErrorCode::kInvalidArgument, where + ": uid given more than once");
    }
  }
  if (pack.size() != entry->tensors.size()) {
    return MakeError(ffi::ErrorCode::kInvalidArgument,
                     "the graph also needs tensors " + ListUids(entry->tensors, &pack) +
                         " that were not supplied");
  }

  // ---- workspace ----------------------------------------------------------------
  auto workspace = rets.get<ffi::AnyBuffer>(out_uids.size());
  if (workspace.has_error()) {
    return MakeError(ffi::ErrorCode::kInvalidArgument,
                     "workspace result: " + workspace.error().message());
  }
  ffi::AnyBuffer ws = **workspace;
  if (ws.element_type() != ffi::DataType::U8) {
    return MakeError(ffi::ErrorCode::kInvalidArgument,
                     std::string("the last result (workspace) must be uint8, got ") +
                         FfiTypeName(ws.element_type()));
  }
  if (static_cast<int64_t>(ws.size_bytes()) < entry->workspace_size) {
    return MakeError(ffi::ErrorCode::kInvalidArgument,
                     "workspace has " + std::to_string(ws.size_bytes()) +
                         " bytes but the graph needs " + std::to_string(entry->workspace_size));
  }

  // ---- run ------------------------------------------------------------------------
  auto status = entry->graph->execute(handle, pack, ws.untyped_data());
  if (status.is_bad()) {
    return MakeError(ffi::ErrorCode::kInternal, "executing the cuDNN graph on device " +
                                                    std::to_string(device) +
                                                    " failed: " + FrontendError(status));
  }
  return ffi::Error::Success();
}

ffi::Error Execute(cudaStream_t stream, int32_t device, ffi::RemainingArgs args,
                   ffi::RemainingRets rets, ffi::Span<const uint8_t> blob, int64_t graph_id,
                   int64_t frontend_version, ffi::Span<const int64_t> in_uids,
                   ffi::Span<const int64_t> out_uids, ffi::Span<const int64_t> scalar_uids,
                   ffi::Span<const int32_t> scalar_bits, ffi::Span<const int64_t> offsets) {
  // The frontend reports some failures by throwing (e.g. std::runtime_error
  // when a CUDA/cuDNN symbol cannot be resolved); none may cross into XLA.
  try {
    return ExecuteImpl(stream, device, args, rets, blob, graph_id, frontend_version, in_uids,
                       out_uids, scalar_uids, scalar_bits, offsets);
  } catch (const std::exception& e) {
    return MakeError(ffi::ErrorCode::kInternal, std::string("C++ exception: ") + e.what());
  } catch (...) {
    return MakeError(ffi::ErrorCode::kInternal, "unknown C++ exception");
  }
}

}  // namespace
}  // namespace scoremod_ffi

// ---------------------------------------------------------------------------
// Exported symbols (everything else is hidden by -fvisibility=hidden).

SCOREMOD_FFI_EXPORT XLA_FFI_Error* ScoremodCudnnExecute(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(ScoremodCudnnExecute, scoremod_ffi::Execute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const uint8_t>>("graph")
                                  .Attr<int64_t>("graph_id")
                                  .Attr<int64_t>("frontend_version")
                                  .Attr<ffi::Span<const int64_t>>("in_uids")
                                  .Attr<ffi::Span<const int64_t>>("out_uids")
                                  .Attr<ffi::Span<const int64_t>>("scalar_uids")
                                  .Attr<ffi::Span<const int32_t>>("scalar_bits")
                                  .Attr<ffi::Span<const int64_t>>("offsets"));

// CUDNN_FRONTEND_VERSION of the headers compiled in (major*10000+minor*100+patch).
SCOREMOD_FFI_EXPORT int64_t scoremod_ffi_compiled_frontend_version(void) {
  return CUDNN_FRONTEND_VERSION;
}

// CUDNN_VERSION of the cuDNN headers compiled in.
SCOREMOD_FFI_EXPORT int64_t scoremod_ffi_compiled_cudnn_version(void) { return CUDNN_VERSION; }

// CUDART_VERSION of the CUDA runtime headers compiled in.
SCOREMOD_FFI_EXPORT int64_t scoremod_ffi_compiled_cudart_version(void) { return CUDART_VERSION; }

// Fallback library paths, used only if nothing suitable is loaded in-process.
SCOREMOD_FFI_EXPORT void scoremod_ffi_set_library_hints(const char* cudnn_path,
                                                        const char* cudart_path) {
  scoremod_ffi::SetLibraryHints(cudnn_path, cudart_path);
}

// Loads cuDNN / picks libcudart now (normally done by the first call).
// Returns 0 on success. Writes a description (success) or the error into
// `message` (NUL-terminated, truncated to `size`). Never throws.
SCOREMOD_FFI_EXPORT int scoremod_ffi_load_libraries(char* message, size_t size) {
  std::string text;
  int rc = 0;
  try {
    text = scoremod_ffi::EnsureCudaLibrariesLoaded(scoremod_ffi::kCompiledCudnnMajor,
                                                   scoremod_ffi::kCompiledCudartMajor);
    if (text.empty()) {
      const auto libs = scoremod_ffi::GetLoadedLibraries();
      text = "cudnn=" + libs.cudnn_path + " (" + libs.cudnn_source +
             ", version " + std::to_string(libs.cudnn_version) + "); cudart=" +
             (libs.cudart_path.empty() ? std::string("<default>") : libs.cudart_path) + " (" +
             libs.cudart_source + ")";
    } else {
      rc = 1;
    }
  } catch (const std::exception& e) {
    text = e.what();
    rc = 1;
  } catch (...) {
    text = "unknown C++ exception";
    rc = 1;
  }
  if (message != nullptr && size > 0) {
    const size_t n = std::min(size - 1, text.size());
    std::memcpy(message, text.data(), n);
    message[n] = '\0';
  }
  return rc;
}

// Number of (device, graph) entries in the deserialized-graph cache.
SCOREMOD_FFI_EXPORT int64_t scoremod_ffi_cache_entries(void) {
  std::lock_guard<std::mutex> lock(scoremod_ffi::CacheMutex());
  return static_cast<int64_t>(scoremod_ffi::Cache().size());
}
