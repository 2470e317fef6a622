// XLA's communicators with several devices per process. XLA's CPU runtime
// makes one communicator per (clique, rank): the devices of a collective's
// replica group, each device's rank its place in the group. Over MPI it asks
// for each with MPI_Comm_split(MPI_COMM_WORLD, color = the clique's first
// device id, key = rank), lazily, from whichever of its threads runs the
// device when it first needs it; the call does not say which device asks,
// and one (color, key) stands for several cliques. So mpijax reads every
// compiled program's cliques from its HLO (xla_cliques.py), prepares them
// collectively from Python (PrepareClique: one MPI communicator across the
// clique's processes, this process's members registered for the stall
// inspector) and has XLA create them in a program with one collective and
// disjoint cliques (the warm-up, during which Expect names them), where each
// (color, key) is one member. XLA keeps its communicators, so the user's
// programs find theirs made.
//
// Each member is an XlaComm (communicator.h) of rank = its rank in the clique
// and size = the clique's size; its operations (member_collectives.cc, p2p.cc) meet the other
// members of this process in a LocalGroup or Mailbox (process_local.h), and one
// thread per process crosses processes with MPI on the clique's
// communicator. Where every member shares one node and each process has the
// same number of them, an all-reduce makes every member a participant of
// node-local segments instead (node_local.h).
#ifndef MPIJAX_XLA_MEMBERS_H_
#define MPIJAX_XLA_MEMBERS_H_

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "node_local/node_local.h"
#include "xla_collectives/communicator.h"
#include "xla_collectives/process_local.h"

namespace mpijax::bridge {

struct XlaClique {
  // Per member (its rank in the clique): global device id, the rank of its
  // process in `comm`, its process's rank in the job, its local device index
  // there, and its place among its process's members.
  std::vector<int64_t> devices;
  std::vector<int> proc, world, local, slot;
  int n = 0;
  // Per process of the clique (ascending job rank): its members, ascending.
  std::vector<std::vector<int>> members_of;
  int me = -1;          // this process's rank in `comm`
  int slots_max = 1;    // the most members any process has
  bool uniform = true;  // every process has as many members
  MPI_Comm comm = MPI_COMM_NULL;   // the clique's processes
  MPI_Comm check = MPI_COMM_NULL;  // signature checks and mismatch reports
  int64_t key = 0, comm_id = -1;
  std::string name;  // "devices 0,1,2048,2049 on ranks 0-1"
  LocalGroup group;
  Mailbox mail;
  // Node-local segments with every member a participant: set up by the
  // first all-reduce (state 0 not tried, 1 mapped, -1 unavailable).
  std::unique_ptr<node_local::Comm> node;
  int node_state = 0;
  std::vector<char> staging;  // the round's work area (the worker only)
  // This process's members, by slot, as XLA holds them.
  std::vector<std::unique_ptr<XlaComm>> handles;
  std::vector<bool> taken;
  int freed = 0;
  // The stall report of a call: one per process, by the first member whose
  // wait times out (MemberReportsStall).
  std::mutex stall_mu;
  int64_t stall_call = -1;
  int stall_slot = -1;
};

// Makes the XLA world communicator known (the bridge's table, made once).
void SetMembersWorld(MPI_Comm world, double timeout_s);

// Prepares the clique of `devices` (global ids, rank order) whose members'
// processes are `world` (job ranks) with local device indices `local`.
// Collective over the clique's processes (a no-op elsewhere); once per
// clique. Returns its id, or -1 where this process has no member.
int64_t PrepareClique(const std::vector<int64_t>& devices,
                      const std::vector<int>& world,
                      const std::vector<int>& local);
// The cliques XLA is about to create (the warm-up's); empty: none.
void ExpectCliques(const std::vector<int64_t>& ids);
// From now on XLA's splits are answered with prepared members (this process
// has `local_devices` devices).
void EnableMembers(int local_devices);
bool MembersEnabled();

// XLA's MPI_Comm_split(world, color, key) as a prepared member: the member
// of rank `key` of the expected clique whose first device is `color` (else
// of the only untaken prepared clique that fits), or a communicator that
// fails every operation with the reason.
XlaComm* TakeMember(int color, int key);

// XLA freed `c` (a member).
int FreeMember(XlaComm* c);

// Whether member `c` reports its stall: the members of a process wait in the
// same call, so the first whose wait times out reports for all of them.
bool MemberReportsStall(XlaComm& c);

}  // namespace mpijax::bridge

#endif  // MPIJAX_XLA_MEMBERS_H_
