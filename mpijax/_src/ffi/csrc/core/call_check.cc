#include "core/call_check.h"

#include <algorithm>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "core/settings.h"
#include "core/wait.h"

namespace mpijax::detail {

CheckExchange SameSignatures(MPI_Comm check, const CallInfo& info, int64_t lo,
                             int64_t hi, bool* same) {
  CheckExchange x;
  Status& status = info.dc->status;
  status.phase.store(1, std::memory_order_relaxed);
  int64_t buf[2] = {hi, -lo};
  MPI_Request req;
  x.rc = MPI_Iallreduce(MPI_IN_PLACE, buf, 2, MPI_INT64_T, MPI_MAX, check,
                        &req);
  if (x.rc != MPI_SUCCESS) {
    x.call = "MPI_Iallreduce";
    return x;
  }
  x.wait = Wait(&req, info);
  if (x.wait.failure()) return x;
  status.phase.store(2, std::memory_order_relaxed);
  *same = buf[0] == -buf[1];
  return x;
}

CheckExchange GatherCalls(MPI_Comm check, const CallInfo& info,
                          const std::vector<int>& counts,
                          const std::vector<int64_t>& my_sigs,
                          const std::vector<std::string>& my_texts,
                          std::vector<int64_t>* sigs,
                          std::vector<std::string>* texts) {
  CheckExchange x;
  int n = counts.empty() ? CommSize(check) : static_cast<int>(counts.size());
  std::vector<int64_t> head;  // per call: signature, text length
  std::string blob;
  for (size_t i = 0; i < my_sigs.size(); ++i) {
    head.push_back(my_sigs[i]);
    head.push_back(static_cast<int64_t>(my_texts[i].size()));
    blob += my_texts[i];
  }
  std::vector<int> hcount(n), hdispl(n), bcount(n), bdispl(n);
  int total = 0;
  for (int r = 0; r < n; ++r) {
    hcount[r] = 2 * (counts.empty() ? 1 : counts[r]);
    hdispl[r] = total;
    total += hcount[r];
  }
  std::vector<int64_t> heads = head;
  std::string blobs = blob;
  MPI_Request req;
  auto wait = [&](int rc, const char* call) {
    x.rc = rc;
    if (rc != MPI_SUCCESS) {
      x.call = call;
      return false;
    }
    x.wait = Wait(&req, info);
    return x.wait.success();
  };
  if (n > 1) {
    heads.assign(total, 0);
    bool done = counts.empty()
        ? wait(MPI_Iallgather(head.data(), 2, MPI_INT64_T, heads.data(), 2,
                              MPI_INT64_T, check, &req),
               "MPI_Iallgather")
        : wait(MPI_Iallgatherv(head.data(), static_cast<int>(head.size()),
                               MPI_INT64_T, heads.data(), hcount.data(),
                               hdispl.data(), MPI_INT64_T, check, &req),
               "MPI_Iallgatherv");
    if (!done) return x;
  }
  total = 0;
  for (int r = 0; r < n; ++r) {
    bcount[r] = 0;
    for (int j = 0; j < hcount[r] / 2; ++j)
      bcount[r] += static_cast<int>(heads[hdispl[r] + 2 * j + 1]);
    bdispl[r] = total;
    total += bcount[r];
  }
  if (n > 1) {
    blobs.assign(std::max(total, 1), '\0');
    if (!wait(MPI_Iallgatherv(blob.data(), static_cast<int>(blob.size()),
                              MPI_CHAR, blobs.data(), bcount.data(),
                              bdispl.data(), MPI_CHAR, check, &req),
              "MPI_Iallgatherv"))
      return x;
  }
  sigs->clear();
  texts->clear();
  for (int r = 0; r < n; ++r) {
    size_t at = static_cast<size_t>(bdispl[r]);
    for (int j = 0; j < hcount[r] / 2; ++j) {
      sigs->push_back(heads[hdispl[r] + 2 * j]);
      size_t len = static_cast<size_t>(heads[hdispl[r] + 2 * j + 1]);
      texts->push_back(blobs.substr(at, len));
      at += len;
    }
  }
  return x;
}

ffi::Error MismatchError(const CallInfo& info, int64_t sig) {
  DevComm* dc = info.dc;
  std::vector<int64_t> sigs;
  std::vector<std::string> texts;
  CheckExchange x = GatherCalls(dc->check, info, {}, {sig},
                                {SiteText(info.site)}, &sigs, &texts);
  if (x.rc != MPI_SUCCESS) return MpiError(x.rc, x.call, info);
  if (x.wait.failure()) return x.wait;
  int n = static_cast<int>(sigs.size());
  auto members = GroupBySignature(n, [&](int r) { return sigs[r]; });
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
    s << (m.size() > 1 ? " run " : " runs ") << texts[first];
    char hex[32];
    std::snprintf(hex, sizeof(hex), "%016llx",
                  static_cast<unsigned long long>(sigs[first]));
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
    bool same = true;
    CheckExchange x = SameSignatures(dc->check, info, sig, sig, &same);
    if (x.rc != MPI_SUCCESS) return MpiError(x.rc, x.call, info);
    if (x.wait.failure()) return x.wait;
    if (!same) return MismatchError(info, sig);
  }
  if (site != nullptr && bit != 0) site->checked->fetch_or(bit);
  return ffi::Error::Success();
}

}  // namespace mpijax::detail
