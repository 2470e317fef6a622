// The XLA FFI handlers (CPU): one C symbol per mpijax operation, handed to
// jax.ffi.register_ffi_target by the module's registrations().
#ifndef MPIJAX_FFI_HANDLERS_H_
#define MPIJAX_FFI_HANDLERS_H_

#include "xla/ffi/api/c_api.h"

// Defined by XLA_FFI_DEFINE_HANDLER_SYMBOL in handlers.cc.
extern "C" {
XLA_FFI_Error* kAllreduce(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kAllreduceMany(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kDeviceAllreduce(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kAllgather(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kReduceScatter(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kAlltoall(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kBcast(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kReduce(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kPpermute(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kBarrier(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kGather(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kScatter(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kScan(XLA_FFI_CallFrame* call_frame);
// send, recv and sendrecv: one handler, three names so stall reports name the call.
XLA_FFI_Error* kP2p(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kJoin(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* kGate(XLA_FFI_CallFrame* call_frame);
}  // extern "C"

#endif  // MPIJAX_FFI_HANDLERS_H_
