#include "core/inspector.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include "core/settings.h"

namespace mpijax::detail {

std::atomic<bool> g_watchdog_running{false};

namespace {

constexpr int kQueryTag = 7001;
constexpr int kReplyTagBase = 7002;  // + (query sequence % 20000)
constexpr double kReplyWaitS = 2.0;

std::mutex g_insp_mu;                  // start / stop
std::atomic<MPI_Comm> g_insp_comm{MPI_COMM_NULL};
std::thread* g_responder = nullptr;    // joined by StopInspector
std::atomic<bool> g_responder_stop{false};
std::thread* g_watchdog = nullptr;     // joined by StopInspector
std::atomic<int64_t> g_query_seq{0};

std::string Seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f", s);
  return buf;
}

void ResponderLoop(MPI_Comm comm) {
  struct Pending {
    MPI_Request req;
    std::unique_ptr<std::string> text;
  };
  std::vector<Pending> pending;
  while (!g_responder_stop.load(std::memory_order_relaxed)) {
    for (size_t i = 0; i < pending.size();) {
      int done = 0;
      MPI_Test(&pending[i].req, &done, MPI_STATUS_IGNORE);
      if (done) {
        pending[i] = std::move(pending.back());
        pending.pop_back();
      } else {
        ++i;
      }
    }
    int flag = 0;
    MPI_Status st;
    if (MPI_Iprobe(MPI_ANY_SOURCE, kQueryTag, comm, &flag, &st) != MPI_SUCCESS)
      break;
    if (!flag) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    int64_t q[3];  // key, device, reply tag
    MPI_Recv(q, 3, MPI_INT64_T, st.MPI_SOURCE, kQueryTag, comm,
             MPI_STATUS_IGNORE);
    Pending p{MPI_REQUEST_NULL,
              std::make_unique<std::string>(DescribeStatus(q[0], q[1]))};
    MPI_Isend(p.text->data(), static_cast<int>(p.text->size()), MPI_CHAR,
              st.MPI_SOURCE, static_cast<int>(q[2]), comm, &p.req);
    pending.push_back(std::move(p));
  }
  for (auto& p : pending) {  // an asker that died: drop, leak the text
    MPI_Cancel(&p.req);
    MPI_Request_free(&p.req);
    p.text.release();
  }
}

// The watchdog thread guards blocking MPI calls (large messages): a thread
// inside one cannot poll its own deadline, so this thread looks at every
// (communicator, device) status a few times per second and, once a blocking
// call has run past MPIJAX_TIMEOUT, reports the stall like WaitAll does (the
// responder threads of the other ranks answer) and aborts the job, or with
// MPIJAX_STALL_ACTION=warn reports again every timeout. It replaces an
// MPI_Ibarrier round trip before every large call.
void WatchdogLoop() {
  struct Seen {
    int64_t since;    // the blocking call being watched
    int64_t next_ns;  // when to report (again)
  };
  std::vector<std::pair<DevComm*, Seen>> seen;
  while (!g_responder_stop.load(std::memory_order_relaxed)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    double timeout = g_settings.timeout_s.load(std::memory_order_relaxed);
    if (timeout <= 0) continue;
    int64_t period = static_cast<int64_t>(timeout * 1e9);
    int64_t now = NowNs();
    struct Due {
      DevComm* dc;
      int64_t device;
      int64_t since;
    };
    std::vector<Due> due;
    {
      std::lock_guard<std::mutex> lock(g_comms_mu);
      for (auto& e : g_comms) {
        for (size_t d = 0; d < e.devs.size(); ++d) {
          DevComm* dc = e.devs[d].get();
          int64_t since =
              dc->status.blocking_since_ns.load(std::memory_order_relaxed);
          if (since != 0 && now - since > period)
            due.push_back({dc, static_cast<int64_t>(d), since});
        }
      }
    }
    for (const Due& u : due) {
      auto it = std::find_if(seen.begin(), seen.end(),
                             [&](const auto& p) { return p.first == u.dc; });
      if (it == seen.end()) {
        seen.push_back({u.dc, {0, 0}});
        it = seen.end() - 1;
      }
      if (it->second.since != u.since) it->second = {u.since, u.since + period};
      if (now < it->second.next_ns) continue;
      it->second.next_ns += period;
      CallInfo info{"collective", ffi::DataType::INVALID,
                    ffi::Span<const int64_t>(nullptr, 0), CommSize(u.dc->comm),
                    u.dc->key, u.device};
      info.dc = u.dc;
      info.site = u.dc->status.site.load(std::memory_order_relaxed);
      ReportStall(info, (now - u.since) * 1e-9);
    }
  }
}

}  // namespace

bool StartInspector(MPI_Comm comm) {
  std::lock_guard<std::mutex> lock(g_insp_mu);
  if (g_responder != nullptr) return false;
  int level = 0;
  MPI_Query_thread(&level);
  if (level < MPI_THREAD_MULTIPLE) return false;
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  g_insp_comm = comm;
  g_responder_stop = false;
  g_responder = new std::thread(ResponderLoop, comm);
  g_watchdog = new std::thread(WatchdogLoop);
  g_watchdog_running = true;
  return true;
}

void StopInspector() {
  std::lock_guard<std::mutex> lock(g_insp_mu);
  g_responder_stop = true;
  g_watchdog_running = false;  // from now on large calls check arrival first
  if (g_watchdog != nullptr) {
    g_watchdog->join();
    delete g_watchdog;
    g_watchdog = nullptr;
  }
  if (g_responder != nullptr) {
    g_responder->join();
    delete g_responder;
    g_responder = nullptr;
  }
  g_insp_comm = MPI_COMM_NULL;
}

namespace {

// "communicator 3" or the label of one of XLA's communicators.
std::string CommName(const DevComm& dc) {
  return dc.label.empty() ? "communicator " + std::to_string(dc.key) : dc.label;
}

// What this process does apart from (key, device): the collectives it is
// in on other communicators; else, if it made a call on another one after
// `since_ns` (its last on this one; 0: none), since when it has been outside
// any. Empty when there is nothing to add.
std::string Elsewhere(int64_t key, int64_t device, int64_t since_ns) {
  std::vector<std::string> busy;
  int64_t last_exit = 0;
  int64_t now = NowNs();
  {
    std::lock_guard<std::mutex> lock(g_comms_mu);
    for (auto& e : g_comms) {
      for (size_t d = 0; d < e.devs.size(); ++d) {
        const DevComm& dc = *e.devs[d];
        if (dc.key == key && static_cast<int64_t>(d) == device) continue;
        const Status& st = dc.status;
        if (st.calls.load(std::memory_order_relaxed) == 0) continue;
        int64_t since = st.since_ns.load(std::memory_order_relaxed);
        if (st.phase.load(std::memory_order_relaxed) != 0) {
          busy.push_back(
              "in " + SiteText(st.site.load(std::memory_order_relaxed)) +
              " on " + CommName(dc) +
              (e.devs.size() > 1 ? " (local device " + std::to_string(d) + ")"
                                 : "") +
              " since " + Seconds((now - since) * 1e-9) + " s");
        } else {
          last_exit = std::max(last_exit, since);
        }
      }
    }
  }
  if (!busy.empty()) {
    std::string s = "now ";
    for (size_t i = 0; i < busy.size() && i < 3; ++i)
      s += (i ? "; and " : "") + busy[i];
    return s;
  }
  // 50 ms: the same moment, as far as a report about seconds goes.
  if (last_exit > since_ns + 50'000'000)
    return "outside any collective since " +
           Seconds((now - last_exit) * 1e-9) + " s";
  if (since_ns == 0)
    return last_exit == 0 ? "outside any collective (none made yet)"
                          : "outside any collective since " +
                                Seconds((now - last_exit) * 1e-9) + " s";
  return "";
}

}  // namespace

std::mutex g_place_mu;
std::function<std::string()> g_place;

namespace {
std::mutex g_activity_mu;
int g_activity = kActivityNone;
std::string g_activity_text;
int64_t g_activity_since = 0;
}  // namespace

void SetActivity(int kind, std::string text) {
  std::lock_guard<std::mutex> lock(g_activity_mu);
  if (kind != g_activity || text != g_activity_text) g_activity_since = NowNs();
  g_activity = kind;
  g_activity_text = std::move(text);
}

namespace {

// (kind, "; compiling jit_step for 3.2 s") of what SetActivity last said.
std::pair<int, std::string> Activity() {
  std::lock_guard<std::mutex> lock(g_activity_mu);
  if (g_activity == kActivityNone) return {kActivityNone, ""};
  return {g_activity, "; " + g_activity_text + " for " +
                          Seconds((NowNs() - g_activity_since) * 1e-9) + " s"};
}

}  // namespace

void SetPythonPlace(std::function<std::string()> place) {
  std::lock_guard<std::mutex> lock(g_place_mu);
  g_place = std::move(place);
}

namespace {

// "; Python: ..." or "".
std::string PythonPlace() {
  std::function<std::string()> place;
  {
    std::lock_guard<std::mutex> lock(g_place_mu);
    place = g_place;
  }
  std::string where = place ? place() : "";
  return where.empty() ? "" : "; Python: " + where;
}

}  // namespace

std::string DescribeStatus(int64_t key, int64_t device) {
  auto [activity, doing] = Activity();
  DevComm* dc = FindDev(key, device);
  if (dc == nullptr) {
    return "0 0 " + std::to_string(activity) +
           " has not used this communicator yet; " + Elsewhere(key, device, 0) +
           doing + PythonPlace();
  }
  const Status& st = dc->status;
  int64_t calls = st.calls.load(std::memory_order_relaxed);
  int phase = st.phase.load(std::memory_order_relaxed);
  int64_t site = st.site.load(std::memory_order_relaxed);
  int64_t since = st.since_ns.load(std::memory_order_relaxed);
  double secs = (NowNs() - since) * 1e-9;
  std::ostringstream s;
  s << calls << " " << phase << " " << activity << " ";
  if (calls == 0) {
    s << "idle, no call on this communicator yet; " << Elsewhere(key, device, 0)
      << doing << PythonPlace();
  } else if (phase == 0) {
    s << "idle since " << Seconds(secs) << " s; last: " << SiteText(site)
      << ", call #" << calls;
    std::string more = Elsewhere(key, device, since);
    if (!more.empty()) s << "; " << more;
    s << doing << PythonPlace();
  } else {
    s << "in call #" << calls << " since " << Seconds(secs) << " s: "
      << (phase == 1 ? "signature check before " : "") << SiteText(site);
  }
  return s.str();
}

void ReportStall(const CallInfo& info, double waited) {
  DevComm* dc = info.dc;
  MPI_Comm insp = g_insp_comm.load();
  int my_insp_rank = insp == MPI_COMM_NULL ? -1 : CommRank(insp);
  const Status& st = dc->status;
  int64_t my_calls = st.calls.load(std::memory_order_relaxed);
  int my_phase = st.phase.load(std::memory_order_relaxed);
  int n = CommSize(dc->comm), me = CommRank(dc->comm);
  // A late rank that compiles (or waits for another's compile) will come.
  bool compiling = false;
  std::ostringstream s;
  s << "rank " << (insp == MPI_COMM_NULL ? me : my_insp_rank)
    << " waited " << Seconds(waited) << " s in "
    << (my_phase == 1 ? "the signature check before " : "")
    << SiteText(info.site) << " (call #" << my_calls << " on "
    << CommName(*dc);
  if (info.device != 0) s << ", local device " << info.device;
  s << ").";
  if (insp == MPI_COMM_NULL) {
    s << " (The stall inspector is off: mpijax.init() did not start it, so "
         "the other ranks cannot be asked.)";
  } else {
    // Whom to ask: this device index on every other rank of the
    // communicator, or a member's peers (several devices per process).
    struct Target {
      int world;
      int64_t device;
      std::string who;
    };
    std::vector<Target> targets;
    if (!dc->peers.empty()) {
      for (const auto& [w, d] : dc->peers)
        targets.push_back({w, d, "rank " + std::to_string(w) +
                                     " local device " + std::to_string(d)});
    } else {
      std::vector<int> ranks(n), world(n);
      for (int i = 0; i < n; ++i) ranks[i] = i;
      MPI_Group g, wg;
      MPI_Comm_group(dc->comm, &g);
      MPI_Comm_group(insp, &wg);
      MPI_Group_translate_ranks(g, n, ranks.data(), wg, world.data());
      MPI_Group_free(&g);
      MPI_Group_free(&wg);
      for (int r = 0; r < n; ++r) {
        if (r == me || world[r] == MPI_UNDEFINED) continue;
        targets.push_back({world[r], info.device,
                           "rank " + std::to_string(world[r])});
      }
    }
    size_t t_n = targets.size();
    int tag = kReplyTagBase + static_cast<int>(g_query_seq++ % 20000);
    // Queries outlive this call if a peer never receives them: leaked.
    auto* queries = new std::vector<int64_t>(3 * t_n);
    std::vector<MPI_Request> sends;
    std::vector<std::string> answer(t_n);
    std::vector<bool> got(t_n, false);
    for (size_t i = 0; i < t_n; ++i) {
      if (targets[i].world == my_insp_rank) {  // a member of this process
        answer[i] = DescribeStatus(dc->key, targets[i].device);
        got[i] = true;
        continue;
      }
      int64_t* q = queries->data() + 3 * i;
      q[0] = dc->key; q[1] = targets[i].device; q[2] = tag;
      MPI_Request req;
      MPI_Isend(q, 3, MPI_INT64_T, targets[i].world, kQueryTag, insp, &req);
      sends.push_back(req);
    }
    auto until = Clock::now() + std::chrono::milliseconds(
                                    static_cast<int>(kReplyWaitS * 1000));
    // Answers from one rank come in the order asked (one tag, one source).
    int missing = 0;
    for (size_t i = 0; i < t_n; ++i) missing += !got[i];
    while (missing > 0 && Clock::now() < until) {
      bool any = false;
      for (size_t i = 0; i < t_n; ++i) {
        if (got[i]) continue;
        bool first = true;  // the first unanswered query to that rank
        for (size_t j = 0; j < i; ++j)
          first &= got[j] || targets[j].world != targets[i].world;
        if (!first) continue;
        int flag = 0;
        MPI_Status rs;
        MPI_Iprobe(targets[i].world, tag, insp, &flag, &rs);
        if (!flag) continue;
        int len = 0;
        MPI_Get_count(&rs, MPI_CHAR, &len);
        answer[i].resize(len);
        MPI_Recv(answer[i].data(), len, MPI_CHAR, targets[i].world, tag, insp,
                 MPI_STATUS_IGNORE);
        got[i] = true;
        --missing;
        any = true;
      }
      if (!any) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    bool all_sent = true;
    for (auto& req : sends) {
      int done = 0;
      MPI_Test(&req, &done, MPI_STATUS_IGNORE);
      if (!done) { all_sent = false; MPI_Request_free(&req); }
    }
    if (all_sent) delete queries;
    std::vector<std::string> late, arrived;
    for (size_t i = 0; i < t_n; ++i) {
      const std::string& who = targets[i].who;
      if (!got[i]) {
        late.push_back(who + " (no answer within " + Seconds(kReplyWaitS) +
                       " s: the process died, is exiting, or is stuck "
                       "outside mpijax)");
        continue;
      }
      long long calls = 0;
      int phase = 0, activity = 0, used = 0;
      std::sscanf(answer[i].c_str(), "%lld %d %d %n", &calls, &phase, &activity,
                  &used);
      if (calls == my_calls && phase == my_phase) {
        arrived.push_back(who);
      } else {
        late.push_back(who + " (" + answer[i].substr(used) + ")");
        compiling |= activity != kActivityNone;
      }
    }
    if (late.empty()) {
      s << " Every rank has arrived; the network may be stuck.";
    } else {
      s << " Not arrived: ";
      for (size_t i = 0; i < late.size(); ++i) s << (i ? ", " : "") << late[i];
      s << ".";
    }
    if (!arrived.empty()) {
      s << " Waiting in the same call: ";
      if (dc->peers.empty()) {
        // "ranks 1,2": the numbers without their "rank ".
        s << "rank" << (arrived.size() > 1 ? "s " : " ");
        for (size_t i = 0; i < arrived.size(); ++i)
          s << (i ? "," : "") << arrived[i].substr(5);
      } else {
        for (size_t i = 0; i < arrived.size(); ++i)
          s << (i ? ", " : "") << arrived[i];
      }
      s << ".";
    }
  }
  std::string text;
  if (compiling) {
    // Not a stall: said once per MPIJAX_TIMEOUT while it lasts, never fatal.
    text = "mpijax: waiting for a compile: " + s.str() +
           " It keeps waiting: a rank that compiles a program, or waits for "
           "another rank's compile, arrives when the compile ends.\n";
  } else {
    s << " Every rank must call the same collectives in the same order "
         "(MPIJAX_TIMEOUT=" << g_settings.timeout_s.load()
      << " s; MPIJAX_STALL_ACTION="
      << (g_settings.stall_abort.load() ? "abort" : "warn") << ").\n";
    text = "mpijax: stall: " + s.str();
  }
  std::fwrite(text.data(), 1, text.size(), stderr);
  std::fflush(stderr);
  if (g_settings.stall_abort.load() && !compiling) {
    // Give the launcher's output forwarding time to pass the report on.
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
}

}  // namespace mpijax::detail
