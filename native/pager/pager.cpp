// pager: routed-expert residency in a fixed RAM arena; see pager.h for the invariant.
//
// Correctness rests on three rules kept in this file:
//  1. read before map: a miss gets a slot, the file pages are read into the slot's memfd pages
//     (O_DIRECT reads through the fill mapping that reserve_arena made, which is never zapped or
//     remapped: io_uring READ_FIXED into its registered chunks (use_io_uring; a chunk stage
//     lending punches is unregistered first and registered again when it comes back, so no read
//     lands in a stale pinned page) or pread; without it, pread into the reading thread's bounce buffer and pwrite to the
//     memfd: either way no mapping that a computing core uses is touched, so no TLB shootdown
//     reaches it), and only when every
//     read of the unit returned all needed bytes
//     is the slot mapped over the region and the unit counted resident. Reading through the
//     region instead would be wrong: two neighbours loaded together share a boundary page, and
//     the region shows only one of their copies, so the other slot's copy would stay stale;
//  2. eviction unmaps to PROT_NONE, except boundary pages that a resident neighbour's slice
//     also touches: those are re-mapped from the neighbour's own copy of that file page;
//  3. victims come only from the evictable sets, which never hold pinned units.
#include "pager.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

std::string errstr(int e) { return std::string(strerror(e)) + " (errno " + std::to_string(e) + ")"; }

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

static int64_t page_size() {
    long p = sysconf(_SC_PAGESIZE);
    return p > 0 ? p : 4096;
}

// Pages a slice [start, start+len) spans.
static int64_t span_pages(int64_t start, int64_t len, int64_t page) {
    return ceil_div(start + len, page) - start / page;
}

std::vector<int64_t> pager::unit_slot_bytes(const std::vector<pager_layer_spec> & layers, int32_t n_expert) {
    const int64_t page = page_size();
    std::vector<int64_t> out;
    for (const auto & l : layers) {
        int64_t total = 0;
        for (const auto & t : l.tensors) {
            int64_t mx = 0;
            for (int32_t e = 0; e < n_expert; e++) {
                mx = std::max(mx, span_pages(t.offset + e * t.expert_bytes, t.expert_bytes, page));
            }
            total += mx * page;
        }
        out.push_back(total);
    }
    return out;
}

void pager::close_files() { files_.clear(); }

void pager::open_files(const std::vector<std::string> & paths, bool direct) {
    files_.clear();
    direct_ = direct;
    for (const auto & path : paths) {
        file_state f;
        f.path = path;
        if (direct_) {
            f.fd = open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
            bool refused = f.fd < 0 && errno == EINVAL;
            if (f.fd >= 0) {
                // Some file systems accept O_DIRECT at open and refuse it at read: probe one page.
                void * buf = nullptr;
                if (posix_memalign(&buf, (size_t) page_, (size_t) page_) == 0) {
                    ssize_t r = pread(f.fd, buf, (size_t) page_, 0);
                    refused = r < 0 && errno == EINVAL;
                    free(buf);
                }
            }
            if (refused) {
                // One file refuses O_DIRECT: read every file buffered (one mode per pager).
                open_files(paths, false);
                return;
            }
        }
        if (f.fd < 0) f.fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
        if (f.fd < 0) {
            int e = errno;
            files_.clear();
            throw pager_io_error("cannot open " + path + ": " + errstr(e), path, 0, e);
        }
        struct stat st{};
        fstat(f.fd, &st);
        f.size = (int64_t) st.st_size;
        f.mtime_ns = (int64_t) st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec;
        files_.push_back(std::move(f));
    }
}

// The arena split (pager.h split_arena): k slots of the largest class first (enough for any one
// layer's top-k, since a large slot may hold a small unit); the rest shared among classes in
// proportion to their total bytes, capped at the number of units a class has; leftover bytes buy
// further slots largest class first.
std::vector<int32_t> pager::split_arena(const std::vector<int64_t> & class_bytes, const std::vector<int64_t> & n_units,
                                        int64_t k, int64_t bytes) {
    const int nc = (int) class_bytes.size();
    std::vector<int32_t> n(nc, 0);
    int64_t all_bytes = 0;
    for (int c = 0; c < nc; c++) all_bytes += n_units[c] * class_bytes[c];
    if (bytes >= all_bytes) {
        for (int c = 0; c < nc; c++) n[c] = (int32_t) n_units[c];
        return n;
    }
    n[0] = (int32_t) std::min<int64_t>(k, n_units[0]);
    const int64_t rest = bytes - n[0] * class_bytes[0];
    int64_t left_bytes = 0;
    for (int c = 0; c < nc; c++) left_bytes += (n_units[c] - n[c]) * class_bytes[c];
    int64_t used = n[0] * class_bytes[0];
    for (int c = 0; c < nc; c++) {
        const int64_t cls_total = (n_units[c] - n[c]) * class_bytes[c];
        int64_t add = (int64_t) ((long double) std::max<int64_t>(0, rest) * cls_total / std::max<int64_t>(1, left_bytes)) / class_bytes[c];
        add = std::min<int64_t>(add, n_units[c] - n[c]);
        n[c] += (int32_t) add;
        used += add * class_bytes[c];
    }
    for (int c = 0; c < nc; c++) {
        while (n[c] < n_units[c] && used + class_bytes[c] <= bytes) {
            n[c]++;
            used += class_bytes[c];
        }
    }
    return n;
}

pager::pager(const pager_config & cfg) : n_expert_(cfg.n_expert) {
    // A constructor that throws runs no destructor: give back what init acquired, then rethrow.
    try {
        init(cfg);
    } catch (...) {
        release_resources();
        throw;
    }
}

void pager::init(const pager_config & cfg) {
    page_ = page_size();
    policy_ = -1;
    std::string known;
    for (int i = 0; i < N_POLICIES; i++) {
        if (cfg.policy == POLICY_NAMES[i]) policy_ = i;
        known += (i ? ", " : "") + std::string(POLICY_NAMES[i]);
    }
    if (policy_ < 0) throw std::invalid_argument("unknown eviction policy '" + cfg.policy + "': use one of " + known);
    if (!(cfg.fnu_alpha > 0 && cfg.fnu_alpha <= 1)) throw std::invalid_argument("fnu_alpha must lie in (0, 1]");
    fnu_alpha_ = cfg.fnu_alpha;
    policy_name_ = cfg.policy;
    if (policy_ == HEAT || policy_ == GATE_RANK) {
        auto it = cfg.policy_params.find("half_life");
        if (it != cfg.policy_params.end()) half_life_ = it->second;
        if (!(half_life_ > 0)) throw std::invalid_argument(policy_name_ + " half_life must lie in (0, inf)");
    }
    if (cfg.layers.empty() || n_expert_ <= 0) throw std::invalid_argument("pager needs at least one MoE layer and n_expert > 0");

    // --- files (one per shard of a split model) ---
    const std::vector<std::string> paths = cfg.paths.empty() ? std::vector<std::string>{cfg.path} : cfg.paths;
    for (const auto & l : cfg.layers)
        for (const auto & t : l.tensors)
            if (t.file < 0 || t.file >= (int32_t) paths.size())
                throw std::invalid_argument("tensor file index " + std::to_string(t.file) + " outside the " +
                                            std::to_string(paths.size()) + " model files");
    open_files(paths, cfg.direct_io);

    // --- regions (mirror layout) ---
    const auto ub = unit_slot_bytes(cfg.layers, n_expert_);
    for (size_t li = 0; li < cfg.layers.size(); li++) {
        const auto & l = cfg.layers[li];
        layers_.push_back(l.layer);
        maps_.emplace_back();  // filled region by region, so a failure part-way leaks nothing
        auto & ms = maps_.back();
        int64_t sub = 0;
        for (const auto & t : l.tensors) {
            tensor_map m{};
            m.offset       = t.offset;
            m.expert_bytes = t.expert_bytes;
            m.file         = t.file;
            m.first_page   = t.offset / page_;
            const int64_t lead = t.offset - m.first_page * page_;
            m.region_bytes = ceil_div(lead + (int64_t) n_expert_ * t.expert_bytes, page_) * page_;
            void * r = mmap(nullptr, (size_t) m.region_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (r == MAP_FAILED) {
                int e = errno;
                throw std::runtime_error("cannot reserve " + std::to_string(m.region_bytes) + " bytes of address space: " + errstr(e));
            }
            m.region = (char *) r;
            int64_t mx = 0;
            for (int32_t e = 0; e < n_expert_; e++) mx = std::max(mx, span_pages(t.offset + e * t.expert_bytes, t.expert_bytes, page_));
            m.sub_off   = sub;
            m.sub_bytes = mx * page_;
            sub += m.sub_bytes;
            ms.push_back(m);
        }
        unit_bytes_.push_back(ub[li]);
    }

    // --- slot classes and the arena split (split_arena) ---
    // Classes are the distinct unit sizes, largest first.
    class_bytes_ = unit_bytes_;
    std::sort(class_bytes_.begin(), class_bytes_.end(), std::greater<int64_t>());
    class_bytes_.erase(std::unique(class_bytes_.begin(), class_bytes_.end()), class_bytes_.end());
    const int nc = (int) class_bytes_.size();
    std::vector<int64_t> n_units(nc, 0);
    for (auto b : unit_bytes_) {
        int c = (int) (std::find(class_bytes_.begin(), class_bytes_.end(), b) - class_bytes_.begin());
        n_units[c] += n_expert_;
    }
    const int64_t k = std::max<int64_t>(1, std::min<int64_t>(cfg.n_expert_used, n_expert_));
    top_k_ = (int32_t) k;
    const int64_t min_bytes = k * class_bytes_[0];
    if (cfg.arena_bytes < min_bytes) {
        throw pager_capacity_error("arena of " + std::to_string(cfg.arena_bytes) + " bytes cannot hold one layer's top-" +
                                   std::to_string(k) + " experts; the smallest arena that works is " +
                                   std::to_string(min_bytes) + " bytes");
    }
    n_units_ = n_units;
    class_n_ = split_arena(class_bytes_, n_units, k, cfg.arena_bytes);
    free_.assign(nc, {});
    class_first_.assign(nc, 0);
    int64_t off = 0;
    for (int c = 0; c < nc; c++) {
        class_first_[c] = (int32_t) slots_.size();
        for (int32_t i = 0; i < class_n_[c]; i++) {
            slots_.push_back(slot{off, class_bytes_[c], c, -1});
            off += class_bytes_[c];
        }
    }
    for (int s = (int) slots_.size() - 1; s >= 0; s--) free_[slots_[s].cls].push_back(s);
    arena_size_ = off;
    memfd_ = memfd_create("epqlab-arena", MFD_CLOEXEC);
    if (memfd_ < 0 || ftruncate(memfd_, (off_t) arena_size_) != 0) {
        int e = errno;
        throw std::runtime_error("cannot create the arena memfd of " + std::to_string(arena_size_) + " bytes: " + errstr(e));
    }
    units_.assign((size_t) layers_.size() * n_expert_, unit{});
    unit_pending_.assign(units_.size(), nullptr);
    pf_inflight_.assign(units_.size(), 0);
    pf_prot_.assign(units_.size(), 0);
    pf_left_.reset(new std::atomic<int>[units_.size()]);
    pf_bad_.reset(new std::atomic<int>[units_.size()]);
    pf_mapped_.reset(new std::atomic<int>[units_.size()]);
    for (size_t u = 0; u < units_.size(); u++) pf_left_[u] = pf_bad_[u] = pf_mapped_[u] = 0;
    if (policy_ == BELADY) pending_next_.assign(units_.size(), 0);
    if (policy_ == FNU) pick_rate_.assign(units_.size(), (double) k / n_expert_);
    evictable_.assign(units_.size(), 0);
    qpol_ = make_queue_policy(policy_name_, (int64_t) slots_.size(), units_.size(), cfg.policy_params, n_expert_);
    pinned_.assign(layers_.size(), {});
    overlay_.assign(layers_.size(), {});
    stats_.layer_requests.assign(layers_.size(), 0);
    stats_.layer_hits.assign(layers_.size(), 0);
    pool_ = std::make_unique<io_pool>(cfg.io_threads);
    pool_->set_after([this](io_job & j) { prefetch_job_done(j); });
}

pager::~pager() { release_resources(); }

void pager::release_resources() {
    // No read may outlive the arena it writes into.
    if (pool_)
        for (auto & b : pf_) pool_->wait_jobs(b->jobs, 0, b->jobs.size());
    pf_.clear();
    if (pool_ && dm_active_) pool_->wait_jobs(dm_jobs_, 0, dm_jobs_.size());
    dm_active_ = false;
    pool_.reset();
    for (auto & ms : maps_)
        for (auto & m : ms) munmap(m.region, (size_t) m.region_bytes);
    maps_.clear();
    if (fill_) munmap(fill_, (size_t) arena_size_);
    fill_ = nullptr;
    if (memfd_ >= 0) close(memfd_);
    memfd_ = -1;
    close_files();
}

int pager::reserve_arena() {
    if (memfd_ < 0) return EBADF;
    if (fill_ || arena_size_ == 0) return 0;
    if (retired_bytes_ == 0) {
        int r;
        do r = posix_fallocate(memfd_, 0, (off_t) arena_size_); while (r == EINTR);
        if (r != 0) return r;
        void * p = mmap(nullptr, (size_t) arena_size_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, memfd_, 0);
        if (p == MAP_FAILED) return errno;
        fill_ = (char *) p;
        return 0;
    }
    // Slots resize took out stay holes: allocate and populate only the others (MAP_POPULATE would
    // allocate every page of a shared mapping).
    void * p = mmap(nullptr, (size_t) arena_size_, PROT_READ | PROT_WRITE, MAP_SHARED, memfd_, 0);
    if (p == MAP_FAILED) return errno;
    fill_ = (char *) p;
    for (size_t s = 0; s < slots_.size(); s++) {
        if (slots_[s].retired) continue;
        try {
            refill_slot((int) s);
        } catch (const std::runtime_error &) {
            munmap(fill_, (size_t) arena_size_);
            fill_ = nullptr;
            return ENOMEM;
        }
    }
    return 0;
}

std::string pager::use_io_uring() {
    if (!fill_) return "the arena has no fill mapping (Pager(prefault=False))";
    if (!slot_chunk_.empty()) return "";
    if (!direct_) return "buffered reads (direct_io=False)";
    const int64_t per = std::max<int64_t>(1, ((int64_t) slots_.size() + 4095) / 4096);
    std::vector<std::pair<char *, int64_t>> bufs;
    std::vector<int32_t> chunk(slots_.size(), -1);
    for (size_t s = 0; s < slots_.size();) {  // slots lie back to back in the memfd, in order
        if (slots_[s].retired) {  // registering pins pages: a hole would be allocated (refilled slots use pread)
            s++;
            continue;
        }
        const int64_t lo = slots_[s].offset;
        int64_t n = 0, hi = lo;
        while (s < slots_.size() && n < per && !slots_[s].retired && slots_[s].offset == hi &&
               hi + slots_[s].bytes - lo <= (int64_t(1) << 30)) {
            chunk[s] = (int32_t) bufs.size();
            hi += slots_[s].bytes;
            s++;
            n++;
        }
        if (n == 0) {  // a slot over 1 GiB: read with pread
            s++;
            continue;
        }
        bufs.push_back({fill_ + lo, hi - lo});
    }
    const std::string why = pool_->use_fixed_buffers(bufs);
    if (why.empty()) {
        slot_chunk_ = std::move(chunk);
        chunk_out_.assign(bufs.size(), 0);
    }
    return why;
}

int64_t pager::arena_resident_bytes() const {
    struct stat st{};
    if (memfd_ < 0 || fstat(memfd_, &st) != 0) return 0;
    return (int64_t) st.st_blocks * 512;
}

int pager::layer_index(int32_t block) const {
    for (size_t i = 0; i < layers_.size(); i++)
        if (layers_[i] == block) return (int) i;
    return -1;
}

void * pager::tensor_data(int li, int ti) const {
    const auto & m = maps_.at(li).at(ti);
    return m.region + (m.offset - m.first_page * page_);
}

const char * pager::expert_data(int li, int ti, int e) const {
    if (e < 0 || e >= n_expert_ || !units_[unit_id(li, e)].mapped) throw std::invalid_argument("expert is not resident");
    const auto & m = maps_.at(li).at(ti);
    if (slot_mode_) return fill_ + slots_[units_[unit_id(li, e)].slot].offset + m.sub_off + m.offset % page_;
    return (const char *) tensor_data(li, ti) + (int64_t) e * m.expert_bytes;
}

std::string pager::set_slot_addressing(bool on) {
    if (!on) {
        if (slot_mode_ && n_resident() > 0) return "slot addressing cannot be turned off with experts resident";
        slot_mode_ = false;
        return "";
    }
    if (slot_mode_) return "";
    if (n_resident() > 0 || dm_active_ || !pf_.empty()) return "experts are resident already: set slot addressing before the first load";
    if (!fill_) return "the arena has no fill mapping (Pager(prefault=False)): slot addressing reads experts through it";
    const int k = top_k_;
    const auto active = active_class_n();
    for (size_t c = 0; c < class_bytes_.size(); c++) {
        if (active[c] < std::min<int64_t>(k, n_units_[c]))
            return "the arena gives the " + std::to_string(class_bytes_[c]) + "-byte slot class " + std::to_string(active[c]) +
                   " slots, fewer than top-" + std::to_string(k) + " (slot addressing keeps each layer in its own class)";
    }
    for (const auto & layer : maps_)
        for (const auto & m : layer)
            if (m.expert_bytes % page_ != 0)
                return "an expert slice of " + std::to_string(m.expert_bytes) + " bytes is not a whole number of " +
                       std::to_string(page_) + "-byte pages, so its experts start at different offsets in a page";
    slot_mode_ = true;
    return "";
}

void pager::slot_view(int li, int ti, void ** data, int64_t * stride, int64_t * n_slots) const {
    if (!slot_mode_) throw std::logic_error("slot_view without slot addressing");
    const auto & m = maps_.at(li).at(ti);
    // Slot s holds the file pages of the expert's slice at s * stride + sub_off; the slice starts
    // offset % page into its first page, for every expert (expert_bytes is a page multiple).
    const int c = (int) (std::find(class_bytes_.begin(), class_bytes_.end(), unit_bytes_[li]) - class_bytes_.begin());
    *data = fill_ + slots_[class_first_[c]].offset + m.sub_off + m.offset % page_;
    *stride = class_bytes_[c];
    *n_slots = class_n_[c];
}

void pager::drop_file_cache(int li, int ti) const {
    const auto & m = maps_.at(li).at(ti);
    posix_fadvise(files_[m.file].fd, (off_t) m.offset, (off_t) (m.expert_bytes * n_expert_), POSIX_FADV_DONTNEED);
}

int pager::capacity(int li) const {
    int n = 0;
    for (const auto & s : slots_) n += !s.retired && (slot_mode_ ? s.bytes == unit_bytes_.at(li) : s.bytes >= unit_bytes_.at(li));
    return n;
}

int64_t pager::n_resident() const {
    int64_t n = 0;
    for (const auto & s : slots_) n += s.unit >= 0;
    return n;
}

void pager::reset_stats() {
    prefetch_finish();
    if (dm_active_) demand_finish();
    pager_stats s;
    deferred_us_ = 0;
    s.layer_requests.assign(layers_.size(), 0);
    s.layer_hits.assign(layers_.size(), 0);
    stats_ = s;
}

void pager::expert_pages(const tensor_map & t, int e, int64_t & p0, int64_t & p1) const {
    const int64_t start = t.offset + (int64_t) e * t.expert_bytes;
    p0 = start / page_;
    p1 = ceil_div(start + t.expert_bytes, page_);
}

void pager::page_experts(const tensor_map & t, int64_t p, int64_t & e_lo, int64_t & e_hi) const {
    const int64_t lo_b = p * page_ - t.offset, hi_b = (p + 1) * page_ - 1 - t.offset;
    e_lo = std::max<int64_t>(0, lo_b < 0 ? 0 : lo_b / t.expert_bytes);
    e_hi = std::min<int64_t>(n_expert_ - 1, hi_b / t.expert_bytes);
}

// ---- eviction order ----------------------------------------------------------------------

// Each policy is a sort key over the evictable units; the smallest key is the victim (among
// slots large enough). Ties end on last_use (least recent first), then the unit id.
//   lru     (0, last_use)                      least recently requested
//   ls      (layer, last_use), stale set first   Least-Stale (SpecMD, arXiv 2602.03921)
//   ls_pos  (-layer, last_use), four groups      seed 000's LS + position (order in take_slot)
//   lfu     (requests so far, last_use)         least frequently requested, counts kept across evictions
//   static  lru, hot units in a last-resort set seed 002's hot-pin
//   fnu     (-predicted next use, last_use)      Belady's rule on a prediction (fnu_update)
//   gate_rank (decayed router probability mass, last_use)   heat weighted by the router (set_gate_mass)
//   belady  (-next use, last_use)               farthest next use: Belady's MIN (replay only)
pager::key_t pager::key_of(int u) const {
    const int li = u / n_expert_;
    const unit & x = units_[u];
    int64_t primary = 0;
    switch (policy_) {
        case LS:     primary = li; break;
        case LS_POS: primary = -li; break;
        case LFU:    primary = (int64_t) x.count; break;
        case LFUDA:
        case HEAT:
        case GATE_RANK: primary = x.prio; break;
        case BELADY:
        case FNU:    primary = -x.next_use; break;
        default:     break;
    }
    return key_t(primary, x.last_use, u);
}

void pager::insert_evictable(int u) {
    const unit & x = units_[u];
    evictable_[u] = 1;
    if (policy_ == STATIC && x.hot) hot_.insert(key_of(u));
    else if ((policy_ == LS || policy_ == LS_POS) && x.last_pass == pass_) current_.insert(key_of(u));
    else stale_.insert(key_of(u));
}

void pager::erase_evictable(int u) {
    evictable_[u] = 0;
    const key_t k = key_of(u);
    if (stale_.erase(k) == 0 && current_.erase(k) == 0) hot_.erase(k);
}

void pager::begin_pass() {
    pass_++;
    stats_.passes++;
    stats_.pass_requests.push_back(0);
    stats_.pass_hits.push_back(0);
    stale_.insert(current_.begin(), current_.end());
    current_.clear();
}

void pager::set_hot(const std::vector<int32_t> & us) {
    prefetch_finish();
    if (dm_active_) demand_finish();
    for (int32_t u : us) {
        if (u < 0 || u >= (int32_t) units_.size()) throw std::out_of_range("hot unit " + std::to_string(u) + " out of range");
        if (units_[u].hot) continue;
        const bool in_set = units_[u].slot >= 0 && !units_[u].pinned;
        if (in_set) erase_evictable(u);
        units_[u].hot = true;
        if (in_set) insert_evictable(u);
    }
}

void pager::evict(int u, int loading_li) {
    unit & x = units_[u];
    const int li = u / n_expert_;
    const bool stale = x.last_pass < pass_;
    const bool left  = li < loading_li;
    stats_.evictions_by_group[(stale ? 0 : 1) + (left ? 0 : 2)]++;
    stats_.evictions++;
    erase_evictable(u);
    if (policy_ == LFUDA) lfuda_age_ = x.prio;
    if (qpol_) qpol_->evicted(u);
    slot & sl = slots_[x.slot];
    if (sl.pending) run_pending(sl.pending);  // done already by u's reads into this slot; cheap then
    const int64_t t0 = io_now_us();
    sl.pending = unmap_deferred(u);
    std::atomic_store(&unit_pending_[u], sl.pending);
    stats_.evict_unmap_us += io_now_us() - t0;
    slots_[x.slot].unit = -1;
    x.slot = -1;
}

void pager::free_unit_slot(int u) {
    if (qpol_) qpol_->dropped(u);
    const int s = units_[u].slot;
    slots_[s].unit = -1;
    free_[slots_[s].cls].push_back(s);
    units_[u].slot = -1;
}

// Returns a free slot id for a unit of layer li, evicting by policy when none is free.
int pager::take_slot(int li, int64_t need, bool speculative, int u_in, bool exact) {
    int c = (int) (std::find(class_bytes_.begin(), class_bytes_.end(), need) - class_bytes_.begin());
    const bool same = slot_mode_ || exact;
    for (int c2 = c; c2 >= (same ? c : 0); c2--) {  // own class, then the smallest larger class (region addressing)
        if (!free_[c2].empty()) {
            int s = free_[c2].back();
            free_[c2].pop_back();
            return s;
        }
    }
    auto fits = [&](const key_t & k) {
        const int u = std::get<2>(k);
        const int64_t b = slots_[units_[u].slot].bytes;
        return (same ? b == need : b >= need) && !(!pf_.empty() && inflight_neighbour(u));
    };
    auto try_range = [&](std::set<key_t>::iterator b, std::set<key_t>::iterator e) -> int {
        for (auto it = b; it != e; ++it) {
            if (fits(*it)) {
                const int u = std::get<2>(*it);
                const int s = units_[u].slot;
                evict(u, li);
                return s;
            }
        }
        return -1;
    };
    int s = -1;
    if (qpol_) {
        const int v = qpol_->victim(u_in, [&](int w) {
            if (!evictable_[w]) return false;
            const int64_t b = slots_[units_[w].slot].bytes;
            return (same ? b == need : b >= need) && !(!pf_.empty() && inflight_neighbour(w));
        });
        if (v >= 0) {
            s = units_[v].slot;
            evict(v, li);
        }
    } else if (policy_ == LS_POS) {
        // stale-left -> current-left -> stale-right -> current-right; larger layer first.
        const key_t bound(-(int64_t) li + 1, 0, INT32_MIN);  // first key with layer < li
        s = try_range(stale_.lower_bound(bound), stale_.end());
        if (s < 0) s = try_range(current_.lower_bound(bound), current_.end());
        if (s < 0) s = try_range(stale_.begin(), stale_.lower_bound(bound));
        if (s < 0) s = try_range(current_.begin(), current_.lower_bound(bound));
    } else {
        s = try_range(stale_.begin(), stale_.end());
        if (s < 0) s = try_range(current_.begin(), current_.end());
    }
    if (s < 0) s = try_range(hot_.begin(), hot_.end());
    if (s < 0 && !speculative && !pf_.empty()) {
        // Batches in flight hold slots (and keep their neighbours and predictions from being
        // victims): a demand load waits for them rather than fail.
        prefetch_finish();
        return take_slot(li, need, speculative, u_in, exact);
    }
    if (s < 0) {
        int64_t pinned = 0;
        for (const auto & p : pinned_) pinned += (int64_t) p.size();
        throw pager_capacity_error("no slot of >= " + std::to_string(need) + " bytes can be freed for layer " +
                                   std::to_string(layers_[li]) + ": " + std::to_string(pinned) + " experts are pinned and the arena has " +
                                   std::to_string(slots_.size()) + " slots. Use a larger arena or fewer experts per batch.");
    }
    return s;
}

// ---- mapping -----------------------------------------------------------------------------

int pager::map_pages(int u, bool populate) const {
    const int li = u / n_expert_;
    for (int ti = 0; ti < (int) maps_[li].size(); ti++)
        if (const int err = map_tensor_pages(u, ti, populate)) return err;
    return 0;
}

std::string map_error(int err) {
    return "mmap of an expert slot failed: " + errstr(err) +
           (err == ENOMEM ? "; vm.max_map_count may be too low for this many resident experts" : "");
}

void pager::map_unit(int u) {
    const int64_t t0 = io_now_us();
    const int err = map_pages(u, false);
    stats_.map_us += io_now_us() - t0;
    if (err) throw std::runtime_error(map_error(err));
    units_[u].mapped = true;
}

void pager::unmap_unit(int u) {
    const int li = u / n_expert_, e = u % n_expert_;
    const int64_t t0 = io_now_us();
    units_[u].mapped = false;
    if (slot_mode_) return;  // nothing was mapped into the region
    for (const auto & m : maps_[li]) {
        int64_t p0, p1;
        expert_pages(m, e, p0, p1);
        char * addr = m.region + (p0 - m.first_page) * page_;
        mmap(addr, (size_t) ((p1 - p0) * page_), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
        // Boundary pages may also belong to a resident neighbour: give them back its copy.
        const int64_t edges[2] = {p0, p1 - 1};
        for (int k = 0; k < (p1 - 1 == p0 ? 1 : 2); k++) {
            const int64_t p = edges[k];
            const int64_t lo_b = p * page_ - m.offset, hi_b = (p + 1) * page_ - 1 - m.offset;
            const int64_t e_lo = std::max<int64_t>(0, lo_b < 0 ? 0 : lo_b / m.expert_bytes);
            const int64_t e_hi = std::min<int64_t>(n_expert_ - 1, hi_b / m.expert_bytes);
            for (int64_t e2 = e_lo; e2 <= e_hi; e2++) {
                if (e2 == e) continue;
                const unit & y = units_[li * n_expert_ + e2];
                if (!y.mapped) continue;
                int64_t q0, q1;
                expert_pages(m, (int) e2, q0, q1);
                mmap(m.region + (p - m.first_page) * page_, (size_t) page_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, memfd_,
                     (off_t) (slots_[y.slot].offset + m.sub_off + (p - q0) * page_));
                break;
            }
        }
    }
    stats_.map_us += io_now_us() - t0;
}

std::shared_ptr<pager::unmap_task> pager::unmap_deferred(int u) {
    const int li = u / n_expert_, e = u % n_expert_;
    const int64_t t0 = io_now_us();
    units_[u].mapped = false;
    if (slot_mode_) return nullptr;  // nothing was mapped into the region
    auto task = std::make_shared<unmap_task>();
    for (int ti = 0; ti < (int) maps_[li].size(); ti++) {
        const tensor_map & m = maps_[li][ti];
        int64_t p0, p1;
        expert_pages(m, e, p0, p1);
        int64_t run0 = -1;  // start of the current range of deferred pages
        for (int64_t p = p0; p <= p1; p++) {
            bool now = false;  // a mapped or pinned neighbour touches page p: remap it at once
            if (p < p1 && (p == p0 || p == p1 - 1)) {
                int64_t lo, hi;
                page_experts(m, p, lo, hi);
                for (int64_t e2 = lo; e2 <= hi && !now; e2++) {
                    const unit & y = units_[li * n_expert_ + e2];
                    now = e2 != e && (y.mapped || y.pinned);
                }
            }
            if (p < p1 && !now) {
                if (run0 < 0) run0 = p;
                continue;
            }
            if (run0 >= 0) task->ranges.push_back({m.region + (run0 - m.first_page) * page_, (size_t) ((p - run0) * page_)});
            run0 = -1;
            if (p < p1) restore_page(li, ti, p);  // the neighbour's copy, or PROT_NONE
        }
    }
    stats_.map_us += io_now_us() - t0;
    return task->ranges.empty() ? nullptr : task;
}

void pager::run_pending(const std::shared_ptr<unmap_task> & t) const {
    std::call_once(t->once, [&] {
        const int64_t t0 = io_now_us();
        for (const auto & r : t->ranges)
            mmap(r.first, r.second, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
        deferred_us_ += io_now_us() - t0;
    });
}

void pager::sharing_experts(const tensor_map & m, int e, int64_t & e_lo, int64_t & e_hi) const {
    int64_t p0, p1, lo, hi;
    expert_pages(m, e, p0, p1);
    page_experts(m, p0, e_lo, hi);
    page_experts(m, p1 - 1, lo, e_hi);
    e_lo = std::min<int64_t>(e_lo, e);
    e_hi = std::max<int64_t>(e_hi, e);
}

void pager::run_pending_around(int li, int ti, int e) const {
    int64_t lo, hi;
    sharing_experts(maps_[li][ti], e, lo, hi);
    for (int64_t e2 = lo; e2 <= hi; e2++)
        if (auto t = std::atomic_load(&unit_pending_[li * n_expert_ + e2])) run_pending(t);
}

// ---- load / release ----------------------------------------------------------------------

void pager::release_layer(int li) {
    if (dm_active_ && dm_li_ == li) demand_finish();  // its units' reads may still be in flight
    if (!overlay_.at(li).empty()) clear_zero_overlay(li);
    for (int u : pinned_.at(li)) {
        units_[u].pinned = false;
        if (units_[u].slot >= 0) insert_evictable(u);
    }
    pinned_[li].clear();
}

// ---- zero overlay (lossy skip-cold) ----------------------------------------------------------

void pager::zero_overlay(int li, const int32_t * ids, int n) {
    if (slot_mode_) throw std::logic_error("zero_overlay needs region addressing (skip-cold maps zeros over a skipped expert's pages)");
    prefetch_finish();
    if (dm_active_) demand_finish();
    if (li < 0 || li >= (int) layers_.size()) throw std::out_of_range("MoE layer index " + std::to_string(li) + " out of range");
    std::vector<int32_t> skip(ids, ids + n);
    std::sort(skip.begin(), skip.end());
    skip.erase(std::unique(skip.begin(), skip.end()), skip.end());
    for (int32_t e : skip) {
        if (e < 0 || e >= n_expert_) throw std::out_of_range("expert id " + std::to_string(e) + " out of range [0, " + std::to_string(n_expert_) + ")");
        if (units_[unit_id(li, e)].mapped) throw std::invalid_argument("zero_overlay of expert " + std::to_string(e) + ", which is resident: only non-resident experts can be skipped");
    }
    if (skip.empty()) return;
    for (int32_t e : skip)  // their deferred unmaps (and neighbours') before the zero pages go in
        for (int ti = 0; ti < (int) maps_[li].size(); ti++) run_pending_around(li, ti, e);
    auto skipped = [&](int64_t e) { return std::binary_search(skip.begin(), skip.end(), (int32_t) e); };
    const int64_t t0 = io_now_us();
    std::vector<char> tmp((size_t) page_);
    for (int ti = 0; ti < (int) maps_[li].size(); ti++) {
        const tensor_map & m = maps_[li][ti];
        std::vector<int64_t> pages;
        for (int32_t e : skip) {
            int64_t p0, p1;
            expert_pages(m, e, p0, p1);
            for (int64_t p = p0; p < p1; p++) pages.push_back(p);
        }
        std::sort(pages.begin(), pages.end());
        pages.erase(std::unique(pages.begin(), pages.end()), pages.end());
        for (int64_t p : pages) {
            char * addr = m.region + (p - m.first_page) * page_;
            int64_t e_lo, e_hi;
            page_experts(m, p, e_lo, e_hi);
            bool shared = false;  // a resident expert's slice touches this page: keep its bytes
            for (int64_t e2 = e_lo; e2 <= e_hi && !shared; e2++) shared = !skipped(e2) && units_[li * n_expert_ + e2].mapped;
            if (shared) memcpy(tmp.data(), addr, (size_t) page_);  // the file page, mapped from that expert's slot
            void * r = mmap(addr, (size_t) page_, shared ? PROT_READ | PROT_WRITE : PROT_READ,
                            MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
            if (r == MAP_FAILED) {
                int err = errno;
                throw std::runtime_error("mmap of a zero page for a skipped expert failed: " + errstr(err));
            }
            overlay_[li].emplace_back(ti, p);
            if (!shared) continue;  // the anonymous page reads as zeros
            memcpy(addr, tmp.data(), (size_t) page_);
            for (int64_t e2 = e_lo; e2 <= e_hi; e2++) {
                if (!skipped(e2)) continue;
                const int64_t a = std::max(m.offset + e2 * m.expert_bytes, p * page_);
                const int64_t b = std::min(m.offset + (e2 + 1) * m.expert_bytes, (p + 1) * page_);
                if (b > a) memset(addr + (a - p * page_), 0, (size_t) (b - a));
            }
        }
    }
    stats_.map_us += io_now_us() - t0;
}

void pager::restore_page(int li, int ti, int64_t p) {
    const tensor_map & m = maps_[li][ti];
    char * addr = m.region + (p - m.first_page) * page_;
    int64_t e_lo, e_hi;
    page_experts(m, p, e_lo, e_hi);
    for (int64_t e2 = e_lo; e2 <= e_hi; e2++) {
        const unit & y = units_[li * n_expert_ + e2];
        if (!y.mapped) continue;
        int64_t q0, q1;
        expert_pages(m, (int) e2, q0, q1);
        mmap(addr, (size_t) page_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, memfd_,
             (off_t) (slots_[y.slot].offset + m.sub_off + (p - q0) * page_));
        return;
    }
    mmap(addr, (size_t) page_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
}

void pager::clear_zero_overlay(int li) {
    const int64_t t0 = io_now_us();
    for (const auto & o : overlay_[li]) restore_page(li, o.first, o.second);
    overlay_[li].clear();
    stats_.map_us += io_now_us() - t0;
}

void pager::release_all() {
    for (int li = 0; li < (int) layers_.size(); li++) release_layer(li);
}

void pager::unit_jobs(int u, std::vector<io_job> & jobs, std::vector<int> & job_unit, std::vector<int> * job_tensor) const {
    const int li = u / n_expert_, e = u % n_expert_;
    const slot & sl = slots_[units_[u].slot];
    for (size_t ti = 0; ti < maps_[li].size(); ti++) {
        const auto & m = maps_[li][ti];
        int64_t p0, p1;
        expert_pages(m, e, p0, p1);
        const int64_t end  = m.offset + (int64_t) e * m.expert_bytes + m.expert_bytes;  // slice end, file bytes
        const int64_t len  = (p1 - p0) * page_;
        const int64_t step = seg_bytes_ > 0 ? seg_bytes_ : len;
        for (int64_t off = 0; off < len; off += step) {
            io_job j;
            j.offset = p0 * page_ + off;
            j.len    = std::min(step, len - off);
            j.need   = std::max<int64_t>(0, std::min(j.offset + j.len, end) - j.offset);
            if (fill_) {
                j.dst = fill_ + sl.offset + m.sub_off + off;  // straight into the slot's pages (reserve_arena)
            } else {
                j.out_fd  = memfd_;  // into the slot's memfd pages through the reader's bounce buffer
                j.out_off = sl.offset + m.sub_off + off;
            }
            j.fd     = files_[m.file].fd;
            j.tag    = u;
            if (sl.pending) j.before = [this, t = sl.pending] { run_pending(t); };
            jobs.push_back(j);
            job_unit.push_back(u);
            if (job_tensor) job_tensor->push_back((int) ti);
        }
    }
}

void pager::load_layer(int li, const int32_t * ids, int n, uint8_t * hit_out) {
    prefetch_finish_for(li, ids, n);  // li's batches; others may read on
    if (dm_active_) demand_finish();
    std::vector<io_job> jobs;
    std::vector<int>    job_unit;
    const std::vector<int> misses = place_misses(li, ids, n, hit_out, jobs, job_unit, nullptr);
    if (misses.empty()) return;
    run_reads(jobs);
    settle_misses(li, misses, jobs, job_unit);
}

std::vector<int> pager::place_misses(int li, const int32_t * ids, int n, uint8_t * hit_out, std::vector<io_job> & jobs,
                                     std::vector<int> & job_unit, std::vector<int> * job_tensor) {
    if (li < 0 || li >= (int) layers_.size()) throw std::out_of_range("MoE layer index " + std::to_string(li) + " out of range");
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= n_expert_) {
            throw std::out_of_range("expert id " + std::to_string(ids[i]) + " out of range [0, " + std::to_string(n_expert_) + ")");
        }
    }
    stats_.load_calls++;
    std::vector<int> misses;
    for (int i = 0; i < n; i++) {
        const int u = unit_id(li, ids[i]);
        unit & x = units_[u];
        bool dup = false;
        for (int j = 0; j < i; j++) dup |= ids[j] == ids[i];
        if (hit_out) hit_out[i] = x.slot >= 0;
        if (dup) continue;
        stats_.requests++;
        stats_.layer_requests[li]++;
        if (!stats_.pass_requests.empty()) stats_.pass_requests.back()++;
        if (x.slot >= 0) {
            const bool in_flight = pf_inflight_[u];  // a batch is reading it: its use is counted now
            if (x.prefetched || in_flight) {
                x.prefetched = false;
                stats_.prefetch_used++;
                for (const auto & m : maps_[li]) {  // the bytes its prefetch read: whole pages of each slice
                    int64_t p0, p1;
                    expert_pages(m, ids[i], p0, p1);
                    stats_.prefetch_used_bytes += (p1 - p0) * page_;
                }
            }
            stats_.hits++;
            stats_.layer_hits[li]++;
            if (!stats_.pass_hits.empty()) stats_.pass_hits.back()++;
            if (!x.pinned) erase_evictable(u);
        } else {
            stats_.misses++;
            misses.push_back(u);
        }
        // The unit is in no evictable set now (pinned or just erased): its key may change.
        x.last_use  = ++tick_;
        x.last_pass = pass_;
        x.count++;
        policy_request(u, x.slot >= 0);
        if (policy_ == BELADY) x.next_use = pending_next_[u];
        if (!x.pinned) {
            x.pinned = true;
            pinned_[li].push_back(u);
        }
    }
    if (misses.empty()) return misses;

    std::vector<int> placed;
    try {
        check_file();
        for (int u : misses) {
            if (qpol_) qpol_->admit(u);
            if (refusing_ && admission_refused(li, u)) {  // staged by the caller: no slot, no victim, no insertion
                qpol_->refused(u);
                refused_.push_back(u);
                stats_.admission_staged++;
                continue;
            }
            const int s = take_slot(li, unit_bytes_[li], false, u);
            units_[u].slot = s;
            slots_[s].unit = u;
            policy_insert(u);
            placed.push_back(u);
            unit_jobs(u, jobs, job_unit, job_tensor);
        }
    } catch (...) {
        // Undo the misses placed so far (slots taken, nothing read): they never become resident.
        // Experts of li a batch is still reading were pinned as hits: settle them before they are
        // unpinned (and become evictable).
        for (int u : placed) free_unit_slot(u);
        try {
            finish_batches(li);
        } catch (...) {
        }
        release_layer(li);
        throw;
    }

    return placed;
}

bool pager::admission_refused(int li, int u) {
    if (!qpol_ || !qpol_->stages()) return false;
    const int64_t need = unit_bytes_[li];
    const int c = (int) (std::find(class_bytes_.begin(), class_bytes_.end(), need) - class_bytes_.begin());
    for (int c2 = c; c2 >= (slot_mode_ ? c : 0); c2--)  // take_slot's free slots: none refuses
        if (!free_[c2].empty()) return false;
    return qpol_->refuse(u, [&](int w) {  // take_slot's victims
        if (!evictable_[w]) return false;
        const int64_t b = slots_[units_[w].slot].bytes;
        return (slot_mode_ ? b == need : b >= need) && !(!pf_.empty() && inflight_neighbour(w));
    });
}

void pager::settle_misses(int li, const std::vector<int> & misses, std::vector<io_job> & jobs, const std::vector<int> & job_unit) {
    const io_job * failed = nullptr;
    std::vector<int> bad_units;
    for (size_t i = 0; i < jobs.size(); i++) {
        const io_job & j = jobs[i];
        stats_.bytes_read += j.len;
        stats_.read_us += j.t_us;
        if (j.err != 0 || j.got < j.need) {
            if (!failed) failed = &j;
            if (std::find(bad_units.begin(), bad_units.end(), job_unit[i]) == bad_units.end()) bad_units.push_back(job_unit[i]);
        }
    }
    for (size_t i = 0; i < misses.size(); i++) {
        const int u = misses[i];
        if (std::find(bad_units.begin(), bad_units.end(), u) != bad_units.end()) continue;
        try {
            map_unit(u);
        } catch (...) {
            // mmap failed part-way (ENOMEM): this unit, the misses not mapped yet and the failed
            // reads never become resident; unmap the slices mapped (boundary pages go back to
            // resident neighbours), give back their slots and unpin.
            units_[u].mapped = true;
            unmap_unit(u);
            for (size_t k = 0; k < misses.size(); k++) {
                const int v = misses[k];
                if (k >= i || std::find(bad_units.begin(), bad_units.end(), v) != bad_units.end()) free_unit_slot(v);
            }
            release_layer(li);
            throw;
        }
    }
    if (failed) {
        for (int u : bad_units) free_unit_slot(u);
        release_layer(li);
        throw_read_error(*failed);
    }
}

void pager::router_update(int li, const std::vector<int32_t> & picked) {
    if (policy_ == FNU) fnu_update(li, picked);
    if (qpol_) qpol_->router(li, picked);
}

void pager::policy_request(int u, bool resident) {
    unit & x = units_[u];
    if (policy_ == LFUDA && resident) {
        x.freq++;
        x.prio = lfuda_age_ + x.freq;
    } else if (policy_ == HEAT) {
        x.heat = x.heat * std::pow(2.0, -(double) (pass_ - x.heat_pass) / half_life_) + 1.0;
        x.heat_pass = pass_;
        const double key = std::log2(x.heat) + (double) pass_ / half_life_;  // >= 0: its bits order as it does
        std::memcpy(&x.prio, &key, sizeof key);
    } else if (policy_ == GATE_RANK) {
        // heat's rule with the request's router probability mass for its 1 (issue 50's gate-rank);
        // the key may be negative, so its bits are mapped to an order-preserving int64.
        x.heat = x.heat * std::pow(2.0, -(double) (pass_ - x.heat_pass) / half_life_) + gate_mass_[u];
        gate_mass_[u] = 0;
        x.heat_pass = pass_;
        const double key = std::log2(std::max(x.heat, 1e-300)) + (double) pass_ / half_life_;
        int64_t b;
        std::memcpy(&b, &key, sizeof key);
        x.prio = b < 0 ? INT64_MIN - b : b;  // negative doubles order backwards as raw bits
    }
    if (qpol_) qpol_->request(u, resident);
}

void pager::policy_insert(int u) {
    if (policy_ == LFUDA) {
        units_[u].freq = 1;
        units_[u].prio = lfuda_age_ + 1;
    }
    if (qpol_) qpol_->insert(u);
}

// fnu predicts when each expert of layer li is next requested, in layer steps (pass * L + layer):
// the layer comes round again in the next pass, and the expert is picked there with probability
// p = its pick rate (an EMA over the passes, weight alpha on the newest), so the expected wait
// is L / p steps from now (geometric). Belady's rule then evicts the farthest prediction.
void pager::fnu_update(int li, const std::vector<int32_t> & picked) {
    const int L = (int) layers_.size();
    for (int e = 0; e < n_expert_; e++) {
        const int u = unit_id(li, e);
        unit & x = units_[u];
        // In an evictable set (not pinned, not being read by a prefetch or protected by one).
        const key_t key = key_of(u);
        const bool in_set = x.slot >= 0 && !x.pinned && (stale_.count(key) || current_.count(key) || hot_.count(key));
        if (in_set) erase_evictable(u);
        const double hit = std::binary_search(picked.begin(), picked.end(), e) ? 1.0 : 0.0;
        pick_rate_[u] = (1 - fnu_alpha_) * pick_rate_[u] + fnu_alpha_ * hit;
        const double wait = (double) L / std::max(pick_rate_[u], 1e-3);
        x.next_use = (int64_t) pass_ * L + li + (int64_t) wait;
        if (in_set) insert_evictable(u);
    }
}

bool pager::request_layer(int li, const int32_t * ids, int k, int n_tokens, std::vector<int32_t> * staged_ids) {
    prefetch_finish_for(li, ids, k * n_tokens);  // li's batches; others may read on
    if (dm_active_) demand_finish();
    std::vector<int32_t> uni(ids, ids + (size_t) k * n_tokens);
    std::sort(uni.begin(), uni.end());
    uni.erase(std::unique(uni.begin(), uni.end()), uni.end());
    router_update(li, uni);
    if ((int) uni.size() > capacity(li)) {
        if (staged_ids) *staged_ids = std::move(uni);
        return false;
    }
    refused_.clear();
    refusing_ = staged_ids != nullptr;  // only a caller that stages may have misses refused a slot
    try {
        if (n_tokens == 1) load_layer(li, ids, k, nullptr);
        else load_layer(li, uni.data(), (int) uni.size(), nullptr);
    } catch (...) {
        refusing_ = false;
        refused_.clear();
        throw;
    }
    refusing_ = false;
    if (refused_.empty()) return true;
    refused_.clear();
    *staged_ids = std::move(uni);  // the refused experts are read by the staging, the others copied
    return false;
}

void pager::set_gate_mass(int li, const int32_t * ids, const float * p, int n) {
    if (policy_ != GATE_RANK) return;
    if (gate_mass_.size() != units_.size()) gate_mass_.assign(units_.size(), 0.0);
    for (int u : gate_touched_) gate_mass_[u] = 0;
    gate_touched_.clear();
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= n_expert_) continue;
        const int u = unit_id(li, ids[i]);
        if (gate_mass_[u] == 0) gate_touched_.push_back(u);
        gate_mass_[u] += (double) p[i];
    }
}

void pager::replay(const int32_t * ex, int64_t T, int L, int k, const int32_t * ub, const std::vector<int> & lidx,
                   const float * probs) {
    if (policy_ == GATE_RANK && !probs)
        throw std::invalid_argument("policy gate_rank replays need each selected expert's router probability: a route "
                                    "log recorded by this version (its `probs` array)");
    prefetch_finish();
    if (dm_active_) demand_finish();
    if ((int) lidx.size() != L) throw std::invalid_argument("layer_index must have one entry per log layer");
    for (int li : lidx)
        if (li < 0 || li >= (int) layers_.size()) throw std::out_of_range("MoE layer index " + std::to_string(li) + " out of range");
    // Steps as the live hook sees them: per ubatch, per layer, the routed tokens' ids.
    struct step { int li; int n_tokens; bool first; std::vector<int32_t> ids, units; std::vector<float> p; };
    std::vector<step> steps;
    for (int64_t t0 = 0; t0 < T;) {
        int64_t t1 = t0 + 1;
        while (t1 < T && ub[t1] == ub[t0]) t1++;
        bool first = true;
        for (int l = 0; l < L; l++) {
            step s{lidx[l], 0, first, {}, {}};
            for (int64_t t = t0; t < t1; t++) {
                const int32_t * row = ex + (t * L + l) * k;
                if (row[0] < 0) continue;  // not routed through this layer (non-output token, last layer)
                s.ids.insert(s.ids.end(), row, row + k);
                if (probs) s.p.insert(s.p.end(), probs + (t * L + l) * k, probs + (t * L + l) * k + k);
                s.n_tokens++;
            }
            if (s.n_tokens == 0) continue;
            std::vector<int32_t> uni(s.ids);
            std::sort(uni.begin(), uni.end());
            uni.erase(std::unique(uni.begin(), uni.end()), uni.end());
            if ((int) uni.size() <= capacity(s.li))  // a staged layer makes no requests
                for (int32_t e : uni) s.units.push_back(unit_id(s.li, e));
            first = false;
            steps.push_back(std::move(s));
        }
        t0 = t1;
    }
    // Belady: each request's next use is the index of the next step requesting the same unit.
    std::vector<std::vector<int64_t>> next(policy_ == BELADY ? steps.size() : 0);
    if (policy_ == BELADY) {
        std::vector<int64_t> seen(units_.size(), INT64_MAX / 2);
        for (int64_t i = (int64_t) steps.size() - 1; i >= 0; i--) {
            for (int u : steps[i].units) next[i].push_back(seen[u]);
            for (int u : steps[i].units) seen[u] = i;
        }
    }
    int prev = -1;
    std::vector<int32_t> staged;  // as the hook asks: a policy may refuse misses a slot (admission staging)
    for (size_t i = 0; i < steps.size(); i++) {
        const step & s = steps[i];
        if (prev >= 0) release_layer(prev);
        if (s.first) begin_pass();
        if (policy_ == BELADY)
            for (size_t j = 0; j < s.units.size(); j++) pending_next_[s.units[j]] = next[i][j];
        if (probs) set_gate_mass(s.li, s.ids.data(), s.p.data(), (int) s.ids.size());
        request_layer(s.li, s.ids.data(), k, s.n_tokens, &staged);
        prev = s.li;
    }
    if (prev >= 0) release_layer(prev);
}

void pager::check_file() const {
    for (const auto & f : files_) {
        struct stat st{};
        if (fstat(f.fd, &st) == 0 &&
            ((int64_t) st.st_size != f.size || (int64_t) st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec != f.mtime_ns)) {
            throw pager_io_error("the model file " + f.path + " changed (size or mtime) since the pager opened it: its experts "
                                 "would mix with older bytes already in memory; reopen the session", f.path, 0, ESTALE);
        }
    }
}

void pager::run_reads(std::vector<io_job> & jobs) {
    const int64_t t0 = io_now_us();
    pool_->run(files_[0].fd, !direct_, jobs);
    redo_refused_direct(jobs);
    stats_.io_wait_us += io_now_us() - t0;
}

void pager::redo_refused_direct(std::vector<io_job> & jobs) {
    if (!direct_) return;
    // A file system that took O_DIRECT at open may still refuse a read: go buffered, redo those.
    bool redo = false;
    for (auto & j : jobs) redo |= j.err == EINVAL;
    if (!redo) return;
    // Queued reads hold the descriptors about to be closed: let them finish first, so none reads a
    // reused descriptor number. Prefetch results are settled by their batch as usual; a pending
    // pipelined load's refused reads are redone here too (its own redo would find direct_ off).
    for (auto & b : pf_) pool_->wait_jobs(b->jobs, 0, b->jobs.size());
    std::vector<std::vector<io_job> *> sets{&jobs};
    if (dm_active_ && &jobs != &dm_jobs_) {
        pool_->wait_jobs(dm_jobs_, 0, dm_jobs_.size());
        sets.push_back(&dm_jobs_);
    }
    std::vector<int> fds(files_.size(), -1);
    for (size_t i = 0; i < files_.size(); i++) fds[i] = open(files_[i].path.c_str(), O_RDONLY | O_CLOEXEC);
    if (std::find(fds.begin(), fds.end(), -1) == fds.end()) {
        for (auto * js : sets)
            for (auto & j : *js)
                for (size_t i = 0; i < files_.size(); i++)
                    if (j.fd == files_[i].fd) j.fd = fds[i];
        for (size_t i = 0; i < files_.size(); i++) {
            close(files_[i].fd);
            files_[i].fd = fds[i];
        }
        direct_ = false;
        for (auto * js : sets)
            for (auto & j : *js)
                if (j.err == EINVAL) { std::vector<io_job> one{j}; pool_->run(j.fd, true, one); j = one[0]; }
    } else {
        for (int fd : fds) if (fd >= 0) close(fd);
    }
}

void pager::throw_read_error(const io_job & j) const {
    std::string path_ = files_[0].path;
    for (const auto & f : files_) if (f.fd == j.fd) path_ = f.path;
    std::string what = j.err
        ? "read of " + std::to_string(j.len) + " bytes at offset " + std::to_string(j.offset) + " of " + path_ + " failed: " + errstr(j.err)
        : "short read at offset " + std::to_string(j.offset) + " of " + path_ + ": got " + std::to_string(j.got) + " of " +
              std::to_string(j.need) + " bytes (was the file truncated or replaced?)";
    throw pager_io_error(what, path_, j.offset, j.err ? j.err : EIO);
}
