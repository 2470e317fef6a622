// XLA's all-to-all and collective-permute through the bridge, and the small
// all-reduce across nodes: every message carries a header naming the
// sender's operation, checked before XLA gets the data.
#include <mpi.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "xla_collectives/process_local.h"
#include "xla_collectives/members.h"
#include "xla_collectives/operation.h"

namespace mpijax::bridge {
namespace {

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
  // Only the programs' fingerprints differ: each rank names its own.
  bool same_op = whole && h->sig != want.sig && h->kind == want.kind &&
                 h->type == want.type && h->op == want.op &&
                 h->count == want.count && h->bytes == want.bytes;
  s << "mismatch in XLA's collectives on " << Where(c) << ": this rank runs "
    << (same_op ? WithProgramText(op.Describe(), op.program()) : op.Describe())
    << " and receives from rank " << WorldRank(c, peer) << ", ";
  if (same_op) {
    s << "which runs the same operation as part of another program";
  } else if (whole) {
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
  if (same_op) s << kProgramHint;
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

// Waits for `n` requests at `reqs` under the stall inspector; an MPI error
// ends the job (`what`: "sending" or "receiving").
void WaitOrDie(XlaComm& c, Op& op, int n, MPI_Request* reqs, MPI_Status* st,
               const char* what) {
  int rc = WaitRequests(op, n, reqs, st);
  if (rc == MPI_SUCCESS) return;
  if (rc == MPI_ERR_IN_STATUS)
    for (int i = 0; i < n; ++i)
      if (st[i].MPI_ERROR != MPI_SUCCESS) rc = st[i].MPI_ERROR;
  Fatal(c, std::string("MPI failed ") + what + " " + op.Describe() + " on " +
               Where(c) + ": " + MpiText(rc) + ".");
}

// A receive's first message: waits for it and checks its header, then
// copies the data it carried or posts the receive of the data (r.reqs[1],
// of the size both now agree on).
void ReceiveFirst(XlaComm& c, Op& op, Request& r) {
  MPI_Status st;
  WaitOrDie(c, op, 1, &r.reqs[0], &st, "receiving");
  int got = 0;
  MPI_Get_count(&st, MPI_BYTE, &got);
  CheckHeader(c, op, r.staging.get(), got, r.peer, r.want);
  if (r.bytes > kInlineBytes) {
    int rc = MPI_Irecv(r.user, static_cast<int>(r.bytes), MPI_BYTE, r.peer,
                       r.tag, c.comm, &r.reqs[1]);
    if (rc != MPI_SUCCESS) {
      Fatal(c, "MPI failed receiving " + op.Describe() + " on " + Where(c) +
                   ": " + MpiText(rc) + ".");
    }
  } else if (r.bytes > 0) {
    std::memcpy(r.user, r.staging.get() + sizeof(Header), r.bytes);
  }
}

// Waits for `r` under the stall inspector (a receive: its header checked
// before XLA gets the data).
void Complete(XlaComm& c, Op& op, Request& r, int* status3) {
  MPI_Status st[2];
  if (r.recv) {
    ReceiveFirst(c, op, r);
    WaitOrDie(c, op, 1, &r.reqs[1], st, "receiving");
  } else {
    WaitOrDie(c, op, r.n, r.reqs, st, "sending");
  }
  if (status3 != nullptr) {
    status3[0] = r.peer;
    status3[1] = r.tag;
    status3[2] = MPI_SUCCESS;
  }
}

// Completes the exchanges of one all-to-all together: every header is
// checked first, then every transfer is waited for at once.
void CompleteAll(XlaComm& c, Op& op,
                 std::vector<std::unique_ptr<Request>>& reqs) {
  std::vector<MPI_Request> all;
  for (auto& r : reqs) {
    if (r->recv) {
      ReceiveFirst(c, op, *r);
      all.push_back(r->reqs[1]);
    } else {
      all.insert(all.end(), r->reqs, r->reqs + r->n);
    }
  }
  std::vector<MPI_Status> st(all.size());
  WaitOrDie(c, op, static_cast<int>(all.size()), all.data(), st.data(),
            "exchanging");
  reqs.clear();
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

}  // namespace

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

// XLA's all-to-all: MPI_Sendrecv with rank + 1, rank + 2, ... in turn; the
// operation's guard spans them (it begins at the exchange with rank + 1).
int Sendrecv(XlaComm& c, const void* send, int send_count, int send_type,
             int dest, int send_tag, void* recv, int recv_count,
             int recv_type, int source, int recv_tag, int* status3) {
  if (!c.failed.empty()) return FailedOp(c);
  size_t send_bytes = static_cast<size_t>(send_count) * TypeOf(send_type).bytes;
  size_t recv_bytes = static_cast<size_t>(recv_count) * TypeOf(recv_type).bytes;
  using Exchanges = std::vector<std::unique_ptr<Request>>;
  if (!c.exchanges) c.exchanges = std::make_shared<Exchanges>();
  Exchanges& pending = *static_cast<Exchanges*>(c.exchanges.get());
  if (c.p2p == nullptr || c.sendrecvs == 0 || dest == (c.rank + 1) % c.size) {
    if (c.p2p != nullptr) {
      // An all-to-all that ended early: its exchanges finish first.
      if (!pending.empty()) CompleteAll(c, *static_cast<Op*>(c.p2p), pending);
      EndOp(c);
    }
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
    // XLA reads none of its all-to-all's buffers before the last exchange
    // returns, so the exchanges are only posted until then and proceed
    // together, not one after another (4 ranks on 2 cores, 256 KiB: 350
    // instead of 540-770 us per jitted call).
    pending.emplace_back(new Request);
    PostRecv(c, op, kAllToAll, recv, recv_bytes, source, recv_tag,
             pending.back().get());
    pending.emplace_back(new Request);
    PostSend(c, op, kAllToAll, send, send_bytes, dest, send_tag,
             pending.back().get());
    if (c.sendrecvs + 1 >= c.size - 1) CompleteAll(c, op, pending);
    if (status3 != nullptr) {
      status3[1] = recv_tag;
      status3[2] = MPI_SUCCESS;
    }
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

