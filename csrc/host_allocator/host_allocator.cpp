// offloadd's caching CPU allocator: warm pages without a fragmented heap.
//
// Note [host cache]
// ~~~~~~~~~~~~~~~~~
// With offloading on, a CPU training step allocates an activation, writes it out, frees it, and
// allocates the next one. glibc serves those from its heap once its dynamic mmap threshold has
// risen, and the heap fragments: several times what it holds stays resident. Handing the pages
// back instead (a fixed mmap threshold, malloc_trim) makes every activation fault its pages in
// and zero them again, a large share of the step. Both figures are in
// docs/benchmarks/fastpath_allocator_cpu-2core_2026-11-23.md.
//
// This allocator keeps the pages warm and the footprint tight at once:
//   * Allocations of at least `min_bytes` get a mapping of their own, rounded up to a size class
//     (eight classes per power of two, so at most 1/8 is unused, and untouched pages are not
//     resident anyway). Smaller ones go to the allocator that was installed before (glibc).
//   * A freed block is kept, mapped and warm, on its class's free list. The next allocation of
//     that class takes the most recently freed block (warmest in cache).
//   * The footprint (live + cached bytes) is capped at max(floor, peak live bytes x (1 + slack)).
//     A miss that would exceed the cap first unmaps the blocks freed longest ago. In a training
//     loop the shapes repeat, so after the first step nearly every allocation is a hit, and the
//     footprint follows what is actually live, which is what offloading makes small.
//   * Blocks are page-aligned, so a saved tensor's storage is written with O_DIRECT in place
//     without a bounce page at its head. Blocks of 2 MiB and more start on a huge page and are
//     advised to use huge pages: fewer segments per O_DIRECT request, fewer faults.
// Only the blocks this allocator mapped carry its deleter; its raw deleter passes any other
// pointer to the previous allocator. A fork while another thread holds the lock must not leave
// the child locked (DataLoader workers fork): pthread_atfork takes and releases it.
//
// Built by offloadd's install against the torch installed then (setup.py), as the extension
// module offloadd.runtime._host_cache; importing it registers the torch ops at the end,
// torch.ops.offloadd_host_cache.*, which offloadd/runtime/host_allocator.py drives.

#include <Python.h>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/library.h>

#include <pthread.h>
#include <sys/mman.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <deque>
#include <list>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

constexpr size_t kPage = 4096;
constexpr size_t kHuge = size_t{2} << 20;

struct FreeBlock {
  void* ptr;
  size_t bytes;
};

struct Counters {
  uint64_t live_bytes;
  uint64_t cached_bytes;
  uint64_t peak_live_bytes;
  uint64_t peak_footprint_bytes;
  uint64_t hits;
  uint64_t misses;
  uint64_t evicted_bytes;
  uint64_t mapped_bytes;  // bytes ever mapped (misses' sizes)
  uint64_t window_peak_live_bytes;  // most live bytes since the last reset_window()
};

size_t size_class(size_t n) {
  // 2^(b-1) < n <= 2^b; eight steps between 2^(b-1) and 2^b, never below a page.
  size_t b = 64 - static_cast<size_t>(__builtin_clzll(static_cast<unsigned long long>(n - 1)));
  size_t step = b > 4 ? (size_t{1} << (b - 4)) : 1;
  if (step < kPage) step = kPage;
  return (n + step - 1) / step * step;
}

class HostCache final : public c10::Allocator {
 public:
  static HostCache& get() {
    static HostCache* cache = new HostCache();  // never destroyed: blocks may outlive main()
    return *cache;
  }

  void configure(size_t min_bytes, size_t floor_bytes, double slack, bool huge_pages) {
    std::lock_guard<std::mutex> lock(mu_);
    huge_pages_ = huge_pages;
    min_bytes_.store(min_bytes < 1 ? 1 : min_bytes, std::memory_order_relaxed);
    floor_bytes_ = floor_bytes;
    slack_ = slack < 0 ? 0 : slack;
  }

  void install() {
    std::lock_guard<std::mutex> lock(mu_);
    c10::Allocator* current = c10::GetCPUAllocator();
    if (current != this) {
      previous_.store(current);
    }
    c10::SetCPUAllocator(this, /*priority=*/1);
    caching_ = true;
  }

  // Gives torch back the allocator it had. Blocks still live keep this deleter; freed after
  // this, they are unmapped instead of cached.
  void uninstall() {
    std::lock_guard<std::mutex> lock(mu_);
    c10::Allocator* previous = previous_.load();
    if (previous != nullptr && c10::GetCPUAllocator() == this) {
      c10::SetCPUAllocator(previous, /*priority=*/1);
    }
    caching_ = false;
    while (!lru_.empty()) evict_oldest();
  }

  bool installed() const { return c10::GetCPUAllocator() == this; }

  c10::DataPtr allocate(size_t n) override {
    if (n < min_bytes_.load(std::memory_order_relaxed)) {
      return previous_allocator()->allocate(n);
    }
    size_t bytes = size_class(n);
    void* p = take(bytes);
    return {p, p, &HostCache::release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &HostCache::release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  static void release(void* p) { get().give_back(p); }

  void counters(Counters* out) {
    std::lock_guard<std::mutex> lock(mu_);
    *out = c_;
  }

  // Starts a new window for window_peak_live_bytes; returns the live bytes now.
  uint64_t reset_window() {
    std::lock_guard<std::mutex> lock(mu_);
    c_.window_peak_live_bytes = c_.live_bytes;
    return c_.live_bytes;
  }

  // Unmaps every cached block; returns the bytes unmapped.
  uint64_t empty() {
    std::lock_guard<std::mutex> lock(mu_);
    uint64_t before = c_.cached_bytes;
    while (!lru_.empty()) evict_oldest();
    return before;
  }

  void lock() { mu_.lock(); }
  void unlock() { mu_.unlock(); }

 private:
  HostCache() = default;

  c10::Allocator* previous_allocator() const {
    c10::Allocator* p = previous_.load();
    return p != nullptr ? p : c10::GetDefaultCPUAllocator();
  }

  void* take(size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    auto cls = free_.find(bytes);
    if (cls != free_.end() && !cls->second.empty()) {
      auto it = cls->second.back();  // most recently freed: warmest
      cls->second.pop_back();
      void* p = it->ptr;
      lru_.erase(it);
      c_.cached_bytes -= bytes;
      c_.hits += 1;
      mark_live(p, bytes);
      return p;
    }
    c_.misses += 1;
    size_t peak = c_.peak_live_bytes > c_.live_bytes + bytes ? c_.peak_live_bytes
                                                              : c_.live_bytes + bytes;
    double cap = static_cast<double>(peak) * (1.0 + slack_);
    if (cap < static_cast<double>(floor_bytes_)) cap = static_cast<double>(floor_bytes_);
    while (!lru_.empty() &&
           static_cast<double>(c_.live_bytes + c_.cached_bytes + bytes) > cap) {
      evict_oldest();
    }
    void* p = map(bytes);
    if (p == nullptr) {
      // Out of address space or memory: give back everything cached, then try once more.
      while (!lru_.empty()) evict_oldest();
      p = map(bytes);
      if (p == nullptr) {
        TORCH_CHECK_WITH(OutOfMemoryError, false, "offloadd host cache: could not map ", bytes,
                         " bytes: ", std::strerror(errno));
      }
    }
    c_.mapped_bytes += bytes;
    mark_live(p, bytes);
    return p;
  }

  // A fresh block; from kHuge up, aligned to a huge page and advised to use huge pages (see
  // Note [huge-page buffers] in offloadd/io/hugepages.py: an O_DIRECT request costs per
  // physically contiguous run, and a huge page is faulted and zeroed at once).
  void* map(size_t bytes) {
    bool huge = huge_pages_ && bytes >= kHuge;
    size_t span = huge ? bytes + kHuge : bytes;
    void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return nullptr;
    if (!huge) return raw;
    uintptr_t start = reinterpret_cast<uintptr_t>(raw);
    uintptr_t aligned = (start + kHuge - 1) & ~(uintptr_t{kHuge} - 1);
    if (aligned > start) munmap(raw, aligned - start);
    uintptr_t end = aligned + bytes;
    if (start + span > end) munmap(reinterpret_cast<void*>(end), start + span - end);
    void* p = reinterpret_cast<void*>(aligned);
    madvise(p, bytes, MADV_HUGEPAGE);  // refused where THP is "never": 4 KiB pages then
    return p;
  }

  void mark_live(void* p, size_t bytes) {
    live_[p] = bytes;
    c_.live_bytes += bytes;
    if (c_.live_bytes > c_.peak_live_bytes) c_.peak_live_bytes = c_.live_bytes;
    if (c_.live_bytes > c_.window_peak_live_bytes) c_.window_peak_live_bytes = c_.live_bytes;
    uint64_t footprint = c_.live_bytes + c_.cached_bytes;
    if (footprint > c_.peak_footprint_bytes) c_.peak_footprint_bytes = footprint;
  }

  void give_back(void* p) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = live_.find(p);
      if (it != live_.end()) {
        size_t bytes = it->second;
        live_.erase(it);
        c_.live_bytes -= bytes;
        if (!caching_) {
          munmap(p, bytes);
          return;
        }
        c_.cached_bytes += bytes;
        lru_.push_back({p, bytes});
        free_[bytes].push_back(std::prev(lru_.end()));
        return;
      }
    }
    // Not one of ours: only raw_deallocate gets here, with a block of the previous allocator.
    c10::DeleterFnPtr d = previous_allocator()->raw_deleter();
    TORCH_CHECK(d != nullptr, "offloadd host cache: no raw deleter for a foreign block");
    d(p);
  }

  void evict_oldest() {  // mu_ held, lru_ not empty
    FreeBlock b = lru_.front();
    auto& stack = free_[b.bytes];
    stack.pop_front();  // the oldest of a class is the oldest overall among that class
    lru_.pop_front();
    c_.cached_bytes -= b.bytes;
    c_.evicted_bytes += b.bytes;
    munmap(b.ptr, b.bytes);
  }

  std::mutex mu_;
  std::atomic<c10::Allocator*> previous_{nullptr};  // torch's allocator before install()
  std::atomic<size_t> min_bytes_{128 * 1024};
  size_t floor_bytes_ = 64u << 20;
  double slack_ = 0.4;
  bool caching_ = false;  // installed: freed blocks are kept
  bool huge_pages_ = true;
  std::unordered_map<void*, size_t> live_;
  std::list<FreeBlock> lru_;  // front: freed longest ago
  std::unordered_map<size_t, std::deque<std::list<FreeBlock>::iterator>> free_;
  Counters c_{};
};

void atfork_prepare() { HostCache::get().lock(); }
void atfork_release() { HostCache::get().unlock(); }

// ---- the ops (no tensor arguments: catch-all kernels) ---------------------------------------

// Sets the policy; may be called again later.
void configure(int64_t min_bytes, int64_t floor_bytes, double slack, bool huge_pages) {
  TORCH_CHECK(min_bytes >= 0 && floor_bytes >= 0, "offloadd host cache: min_bytes ", min_bytes,
              " and floor_bytes ", floor_bytes, " must not be negative");
  HostCache::get().configure(static_cast<size_t>(min_bytes), static_cast<size_t>(floor_bytes),
                             slack, huge_pages);
}

// Makes the cache torch's CPU allocator. Idempotent. True if it is installed afterwards.
bool install() {
  static std::once_flag forked;
  std::call_once(forked, [] { pthread_atfork(atfork_prepare, atfork_release, atfork_release); });
  HostCache::get().install();
  return HostCache::get().installed();
}

// Makes the previous allocator torch's CPU allocator again and unmaps the cached blocks.
void uninstall() { HostCache::get().uninstall(); }

bool installed() { return HostCache::get().installed(); }

// The nine counters, in the order of struct Counters.
std::vector<int64_t> counters() {
  Counters c;
  HostCache::get().counters(&c);
  return {static_cast<int64_t>(c.live_bytes),      static_cast<int64_t>(c.cached_bytes),
          static_cast<int64_t>(c.peak_live_bytes), static_cast<int64_t>(c.peak_footprint_bytes),
          static_cast<int64_t>(c.hits),            static_cast<int64_t>(c.misses),
          static_cast<int64_t>(c.evicted_bytes),   static_cast<int64_t>(c.mapped_bytes),
          static_cast<int64_t>(c.window_peak_live_bytes)};
}

// Unmaps every cached block; returns the bytes given back.
int64_t empty() { return static_cast<int64_t>(HostCache::get().empty()); }

// Starts a new window for the window peak of live bytes; returns the live bytes now.
int64_t reset_window() { return static_cast<int64_t>(HostCache::get().reset_window()); }

}  // namespace

TORCH_LIBRARY(offloadd_host_cache, m) {
  m.def("configure(int min_bytes, int floor_bytes, float slack, bool huge_pages) -> ()",
        &configure);
  m.def("install() -> bool", &install);
  m.def("uninstall() -> ()", &uninstall);
  m.def("installed() -> bool", &installed);
  m.def("counters() -> int[]", &counters);
  m.def("empty() -> int", &empty);
  m.def("reset_window() -> int", &reset_window);
}

// The extension module offloadd.runtime._host_cache: empty; loading it registers the ops above.
extern "C" PyObject* PyInit__host_cache(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_host_cache",
                               "offloadd's host cache: torch.ops.offloadd_host_cache.*", -1,
                               nullptr};
  return PyModule_Create(&module);
}
