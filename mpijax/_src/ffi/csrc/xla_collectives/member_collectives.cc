// XLA's all-reduce, all-gather and reduce-scatter with several devices per
// process: each (process, local device) is a member of XLA's communicator
// (members.h); the members of one process meet in a round and one MPI
// call per process crosses them.
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "xla_collectives/members.h"
#include "xla_collectives/operation.h"

namespace mpijax::bridge {
namespace {

using detail::g_settings;

// What a member hands its clique's other local members for a round.
struct MemberPost {
  const char* src;  // its input (the whole operand)
  char* dst;        // its output
  int64_t sig;      // its operation, as Op::sig()
  int64_t site;     // ... and as the inspector names it
  const std::string* program;  // Op::program()
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
  std::vector<int> counts;  // members per process
  for (const auto& m : q.members_of) counts.push_back(static_cast<int>(m.size()));
  std::vector<int64_t> my_sigs, sigs;
  std::vector<std::string> my_texts, texts;
  for (size_t s = 0; s < mine.size(); ++s) {
    const MemberPost& post = PostOf(posts, s);
    my_sigs.push_back(post.sig);
    my_texts.push_back(WithProgramText(detail::SiteText(post.site),
                                       post.program ? *post.program : ""));
  }
  detail::CheckExchange x = detail::GatherCalls(q.check, op.info(), counts,
                                                my_sigs, my_texts, &sigs, &texts);
  ExchangeOrFatal(c, x);
  // Every member's signature and text, by slot.
  std::vector<int64_t> sig(q.n);
  std::vector<std::string> text(q.n);
  size_t i = 0;
  for (const auto& members : q.members_of) {
    for (int k : members) {
      sig[k] = sigs[i];
      text[k] = texts[i++];
    }
  }
  auto groups = detail::GroupBySignature(q.n, [&](int k) { return sig[k]; });
  // Each group's operation; with its program only where that is all that differs.
  std::vector<std::string> whats;
  for (const auto& g : groups) whats.push_back(text[g[0]]);
  bool programs = OnlyProgramsDiffer(whats);
  for (std::string& w : whats)
    if (!programs) w = WithoutProgramText(w);
  std::ostringstream s;
  s << "mpijax: mismatch in XLA's collectives on " << Where(c) << ", call #"
    << c.dc->status.calls.load(std::memory_order_relaxed) << ": ";
  for (size_t g = 0; g < groups.size(); ++g) {
    if (g) s << (g + 1 == groups.size() ? ", but " : ", ");
    s << MemberNames(q, groups[g]) << (groups[g].size() > 1 ? " run " : " runs ")
      << whats[g];
  }
  s << ". No data was exchanged. Every rank must run the same jitted programs, "
       "in the same order, on arrays of the same shapes and dtypes (a last "
       "batch of another size on some ranks, or a branch on the rank, "
       "breaks this).";
  if (programs) s << kProgramHint;
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
  bool same = lo == hi;
  if (q.members_of.size() > 1) {
    detail::CheckExchange x =
        detail::SameSignatures(q.check, op.info(), lo, hi, &same);
    ExchangeOrFatal(c, x);
  }
  if (same) return 0;
  *text = MemberMismatchText(c, op, posts);
  return kErrXla;
}

}  // namespace

// A mismatch the node-local segments found (every member sees it): the
// members' round words it.
int MemberMismatch(XlaComm& c, Op& op) {
  XlaClique& q = *c.clique;
  MemberPost post{nullptr, nullptr, op.sig(), op.info().site, &op.program()};
  NodeCaller caller(c, op);
  std::string text;
  q.group.Round(
      c.slot, &post, caller,
      [&](const std::vector<const void*>& posts, std::string* out) {
        *out = MemberMismatchText(c, op, posts);
        return kErrXla;
      },
      &text);
  return Fail(c, text, true, Brief(text));
}

// Maps the clique's node-local segments at its first all-reduce, every
// member a participant (a round; collective over the clique's communicator
// through each process's worker). Only where every process has as many
// members: the segments' slots are per process.
void MemberNodeSetup(XlaComm& c, Op& op) {
  XlaClique& q = *c.clique;
  MemberPost post{nullptr, nullptr, op.sig(), op.info().site, &op.program()};
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
  MemberPost post{src, dst, op.sig(), op.info().site, &op.program()};
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
  return rc == 0 ? 0 : Fail(c, text, true, Brief(text));
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
                  op.info().site, &op.program()};
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
  return rc == 0 ? 0 : Fail(c, text, true, Brief(text));
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
  MemberPost post{src != nullptr ? src : dst, dst, op.sig(), op.info().site,
                  &op.program()};
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
  return rc == 0 ? 0 : Fail(c, text, true, Brief(text));
}

}  // namespace mpijax::bridge
