// The XLA FFI handlers (CPU), listed once: MPIJAX_HANDLERS(X) calls
// X(symbol, target) for every FFI target name Python lowers to, with the C
// symbol that serves it (defined by XLA_FFI_DEFINE_HANDLER_SYMBOL beside its
// implementation, in its family's handlers_*.cc). The list declares the
// symbols below and makes the module's registrations() (module.cc), which
// mpijax/_src/ffi/__init__.py hands to jax.ffi.register_ffi_target.
//
// Adding a handler: its implementation and binding in a family file, one
// line here, and its lowering in mpijax/_src/ops/.
#ifndef MPIJAX_FFI_HANDLERS_H_
#define MPIJAX_FFI_HANDLERS_H_

#include "xla/ffi/api/c_api.h"

#define MPIJAX_HANDLERS(X)                                       \
  /* handlers_allreduce.cc */                                    \
  X(kAllreduce, "mpijax_allreduce")                              \
  X(kAllreduceMany, "mpijax_allreduce_many")                     \
  X(kDeviceAllreduce, "mpijax_device_allreduce")                 \
  X(kScan, "mpijax_scan")                                        \
  /* handlers_block.cc */                                        \
  X(kAllgather, "mpijax_allgather")                              \
  X(kAlltoall, "mpijax_alltoall")                                \
  X(kReduceScatter, "mpijax_reduce_scatter")                     \
  /* handlers_rooted.cc */                                       \
  X(kBcast, "mpijax_bcast")                                      \
  X(kReduce, "mpijax_reduce")                                    \
  X(kGather, "mpijax_gather")                                    \
  X(kScatter, "mpijax_scatter")                                  \
  /* handlers_p2p.cc; send, recv and sendrecv: one handler, */   \
  /* three names, so stall reports name the call */              \
  X(kPpermute, "mpijax_ppermute")                                \
  X(kP2p, "mpijax_send")                                         \
  X(kP2p, "mpijax_recv")                                         \
  X(kP2p, "mpijax_sendrecv")                                     \
  /* handlers_sync.cc */                                         \
  X(kBarrier, "mpijax_barrier")                                  \
  X(kJoin, "mpijax_join")                                        \
  X(kGate, "mpijax_gate")

extern "C" {
#define MPIJAX_DECLARE_HANDLER(symbol, target) \
  XLA_FFI_Error* symbol(XLA_FFI_CallFrame* call_frame);
MPIJAX_HANDLERS(MPIJAX_DECLARE_HANDLER)
#undef MPIJAX_DECLARE_HANDLER
}  // extern "C"

#endif  // MPIJAX_FFI_HANDLERS_H_
