// One XLA operation under mpijax's guards, shared by the files that run
// XLA's collectives through the bridge: what XLA asks for (kind, dtype, op,
// signature), the operation's guard (Op: inspector, timeline, the site the
// stall report and mismatch errors name), the cross-rank check, the stall-
// watched waits, the failure paths and the node-local all-reduce.
//   collectives.cc         all-reduce, all-gather, reduce-scatter (one device
//                          per process)
//   member_collectives.cc  ... with several devices per process (members.h)
//   p2p.cc                 all-to-all and collective-permute, headers in
//                          band, and the small all-reduce across nodes
#ifndef MPIJAX_XLA_OPERATION_H_
#define MPIJAX_XLA_OPERATION_H_

#include <mpi.h>

#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "bridge/bridge_table.h"
#include "core/call.h"
#include "base/common.h"
#include "core/inspector.h"
#include "node_local/node_local.h"
#include "core/settings.h"
#include "core/call_check.h"
#include "core/timeline.h"
#include "core/wait.h"
#include "xla_collectives/communicator.h"
#include "xla_collectives/members.h"
#include "xla_collectives/collectives.h"

namespace mpijax::bridge {

namespace ffi = ::xla::ffi;

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
inline constexpr const char* kKindNames[kKinds] = {"XLA all-reduce", "XLA all-gather",
                                        "XLA reduce-scatter", "XLA all-to-all",
                                        "XLA collective-permute"};
// As Python names them (HLO's opcodes).
inline constexpr const char* kHloNames[kKinds] = {"all-reduce", "all-gather",
                                       "reduce-scatter", "all-to-all",
                                       "collective-permute"};

struct Type {
  MPI_Datatype mpi = MPI_DATATYPE_NULL;
  ffi::DataType ffi = ffi::DataType::INVALID;
  int bytes = 0;
  const char* name = "unknown";
};

Type TypeOf(int code);
// MPI's op for `code` on elements of type `t`: a sum of 8- or 16-bit
// integers wraps around as XLA's does (Open MPI's AVX kernels saturate it).
MPI_Op OpOf(int code, const Type& t);
// "sum", ... or "" where the code names no op.
const char* OpName(int code);
// A 63-bit signature of what every rank must agree on (never 0, never
// negative: the check compares sig and -sig).
int64_t Signature(int kind, int type, int64_t count, int op);
// `sig` with a program's fingerprint folded in (the same properties).
int64_t WithProgram(int64_t sig, uint64_t program);
// " in jit(f)/psum", " in jit(f)/psum or jit(g)/psum", or "" (AddLabel's).
std::string LabelOf(int kind, const char* dtype, int64_t elements, int op);
// The key AddLabel and AddProgram file an operation under.
std::string LabelKey(const std::string& kind, const std::string& dtype,
                     int64_t elements, const std::string& op);
// An operation's text with the program whose first collective it is:
// "XLA all-reduce float32[4] (sum), the first collective of program
// jit_f (f32[2,4])->f32[4], in jit(f)/psum" (unchanged for "").
std::string WithProgramText(const std::string& text, const std::string& program);
// ... and back (the text without its program).
std::string WithoutProgramText(const std::string& text);
// Whether `texts` (WithProgramText's, of the ranks' operations) differ only
// in their programs.
bool OnlyProgramsDiffer(const std::vector<std::string>& texts);

// --- errors ----------------------------------------------------------------------

// The text of the last kErrXla on this thread (ErrorText).
extern thread_local std::string t_error;
// What WithProgramText puts in an operation's text, and the hint a mismatch
// of programs adds.
extern const char* const kProgramMark;
extern const char* const kProgramHint;

// A failure mpijax found before any data moved: the whole text on stderr
// (once per communicator: from its first rank, the text being the same on
// every rank when `same_everywhere`), and an error code whose text XLA's
// exception carries (MPI_Error_string: at most 255 bytes reach it).
int Fail(const XlaComm& c, const std::string& text, bool same_everywhere,
         const std::string& summary = "");
// A failure after data may have moved, or in MPI itself: XLA's buffers may
// still be written, so the job ends here, with the reason.
[[noreturn]] void Fatal(const XlaComm& c, const std::string& text);
std::string MpiText(int rc);
// The end of the job where a cross-rank check's exchange failed (MPI's
// error, or a stall action that raises).
void ExchangeOrFatal(const XlaComm& c, const detail::CheckExchange& x);
// "XLA communicator #3 (ranks 0-3)", or the member's own description.
std::string Where(const XlaComm& c);
// An operation on a communicator mpijax could not give XLA.
int FailedOp(const XlaComm& c);
// A mismatch's text for the exception (at most 255 bytes reach it): the
// operations without their programs' names, up to ". No data was exchanged".
std::string Brief(const std::string& mismatch);

// --- one operation's guard ------------------------------------------------------

// What one XLA operation is, for the inspector, the timeline and the checks.
class Op {
 public:
  Op(XlaComm& c, int kind, int type, int64_t count, int op)
      : c_(c), kind_(kind), type_(type), count_(count), op_(op),
        t_(TypeOf(type)) {
    dims_[0] = count;
    sig_ = Signature(kind, type, count, op);
    info_.emplace(detail::CallInfo{kKindNames[kind], t_.ffi,
                           ffi::Span<const int64_t>(dims_, 1), c.size,
                           c.comm_id, c.device});
    info_->dc = c.dc;
    uint64_t program = 0;
    info_->site = SiteFor(
        c, static_cast<uint64_t>(sig_), [&] { return Describe(); },
        [&] { return Key(); }, &program, &program_);
    // The first operation of a newly compiled program on this communicator
    // also carries the program's fingerprint: ranks that compiled different
    // programs (other shapes) differ here, in the check every call makes.
    if (program != 0) sig_ = WithProgram(sig_, program);
    info_->sig = sig_;
  }

  // Marks the communicator busy and starts the timeline's event. A
  // collective-permute is numbered as point-to-point: only the members with a
  // pair take part, so counting it would put the others' numbers behind and
  // the straggler report could pair none of the communicator's later calls.
  void Enter() {
    timeline_.emplace(*info_, kind_ != kPermute);
    scope_.emplace(c_.dc->status, info_->site);
  }

  detail::CallInfo& info() { return *info_; }
  XlaComm& comm() { return c_; }
  int64_t sig() const { return sig_; }
  int type_code() const { return type_; }
  int op_code() const { return op_; }
  int64_t count() const { return count_; }
  const Type& type() const { return t_; }
  // The program this operation is the first of ("jit_f (f32[2,4])->f32[4]"),
  // else "".
  const std::string& program() const { return program_; }

  // What AddLabel filed this operation's programs under.
  std::string Key() const {
    return LabelKey(kHloNames[kind_], type_ == MJB_BYTE ? "bytes" : t_.name,
                    Elements(), OpName(op_));
  }

  // "XLA all-reduce float32[1024] (sum) in jit(f)/psum".
  std::string Describe() const {
    std::ostringstream s;
    s << kKindNames[kind_] << " ";
    if (type_ == MJB_BYTE) {
      s << count_ << " bytes";
    } else {
      s << t_.name << "[" << count_ << "]";
    }
    const char* who = c_.clique != nullptr ? " devices" : " ranks";
    if (kind_ == kAllGather) s << " from each of " << c_.size << who;
    if (kind_ == kAllToAll) s << " to each of " << c_.size << who;
    if (OpName(op_)[0] != 0) s << " (" << OpName(op_) << ")";
    s << LabelOf(kind_, type_ == MJB_BYTE ? "bytes" : t_.name, Elements(), op_);
    return s.str();
  }

  // The elements (bytes) of the operation's result, as Python names them:
  // an all-gather's and an all-to-all's are every rank's block.
  int64_t Elements() const {
    return kind_ == kAllGather || kind_ == kAllToAll ? count_ * c_.size : count_;
  }

 private:
  XlaComm& c_;
  int kind_, type_;
  int64_t count_;
  int op_;
  Type t_;
  int64_t dims_[1];
  int64_t sig_;
  std::string program_;
  std::optional<detail::CallInfo> info_;
  std::optional<detail::TimelineScope> timeline_;
  std::optional<detail::CallScope> scope_;
};

// Ends an operation whose guard outlives one MPI call (all-to-all,
// collective-permute).
void EndOp(XlaComm& c);

// The ranks' operations differ: every rank of the communicator learns
// every rank's operation (collective on the check communicator) and gets the
// same text.
int Mismatch(XlaComm& c, Op& op);
// Compares this operation across the communicator's ranks before any data
// moves (one small all-reduce on the check communicator); the waiting rank
// reports a stall past MPIJAX_TIMEOUT. kErrXla on a mismatch, else 0.
int Compare(XlaComm& c, Op& op);
// Polls `n` requests to completion; a wait past MPIJAX_TIMEOUT is reported
// by the stall inspector (then MPIJAX_STALL_ACTION applies) and goes on.
// Returns MPI's error code, with the statuses filled.
int WaitRequests(Op& op, int n, MPI_Request* reqs, MPI_Status* st);

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
    return detail::g_settings.timeout_s.load(std::memory_order_relaxed);
  }
  double SpinS() const override {
    return detail::g_settings.wait_spin_s.load(std::memory_order_relaxed);
  }
  void Stalled(double waited_s) override {
    if (c_.clique != nullptr && !MemberReportsStall(c_)) return;
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
               const node_local::Status& s);
// Whether c's ranks share a node and its segments are mapped (set up when
// XLA made the communicator, see SetUpNode).
inline bool NodeReady(const XlaComm& c) { return c.dc->node.state == 1; }
// The node-local all-reduce on `node`: c's own segments, or a member's view
// of its clique's (several devices per process).
int NodeAllreduceOn(XlaComm& c, Op& op, node_local::Comm& node,
                    const char* src, char* dst, size_t n, MPI_Op mop);
// ... on c's own segments.
int NodeAllreduce(XlaComm& c, Op& op, const char* src, char* dst, size_t n,
                  MPI_Op mop);
// The node-local reduce-scatter on c's own segments: `src` holds c.size
// blocks of `count` elements, this rank's reduced block goes to `dst`.
int NodeReduceScatter(XlaComm& c, Op& op, const char* src, char* dst,
                      size_t count, MPI_Op mop);

// Whether XLA's all-gather of `bytes` in all goes by NodeAllgather (the same
// answer on every rank once the signatures agree).
bool UseNodeAllgather(const XlaComm& c, size_t bytes);
// The node-local all-gather by cross-memory attach on c's own segments:
// `block` bytes at `src` from every rank into `dst`.
int NodeAllgather(XlaComm& c, Op& op, const char* src, char* dst,
                  size_t block);

// --- the other files' paths ---------------------------------------------------------

// Messages up to this size carry their header in front of the data
// (p2p.cc); all-reduces up to it across nodes take SmallAllreduce.
constexpr size_t kInlineBytes = size_t{64} << 10;
// An all-reduce of at most kInlineBytes across nodes, checked in band.
void SmallAllreduce(XlaComm& c, Op& op, const char* src, char* dst, size_t n,
                    MPI_Op mop);

// Several devices per process (member_collectives.cc): c.clique is set.
int MemberMismatch(XlaComm& c, Op& op);
int MemberAllreduce(XlaComm& c, Op& op, const char* src, char* dst, size_t n,
                    MPI_Op mop);
int MemberAllgather(XlaComm& c, Op& op, const char* src, char* dst,
                    size_t count);
int MemberReduceScatter(XlaComm& c, Op& op, const char* src, char* dst,
                        size_t count, MPI_Op mop);

}  // namespace mpijax::bridge

#endif  // MPIJAX_XLA_OPERATION_H_
