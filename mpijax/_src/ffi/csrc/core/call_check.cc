#include "core/call_check.h"

#include <algorithm>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "core/settings.h"
#include "core/wait.h"

namespace mpijax::detail {

ffi::Error MismatchError(const CallInfo& info, int64_t sig) {
  DevComm* dc = info.dc;
  int n = CommSize(dc->check);
  std::string text = SiteText(info.site);
  int64_t mine[2] = {sig, static_cast<int64_t>(text.size())};
  std::vector<int64_t> all(2 * n);
  MPI_Request req;
  MPIJAX_CHECK_MPI(MPI_Iallgather(mine, 2, MPI_INT64_T, all.data(), 2,
                                  MPI_INT64_T, dc->check, &req), info);
  if (auto e = Wait(&req, info); e.failure()) return e;
  std::vector<int> counts(n), displs(n);
  int total = 0;
  for (int r = 0; r < n; ++r) {
    counts[r] = static_cast<int>(all[2 * r + 1]);
    displs[r] = total;
    total += counts[r];
  }
  std::string texts(std::max(total, 1), '\0');
  MPIJAX_CHECK_MPI(MPI_Iallgatherv(text.data(), static_cast<int>(text.size()),
                                   MPI_CHAR, texts.data(), counts.data(),
                                   displs.data(), MPI_CHAR, dc->check, &req),
                   info);
  if (auto e = Wait(&req, info); e.failure()) return e;
  auto members = GroupBySignature(n, [&](int r) { return all[2 * r]; });
  std::ostringstream s;
  s << "mpijax: collective mismatch on "
    << (dc->label.empty() ? "communicator " + std::to_string(dc->key)
                          : dc->label)
    << " (call #" << dc->status.calls.load(std::memory_order_relaxed)
    << "): ";
  for (size_t g = 0; g < members.size(); ++g) {
    const auto& m = members[g];
    int first = m[0];
    if (g) s << (g + 1 == members.size() ? " but " : ", ");
    s << (m.size() > 1 ? "ranks " : "rank ");
    for (size_t i = 0; i < m.size(); ++i) s << (i ? "," : "") << m[i];
    s << (m.size() > 1 ? " run " : " runs ")
      << texts.substr(displs[first], counts[first]);
    char hex[32];
    std::snprintf(hex, sizeof(hex), "%016llx",
                  static_cast<unsigned long long>(all[2 * first]));
    s << " [signature " << hex << "]";
  }
  s << ". Every rank must call the same collectives in the same order with "
       "the same shapes and dtypes.";
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition, s.str());
}

ffi::Error CheckSignature(const CallInfo& info, int64_t sig) {
  DevComm* dc = info.dc;
  Site* site = GetSite(info.site);
  uint64_t bit = info.device >= 0 && info.device < 64
                     ? (uint64_t{1} << info.device) : 0;
  bool every = g_settings.check_every.load(std::memory_order_relaxed);
  if (!every && site != nullptr && bit != 0 &&
      (site->checked->load(std::memory_order_relaxed) & bit)) {
    return ffi::Error::Success();
  }
  if (info.comm_size > 1) {
    dc->status.phase.store(1, std::memory_order_relaxed);
    int64_t buf[2] = {sig, -sig};  // sig < 2^63: -sig never overflows
    MPI_Request req;
    MPIJAX_CHECK_MPI(MPI_Iallreduce(MPI_IN_PLACE, buf, 2, MPI_INT64_T, MPI_MAX,
                                    dc->check, &req), info);
    if (auto e = Wait(&req, info); e.failure()) return e;
    dc->status.phase.store(2, std::memory_order_relaxed);
    if (buf[0] != -buf[1]) return MismatchError(info, sig);
  }
  if (site != nullptr && bit != 0) site->checked->fetch_or(bit);
  return ffi::Error::Success();
}

}  // namespace mpijax::detail
