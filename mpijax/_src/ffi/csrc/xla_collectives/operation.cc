// What XLA asks for, the operation's guard and its failure paths, the check
// across ranks and the node-local all-reduce (operation.h).
#include "xla_collectives/operation.h"

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "base/idle.h"
#include "core/reduce_ops.h"
#include "base/spans.h"

namespace mpijax::bridge {

using detail::g_settings;

// --- what XLA asks for -------------------------------------------------------

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

MPI_Op OpOf(int code, const Type& t) {
  using D = ffi::DataType;
  if (code == MJB_SUM && (t.ffi == D::S8 || t.ffi == D::U8 ||
                          t.ffi == D::S16 || t.ffi == D::U16)) {
    MPI_Datatype dt;
    MPI_Op wrap;
    detail::InitTypesOnce();
    if (!detail::ReductionTypes(t.ffi, detail::kSum, &dt, &wrap).failure())
      return wrap;
  }
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

int64_t WithProgram(int64_t sig, uint64_t program) {
  uint64_t h = static_cast<uint64_t>(sig) ^ (program * 0x9e3779b97f4a7c15ULL);
  h ^= h >> 29;
  h *= 0xbf58476d1ce4e5b9ULL;
  h ^= h >> 32;
  h &= (uint64_t{1} << 63) - 1;
  return static_cast<int64_t>(h == 0 ? 1 : h);
}

// --- labels: which jitted program an operation belongs to ---------------------

namespace {

std::mutex g_labels_mu;
std::unordered_map<std::string, std::vector<std::string>> g_labels;
// Counts the labels and programs added: a call site named before a program
// of the same shape was compiled is named again (SiteFor).
std::atomic<uint64_t> g_label_generation{1};

// Every program with collectives across processes this process compiled,
// in order (AddProgram); a program compiled twice is here twice.
struct Program {
  uint64_t fingerprint;
  std::string text;  // "jit_f (f32[2,4])->f32[4]"
  std::unordered_set<std::string> keys;  // its operations (LabelKey)
};
std::vector<Program> g_programs;

// FNV-1a: the same text gives the same fingerprint in every process.
uint64_t Fingerprint(const std::string& text) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char ch : text) {
    h ^= ch;
    h *= 0x100000001b3ULL;
  }
  return h == 0 ? 1 : h;
}

}  // namespace

std::string LabelKey(const std::string& kind, const std::string& dtype,
                     int64_t elements, const std::string& op) {
  return kind + "|" + dtype + "|" + std::to_string(elements) + "|" + op;
}

std::string WithoutProgramText(const std::string& text) {
  size_t mark = text.find(kProgramMark);
  if (mark == std::string::npos) return text;
  size_t in = text.find(", in ", mark);
  return text.substr(0, mark) + (in == std::string::npos ? "" : text.substr(in + 1));
}

bool OnlyProgramsDiffer(const std::vector<std::string>& texts) {
  bool programs = false;
  for (const std::string& t : texts) {
    programs = programs || t.find(kProgramMark) != std::string::npos;
    if (WithoutProgramText(t) != WithoutProgramText(texts[0])) return false;
  }
  return programs;
}

std::string WithProgramText(const std::string& text, const std::string& program) {
  if (program.empty()) return text;
  // Before the labels (" in jit(f)/psum"), which the exception's text leaves out.
  size_t in = text.find(" in ");
  std::string what = ", the first collective of program " + program;
  if (in == std::string::npos) return text + what;
  return text.substr(0, in) + what + "," + text.substr(in);
}

void AddProgram(const std::string& text,
                const std::vector<std::tuple<std::string, std::string, int64_t,
                                             std::string>>& collectives) {
  Program p{Fingerprint(text), text, {}};
  for (const auto& [kind, dtype, elements, op] : collectives)
    p.keys.insert(LabelKey(kind, dtype, elements, op));
  std::lock_guard<std::mutex> lock(g_labels_mu);
  g_programs.push_back(std::move(p));
  g_label_generation.fetch_add(1, std::memory_order_acq_rel);
}

bool NewestProgramSince(const std::string& key, size_t since, size_t* count,
                        uint64_t* program, std::string* text) {
  std::lock_guard<std::mutex> lock(g_labels_mu);
  *count = g_programs.size();
  for (size_t i = g_programs.size(); i > since; --i) {
    const Program& p = g_programs[i - 1];
    if (p.keys.count(key)) {
      *program = p.fingerprint;
      *text = p.text;
      return true;
    }
  }
  return false;
}

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

std::string ErrorText() { return t_error; }

void AddLabel(const std::string& kind, const std::string& dtype,
              int64_t elements, const std::string& op,
              const std::string& label) {
  std::lock_guard<std::mutex> lock(g_labels_mu);
  auto& v = g_labels[LabelKey(kind, dtype, elements, op)];
  if (std::find(v.begin(), v.end(), label) == v.end()) {
    v.push_back(label);
    g_label_generation.fetch_add(1, std::memory_order_acq_rel);
  }
}

uint64_t LabelGeneration() {
  return g_label_generation.load(std::memory_order_acquire);
}

// --- errors ----------------------------------------------------------------------

thread_local std::string t_error;

const char* const kProgramMark = ", the first collective of program ";
const char* const kProgramHint =
    " The programs are named by their arguments' shapes, each device's part: "
    "ranks that compiled the same function for other shapes built their "
    "global arrays from rows of other shapes (pass global_shape to "
    "jax.make_array_from_process_local_data, and every rank the same number "
    "of rows).";

int Fail(const XlaComm& c, const std::string& text, bool same_everywhere,
         const std::string& summary) {
  if (!same_everywhere || c.rank == 0) {
    std::string block = text + "\n";
    std::fwrite(block.data(), 1, block.size(), stderr);
    std::fflush(stderr);
  }
  const std::string& e = summary.empty() ? text : summary;
  t_error = e.size() <= 255 ? e : e.substr(0, 251) + " ...";
  return kErrXla;
}

void Fatal(const XlaComm& c, const std::string& text) {
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

void ExchangeOrFatal(const XlaComm& c, const detail::CheckExchange& x) {
  if (x.rc != MPI_SUCCESS)
    Fatal(c, std::string(x.call) + " failed: " + MpiText(x.rc));
  if (x.wait.failure()) Fatal(c, x.wait.message());
}

std::string Where(const XlaComm& c) {
  if (!c.where.empty()) return c.where;
  return "XLA communicator #" + std::to_string(c.number) + " (ranks " +
         c.ranks + ")";
}

int FailedOp(const XlaComm& c) {
  t_error = c.failed.size() <= 255 ? c.failed : c.failed.substr(0, 251) + " ...";
  return kErrXla;
}

namespace {

// A mismatch of programs (WithProgramText's): "ranks 0,1,2 run program A,
// but rank 3 runs program B, at XLA all-reduce float32[4] (sum)", the
// operation once where every rank runs the same one. `head` ends in
// "call #N", `body` is the groups' text.
std::string ProgramBrief(const std::string& head, const std::string& body) {
  // The groups: "ranks 0,1,2 run X", ", but rank 3 runs Y" (a group starts
  // with "rank"; no operation's or program's text has ", rank").
  std::vector<std::string> groups;
  size_t at = 0;
  while (at != std::string::npos) {
    size_t next = std::string::npos, skip = 0;
    for (size_t p = body.find(", ", at); p != std::string::npos;
         p = body.find(", ", p + 1)) {
      if (body.compare(p + 2, 4, "rank") == 0) { next = p; skip = 2; break; }
      if (body.compare(p + 2, 8, "but rank") == 0) { next = p; skip = 6; break; }
    }
    groups.push_back(body.substr(at, next == std::string::npos ? next : next - at));
    at = next == std::string::npos ? next : next + skip;
  }
  std::string out = head, op;
  bool same_op = true;
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::string& text = groups[g];
    size_t verb = text.find(" run");
    if (verb == std::string::npos) return "";
    size_t what = text.find(' ', verb + 1);
    std::string who = text.substr(0, what);  // "ranks 0,1,2 run"
    std::string rest = what == std::string::npos ? "" : text.substr(what + 1);
    size_t mark = rest.find(kProgramMark);
    std::string this_op = rest.substr(0, std::min(mark, rest.find(" in ")));
    std::string program = "another program";
    if (mark != std::string::npos) {
      size_t from = mark + std::strlen(kProgramMark);
      size_t to = rest.find(", in ", from);
      program = "program " + rest.substr(from, to == std::string::npos ? to : to - from);
    }
    if (g == 0) op = this_op;
    same_op = same_op && this_op == op;
    out += (g == 0 ? ": " : g + 1 == groups.size() ? ", but " : ", ") + who + " " + program;
  }
  if (same_op) out += ", at " + op;
  return out + " (details on stderr)";
}

}  // namespace

std::string Brief(const std::string& mismatch) {
  std::string s = mismatch.substr(0, mismatch.find(". No data was exchanged"));
  size_t at = s.find(": ", s.find("call #"));
  if (at == std::string::npos) return s;
  std::string out = s.substr(0, at);
  // "XLA communicator of devices 0,1,2048,2049 on ranks 0,1": the ranks.
  size_t of = out.find(" of devices ");
  size_t on = of == std::string::npos ? of : out.find(" on ranks ", of);
  if (on != std::string::npos) out.erase(of, on - of);
  if (s.find(kProgramMark, at) != std::string::npos) {
    // "XLA communicator #1 (ranks 0-3)": the ranks are in the groups.
    size_t ranks = out.find(" (ranks ");
    size_t close = ranks == std::string::npos ? ranks : out.find(')', ranks);
    if (close != std::string::npos) out.erase(ranks, close + 1 - ranks);
    std::string brief = ProgramBrief(out, s.substr(at + 2));
    if (!brief.empty()) return brief;
  }
  // " ... runs XLA all-reduce float32[4] (sum) in jit(f)/psum, but ...": the
  // program runs from " in " to the next ", ".
  while (at < s.size()) {
    size_t in = s.find(" in ", at);
    out += s.substr(at, in == std::string::npos ? std::string::npos : in - at);
    if (in == std::string::npos) break;
    at = s.find(", ", in);
  }
  return out + " (details on stderr)";
}

// --- the guard ---------------------------------------------------------------

void EndOp(XlaComm& c) {
  delete static_cast<Op*>(c.p2p);
  c.p2p = nullptr;
}

// The ranks' operations differ: every rank of the communicator learns
// every rank's operation (collective on the check communicator) and gets the
// same text.
int Mismatch(XlaComm& c, Op& op) {
  if (c.clique != nullptr) return MemberMismatch(c, op);
  detail::DevComm* dc = c.dc;
  std::vector<int64_t> sigs;
  std::vector<std::string> texts;
  detail::CheckExchange x = detail::GatherCalls(
      dc->check, op.info(), {}, {op.sig()},
      {WithProgramText(detail::SiteText(op.info().site), op.program())}, &sigs,
      &texts);
  ExchangeOrFatal(c, x);
  int n = static_cast<int>(sigs.size());
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
  auto members = detail::GroupBySignature(n, [&](int r) { return sigs[r]; });
  // Each group's operation; with its program only where that is all that differs.
  std::vector<std::string> whats;
  for (const auto& m : members) whats.push_back(texts[m[0]]);
  bool programs = OnlyProgramsDiffer(whats);
  for (std::string& w : whats)
    if (!programs) w = WithoutProgramText(w);
  // The whole text on stderr; the exception's (at most 255 bytes) without
  // the programs' names.
  std::ostringstream s, brief;
  int64_t call = dc->status.calls.load(std::memory_order_relaxed);
  s << "mpijax: mismatch in XLA's collectives on " << Where(c) << ", call #"
    << call << ": ";
  brief << "mpijax: mismatch in XLA's collectives on XLA communicator #"
        << c.number << ", call #" << call << ": ";
  for (size_t g = 0; g < members.size(); ++g) {
    const auto& m = members[g];
    std::string who = m.size() > 1 ? "ranks " : "rank ";
    for (size_t i = 0; i < m.size(); ++i)
      who += (i ? "," : "") + std::to_string(world[m[i]]);
    const std::string& what = whats[g];
    std::string sep = g == 0 ? "" : g + 1 == members.size() ? ", but " : ", ";
    s << sep << who << (m.size() > 1 ? " run " : " runs ") << what;
    brief << sep << who << " " << what.substr(0, what.find(" in "));
  }
  s << ". No data was exchanged. Every rank must run the same jitted programs, "
       "in the same order, on arrays of the same shapes and dtypes (a last "
       "batch of another size on some ranks, or a branch on the rank, "
       "breaks this).";
  brief << " (details on stderr)";
  if (!programs) return Fail(c, s.str(), true, brief.str());
  s << kProgramHint;
  return Fail(c, s.str(), true, Brief(s.str()));
}

// Compares this operation across the communicator's ranks before any data
// moves (one small all-reduce on the check communicator); the waiting rank
// reports a stall past MPIJAX_TIMEOUT. kErrXla on a mismatch, else 0.
int Compare(XlaComm& c, Op& op) {
  if (c.size < 2) return 0;
  bool same = true;
  detail::CheckExchange x =
      detail::SameSignatures(c.dc->check, op.info(), op.sig(), op.sig(), &same);
  ExchangeOrFatal(c, x);
  return same ? 0 : Mismatch(c, op);
}

// Polls `n` requests to completion; a wait past MPIJAX_TIMEOUT is reported
// by the stall inspector (then MPIJAX_STALL_ACTION applies) and goes on.
// Returns MPI's error code, with the statuses filled: a receive of the wrong
// size ends in MPI_ERR_TRUNCATE, which the caller words.
int WaitRequests(Op& op, int n, MPI_Request* reqs, MPI_Status* st) {
  double timeout = g_settings.timeout_s.load(std::memory_order_relaxed);
  idle::Backoff backoff(g_settings.wait_spin_s.load(std::memory_order_relaxed),
                        g_settings.oversubscribed.load(std::memory_order_relaxed));
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
        if (op.comm().clique == nullptr || MemberReportsStall(op.comm()))
          detail::ReportStall(op.info(), (now - start) * 1e-9);
        deadline = NowNs() + period;
      }
    }
    backoff.Pause(spin);
  }
}

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

namespace {

// Whether the node-local collective of `bytes` on `node` goes by
// cross-memory attach (the same answer on every rank of `node`).
bool UseCma(const node_local::Comm& node, size_t bytes) {
  int64_t cma_min = g_settings.cma_min_bytes.load(std::memory_order_relaxed);
  return node.cma_ok && cma_min > 0 &&
         (bytes >= static_cast<size_t>(cma_min) ||
          bytes > node.segment_bytes());
}

}  // namespace

// The node-local all-reduce on `node`: c's own segments, or a member's view
// of its clique's (several devices per process).
int NodeAllreduceOn(XlaComm& c, Op& op, node_local::Comm& node,
                    const char* src, char* dst, size_t n, MPI_Op mop) {
  const Type& t = op.type();
  size_t es = static_cast<size_t>(t.bytes), bytes = n * es;
  NodeCaller caller(c, op);
  if (UseCma(node, bytes)) {
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

namespace {
// Whether [a, a + a_bytes) and [b, b + b_bytes) share a byte.
bool Overlap(const char* a, size_t a_bytes, const char* b, size_t b_bytes) {
  auto at = [](const char* p) { return reinterpret_cast<uintptr_t>(p); };
  return at(a) < at(b) + b_bytes && at(b) < at(a) + a_bytes;
}
}  // namespace

bool UseNodeAllgather(const XlaComm& c, size_t bytes) {
  int64_t cma_min = g_settings.cma_min_bytes.load(std::memory_order_relaxed);
  return cma_min > 0 && bytes >= static_cast<size_t>(cma_min) &&
         NodeReady(c) && c.dc->node.cma_ok;
}

int NodeAllgather(XlaComm& c, Op& op, const char* src, char* dst,
                  size_t block) {
  std::lock_guard<std::mutex> lock(c.node_mu);
  node_local::Comm& node = c.dc->node;
  // An input inside the output but not at this rank's block is copied aside
  // (another rank's block would overwrite it).
  thread_local std::vector<char> aside;
  const char* mine = dst + static_cast<size_t>(c.rank) * block;
  if (src != mine && Overlap(src, block, dst, block * c.size)) {
    aside.assign(src, src + block);
    src = aside.data();
  }
  op.info().path |= detail::kPathCma;
  NodeCaller caller(c, op);
  node_local::Status s = node_local::CmaAllgather(node, caller, src, dst, block);
  if (!s.ok() && !caller.mismatched) node.cma_ok = false;
  return NodeResult(c, op, caller, s);
}

int NodeReduceScatter(XlaComm& c, Op& op, const char* src, char* dst,
                      size_t count, MPI_Op mop) {
  std::lock_guard<std::mutex> lock(c.node_mu);
  node_local::Comm& node = c.dc->node;
  size_t es = static_cast<size_t>(op.type().bytes), block = count * es;
  size_t bytes = block * c.size;
  // The whole operand: the shared-memory path's all-reduce result, or this
  // rank's input copied aside (not Scratch(), which CmaReduceScatter uses).
  thread_local std::vector<char> whole;
  if (UseCma(node, bytes)) {
    // Every rank reads its block of the others' inputs: none writes into
    // another's memory, no scratch of the whole operand. An output inside
    // this rank's input gets its input copied aside first.
    if (Overlap(src, bytes, dst, block)) {
      if (whole.size() < bytes) whole.resize(bytes);
      std::memcpy(whole.data(), src, bytes);
      src = whole.data();
    }
    op.info().path |= detail::kPathCma;
    NodeCaller caller(c, op);
    node_local::Status s = node_local::CmaReduceScatter(
        node, caller, src, dst, count, es, op.type().mpi, mop);
    if (!s.ok() && !caller.mismatched) node.cma_ok = false;
    return NodeResult(c, op, caller, s);
  }
  // Shared memory: the all-reduce of the whole operand, then this rank's
  // block (small operands; MPI's reduce-scatter took 17x the time).
  if (whole.size() < bytes) whole.resize(bytes);
  if (int rc = NodeAllreduceOn(c, op, node, src, whole.data(), count * c.size,
                               mop);
      rc != 0)
    return rc;
  std::memcpy(dst, whole.data() + c.rank * block, block);
  return 0;
}

}  // namespace mpijax::bridge
