#include "core/reduce_ops.h"

#include <cmath>
#include <mutex>
#include <string>

#include "base/half.h"

namespace mpijax::detail {
namespace {

std::once_flag g_types_once;
MPI_Datatype g_half_type = MPI_DATATYPE_NULL;  // 2 opaque bytes (f16, bf16)
MPI_Op g_f16_ops[4];                           // sum, prod, min, max
MPI_Op g_bf16_ops[4];
// 8- and 16-bit integer sums that wrap around like XLA's: Open MPI's AVX
// kernels (op/avx, on by default on x86) add these with saturating
// instructions (open-mpi/ompi#8045, 'wontfix'): int8 100 + 100 came back 127
// from 64 elements on, where jax.lax gives -56. Signed and unsigned share
// the op: two's-complement addition is the same bits.
MPI_Op g_wrap_sum8 = MPI_OP_NULL, g_wrap_sum16 = MPI_OP_NULL;

const char* kOpNames[] = {"sum", "prod", "min", "max", "and", "or", "xor"};

// float16 / bfloat16 reductions: widen to float per element, round back.
template <float (*ToF)(uint16_t), uint16_t (*FromF)(float), int kOp>
void HalfOp(void* in, void* inout, int* len, MPI_Datatype*) {
  const uint16_t* a = static_cast<const uint16_t*>(in);
  uint16_t* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) {
    float x = ToF(a[i]), y = ToF(b[i]), r;
    if constexpr (kOp == kSum) r = x + y;
    else if constexpr (kOp == kProd) r = x * y;
    // NaN propagates like MPI_MIN/MAX on floats in practice (x != x).
    else if constexpr (kOp == kMin) r = (x != x || x < y) ? x : y;
    else r = (x != x || x > y) ? x : y;
    b[i] = FromF(r);
  }
}

template <typename U>
void WrapSumOp(void* in, void* inout, int* len, MPI_Datatype*) {
  const U* a = static_cast<const U*>(in);
  U* b = static_cast<U*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = static_cast<U>(a[i] + b[i]);
}

// Run right after each chunk's MPI call, so a chunk that fits in cache is
// divided there. (Inside a training step XLA's own division is cheaper
// still: it fuses into the optimizer's update, which is why mpijax.train
// uses it.)
template <typename T>
void DivideAll(T* p, size_t count, T d) {
  // x * (1/d) rounds exactly like x / d when d is a power of two (1/d is then
  // exact), and a multiply is several times cheaper than a divide.
  if (std::ilogb(d) >= 0 && std::scalbn(T(1), std::ilogb(d)) == d) {
    T r = T(1) / d;
    for (size_t i = 0; i < count; ++i) p[i] *= r;
  } else {
    for (size_t i = 0; i < count; ++i) p[i] /= d;
  }
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void DivideHalf(uint16_t* p, size_t count, float d) {
  for (size_t i = 0; i < count; ++i) p[i] = FromF(ToF(p[i]) / d);
}

}  // namespace

const char* DtypeName(ffi::DataType t) {
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
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::C64: return "complex64";
    case ffi::DataType::C128: return "complex128";
    default: return "unsupported";
  }
}

void InitTypesOnce() {
  std::call_once(g_types_once, [] {
    MPI_Type_contiguous(2, MPI_BYTE, &g_half_type);
    MPI_Type_commit(&g_half_type);
    MPI_Op_create(&HalfOp<F16ToFloat, FloatToF16, kSum>, 1, &g_f16_ops[0]);
    MPI_Op_create(&HalfOp<F16ToFloat, FloatToF16, kProd>, 1, &g_f16_ops[1]);
    MPI_Op_create(&HalfOp<F16ToFloat, FloatToF16, kMin>, 1, &g_f16_ops[2]);
    MPI_Op_create(&HalfOp<F16ToFloat, FloatToF16, kMax>, 1, &g_f16_ops[3]);
    MPI_Op_create(&HalfOp<Bf16ToFloat, FloatToBf16, kSum>, 1, &g_bf16_ops[0]);
    MPI_Op_create(&HalfOp<Bf16ToFloat, FloatToBf16, kProd>, 1, &g_bf16_ops[1]);
    MPI_Op_create(&HalfOp<Bf16ToFloat, FloatToBf16, kMin>, 1, &g_bf16_ops[2]);
    MPI_Op_create(&HalfOp<Bf16ToFloat, FloatToBf16, kMax>, 1, &g_bf16_ops[3]);
    MPI_Op_create(&WrapSumOp<uint8_t>, 1, &g_wrap_sum8);
    MPI_Op_create(&WrapSumOp<uint16_t>, 1, &g_wrap_sum16);
  });
}

ffi::Error ReductionTypes(ffi::DataType t, int64_t op, MPI_Datatype* dt,
                          MPI_Op* mop) {
  if (op < kSum || op > kXor) {
    return ffi::Error::InvalidArgument("mpijax: unknown reduction op code " +
                                       std::to_string(op));
  }
  bool is_float = false, is_complex = false, is_half = false;
  switch (t) {
    case ffi::DataType::PRED: *dt = MPI_UINT8_T; break;
    case ffi::DataType::S8: *dt = MPI_INT8_T; break;
    case ffi::DataType::S16: *dt = MPI_INT16_T; break;
    case ffi::DataType::S32: *dt = MPI_INT32_T; break;
    case ffi::DataType::S64: *dt = MPI_INT64_T; break;
    case ffi::DataType::U8: *dt = MPI_UINT8_T; break;
    case ffi::DataType::U16: *dt = MPI_UINT16_T; break;
    case ffi::DataType::U32: *dt = MPI_UINT32_T; break;
    case ffi::DataType::U64: *dt = MPI_UINT64_T; break;
    case ffi::DataType::F32: *dt = MPI_FLOAT; is_float = true; break;
    case ffi::DataType::F64: *dt = MPI_DOUBLE; is_float = true; break;
    case ffi::DataType::C64: *dt = MPI_C_FLOAT_COMPLEX; is_complex = true; break;
    case ffi::DataType::C128: *dt = MPI_C_DOUBLE_COMPLEX; is_complex = true; break;
    case ffi::DataType::F16:
    case ffi::DataType::BF16: *dt = g_half_type; is_half = true; break;
    default:
      return ffi::Error::InvalidArgument(
          std::string("mpijax: unsupported dtype for a reduction: ") +
          DtypeName(t));
  }
  bool bad = ((is_float || is_complex || is_half) && op >= kAnd) ||
             (is_complex && (op == kMin || op == kMax)) ||
             (t == ffi::DataType::PRED && (op == kSum || op == kProd));
  if (bad) {
    return ffi::Error::InvalidArgument(std::string("mpijax: op '") +
                                       kOpNames[op] + "' is not defined for " +
                                       DtypeName(t));
  }
  if (is_half) {
    *mop = (t == ffi::DataType::F16 ? g_f16_ops : g_bf16_ops)[op];
    return ffi::Error::Success();
  }
  static const MPI_Op kOps[] = {MPI_SUM, MPI_PROD, MPI_MIN, MPI_MAX,
                                MPI_BAND, MPI_BOR, MPI_BXOR};
  *mop = kOps[op];
  if (op == kSum && (t == ffi::DataType::S8 || t == ffi::DataType::U8))
    *mop = g_wrap_sum8;
  if (op == kSum && (t == ffi::DataType::S16 || t == ffi::DataType::U16))
    *mop = g_wrap_sum16;
  return ffi::Error::Success();
}

ffi::Error DivideInPlace(ffi::DataType t, void* p, size_t count,
                         int64_t divisor) {
  switch (t) {
    case ffi::DataType::F32:
      DivideAll(static_cast<float*>(p), count, static_cast<float>(divisor));
      break;
    case ffi::DataType::F64:
      DivideAll(static_cast<double*>(p), count, static_cast<double>(divisor));
      break;
    case ffi::DataType::C64:  // (a + bi) / d, component-wise
      DivideAll(static_cast<float*>(p), 2 * count, static_cast<float>(divisor));
      break;
    case ffi::DataType::C128:
      DivideAll(static_cast<double*>(p), 2 * count,
                static_cast<double>(divisor));
      break;
    case ffi::DataType::F16:
      DivideHalf<F16ToFloat, FloatToF16>(static_cast<uint16_t*>(p), count,
                                         static_cast<float>(divisor));
      break;
    case ffi::DataType::BF16:
      DivideHalf<Bf16ToFloat, FloatToBf16>(static_cast<uint16_t*>(p), count,
                                           static_cast<float>(divisor));
      break;
    default:
      return ffi::Error::InvalidArgument(
          std::string("mpijax: a mean needs a floating dtype, got ") +
          DtypeName(t));
  }
  return ffi::Error::Success();
}

}  // namespace mpijax::detail
