// The Python module _mpijax_ffi: settings, the communicator and call-site
// registries, the stall inspector's threads, and the handler capsules for
// jax.ffi.register_ffi_target. mpijax/_src/ffi/_mpijax_ffi.pyi is its stub
// (tests/unit/test_ffi_stub.py checks that they agree).
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <future>
#include <memory>
#include <thread>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "core/arrivals.h"
#include "handlers/handlers.h"
#include "core/inspector.h"
#include "nanobind/nanobind.h"
#include "nanobind/ndarray.h"
#include "nanobind/stl/pair.h"
#include "nanobind/stl/string.h"
#include "nanobind/stl/tuple.h"
#include "nanobind/stl/vector.h"
#include "node_local/node_local.h"
#include "core/reduce_ops.h"
#include "core/registry.h"
#include "core/settings.h"
#include "core/timeline.h"
#include "xla_collectives/collectives.h"
#include "xla_collectives/members.h"

namespace nb = nanobind;

namespace mpijax::detail {
namespace {

// Open MPI's MPI_Comm is a pointer, MPICH's an int; mpi4py's
// MPI._handleof() gives the same bits as a Python int in both cases. (A
// template so the branch not taken is never instantiated.)
template <typename Comm = MPI_Comm>
Comm HandleToComm(uintptr_t handle) {
  if constexpr (std::is_pointer_v<Comm>) {
    return reinterpret_cast<Comm>(handle);
  } else {
    return static_cast<Comm>(handle);
  }
}

std::vector<MPI_Comm> HandlesToComms(const std::vector<uintptr_t>& handles) {
  std::vector<MPI_Comm> comms;
  for (uintptr_t h : handles) comms.push_back(HandleToComm(h));
  return comms;
}

template <typename T>
nb::capsule Capsule(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

std::string LinkedLibraryVersion() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(text, &len);
  return std::string(text, len);
}

void Setup(int64_t max_chunk_bytes, double timeout_s, bool stall_abort,
           bool check_every, int64_t blocking_min_bytes,
           int64_t ring_min_bytes, int64_t ring_in_place_min_bytes,
           int64_t shm_max_bytes, int64_t cma_min_bytes, double wait_spin_s,
           bool oversubscribed) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    throw nb::value_error("mpijax: MPI is not initialized; import mpi4py.MPI "
                          "(or call mpijax.init()) first.");
  }
  if (max_chunk_bytes <= 0) {
    throw nb::value_error(("max_chunk_bytes must be positive, got " +
                           std::to_string(max_chunk_bytes)).c_str());
  }
  InitTypesOnce();
  Settings& s = g_settings;
  s.max_chunk_bytes = max_chunk_bytes;
  s.timeout_s = timeout_s;
  s.stall_abort = stall_abort;
  s.check_every = check_every;
  s.blocking_min_bytes = blocking_min_bytes;
  s.ring_min_bytes = ring_min_bytes;
  s.ring_in_place_min_bytes = ring_in_place_min_bytes;
  s.shm_max_bytes = std::min<int64_t>(shm_max_bytes, int64_t{1} << 30);
  s.cma_min_bytes = cma_min_bytes;
  s.wait_spin_s = wait_spin_s;
  s.oversubscribed = oversubscribed;
}

// The MPI datatype of a NumPy array's dtype, for node_allreduce.
MPI_Datatype ArrayType(nb::dlpack::dtype t) {
  using nb::dlpack::dtype_code;
  if (t.lanes == 1 && t.code == static_cast<uint8_t>(dtype_code::Float)) {
    if (t.bits == 32) return MPI_FLOAT;
    if (t.bits == 64) return MPI_DOUBLE;
  }
  if (t.lanes == 1 && t.code == static_cast<uint8_t>(dtype_code::Int)) {
    if (t.bits == 32) return MPI_INT32_T;
    if (t.bits == 64) return MPI_INT64_T;
  }
  throw nb::type_error("node_allreduce: float32, float64, int32 or int64 "
                       "arrays only");
}

using CpuArray = nb::ndarray<nb::c_contig, nb::device::cpu>;

// node_local::Allreduce on an mpi4py communicator, `repeat` times with one
// state (set up by the first); the path of each call.
std::vector<int> NodeAllreduce(uintptr_t handle, CpuArray send, CpuArray recv,
                               const std::string& op, int64_t shm_max_bytes,
                               int64_t cma_min_bytes, int repeat) {
  MPI_Datatype dt = ArrayType(send.dtype());
  if (send.dtype() != recv.dtype() || send.size() != recv.size()) {
    throw nb::value_error("node_allreduce: send and recv must have the same "
                          "dtype and size");
  }
  if (send.size() > static_cast<size_t>(INT32_MAX)) {
    throw nb::value_error("node_allreduce: more than 2**31 - 1 elements");
  }
  MPI_Op mop = op == "sum"    ? MPI_SUM
               : op == "prod" ? MPI_PROD
               : op == "min"  ? MPI_MIN
               : op == "max"  ? MPI_MAX
                              : MPI_OP_NULL;
  if (mop == MPI_OP_NULL) {
    throw nb::value_error(("node_allreduce: op must be 'sum', 'prod', 'min' "
                           "or 'max', got '" + op + "'").c_str());
  }
  node_local::Limits limits;
  limits.shm_max_bytes = shm_max_bytes;
  limits.cma_min_bytes = cma_min_bytes;
  node_local::Comm c(HandleToComm(handle), limits);
  const void* sendbuf =
      send.data() == recv.data() ? MPI_IN_PLACE : send.data();
  std::vector<int> paths;
  int rc = MPI_SUCCESS;
  {
    nb::gil_scoped_release release;
    for (int i = 0; i < repeat && rc == MPI_SUCCESS; ++i) {
      rc = node_local::Allreduce(c, sendbuf, recv.data(),
                                 static_cast<int>(recv.size()), dt, mop);
      paths.push_back(c.last_path);
    }
  }
  if (rc != MPI_SUCCESS) {
    throw std::runtime_error("node_allreduce: error " + std::to_string(rc) +
                             ": " + c.last_error);
  }
  return paths;
}

}  // namespace
}  // namespace mpijax::detail

NB_MODULE(_mpijax_ffi, m) {
  using namespace mpijax::detail;
  m.doc() = "mpijax's MPI transport: XLA FFI handlers and communicator table.";

  m.def("registrations", [] {
    nb::dict d;
#define MPIJAX_REGISTER_HANDLER(symbol, target) d[target] = Capsule(symbol);
    MPIJAX_HANDLERS(MPIJAX_REGISTER_HANDLER)
#undef MPIJAX_REGISTER_HANDLER
    return d;
  }, "FFI target name -> handler capsule, for jax.ffi.register_ffi_target.");

  m.def("setup", &Setup, nb::kw_only(), nb::arg("max_chunk_bytes"),
        nb::arg("timeout_s"), nb::arg("stall_abort"), nb::arg("check_every"),
        nb::arg("blocking_min_bytes"), nb::arg("ring_min_bytes"),
        nb::arg("ring_in_place_min_bytes"), nb::arg("shm_max_bytes"),
        nb::arg("cma_min_bytes"), nb::arg("wait_spin_s"),
        nb::arg("oversubscribed"),
        "Creates the float16/bfloat16 MPI ops; sets chunk size, timeout, "
        "stall action, whether every call's signature is checked, the sizes "
        "from which collectives block and all-reduces run the ring, up to "
        "which all-reduces go through node-local shared memory, from "
        "which they run by cross-memory attach, how long a wait spins "
        "before it sleeps (< 0: never sleeps), and whether the node has more "
        "ranks than cores (waits then yield the core after every poll).");

  m.def("register_comms", [](const std::vector<uintptr_t>& handles,
                             const std::vector<uintptr_t>& check_handles,
                             int64_t key, const std::vector<int64_t>& ordinals) {
    if (handles.size() != check_handles.size() ||
        ordinals.size() != handles.size()) {
      throw nb::value_error("register_comms: one check communicator and one "
                            "device ordinal per communicator are needed");
    }
    return RegisterComms(HandlesToComms(handles), HandlesToComms(check_handles),
                         key, ordinals);
  }, nb::arg("handles"), nb::arg("check_handles"), nb::arg("key"),
  nb::arg("ordinals"),
  "Registers one communicator (and one signature-check communicator) per "
  "local device index (mpi4py handles from MPI._handleof); `key` is the id "
  "all ranks of the communicator agreed on; `ordinals` are XLA's device "
  "ordinals (jax device ids) of the local devices in index order. Returns "
  "the id used as the ops' 'comm' attribute.");

  m.def("node_paths", &NodePaths, nb::arg("comm_id"),
  "The node-local all-reduce paths of comm_id, per local device: 0 not set up "
  "yet (no all-reduce has needed them), -1 unavailable (ranks on several "
  "nodes, or no shared memory), 1 shared memory, 2 shared memory and "
  "cross-memory attach. For diagnostics and tests; read between calls.");

  m.def("setup_device_group", [](int64_t comm_id, uintptr_t handle,
                                 int64_t segment_bytes) {
    nb::gil_scoped_release release;
    return SetupDeviceGroup(comm_id, HandleToComm(handle), segment_bytes);
  }, nb::arg("comm_id"), nb::arg("handle"), nb::arg("segment_bytes"),
  "Sets up (once) the node-local all-reduce over every local device of every "
  "rank of comm_id: collective over the mpi4py communicator `handle` (a "
  "private one of the same ranks, kept until shutdown). Returns [state (1 "
  "ready, -1 unavailable), segment bytes, 1 if cross-memory attach works].");

  m.def("node_allreduce", &NodeAllreduce, nb::arg("handle"), nb::arg("send"),
        nb::arg("recv"), nb::kw_only(), nb::arg("op") = "sum",
        nb::arg("shm_max_bytes") = int64_t{1} << 20,
        nb::arg("cma_min_bytes") = int64_t{64} << 10, nb::arg("repeat") = 1,
        "Runs the node-local all-reduce's C++ API (node_local::Allreduce, for "
        "libraries outside mpijax's handlers) on the mpi4py communicator "
        "`handle` (MPI._handleof), `repeat` times with one state; recv may be "
        "send (in place). Returns each call's path: 0 MPI_Allreduce, 1 "
        "shared memory, 2 cross-memory attach. Collective; for tests.");

  m.def("unregister_comms", &UnregisterComms, nb::arg("comm_id"),
  "Forgets the communicators of comm_id (before Python frees them).");

  m.def("register_site", [](const std::string& text, int64_t slot) {
    if (slot < 0) throw nb::value_error("register_site: slot must be >= 0");
    return RegisterSite(text, slot);
  }, nb::arg("text"), nb::arg("slot"),
  "Registers a call site's description (e.g. 'allreduce(float32[4], sum) at "
  "train.py:42') and its check slot (one per (signature, communicator)); "
  "returns its id, the ops' 'site' attribute.");

  m.def("xla_label", &mpijax::bridge::AddLabel, nb::arg("kind"), nb::arg("dtype"),
        nb::arg("elements"), nb::arg("op"), nb::arg("label"),
  "Names one of XLA's collectives in a compiled program for the bridge's "
  "reports and timeline: its HLO opcode ('all-reduce', ...), dtype name "
  "('bytes' for all-to-all and collective-permute), the elements (bytes) of "
  "its result, reduction op name ('sum', ... or '') and the label (e.g. "
  "'jit(f)/psum').");

  m.def("xla_program", &mpijax::bridge::AddProgram, nb::arg("text"), nb::arg("collectives"),
  "A compiled program with collectives across processes: its text (its name and "
  "the shapes of its arguments, the same on every rank that compiled the same "
  "program) and its collectives as (kind, dtype, elements, op) of xla_label. The "
  "first of its operations on each of XLA's communicators carries the program's "
  "fingerprint in the ranks' check, so ranks that compiled different programs "
  "stop there.");

  m.def("xla_enable_members", &mpijax::bridge::EnableMembers,
        nb::arg("local_devices"),
  "From now on the bridge answers XLA's communicator requests with members "
  "prepared by xla_prepare_clique (several devices per process).");

  m.def("xla_prepare_clique", [](const std::vector<int64_t>& devices,
                                 const std::vector<int>& world,
                                 const std::vector<int>& local) {
    if (devices.empty() || world.size() != devices.size() ||
        local.size() != devices.size())
      throw nb::value_error("xla_prepare_clique: devices, world and local "
                            "must be non-empty and of one length");
    nb::gil_scoped_release release;  // collective: other threads may run
    return mpijax::bridge::PrepareClique(devices, world, local);
  }, nb::arg("devices"), nb::arg("world"), nb::arg("local"),
  "Prepares the communicator XLA will make for a clique (devices: global "
  "ids in rank order; world: each member's job rank; local: its local "
  "device index). Collective over the clique's ranks. Returns its id, or "
  "-1 where this rank has no member.");

  m.def("xla_expect", &mpijax::bridge::ExpectCliques, nb::arg("ids"),
  "Names the prepared cliques XLA is about to create (the warm-up's).");

  m.def("site_texts", &SiteTexts,
  "Every registered call site's description, indexed by its id.");

  m.def("start_inspector", [](uintptr_t handle) {
    return StartInspector(HandleToComm(handle));
  }, nb::arg("handle"),
  "Starts the stall inspector's responder and watchdog threads on a private "
  "communicator spanning the job (needs MPI_THREAD_MULTIPLE); False if not "
  "started.");

  m.def("stop_inspector", [] {
    nb::gil_scoped_release release;
    StopInspector();
  }, "Stops and joins the responder thread (before its communicator is freed).");

  m.def("set_python_place", [](nb::object fn) {
    if (fn.is_none()) {
      SetPythonPlace(nullptr);
      return;
    }
    // Called on the responder thread: the GIL may be busy (a pure-Python
    // loop gives it up every few ms) or never free (a C extension holding
    // it); the answer cannot wait, so the call runs on a thread of its own
    // and is dropped after kPlaceWaitS. Leaked on purpose: it may still be
    // called while Python shuts down.
    auto* held = new nb::object(fn);
    SetPythonPlace([held]() -> std::string {
      constexpr double kPlaceWaitS = 0.3;
      auto result = std::make_shared<std::promise<std::string>>();
      std::future<std::string> got = result->get_future();
      std::thread([held, result] {
        std::string text;
        {
          nb::gil_scoped_acquire gil;
          try {
            text = nb::cast<std::string>((*held)());
          } catch (...) {
          }
        }
        result->set_value(text);
      }).detach();
      if (got.wait_for(std::chrono::duration<double>(kPlaceWaitS)) !=
          std::future_status::ready)
        return "";
      return got.get();
    });
  }, nb::arg("fn").none(),
  "Sets the function (no arguments, returns str) that tells where the Python "
  "main thread is, for the stall inspector's answers; None removes it.");

  m.def("status", &DescribeStatus, nb::arg("key"), nb::arg("device"),
  "This process's status line for (communicator key, device), as the stall "
  "inspector sends it: '<calls> <phase> <activity> <text>'.");

  m.def("set_activity", [](int kind, std::string text) {
    if (kind < kActivityNone || kind > kActivityWaitingCompile)
      throw nb::value_error("set_activity: kind must be 0, 1 or 2");
    SetActivity(kind, std::move(text));
  }, nb::arg("kind"), nb::arg("text"),
  "What this process does that ranks waiting for it should know of: 1 "
  "compiling a program, 2 waiting for another rank's compile, 0 neither; "
  "`text` names it ('compiling jit_step').");

  m.def("timeline_start", [](int64_t capacity) {
    if (capacity < 1) throw nb::value_error("timeline_start: capacity must be >= 1");
    TimelineStart(capacity);
  }, nb::arg("capacity"),
  "Turns the collective timeline on: every handler call records one event in "
  "a ring of at least `capacity` events (a power of two, allocated once).");

  m.def("timeline_stop", &TimelineStop, "Turns the collective timeline off.");

  m.def("timeline_drain", [] {
    int64_t lost = 0;
    std::vector<TimelineEvent> events;
    {
      nb::gil_scoped_release release;
      events = TimelineDrain(&lost);
    }
    nb::list out;
    for (const TimelineEvent& e : events) {
      nb::object shape = nb::none();
      if (e.ndim >= 0) {
        nb::list dims;
        for (int i = 0; i < std::min(e.ndim, kTimelineMaxDims); ++i)
          dims.append(e.dims[i]);
        shape = nb::tuple(dims);
      }
      out.append(nb::make_tuple(
          e.name, DtypeName(static_cast<ffi::DataType>(e.dtype)), shape,
          e.bytes, e.path, e.site, e.key, e.device, e.comm_size, e.seq,
          e.enter_ns, e.exit_ns));
    }
    return std::make_pair(out, lost);
  }, "The events recorded since the last drain, oldest first, as tuples (name, "
  "dtype, shape or None, bytes, path bits, site, communicator key, local "
  "device, communicator size, sequence number or -1, enter ns, exit ns), and "
  "how many were lost.");

  m.def("arrivals_record", &ArrivalsRecord, nb::arg("on"),
  "Turns the straggler report's arrival stamps on or off: every collective "
  "call stamps when it entered into its (communicator, device)'s ring.");

  m.def("arrivals_drain", [] {
    std::string rows;
    {
      nb::gil_scoped_release release;
      rows = DrainArrivals();
    }
    return nb::bytes(rows.data(), rows.size());
  }, "The arrivals stamped since the last drain (at most 4096 per "
  "communicator and device, the most recent), as int64 rows of (communicator "
  "key, leader: the job rank of its rank 0, local device, 1 if the device's "
  "calls are collectives of their own, communicator size, collective number, "
  "enter ns), native byte order.");

  m.def("now_ns", [] { return mpijax::NowNs(); },
        "The handlers' clock (steady_clock) in nanoseconds.");

  m.def("build_mpi_version", [] {
#if defined(MPIJAX_BUILD_MPI_VERSION)
    return std::string(MPIJAX_BUILD_MPI_VERSION);
#else
    return std::string("unknown");
#endif
  }, "The MPI family and version of the mpi.h this module was compiled with.");

  m.def("linked_library_version", &LinkedLibraryVersion,
        "MPI_Get_library_version of the libmpi this module resolved to.");
}
