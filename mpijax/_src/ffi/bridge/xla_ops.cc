#include "xla_ops.h"

#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <unordered_map>
#include <vector>

#include "bridge_table.h"
#include "call.h"
#include "common.h"
#include "inspector.h"
#include "node_local.h"
#include "ring.h"
#include "settings.h"
#include "spans.h"
#include "timeline.h"
#include "idle.h"
#include "wait.h"
#include "xla_members.h"

namespace mpijax::bridge {
namespace {

namespace ffi = ::xla::ffi;
using detail::CallInfo;
using detail::g_settings;

// --- what XLA asks for -------------------------------------------------------

enum Kind : int {
  kAllReduce = 0,
  kAllGather,
  kReduceScatter,
  kAllToAll,
  kPermute,
  kKinds
};
// Timeline and site names (static: the timeline keeps the pointer).
const char* const kKindNames[kKinds] = {"XLA all-reduce", "XLA all-gather",
                                        "XLA reduce-scatter", "XLA all-to-all",
                                        "XLA collective-permute"};
// As Python names them (HLO's opcodes).
const char* const kHloNames[kKinds] = {"all-reduce", "all-gather",
                                       "reduce-scatter", "all-to-all",
                                       "collective-permute"};

struct Type {
  MPI_Datatype mpi = MPI_DATATYPE_NULL;
  ffi::DataType ffi = ffi::DataType::INVALID;
  int bytes = 0;
  const char* name = "unknown";
};

Type TypeOf(int code) {
  using D = ffi::DataType;
  switch (code) {
    case MJB_BYTE: return {MPI_BYTE, D::U8, 1, "bytes"};
    case MJB_INT8: return {MPI_INT8_T, D::S8, 1, "int8"};
    case MJB_UINT8: return {MPI_UINT8_T, D::U8, 1, "uint8"};
    case MJB_INT16: return {MPI_INT16_T, D::S16, 2, "int16"};
    case MJB_UINT16: return {MPI_UINT16_T, D::U16, 2, "uint16"};
    case MJB_INT32: return {MPI_INT32_T, D::S32, 4, "int32"};
    case MJB_UINT32: return {MPI_UINT32_T, D::U32, 4, "uint32"};
    case MJB_INT64: return {MPI_INT64_T, D::S64, 8, "int64"};
    case MJB_UINT64: return {MPI_UINT64_T, D::U64, 8, "uint64"};
    case MJB_FLOAT: return {MPI_FLOAT, D::F32, 4, "float32"};
    case MJB_DOUBLE: return {MPI_DOUBLE, D::F64, 8, "float64"};
    case MJB_C_FLOAT_COMPLEX: return {MPI_C_FLOAT_COMPLEX, D::C64, 8, "complex64"};
    case MJB_C_DOUBLE_COMPLEX:
      return {MPI_C_DOUBLE_COMPLEX, D::C128, 16, "complex128"};
    case MJB_CHAR: return {MPI_CHAR, D::S8, 1, "int8"};
    case MJB_INT: return {MPI_INT, D::S32, 4, "int32"};
    case MJB_LONG: return {MPI_LONG, D::S64, 8, "int64"};
    case MJB_UNSIGNED: return {MPI_UNSIGNED, D::U32, 4, "uint32"};
    case MJB_UNSIGNED_LONG: return {MPI_UNSIGNED_LONG, D::U64, 8, "uint64"};
    default: return {};
  }
}

MPI_Op OpOf(int code) {
  switch (code) {
    case MJB_SUM: return MPI_SUM;
    case MJB_PROD: return MPI_PROD;
    case MJB_MIN: return MPI_MIN;
    case MJB_MAX: return MPI_MAX;
    case MJB_LAND: return MPI_LAND;
    case MJB_LOR: return MPI_LOR;
    case MJB_BAND: return MPI_BAND;
    case MJB_BOR: return MPI_BOR;
    default: return MPI_OP_NULL;
  }
}

const char* OpName(int code) {
  switch (code) {
    case MJB_SUM: return "sum";
    case MJB_PROD: return "product";
    case MJB_MIN: return "min";
    case MJB_MAX: return "max";
    case MJB_LAND: return "and";
    case MJB_LOR: return "or";
    case MJB_BAND: return "bitwise and";
    case MJB_BOR: return "bitwise or";
    default: return "";
  }
}

// A 63-bit signature of what every rank must agree on (never 0, never
// negative: the check compares sig and -sig).
int64_t Signature(int kind, int type, int64_t count, int op) {
  uint64_t h = 0x6d706a78786c6121ULL;
  for (uint64_t v : {uint64_t(kind), uint64_t(type), uint64_t(count),
                     uint64_t(op)}) {
    h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    h *= 0xbf58476d1ce4e5b9ULL;
    h ^= h >> 31;
  }
  h &= (uint64_t{1} << 63) - 1;
  return static_cast<int64_t>(h == 0 ? 1 : h);
}

// --- labels: which jitted program an operation belongs to ---------------------

std::mutex g_labels_mu;
std::unordered_map<std::string, std::vector<std::string>> g_labels;

std::string LabelKey(const std::string& kind, const std::string& dtype,
                     int64_t elements, const std::string& op) {
  return kind + "|" + dtype + "|" + std::to_string(elements) + "|" + op;
}

// " in jit(f)/psum", " in jit(f)/psum or jit(g)/psum", or "".
std::string LabelOf(int kind, const char* dtype, int64_t elements, int op) {
  std::string key = LabelKey(kHloNames[kind], dtype, elements, OpName(op));
  std::lock_guard<std::mutex> lock(g_labels_mu);
  auto it = g_labels.find(key);
  if (it == g_labels.end() || it->second.empty()) return "";
  std::string s = " in ";
  size_t shown = std::min<size_t>(it->second.size(), 3);
  for (size_t i = 0; i < shown; ++i) s += (i ? " or " : "") + it->second[i];
  if (it->second.size() > shown)
    s += " or " + std::to_string(it->second.size() - shown) + " more";
  return s;
}

// --- errors ----------------------------------------------------------------------

thread_local std::string t_error;

// A failure mpijax found before any data moved: the whole text on stderr
// (once per communicator: from its first rank, the text being the same on
// every rank when `same_everywhere`), and an error code whose text XLA's
// exception carries (MPI_Error_string: at most 255 bytes reach it).
int Fail(const XlaComm& c, const std::string& text, bool same_everywhere,
         const std::string& summary = "") {
  if (!same_everywhere || c.rank == 0) {
    std::string block = text + "\n";
    std::fwrite(block.data(), 1, block.size(), stderr);
    std::fflush(stderr);
  }
  const std::string& e = summary.empty() ? text : summary;
  t_error = e.size() <= 255 ? e : e.substr(0, 251) + " ...";
  return kErrXla;
}

// A failure after data may have moved, or in MPI itself: XLA's buffers may
// still be written, so the job ends here, with the reason.
[[noreturn]] void Fatal(const XlaComm& c, const std::string& text) {
  int world = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &world);
  std::fprintf(stderr, "mpijax: rank %d: %s Stopping the job.\n", world,
               text.c_str());
  std::fflush(stderr);
  (void)c;
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();
}

std::string MpiText(int rc) {
  char text[MPI_MAX_ERROR_STRING] = {0};
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS)
    return "MPI error " + std::to_string(rc);
  return std::string(text, len);
}

std::string Where(const XlaComm& c) {
  if (!c.where.empty()) return c.where;
  return "XLA communicator #" + std::to_string(c.number) + " (ranks " +
         c.ranks + ")";
}

// --- one operation's guard ------------------------------------------------------

// What one XLA operation is, for the inspector, the timeline and the checks.
class Op {
 public:
  Op(XlaComm& c, int kind, int type, int64_t count, int op)
      : c_(c), kind_(kind), type_(type), count_(count), op_(op),
        t_(TypeOf(type)) {
    dims_[0] = count;
    sig_ = Signature(kind, type, count, op);
    info_.emplace(CallInfo{kKindNames[kind], t_.ffi,
                           ffi::Span<const int64_t>(dims_, 1), c.size,
                           c.comm_id, c.device});
    info_->dc = c.dc;
    info_->sig = sig_;
    info_->site = SiteFor(c, static_cast<uint64_t>(sig_),
                          [&] { return Describe(); });
  }

  // Marks the communicator busy and starts the timeline's event.
  void Enter() {
    timeline_.emplace(*info_, true);
    scope_.emplace(c_.dc->status, info_->site);
  }

  CallInfo& info() { return *info_; }
  int64_t sig() const { return sig_; }
  int type_code() const { return type_; }
  int op_code() const { return op_; }
  int64_t count() const { return count_; }
  const Type& type() const { return t_; }

  // "XLA all-reduce float32[1024] (sum) in jit(f)/psum".
  std::string Describe() const {
    std::ostringstream s;
    s << kKindNames[kind_] << " ";
    int64_t elements = count_;
    if (type_ == MJB_BYTE) {
      s << count_ << " bytes";
    } else {
      s << t_.name << "[" << count_ << "]";
    }
    const char* who = c_.clique != nullptr ? " devices" : " ranks";
    if (kind_ == kAllGather) s << " from each of " << c_.size << who;
    if (kind_ == kAllGather) elements = count_ * c_.size;
    if (kind_ == kAllToAll) s << " to each of " << c_.size << who;
    if (OpName(op_)[0] != 0) s << " (" << OpName(op_) << ")";
    // All-to-all and collective-permute move bytes: Python names them by
    // the bytes of their result.
    if (kind_ == kAllToAll) elements = count_ * c_.size;
    s << LabelOf(kind_, type_ == MJB_BYTE ? "bytes" : t_.name, elements, op_);
    return s.str();
  }

 private:
  XlaComm& c_;
  int kind_, type_;
  int64_t count_;
  int op_;
  Type t_;
  int64_t dims_[1];
  int64_t sig_;
  std::optional<CallInfo> info_;
  std::optional<detail::TimelineScope> timeline_;
  std::optional<detail::CallScope> scope_;
};

// Ends an operation whose guard outlives one MPI call (all-to-all,
// collective-permute).
void EndOp(XlaComm& c) {
  delete static_cast<Op*>(c.p2p);
  c.p2p = nullptr;
}

int MemberMismatch(XlaComm& c, Op& op);

// The ranks' operations differ: every rank of the communicator learns
// every rank's operation (collective on the check communicator) and gets the
// same text.
int Mismatch(XlaComm& c, Op& op) {
  if (c.clique != nullptr) return MemberMismatch(c, op);
  detail::DevComm* dc = c.dc;
  int n = CommSize(dc->check);
  std::string text = detail::SiteText(op.info().site);
  int64_t mine[2] = {op.sig(), static_cast<int64_t>(text.size())};
  std::vector<int64_t> all(2 * n);
  MPI_Request req;
  int rc = MPI_Iallgather(mine, 2, MPI_INT64_T, all.data(), 2, MPI_INT64_T,
                          dc->check, &req);
  if (rc != MPI_SUCCESS) Fatal(c, "MPI_Iallgather failed: " + MpiText(rc));
  if (auto e = detail::Wait(&req, op.info()); e.failure())
    Fatal(c, e.message());
  std::vector<int> counts(n), displs(n);
  int total = 0;
  for (int r = 0; r < n; ++r) {
    counts[r] = static_cast<int>(all[2 * r + 1]);
    displs[r] = total;
    total += counts[r];
  }
  std::string texts(std::max(total, 1), '\0');
  rc = MPI_Iallgatherv(text.data(), static_cast<int>(text.size()), MPI_CHAR,
                       texts.data(), counts.data(), displs.data(), MPI_CHAR,
                       dc->check, &req);
  if (rc != MPI_SUCCESS) Fatal(c, "MPI_Iallgatherv failed: " + MpiText(rc));
  if (auto e = detail::Wait(&req, op.info()); e.failure())
    Fatal(c, e.message());
  // The communicator's ranks in the job, to name them as the user knows them.
  std::vector<int> world(n);
  {
    std::vector<int> mine_ranks(n);
    for (int i = 0; i < n; ++i) mine_ranks[i] = i;
    MPI_Group g, wg;
    MPI_Comm_group(dc->comm, &g);
    MPI_Comm_group(MPI_COMM_WORLD, &wg);
    MPI_Group_translate_ranks(g, n, mine_ranks.data(), wg, world.data());
    MPI_Group_free(&g);
    MPI_Group_free(&wg);
  }
  std::vector<int64_t> sigs;
  std::vector<std::vector<int>> members;
  for (int r = 0; r < n; ++r) {
    auto it = std::find(sigs.begin(), sigs.end(), all[2 * r]);
    if (it == sigs.end()) {
      sigs.push_back(all[2 * r]);
      members.push_back({r});
    } else {
      members[it - sigs.begin()].push_back(r);
    }
  }
  // The whole text on stderr; the exception's (at most 255 bytes) without
  // the programs' names.
  std::ostringstream s, brief;
  int64_t call = dc->status.calls.load(std::memory_order_relaxed);
  s << "mpijax: mismatch in XLA's collectives on " << Where(c) << ", call #"
    << call << ": ";
  brief << "mpijax: mismatch in XLA's collectives on XLA communicator #"
        << c.number << ", call #" << call << ": ";
  for (size_t g = 0; g < sigs.size(); ++g) {
    const auto& m = members[g];
    std::string who = m.size() > 1 ? "ranks " : "rank ";
    for (size_t i = 0; i < m.size(); ++i)
      who += (i ? "," : "") + std::to_string(world[m[i]]);
    std::string what = texts.substr(displs[m[0]], counts[m[0]]);
    std::string sep = g == 0 ? "" : g + 1 == sigs.size() ? ", but " : ", ";
    s << sep << who << (m.size() > 1 ? " run " : " runs ") << what;
    brief << sep << who << " " << what.substr(0, what.find(" in "));
  }
  s << ". No data was exchanged. Every rank must run the same jitted programs, "
       "in the same order, on arrays of the same shapes and dtypes (a last "
       "batch of another size on some ranks, or a branch on the rank, "
       "breaks this).";
  brief << " (details on stderr)";
  return Fail(c, s.str(), true, brief.str());
}

// Compares this operation across the communicator's ranks before any data
// moves (one small all-reduce on the check communicator); the waiting rank
// reports a stall past MPIJAX_TIMEOUT. kErrXla on a mismatch, else 0.
int Compare(XlaComm& c, Op& op) {
  if (c.size < 2) return 0;
  detail::DevComm* dc = c.dc;
  dc->status.phase.store(1, std::memory_order_relaxed);
  int64_t buf[2] = {op.sig(), -op.sig()};
  MPI_Request req;
  int rc = MPI_Iallreduce(MPI_IN_PLACE, buf, 2, MPI_INT64_T, MPI_MAX,
                          dc->check, &req);
  if (rc != MPI_SUCCESS) Fatal(c, "MPI_Iallreduce failed: " + MpiText(rc));
  if (auto e = detail::Wait(&req, op.info()); e.failure())
    Fatal(c, e.message());
  dc->status.phase.store(2, std::memory_order_relaxed);
  return buf[0] != -buf[1] ? Mismatch(c, op) : 0;
}

// Polls `n` requests to completion; a wait past MPIJAX_TIMEOUT is reported
// by the stall inspector (then MPIJAX_STALL_ACTION applies) and goes on.
// Returns MPI's error code, with the statuses filled: a receive of the wrong
// size ends in MPI_ERR_TRUNCATE, which the caller words.
int WaitRequests(Op& op, int n, MPI_Request* reqs, MPI_Status* st) {
  double timeout = g_settings.timeout_s.load(std::memory_order_relaxed);
  idle::Backoff backoff(g_settings.wait_spin_s.load(std::memory_order_relaxed));
  int64_t start = NowNs();
  int64_t period = static_cast<int64_t>(timeout * 1e9);
  int64_t deadline = start + period;
  for (uint64_t spin = 0;; ++spin) {
    int done = 0;
    int rc = MPI_Testall(n, reqs, &done, st);
    if (rc != MPI_SUCCESS) return rc;
    if (done) return MPI_SUCCESS;
    if (timeout > 0 && (spin & 255) == 255) {
      int64_t now = NowNs();
      if (now > deadline) {
        detail::ReportStall(op.info(), (now - start) * 1e-9);
        deadline = NowNs() + period;
      }
    }
    backoff.Pause(spin);
  }
}

// Runs one of MPI's collectives on XLA's buffers, blocking under the
// watchdog or polled (detail::ChooseBlocking), and ends the job if MPI fails.
template <typename Blocking, typename Nonblocking>
void RunCollective(XlaComm& c, Op& op, size_t bytes, Blocking blocking,
                   Nonblocking nonblocking) {
  bool block = false, watched = false;
  if (auto e = detail::ChooseBlocking(c.comm, bytes, op.info(), &block,
                                      &watched);
      e.failure())
    Fatal(c, e.message());
  const char* call = "";
  int rc = MPI_SUCCESS;
  if (block) {
    detail::BlockingMark mark(watched ? c.dc : nullptr);
    call = "the blocking call";
    rc = blocking();
  } else {
    MPI_Request req = MPI_REQUEST_NULL;
    call = "the nonblocking call";
    rc = nonblocking(&req);
    if (rc == MPI_SUCCESS) {
      MPI_Status st;
      call = "the wait";
      rc = WaitRequests(op, 1, &req, &st);
    }
  }
  if (rc != MPI_SUCCESS) {
    Fatal(c, std::string("MPI failed in ") + call + " of " + op.Describe() +
                 " on " + Where(c) + ": " + MpiText(rc) + ".");
  }
}

// --- the node-local paths ---------------------------------------------------------

// XLA's operation as the node-local all-reduce's caller: every call compares
// the ranks' signatures in the segments' headers, before any rank reads
// another's data, so a mismatch costs nothing until it happens.
class NodeCaller : public node_local::Caller {
 public:
  NodeCaller(XlaComm& c, Op& op) : c_(c), op_(op) { sig = op.sig(); }
  double Timeout() const override {
    return g_settings.timeout_s.load(std::memory_order_relaxed);
  }
  double SpinS() const override {
    return g_settings.wait_spin_s.load(std::memory_order_relaxed);
  }
  void Stalled(double waited_s) override {
    detail::ReportStall(op_.info(), waited_s);
  }
  void Blocking(bool inside) override {
    c_.dc->status.blocking_since_ns.store(inside ? NowNs() : 0,
                                          std::memory_order_relaxed);
  }
  node_local::Status MpiFailed(int rc, const char* call) override {
    Fatal(c_, std::string(call) + " failed in " + op_.Describe() + " on " +
                  Where(c_) + ": " + MpiText(rc));
  }
  node_local::Status Mismatch(int, int64_t rank_sig, int64_t, int64_t) override {
    mismatched = true;
    if (rank_sig != sig) return {node_local::kInternal, "signature"};
    return {node_local::kInternal,
            "the ranks take different node-local paths (MPIJAX_SHM_MAX_BYTES "
            "and MPIJAX_CMA_MIN_BYTES must be the same on every rank)"};
  }
  node_local::Status CmaFailed(int rank, const std::string& how) override {
    return {node_local::kInternal,
            "the cross-memory all-reduce failed on rank " +
                std::to_string(rank) + " (" + how +
                "); MPIJAX_CMA_MIN_BYTES=0 turns this path off"};
  }
  bool mismatched = false;

 private:
  XlaComm& c_;
  Op& op_;
};

// A node-local path's result: 0, a mismatch's kErrXla, or the end of the job.
int NodeResult(XlaComm& c, Op& op, NodeCaller& caller,
               const node_local::Status& s) {
  if (s.ok()) return 0;
  if (caller.mismatched && s.message == "signature") return Mismatch(c, op);
  if (caller.mismatched) {
    return Fail(c, "mpijax: " + op.Describe() + " on " + Where(c) + ": " +
                       s.message, false);
  }
  Fatal(c, op.Describe() + " on " + Where(c) + ": " + s.message + ".");
}

// Whether c's ranks share a node and its segments are mapped (set up when
// XLA made the communicator, see SetUpNode).
bool NodeReady(const XlaComm& c) { return c.dc->node.state == 1; }

// The node-local all-reduce on `node`: c's own segments, or a member's view
// of its clique's (several devices per process).
int NodeAllreduceOn(XlaComm& c, Op& op, node_local::Comm& node,
                    const char* src, char* dst, size_t n, MPI_Op mop) {
  const Type& t = op.type();
  size_t es = static_cast<size_t>(t.bytes), bytes = n * es;
  NodeCaller caller(c, op);
  int64_t cma_min = g_settings.cma_min_bytes.load(std::memory_order_relaxed);
  if (node.cma_ok && cma_min > 0 &&
      (bytes >= static_cast<size_t>(cma_min) ||
       bytes > node.segment_bytes())) {
    op.info().path |= detail::kPathCma;
    Spans spans(es);
    spans.Add(src, dst, n);
    node_local::Status s =
        node_local::CmaAllreduce(node, caller, spans, t.mpi, mop);
    if (!s.ok() && !caller.mismatched) node.cma_ok = false;
    return NodeResult(c, op, caller, s);
  }
  // Shared memory, a segment at a time; the signature covers the whole
  // operation, so ranks that reduce different totals differ at the first.
  op.info().path |= detail::kPathShm;
  size_t chunk = std::max<size_t>(node.segment_bytes() / es, 1);
  for (size_t at = 0; at < n; at += chunk) {
    size_t m = std::min(chunk, n - at);
    node_local::Status s = node_local::ShmAllreduce(
        node, caller, src + at * es, dst + at * es, m, es, t.mpi, mop);
    if (int rc = NodeResult(c, op, caller, s); rc != 0) return rc;
  }
  return 0;
}

int NodeAllreduce(XlaComm& c, Op& op, const char* src, char* dst, size_t n,
                  MPI_Op mop) {
  std::lock_guard<std::mutex> lock(c.node_mu);
  return NodeAllreduceOn(c, op, c.dc->node, src, dst, n, mop);
}

// --- members: several devices per process (xla_members.h) ---------------------

// What a member hands its clique's other local members for a round.
struct MemberPost {
  const char* src;  // its input (the whole operand)
  char* dst;        // its output
  int64_t sig;      // its operation, as Op::sig()
  int64_t site;     // ... and as the inspector names it
};

const MemberPost& PostOf(const std::vector<const void*>& posts, size_t i) {
  return *static_cast<const MemberPost*>(posts[i]);
}

// This process's members of c's clique, by slot.
const std::vector<int>& Mine(const XlaClique& q) { return q.members_of[q.me]; }

// The round's work area: `bytes` of the clique's staging (the worker only).
char* Staging(XlaClique& q, size_t bytes) {
  if (q.staging.size() < bytes) q.staging.resize(bytes);
  return q.staging.data();
}

// "rank 0 local devices 0,1 and rank 1 local device 1": members by rank.
std::string MemberNames(const XlaClique& q, const std::vector<int>& members) {
  std::vector<int> ranks;
  for (int k : members)
    if (std::find(ranks.begin(), ranks.end(), q.world[k]) == ranks.end())
      ranks.push_back(q.world[k]);
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) {
    std::vector<int> devs;
    for (int k : members)
      if (q.world[k] == ranks[i]) devs.push_back(q.local[k]);
    s += (i ? " and rank " : "rank ") + std::to_string(ranks[i]) +
         (devs.size() > 1 ? " local devices " : " local device ");
    for (size_t j = 0; j < devs.size(); ++j)
      s += (j ? "," : "") + std::to_string(devs[j]);
  }
  return s;
}

// The text of a mismatch among the members of c's clique: every process's
// round worker gathers every member's operation (collective over the
// clique's check communicator) and words the same text.
std::string MemberMismatchText(XlaComm& c, Op& op,
                               const std::vector<const void*>& posts) {
  XlaClique& q = *c.clique;
  const std::vector<int>& mine = Mine(q);
  size_t procs = q.members_of.size();
  std::vector<int64_t> head;  // per local member: signature, text length
  std::string blob;
  for (size_t s = 0; s < mine.size(); ++s) {
    std::string t = detail::SiteText(PostOf(posts, s).site);
    head.push_back(PostOf(posts, s).sig);
    head.push_back(static_cast<int64_t>(t.size()));
    blob += t;
  }
  std::vector<int64_t> heads = head;
  std::string blobs = blob;
  std::vector<int> hcount(procs), hdispl(procs), bcount(procs), bdispl(procs);
  if (procs > 1) {
    int total = 0;
    for (size_t p = 0; p < procs; ++p) {
      hcount[p] = 2 * static_cast<int>(q.members_of[p].size());
      hdispl[p] = total;
      total += hcount[p];
    }
    heads.assign(total, 0);
    MPI_Request req;
    auto wait = [&](int rc, const char* call) {
      if (rc != MPI_SUCCESS) Fatal(c, std::string(call) + " failed: " + MpiText(rc));
      if (auto e = detail::Wait(&req, op.info()); e.failure()) Fatal(c, e.message());
    };
    wait(MPI_Iallgatherv(head.data(), static_cast<int>(head.size()),
                         MPI_INT64_T, heads.data(), hcount.data(),
                         hdispl.data(), MPI_INT64_T, q.check, &req),
         "MPI_Iallgatherv");
    int mine_bytes = static_cast<int>(blob.size());
    wait(MPI_Iallgather(&mine_bytes, 1, MPI_INT, bcount.data(), 1, MPI_INT,
                        q.check, &req),
         "MPI_Iallgather");
    total = 0;
    for (size_t p = 0; p < procs; ++p) {
      bdispl[p] = total;
      total += bcount[p];
    }
    blobs.assign(std::max(total, 1), '\0');
    wait(MPI_Iallgatherv(blob.data(), mine_bytes, MPI_CHAR, blobs.data(),
                         bcount.data(), bdispl.data(), MPI_CHAR, q.check,
                         &req),
         "MPI_Iallgatherv");
  } else {
    hdispl[0] = bdispl[0] = 0;
  }
  // Every member's signature and text.
  std::vector<int64_t> sig(q.n);
  std::vector<std::string> text(q.n);
  for (size_t p = 0; p < procs; ++p) {
    size_t at = bdispl[p];
    for (size_t j = 0; j < q.members_of[p].size(); ++j) {
      int k = q.members_of[p][j];
      sig[k] = heads[hdispl[p] + 2 * j];
      size_t len = static_cast<size_t>(heads[hdispl[p] + 2 * j + 1]);
      text[k] = blobs.substr(at, len);
      at += len;
    }
  }
  std::vector<int64_t> sigs;
  std::vector<std::vector<int>> groups;
  for (int k = 0; k < q.n; ++k) {
    auto it = std::find(sigs.begin(), sigs.end(), sig[k]);
    if (it == sigs.end()) {
      sigs.push_back(sig[k]);
      groups.push_back({k});
    } else {
      groups[it - sigs.begin()].push_back(k);
    }
  }
  std::ostringstream s;
  s << "mpijax: mismatch in XLA's collectives on " << Where(c) << ", call #"
    << c.dc->status.calls.load(std::memory_order_relaxed) << ": ";
  for (size_t g = 0; g < groups.size(); ++g) {
    if (g) s << (g + 1 == groups.size() ? ", but " : ", ");
    s << MemberNames(q, groups[g]) << (groups[g].size() > 1 ? " run " : " runs ")
      << text[groups[g][0]];
  }
  s << ". No data was exchanged. Every rank must run the same jitted programs, "
       "in the same order, on arrays of the same shapes and dtypes (a last "
       "batch of another size on some ranks, or a branch on the rank, "
       "breaks this).";
  return s.str();
}

// Whether every member of c's clique, here and in its other processes, runs
// the same operation (the round's worker; collective over the check
// communicator). kErrXla with the mismatch's text in *text, else 0.
int MemberCompare(XlaComm& c, Op& op, const std::vector<const void*>& posts,
                  std::string* text) {
  XlaClique& q = *c.clique;
  int64_t lo = INT64_MAX, hi = INT64_MIN;
  for (size_t i = 0; i < posts.size(); ++i) {
    lo = std::min(lo, PostOf(posts, i).sig);
    hi = std::max(hi, PostOf(posts, i).sig);
  }
  if (q.members_of.size() > 1) {
    c.dc->status.phase.store(1, std::memory_order_relaxed);
    int64_t buf[2] = {hi, -lo};
    MPI_Request req;
    int rc = MPI_Iallreduce(MPI_IN_PLACE, buf, 2, MPI_INT64_T, MPI_MAX,
                            q.check, &req);
    if (rc != MPI_SUCCESS) Fatal(c, "MPI_Iallreduce failed: " + MpiText(rc));
    if (auto e = detail::Wait(&req, op.info()); e.failure())
      Fatal(c, e.message());
    c.dc->status.phase.store(2, std::memory_order_relaxed);
    hi = buf[0];
    lo = -buf[1];
  }
  if (lo == hi) return 0;
  *text = MemberMismatchText(c, op, posts);
  return kErrXla;
}

// A mismatch the node-local segments found (every member sees it): the
// members' round words it.
int MemberMismatch(XlaComm& c, Op& op) {
  XlaClique& q = *c.clique;
  MemberPost post{nullptr, nullptr, op.sig(), op.info().site};
  NodeCaller caller(c, op);
  std::string text;
  q.group.Round(
      c.slot, &post, caller,
      [&](const std::vector<const void*>& posts, std::string* out) {
        *out = MemberMismatchText(c, op, posts);
        return kErrXla;
      },
      &text);
  return Fail(c, text, true);
}

// Maps the clique's node-local segments at its first all-reduce, every
// member a participant (a round; collective over the clique's communicator
// through each process's worker). Only where every process has as many
// members: the segments' slots are per process.
void MemberNodeSetup(XlaComm& c, Op& op) {
  XlaClique& q = *c.clique;
  MemberPost post{nullptr, nullptr, op.sig(), op.info().site};
  NodeCaller caller(c, op);
  q.group.Round(
      c.slot, &post, caller,
      [&](const std::vector<const void*>&, std::string*) {
        const auto& s = g_settings;
        int64_t shm_max = s.shm_max_bytes.load();
        int state = -1;
        if (q.uniform && (shm_max > 0 || s.cma_min_bytes.load() > 0)) {
          auto owner = std::make_unique<node_local::Comm>(q.comm);
          owner->limits.shm_max_bytes = shm_max;
          owner->limits.cma_min_bytes = s.cma_min_bytes.load();
          owner->limits.timeout_s = s.timeout_s.load();
          owner->limits.wait_spin_s = s.wait_spin_s.load();
          bool ready = false;
          node_local::Status st = node_local::Ready(
              *owner, caller, std::max<int64_t>(shm_max, 4096),
              static_cast<int>(Mine(q).size()), &ready);
          if (st.ok() && ready) {
            for (size_t i = 0; i < q.handles.size(); ++i)
              node_local::View(q.handles[i]->dc->group, *owner,
                               static_cast<int>(i));
            q.node = std::move(owner);
            state = 1;
          } else if (!st.ok()) {
            std::fprintf(stderr,
                         "mpijax: %s keeps to MPI: setting up its node-local "
                         "paths failed: %s\n",
                         Where(c).c_str(), st.message.c_str());
          }
        }
        q.node_state = state;
        return 0;
      },
      nullptr);
}

// An all-reduce among the members: through node-local segments with every
// member a participant where they are set up, else a round: the worker sums
// this process's members' inputs, all-reduces that across the clique's
// processes (one MPI call per process) and hands every member the result.
int MemberAllreduce(XlaComm& c, Op& op, const char* src, char* dst, size_t n,
                    MPI_Op mop) {
  XlaClique& q = *c.clique;
  if (q.node_state == 0) MemberNodeSetup(c, op);
  if (q.node_state == 1)
    return NodeAllreduceOn(c, op, c.dc->group, src, dst, n, mop);
  const Type& t = op.type();
  size_t bytes = n * static_cast<size_t>(t.bytes);
  bool across = q.members_of.size() > 1;
  if (across) op.info().path |= detail::kPathMpi;
  MemberPost post{src, dst, op.sig(), op.info().site};
  NodeCaller caller(c, op);
  std::string text;
  int rc = q.group.Round(
      c.slot, &post, caller,
      [&](const std::vector<const void*>& posts, std::string* out) {
        if (int r = MemberCompare(c, op, posts, out); r != 0) return r;
        char* acc = Staging(q, bytes);
        std::memcpy(acc, PostOf(posts, 0).src, bytes);
        for (size_t i = 1; i < posts.size(); ++i) {
          int r = MPI_Reduce_local(PostOf(posts, i).src, acc,
                                   static_cast<int>(n), t.mpi, mop);
          if (r != MPI_SUCCESS) Fatal(c, "MPI_Reduce_local failed: " + MpiText(r));
        }
        if (across) {
          int count = static_cast<int>(n);
          RunCollective(
              c, op, bytes,
              [&] {
                return MPI_Allreduce(MPI_IN_PLACE, acc, count, t.mpi, mop,
                                     q.comm);
              },
              [&](MPI_Request* req) {
                return MPI_Iallreduce(MPI_IN_PLACE, acc, count, t.mpi, mop,
                                      q.comm, req);
              });
        }
        for (size_t i = 0; i < posts.size(); ++i)
          std::memcpy(PostOf(posts, i).dst, acc, bytes);
        return 0;
      },
      &text);
  return rc == 0 ? 0 : Fail(c, text, true);
}

// An all-gather among the members (`src` null: in place, the member's block
// already in `dst`): a round whose worker packs this process's blocks,
// all-gathers them across the clique's processes and writes every block into
// every local member's output.
int MemberAllgather(XlaComm& c, Op& op, const char* src, char* dst,
                    size_t count) {
  XlaClique& q = *c.clique;
  size_t block = count * static_cast<size_t>(op.type().bytes);
  bool across = q.members_of.size() > 1;
  if (across) op.info().path |= detail::kPathMpi;
  MemberPost post{src != nullptr ? src : dst + c.rank * block, dst, op.sig(),
                  op.info().site};
  NodeCaller caller(c, op);
  std::string text;
  int rc = q.group.Round(
      c.slot, &post, caller,
      [&](const std::vector<const void*>& posts, std::string* out) {
        if (int r = MemberCompare(c, op, posts, out); r != 0) return r;
        const std::vector<int>& mine = Mine(q);
        // Block k (from `from`) into every local member's output.
        auto spread = [&](int k, const char* from) {
          for (size_t i = 0; i < posts.size(); ++i) {
            char* to = PostOf(posts, i).dst + k * block;
            if (to != from) std::memcpy(to, from, block);
          }
        };
        if (!across) {
          for (size_t s = 0; s < mine.size(); ++s)
            spread(mine[s], PostOf(posts, s).src);
          return 0;
        }
        size_t procs = q.members_of.size();
        std::vector<int> counts(procs), displs(procs);
        int total = 0;
        for (size_t p = 0; p < procs; ++p) {
          counts[p] = static_cast<int>(q.members_of[p].size() * block);
          displs[p] = total;
          total += counts[p];
        }
        char* pack = Staging(q, (mine.size() + q.n) * block);
        char* all = pack + mine.size() * block;
        for (size_t s = 0; s < mine.size(); ++s)
          std::memcpy(pack + s * block, PostOf(posts, s).src, block);
        int mine_bytes = static_cast<int>(mine.size() * block);
        RunCollective(
            c, op, q.n * block,
            [&] {
              return MPI_Allgatherv(pack, mine_bytes, MPI_BYTE, all,
                                    counts.data(), displs.data(), MPI_BYTE,
                                    q.comm);
            },
            [&](MPI_Request* req) {
              return MPI_Iallgatherv(pack, mine_bytes, MPI_BYTE, all,
                                     counts.data(), displs.data(), MPI_BYTE,
                                     q.comm, req);
            });
        for (size_t p = 0; p < procs; ++p)
          for (size_t j = 0; j < q.members_of[p].size(); ++j)
            spread(q.members_of[p][j], all + displs[p] + j * block);
        return 0;
      },
      &text);
  return rc == 0 ? 0 : Fail(c, text, true);
}

// A reduce-scatter among the members (`src` null: in place, the input in
// `dst`): a round whose worker sums this process's members' inputs,
// reduce-scatters the sum across the clique's processes (each process's
// members' blocks together) and hands each local member its block.
int MemberReduceScatter(XlaComm& c, Op& op, const char* src, char* dst,
                        size_t count, MPI_Op mop) {
  XlaClique& q = *c.clique;
  const Type& t = op.type();
  size_t block = count * static_cast<size_t>(t.bytes), total = q.n * block;
  bool across = q.members_of.size() > 1;
  if (across) op.info().path |= detail::kPathMpi;
  MemberPost post{src != nullptr ? src : dst, dst, op.sig(), op.info().site};
  NodeCaller caller(c, op);
  std::string text;
  int rc = q.group.Round(
      c.slot, &post, caller,
      [&](const std::vector<const void*>& posts, std::string* out) {
        if (int r = MemberCompare(c, op, posts, out); r != 0) return r;
        const std::vector<int>& mine = Mine(q);
        char* sum = Staging(q, across ? 2 * total + mine.size() * block : total);
        std::memcpy(sum, PostOf(posts, 0).src, total);
        for (size_t i = 1; i < posts.size(); ++i) {
          int r = MPI_Reduce_local(PostOf(posts, i).src, sum,
                                   static_cast<int>(q.n * count), t.mpi, mop);
          if (r != MPI_SUCCESS) Fatal(c, "MPI_Reduce_local failed: " + MpiText(r));
        }
        if (!across) {
          for (size_t s = 0; s < mine.size(); ++s)
            std::memcpy(PostOf(posts, s).dst, sum + mine[s] * block, block);
          return 0;
        }
        // Each process's members' blocks together, in process order.
        char* packed = sum + total;
        char* part = packed + total;
        size_t procs = q.members_of.size(), at = 0;
        std::vector<int> counts(procs);
        for (size_t p = 0; p < procs; ++p) {
          counts[p] = static_cast<int>(q.members_of[p].size() * count);
          for (int k : q.members_of[p]) {
            std::memcpy(packed + at, sum + k * block, block);
            at += block;
          }
        }
        RunCollective(
            c, op, total,
            [&] {
              return MPI_Reduce_scatter(packed, part, counts.data(), t.mpi,
                                        mop, q.comm);
            },
            [&](MPI_Request* req) {
              return MPI_Ireduce_scatter(packed, part, counts.data(), t.mpi,
                                         mop, q.comm, req);
            });
        for (size_t s = 0; s < mine.size(); ++s)
          std::memcpy(PostOf(posts, s).dst, part + s * block, block);
        return 0;
      },
      &text);
  return rc == 0 ? 0 : Fail(c, text, true);
}

// --- point-to-point, with a header -----------------------------------------------

// Every message XLA sends through the bridge carries what the sender means
// to send; the receiver compares it with what it expects before it hands XLA
// the data. Up to kInlineBytes the header travels in front of the data (one
// message, one copy on each side), above in a message of its own, and the
// data follows once the receiver found the header right. A receive is never
// posted smaller than the message that may come: every first message goes
// into a buffer of a header plus kInlineBytes, the most a sender puts in
// one, and data of another size than the header's is never received. (A
// truncated receive is not safe: Open MPI's single-copy path has written a
// whole larger message into the smaller buffer, corrupting the heap.)
constexpr size_t kInlineBytes = size_t{64} << 10;
constexpr uint64_t kHeaderMagic = 0x6d706a7868647221ULL;
// SmallAllreduce's messages; XLA's own use tag 0.
constexpr int kSmallTag = 0x6d6a;

struct Header {
  uint64_t magic;
  int64_t sig;
  int64_t bytes;
  int32_t kind, type, op, pad;  // what the sender runs, to name it
  int64_t count;
};
constexpr size_t kFirstBytes = sizeof(Header) + kInlineBytes;

struct Request {
  XlaComm* c = nullptr;
  bool recv = false;
  int peer = 0, tag = 0;
  int n = 0;  // requests posted
  MPI_Request reqs[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  std::unique_ptr<char[]> staging;  // header (+ data when inline)
  char* user = nullptr;             // a receive's destination
  size_t bytes = 0;
  Header want{};
  // Members (several devices per process): a send to a member of this
  // process, or a receive from one (its rank in the clique).
  std::unique_ptr<Letter> letter;
  int local_from = -1;
};

// A rank of `c` as the job numbers it, for messages.
int WorldRank(const XlaComm& c, int rank) {
  int world = -1;
  MPI_Group g, wg;
  MPI_Comm_group(c.comm, &g);
  MPI_Comm_group(MPI_COMM_WORLD, &wg);
  MPI_Group_translate_ranks(g, 1, &rank, wg, &world);
  MPI_Group_free(&g);
  MPI_Group_free(&wg);
  return world;
}

// The first message from `peer` (`got` bytes at `message`) against what this
// rank expects; on a difference the job ends naming both (a receive cannot
// be undone: XLA would free buffers other requests of the operation use).
void CheckHeader(XlaComm& c, Op& op, const char* message, int got, int peer,
                 const Header& want) {
  const Header* h = reinterpret_cast<const Header*>(message);
  bool whole = static_cast<size_t>(got) >= sizeof(Header) &&
               h->magic == kHeaderMagic;
  size_t bytes = static_cast<size_t>(want.bytes);
  size_t expect = sizeof(Header) + (bytes <= kInlineBytes ? bytes : 0);
  if (whole && h->sig == want.sig && h->bytes == want.bytes &&
      static_cast<size_t>(got) == expect)
    return;
  std::ostringstream s;
  s << "mismatch in XLA's collectives on " << Where(c) << ": this rank runs "
    << op.Describe() << " and receives from rank " << WorldRank(c, peer)
    << ", ";
  if (whole) {
    s << "which runs ";
    if (h->kind < 0 || h->kind >= kKinds) {
      s << "another operation (" << h->bytes << " bytes)";
    } else if (h->type == MJB_BYTE) {
      s << kKindNames[h->kind] << " " << h->bytes << " bytes";
    } else {
      s << kKindNames[h->kind] << " " << TypeOf(h->type).name << "["
        << h->count << "]";
      if (OpName(h->op)[0] != 0) s << " (" << OpName(h->op) << ")";
    }
  } else {
    s << "which sent a message of " << got << " bytes that is not one of "
      << "XLA's operations through mpijax";
  }
  s << ". Every rank must run the same jitted programs, in the same order, on "
       "arrays of the same shapes and dtypes.";
  Fatal(c, s.str());
}

Header MakeHeader(const Op& op, int kind, size_t bytes) {
  return {kHeaderMagic,   op.sig(),      static_cast<int64_t>(bytes), kind,
          op.type_code(), op.op_code(), 0,                            op.count()};
}

// Posts a send of `bytes` from `buf` to `dest` with its header.
void PostSend(XlaComm& c, Op& op, int kind, const void* buf, size_t bytes,
              int dest, int tag, Request* r) {
  r->c = &c;
  r->peer = dest;
  r->tag = tag;
  r->bytes = bytes;
  Header h = MakeHeader(op, kind, bytes);
  bool inline_data = bytes <= kInlineBytes;
  r->staging.reset(new char[sizeof h + (inline_data ? bytes : 0)]);
  std::memcpy(r->staging.get(), &h, sizeof h);
  if (inline_data && bytes > 0)
    std::memcpy(r->staging.get() + sizeof h, buf, bytes);
  size_t first = sizeof h + (inline_data ? bytes : 0);
  int rc = MPI_Isend(r->staging.get(), static_cast<int>(first), MPI_BYTE, dest,
                     tag, c.comm, &r->reqs[0]);
  if (rc != MPI_SUCCESS) Fatal(c, "MPI_Isend failed: " + MpiText(rc));
  r->n = 1;
  if (!inline_data) {
    rc = MPI_Isend(buf, static_cast<int>(bytes), MPI_BYTE, dest, tag, c.comm,
                   &r->reqs[1]);
    if (rc != MPI_SUCCESS) Fatal(c, "MPI_Isend failed: " + MpiText(rc));
    r->n = 2;
  }
}

// Posts the receive of the first message of `bytes` from `source`; data
// beyond kInlineBytes is received in Complete, once the header is right.
void PostRecv(XlaComm& c, Op& op, int kind, void* buf, size_t bytes,
              int source, int tag, Request* r) {
  r->c = &c;
  r->recv = true;
  r->peer = source;
  r->tag = tag;
  r->bytes = bytes;
  r->user = static_cast<char*>(buf);
  r->want = MakeHeader(op, kind, bytes);
  r->staging.reset(new char[kFirstBytes]);
  int rc = MPI_Irecv(r->staging.get(), static_cast<int>(kFirstBytes), MPI_BYTE,
                     source, tag, c.comm, &r->reqs[0]);
  if (rc != MPI_SUCCESS) Fatal(c, "MPI_Irecv failed: " + MpiText(rc));
  r->n = 1;
}

// Waits for `r` under the stall inspector. A receive checks the header
// first, then hands over the data of the same message or receives it (of
// the size both now agree on).
void Complete(XlaComm& c, Op& op, Request& r, int* status3) {
  MPI_Status st[2];
  int rc = WaitRequests(op, r.recv ? 1 : r.n, r.reqs, st);
  if (rc != MPI_SUCCESS) {
    if (rc == MPI_ERR_IN_STATUS)
      for (int i = 0; i < r.n; ++i)
        if (st[i].MPI_ERROR != MPI_SUCCESS) rc = st[i].MPI_ERROR;
    Fatal(c, std::string("MPI failed ") + (r.recv ? "receiving " : "sending ") +
                 op.Describe() + " on " + Where(c) + ": " + MpiText(rc) + ".");
  }
  if (r.recv) {
    int got = 0;
    MPI_Get_count(&st[0], MPI_BYTE, &got);
    CheckHeader(c, op, r.staging.get(), got, r.peer, r.want);
    if (r.bytes > kInlineBytes) {
      rc = MPI_Irecv(r.user, static_cast<int>(r.bytes), MPI_BYTE, r.peer,
                     r.tag, c.comm, &r.reqs[1]);
      if (rc == MPI_SUCCESS) rc = WaitRequests(op, 1, &r.reqs[1], &st[1]);
      if (rc != MPI_SUCCESS) {
        Fatal(c, "MPI failed receiving " + op.Describe() + " on " + Where(c) +
                     ": " + MpiText(rc) + ".");
      }
    } else if (r.bytes > 0) {
      std::memcpy(r.user, r.staging.get() + sizeof(Header), r.bytes);
    }
  }
  if (status3 != nullptr) {
    status3[0] = r.peer;
    status3[1] = r.tag;
    status3[2] = MPI_SUCCESS;
  }
}


// --- members' point-to-point: a letter within the process, MPI across ---------

// The tag of messages from member `from` to member `to` across processes:
// their places among their processes' members (MPI's envelope has the
// processes), so messages between other pairs of the same two processes
// never match.
int MemberTag(const XlaClique& q, int from, int to) {
  return q.slot[from] * q.slots_max + q.slot[to];
}

// Posts a send of `bytes` from `buf` to member `to` of c's clique.
void MemberPostSend(XlaComm& c, Op& op, int kind, const void* buf,
                    size_t bytes, int to, Request* r) {
  XlaClique& q = *c.clique;
  if (q.proc[to] != q.me) {
    PostSend(c, op, kind, buf, bytes, q.proc[to], MemberTag(q, c.rank, to), r);
    return;
  }
  r->c = &c;
  r->peer = to;
  r->bytes = bytes;
  r->letter.reset(new Letter);
  r->letter->from = c.rank;
  r->letter->data = static_cast<const char*>(buf);
  r->letter->bytes = bytes;
  r->letter->sig = op.sig();
  r->letter->kind = kind;
  q.mail.Post(q.slot[to], r->letter.get());
}

// Posts a receive of `bytes` into `buf` from member `from` of c's clique.
void MemberPostRecv(XlaComm& c, Op& op, int kind, void* buf, size_t bytes,
                    int from, Request* r) {
  XlaClique& q = *c.clique;
  if (q.proc[from] != q.me) {
    PostRecv(c, op, kind, buf, bytes, q.proc[from], MemberTag(q, from, c.rank),
             r);
    return;
  }
  r->c = &c;
  r->recv = true;
  r->peer = from;
  r->bytes = bytes;
  r->user = static_cast<char*>(buf);
  r->want = MakeHeader(op, kind, bytes);
  r->local_from = from;
}

// Completes a member's request: a letter to or from a member of this
// process, else MPI's (Complete).
void MemberComplete(XlaComm& c, Op& op, Request& r, int* status3) {
  XlaClique& q = *c.clique;
  if (r.letter == nullptr && r.local_from < 0) {
    Complete(c, op, r, status3);
    return;
  }
  NodeCaller caller(c, op);
  if (r.letter != nullptr) {
    q.mail.WaitTaken(c.slot, r.letter.get(), caller);
  } else {
    Letter* l = q.mail.Take(c.slot, r.local_from, caller);
    if (l->sig != r.want.sig || l->bytes != r.bytes) {
      Fatal(c, "mismatch in XLA's collectives on " + Where(c) +
                   ": local device " + std::to_string(c.device) + " runs " +
                   op.Describe() + " and expects " + std::to_string(r.bytes) +
                   " bytes from local device " +
                   std::to_string(q.local[r.local_from]) + ", which sent " +
                   std::to_string(l->bytes) + " bytes for " +
                   (l->kind >= 0 && l->kind < kKinds ? kKindNames[l->kind]
                                                    : "another operation") +
                   ". Every rank must run the same jitted programs, in the "
                   "same order, on arrays of the same shapes and dtypes.");
    }
    if (r.bytes > 0) std::memcpy(r.user, l->data, r.bytes);
    q.mail.Taken(l, q.slot[r.local_from]);
  }
  if (status3 != nullptr) {
    status3[0] = r.peer;
    status3[1] = 0;
    status3[2] = MPI_SUCCESS;
  }
}

// An operation on a communicator mpijax could not give XLA.
int FailedOp(const XlaComm& c) {
  t_error = c.failed.size() <= 255 ? c.failed : c.failed.substr(0, 251) + " ...";
  return kErrXla;
}

// An all-reduce of at most kInlineBytes across nodes, checked in band: each
// message carries its sender's header (kind, dtype, count, op), so a
// mismatch is found in the exchange itself instead of by a separate check
// (one network round trip each). Recursive doubling: the ranks beyond the
// largest power of two first hand their data to a partner and get the
// result back at the end. Every rank combines the same halves in the same
// association, and the ops are commutative, so every rank gets the same
// bits. A rank that finds another's message different stops the job naming
// both (its partners may already be in a later exchange).
void SmallAllreduce(XlaComm& c, Op& op, const char* src, char* dst, size_t n,
                    MPI_Op mop) {
  const Type& t = op.type();
  size_t bytes = n * t.bytes;
  int p = c.size, r = c.rank, p2 = 1;
  while (p2 * 2 <= p) p2 *= 2;
  if (dst != src) std::memcpy(dst, src, bytes);
  // One staging buffer out, one in: header + data.
  thread_local std::vector<char> out_buf, in_buf;
  out_buf.resize(sizeof(Header) + bytes);
  in_buf.resize(kFirstBytes);  // never smaller than a message that may come
  Header mine = MakeHeader(op, kAllReduce, bytes);
  auto send_to = [&](int peer, MPI_Request* req) {
    std::memcpy(out_buf.data(), &mine, sizeof mine);
    std::memcpy(out_buf.data() + sizeof mine, dst, bytes);
    int rc = MPI_Isend(out_buf.data(), static_cast<int>(out_buf.size()), MPI_BYTE,
                       peer, kSmallTag, c.comm, req);
    if (rc != MPI_SUCCESS) Fatal(c, "MPI_Isend failed: " + MpiText(rc));
  };
  // Receives a partner's header and data and checks the header; returns its data.
  auto receive = [&](int peer, MPI_Request* send_req) -> const char* {
    MPI_Request req;
    int rc = MPI_Irecv(in_buf.data(), static_cast<int>(in_buf.size()), MPI_BYTE,
                       peer, kSmallTag, c.comm, &req);
    if (rc != MPI_SUCCESS) Fatal(c, "MPI_Irecv failed: " + MpiText(rc));
    MPI_Status st;
    rc = WaitRequests(op, 1, &req, &st);
    if (rc != MPI_SUCCESS) {
      Fatal(c, "MPI failed receiving " + op.Describe() + " on " + Where(c) +
                   ": " + MpiText(rc) + ".");
    }
    int got = 0;
    MPI_Get_count(&st, MPI_BYTE, &got);
    CheckHeader(c, op, in_buf.data(), got, peer, mine);
    if (send_req != nullptr) {
      MPI_Status sst;
      rc = WaitRequests(op, 1, send_req, &sst);
      if (rc != MPI_SUCCESS) Fatal(c, "MPI failed sending " + op.Describe() + ": " + MpiText(rc));
    }
    return in_buf.data() + sizeof(Header);
  };
  auto fold_in = [&](const char* theirs) {
    int rc = MPI_Reduce_local(theirs, dst, static_cast<int>(n), t.mpi, mop);
    if (rc != MPI_SUCCESS) Fatal(c, "MPI_Reduce_local failed: " + MpiText(rc));
  };
  if (r >= p2) {  // hand the data over, get the result back
    MPI_Request req;
    send_to(r - p2, &req);
    const char* result = receive(r - p2, &req);
    std::memcpy(dst, result, bytes);
    return;
  }
  if (r + p2 < p) fold_in(receive(r + p2, nullptr));
  for (int mask = 1; mask < p2; mask <<= 1) {
    MPI_Request req;
    send_to(r ^ mask, &req);
    fold_in(receive(r ^ mask, &req));
  }
  if (r + p2 < p) {
    MPI_Request req;
    send_to(r + p2, &req);
    MPI_Status st;
    int rc = WaitRequests(op, 1, &req, &st);
    if (rc != MPI_SUCCESS) Fatal(c, "MPI failed sending " + op.Describe() + ": " + MpiText(rc));
  }
}

}  // namespace

std::string ErrorText() { return t_error; }

void AddLabel(const std::string& kind, const std::string& dtype,
              int64_t elements, const std::string& op,
              const std::string& label) {
  std::lock_guard<std::mutex> lock(g_labels_mu);
  auto& v = g_labels[LabelKey(kind, dtype, elements, op)];
  if (std::find(v.begin(), v.end(), label) == v.end()) v.push_back(label);
}

int Allreduce(XlaComm& c, const void* send, void* recv, int count, int type,
              int op_code) {
  if (!c.failed.empty()) return FailedOp(c);
  Op op(c, kAllReduce, type, count, op_code);
  op.Enter();
  const Type& t = op.type();
  MPI_Op mop = OpOf(op_code);
  char* dst = static_cast<char*>(recv);
  const char* src = send ? static_cast<const char*>(send) : dst;
  size_t bytes = static_cast<size_t>(count) * t.bytes;
  if (c.size == 1) {
    if (src != dst) std::memcpy(dst, src, bytes);
    return 0;
  }
  if (c.clique != nullptr)
    return MemberAllreduce(c, op, src, dst, static_cast<size_t>(count), mop);
  bool every = g_settings.check_every.load(std::memory_order_relaxed);
  if (NodeReady(c)) {
    if (every) {
      if (int rc = Compare(c, op); rc != 0) return rc;
    }
    return NodeAllreduce(c, op, src, dst, static_cast<size_t>(count), mop);
  }
  op.info().path |= detail::kPathMpi;
  if (bytes <= kInlineBytes && !every) {
    SmallAllreduce(c, op, src, dst, static_cast<size_t>(count), mop);
    return 0;
  }
  if (int rc = Compare(c, op); rc != 0) return rc;
  MPI_Comm comm = c.comm;
  if (detail::UseRing(op.info(), bytes, src == dst)) {
    op.info().path = detail::kPathRing;
    Spans spans(t.bytes);
    spans.Add(src, dst, static_cast<size_t>(count));
    if (auto e = detail::RingSegments(op.info(), comm, spans, t.ffi, t.mpi, mop, 1);
        e.failure())
      Fatal(c, e.message());
    return 0;
  }
  const void* in = send ? send : MPI_IN_PLACE;
  RunCollective(
      c, op, bytes,
      [&] { return MPI_Allreduce(in, recv, count, t.mpi, mop, comm); },
      [&](MPI_Request* req) {
        return MPI_Iallreduce(in, recv, count, t.mpi, mop, comm, req);
      });
  return 0;
}

int Allgather(XlaComm& c, const void* send, int send_count, int send_type,
              void* recv, int recv_count, int recv_type) {
  if (!c.failed.empty()) return FailedOp(c);
  Op op(c, kAllGather, recv_type, recv_count, 0);
  op.Enter();
  const Type& t = op.type();
  size_t bytes = static_cast<size_t>(recv_count) * t.bytes;
  if (send != nullptr &&
      (send_count != recv_count || TypeOf(send_type).mpi != t.mpi)) {
    return Fail(c, "mpijax: " + op.Describe() + " on " + Where(c) +
                       ": XLA sends " + std::to_string(send_count) + " " +
                       TypeOf(send_type).name + " but receives " +
                       std::to_string(recv_count) + " " + t.name +
                       " per rank; the bridge only moves equal blocks.",
                false);
  }
  if (c.clique != nullptr) {
    return MemberAllgather(c, op, static_cast<const char*>(send),
                           static_cast<char*>(recv),
                           static_cast<size_t>(recv_count));
  }
  if (int rc = Compare(c, op); rc != 0) return rc;
  op.info().path |= detail::kPathMpi;
  MPI_Comm comm = c.comm;
  const void* in = send ? send : MPI_IN_PLACE;
  MPI_Datatype st = send ? t.mpi : MPI_DATATYPE_NULL;
  int sc = send ? recv_count : 0;
  RunCollective(
      c, op, bytes * c.size,
      [&] { return MPI_Allgather(in, sc, st, recv, recv_count, t.mpi, comm); },
      [&](MPI_Request* req) {
        return MPI_Iallgather(in, sc, st, recv, recv_count, t.mpi, comm, req);
      });
  return 0;
}

int ReduceScatter(XlaComm& c, const void* send, void* recv,
                  const int* recv_counts, int type, int op_code) {
  if (!c.failed.empty()) return FailedOp(c);
  int count = recv_counts[c.rank];
  Op op(c, kReduceScatter, type, count, op_code);
  op.Enter();
  for (int i = 0; i < c.size; ++i) {
    if (recv_counts[i] != count) {
      return Fail(c, "mpijax: " + op.Describe() + " on " + Where(c) +
                         ": XLA asks for blocks of different sizes; the "
                         "bridge only reduces equal blocks.",
                  false);
    }
  }
  if (c.clique != nullptr) {
    return MemberReduceScatter(c, op, static_cast<const char*>(send),
                               static_cast<char*>(recv),
                               static_cast<size_t>(count), OpOf(op_code));
  }
  if (int rc = Compare(c, op); rc != 0) return rc;
  const Type& t = op.type();
  MPI_Op mop = OpOf(op_code);
  op.info().path |= detail::kPathMpi;
  MPI_Comm comm = c.comm;
  const void* in = send ? send : MPI_IN_PLACE;
  size_t bytes = static_cast<size_t>(count) * t.bytes * c.size;
  RunCollective(
      c, op, bytes,
      [&] {
        return MPI_Reduce_scatter_block(in, recv, count, t.mpi, mop, comm);
      },
      [&](MPI_Request* req) {
        return MPI_Ireduce_scatter_block(in, recv, count, t.mpi, mop, comm,
                                         req);
      });
  return 0;
}

// XLA's all-to-all: MPI_Sendrecv with rank + 1, rank + 2, ... in turn; the
// operation's guard spans them (it begins at the exchange with rank + 1).
int Sendrecv(XlaComm& c, const void* send, int send_count, int send_type,
             int dest, int send_tag, void* recv, int recv_count,
             int recv_type, int source, int recv_tag, int* status3) {
  if (!c.failed.empty()) return FailedOp(c);
  size_t send_bytes = static_cast<size_t>(send_count) * TypeOf(send_type).bytes;
  size_t recv_bytes = static_cast<size_t>(recv_count) * TypeOf(recv_type).bytes;
  if (c.p2p == nullptr || c.sendrecvs == 0 || dest == (c.rank + 1) % c.size) {
    if (c.p2p != nullptr) EndOp(c);
    auto* op = new Op(c, kAllToAll, MJB_BYTE,
                      static_cast<int64_t>(recv_bytes), 0);
    op->Enter();
    c.p2p = op;
    c.sendrecvs = 0;
  }
  Op& op = *static_cast<Op*>(c.p2p);
  op.info().path |= detail::kPathMpi;
  Request r_recv, r_send;
  if (c.clique != nullptr) {
    MemberPostRecv(c, op, kAllToAll, recv, recv_bytes, source, &r_recv);
    MemberPostSend(c, op, kAllToAll, send, send_bytes, dest, &r_send);
    MemberComplete(c, op, r_recv, status3);
    MemberComplete(c, op, r_send, nullptr);
  } else {
    PostRecv(c, op, kAllToAll, recv, recv_bytes, source, recv_tag, &r_recv);
    PostSend(c, op, kAllToAll, send, send_bytes, dest, send_tag, &r_send);
    Complete(c, op, r_recv, status3);
    Complete(c, op, r_send, nullptr);
  }
  if (status3 != nullptr) status3[0] = source;
  if (++c.sendrecvs >= c.size - 1) {
    EndOp(c);
    c.sendrecvs = 0;
  }
  return 0;
}

namespace {

// XLA's collective-permute: its receive and sends are one operation, from
// the first one posted until the last is waited for.
Op& PermuteOp(XlaComm& c, size_t bytes) {
  if (c.pending == 0) {
    if (c.p2p != nullptr) EndOp(c);
    auto* op = new Op(c, kPermute, MJB_BYTE, static_cast<int64_t>(bytes), 0);
    op->Enter();
    op->info().path |= detail::kPathMpi;
    c.p2p = op;
  }
  return *static_cast<Op*>(c.p2p);
}

}  // namespace

int Isend(XlaComm& c, const void* buf, int count, int type, int dest, int tag,
          uint64_t* request) {
  if (!c.failed.empty()) return FailedOp(c);
  size_t bytes = static_cast<size_t>(count) * TypeOf(type).bytes;
  Op& op = PermuteOp(c, bytes);
  auto* r = new Request;
  if (c.clique != nullptr)
    MemberPostSend(c, op, kPermute, buf, bytes, dest, r);
  else
    PostSend(c, op, kPermute, buf, bytes, dest, tag, r);
  ++c.pending;
  *request = reinterpret_cast<uint64_t>(r);
  return 0;
}

int Irecv(XlaComm& c, void* buf, int count, int type, int source, int tag,
          uint64_t* request) {
  if (!c.failed.empty()) return FailedOp(c);
  size_t bytes = static_cast<size_t>(count) * TypeOf(type).bytes;
  Op& op = PermuteOp(c, bytes);
  auto* r = new Request;
  if (c.clique != nullptr)
    MemberPostRecv(c, op, kPermute, buf, bytes, source, r);
  else
    PostRecv(c, op, kPermute, buf, bytes, source, tag, r);
  ++c.pending;
  *request = reinterpret_cast<uint64_t>(r);
  return 0;
}

int Wait(uint64_t* request, int* status3) {
  std::unique_ptr<Request> r(reinterpret_cast<Request*>(*request));
  *request = 0;
  XlaComm& c = *r->c;
  Op& op = PermuteOp(c, r->bytes);
  if (c.clique != nullptr)
    MemberComplete(c, op, *r, status3);
  else
    Complete(c, op, *r, status3);
  if (--c.pending == 0) EndOp(c);
  return 0;
}

}  // namespace mpijax::bridge
