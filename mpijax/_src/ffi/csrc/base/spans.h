// Buffers of one dtype seen as one vector, and each thread's scratch memory:
// what the ring and the cross-memory all-reduce work on. Depends on the C++
// library only.
#ifndef MPIJAX_FFI_SPANS_H_
#define MPIJAX_FFI_SPANS_H_

#include <algorithm>
#include <cstddef>
#include <vector>

namespace mpijax {

// Buffers of one dtype seen as one vector of `size()` elements, so that one
// ring covers all of them: its blocks may span several buffers, and the
// buckets of a fused gradient all-reduce need neither a packing copy nor a
// ring (2(P-1) steps) each. A buffer whose src is its dst is reduced in place.
class Spans {
 public:
  explicit Spans(size_t elem_bytes) : es_(elem_bytes) {}
  void Add(const char* src, char* dst, size_t n) {
    if (n == 0) return;
    bufs_.push_back({src, dst, n, total_});
    total_ += n;
    in_place_ = in_place_ || src == dst;
  }
  size_t size() const { return total_; }
  size_t elem_bytes() const { return es_; }
  bool any_in_place() const { return in_place_; }
  size_t buffers() const { return bufs_.size(); }
  // Calls f(buffer, at, count, index) for each piece of elements [lo, hi)
  // that lies in one buffer: the buffer's number, the piece's first element
  // in it and in the whole; stops when f returns false.
  template <typename F>
  void Pieces(size_t lo, size_t hi, F f) const {
    auto it = std::upper_bound(
        bufs_.begin(), bufs_.end(), lo,
        [](size_t v, const Buf& b) { return v < b.start; });
    for (--it; lo < hi && it != bufs_.end(); ++it) {
      size_t count = std::min(hi, it->start + it->n) - lo;
      if (!f(static_cast<size_t>(it - bufs_.begin()), lo - it->start, count,
             lo))
        return;
      lo += count;
    }
  }
  // Buffer i's input and output.
  const char* src(size_t i) const { return bufs_[i].src; }
  char* dst(size_t i) const { return bufs_[i].dst; }

 private:
  struct Buf { const char* src; char* dst; size_t n, start; };
  size_t es_;
  std::vector<Buf> bufs_;
  size_t total_ = 0;
  bool in_place_ = false;
};

// This thread's scratch of at least `bytes` (untouched until used: new[]
// of char does not initialize, so an idle reservation costs no memory).
// Valid until this thread's next call.
char* Scratch(size_t bytes);

}  // namespace mpijax

#endif  // MPIJAX_FFI_SPANS_H_
