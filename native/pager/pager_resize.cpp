// pager_resize: taking whole slots out of the arena and giving them back while a model runs (pager.h resize).
//
// Invariant: a retired slot holds no unit, is on no free list, takes no read and has no pages in the
// memfd (punched out, so the kernel and a memory cgroup uncharge them), and no io_uring chunk that
// holds it is registered; every slot in use has all its pages allocated and, with a fill mapping,
// mapped there (reads never allocate). Which experts are resident changes only as evictions do,
// never the bytes a matmul reads: a retired slot's occupant was evicted as any victim is.
#include "pager.h"

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <sys/mman.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels answer EINVAL and the pages are touched instead
#endif

void pager::punch_slot(int s, const char * what) {
    if (slots_[s].pending) run_pending(slots_[s].pending);  // no region page maps the slot afterwards
    if (!slot_chunk_.empty() && slot_chunk_[s] >= 0 && !chunk_out_[slot_chunk_[s]]) {
        // no read is in flight (the callers finished them): unpin the chunk before its pages are punched out
        pool_->set_fixed_buffer(slot_chunk_[s], false);
        chunk_out_[slot_chunk_[s]] = 1;
    }
    int r;
    do r = fallocate(memfd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t) slots_[s].offset, (off_t) slots_[s].bytes);
    while (r != 0 && errno == EINTR);
    if (r != 0)
        throw std::runtime_error(std::string("cannot give an arena slot's pages back for ") + what + ": " + strerror(errno));
}

void pager::refill_slot(int s) {
    if (!fill_) return;  // without the fill mapping reads allocate through pwrite (Pager(prefault=False))
    const slot & sl = slots_[s];
    int r;
    do r = posix_fallocate(memfd_, (off_t) sl.offset, (off_t) sl.bytes); while (r == EINTR);
    if (r != 0) throw std::runtime_error("cannot allocate " + std::to_string(sl.bytes) + " bytes for an arena slot: " + errstr(r));
    char * p = fill_ + sl.offset;
    if (madvise(p, (size_t) sl.bytes, MADV_POPULATE_WRITE) != 0) {
        // the pages are allocated: reading one byte of each maps it without allocating another
        for (int64_t off = 0; off < sl.bytes; off += page_) (void) *(volatile const char *) (p + off);
    }
}

bool pager::chunk_clear(int32_t ch) const {
    for (size_t s = 0; s < slots_.size(); s++)
        if (slot_chunk_[s] == ch && slots_[s].retired) return false;
    for (int s : lent_)
        if (slot_chunk_[s] == ch) return false;
    return true;
}

std::vector<int32_t> pager::active_class_n() const {
    std::vector<int32_t> n(class_n_);
    for (const auto & sl : slots_) n[sl.cls] -= sl.retired;
    return n;
}

int64_t pager::min_arena_bytes() const {
    int64_t b = 0;
    for (size_t c = 0; c < class_bytes_.size(); c++) {
        if (!slot_mode_ && c > 0) break;
        b += std::min<int64_t>(top_k_, class_n_[c]) * class_bytes_[c];
    }
    return b;
}

bool pager::apply_requested_resize() {
    if (resize_target_.load() < 0) return false;
    for (const auto & p : pinned_)
        if (!p.empty()) return false;  // the next call (a layer later) applies it
    if (!lent_.empty()) return false;
    const int64_t t = resize_target_.exchange(-1);
    if (t < 0) return false;
    const int64_t before = arena_bytes();
    try {
        resize(std::max(t, min_arena_bytes()));
    } catch (const std::exception &) {
        return false;  // a refused or failed resize leaves the arena as it was (resize undoes nothing half-done)
    }
    return arena_bytes() != before;
}

int64_t pager::resize(int64_t bytes) {
    const int64_t t_start = io_now_us(), ev_start = stats_.evictions;
    prefetch_finish();
    if (dm_active_) demand_finish();
    for (const auto & p : pinned_)
        if (!p.empty()) throw std::logic_error("resize while layer experts are pinned: resize between forward passes");
    if (!lent_.empty()) unlend();
    const int64_t least = min_arena_bytes();
    if (bytes < least)
        throw pager_capacity_error("an arena of " + std::to_string(bytes) + " bytes cannot hold one layer's top-" +
                                   std::to_string(top_k_) + " experts; the smallest arena that works is " +
                                   std::to_string(least) + " bytes");
    std::vector<int32_t> want = split_arena(class_bytes_, n_units_, top_k_, std::min(bytes, arena_size_));
    for (size_t c = 0; c < want.size(); c++) {
        want[c] = std::min(want[c], class_n_[c]);
        if (slot_mode_ || c == 0) want[c] = std::max<int32_t>(want[c], std::min<int32_t>(top_k_, class_n_[c]));
    }
    std::vector<int32_t> have = active_class_n();
    for (size_t c = 0; c < want.size(); c++) {
        while (have[c] > want[c]) {  // take a slot out: a free one (highest-numbered first), else the policy's victim
            int s = -1;
            auto & fl = free_[c];
            if (!fl.empty()) {
                auto it = std::max_element(fl.begin(), fl.end());
                s = *it;
                fl.erase(it);
            } else {
                s = take_slot(0, class_bytes_[c], false, -1, true);
            }
            punch_slot(s, "a smaller arena");
            slots_[s].retired = true;
            retired_bytes_ += slots_[s].bytes;
            have[c]--;
        }
        while (have[c] < want[c]) {  // give one back: the lowest-numbered retired slot of the class
            int s = -1;
            for (int i = class_first_[c]; i < class_first_[c] + class_n_[c]; i++)
                if (slots_[i].retired) { s = i; break; }
            refill_slot(s);
            slots_[s].retired = false;
            retired_bytes_ -= slots_[s].bytes;
            free_[c].push_back(s);
            if (!slot_chunk_.empty() && slot_chunk_[s] >= 0 && chunk_out_[slot_chunk_[s]] && chunk_clear(slot_chunk_[s]) &&
                pool_->set_fixed_buffer(slot_chunk_[s], true) == 0)
                chunk_out_[slot_chunk_[s]] = 0;
            have[c]++;
        }
    }
    resizes_++;
    last_resize_us_ = io_now_us() - t_start;
    last_resize_evictions_ = stats_.evictions - ev_start;
    return arena_bytes();
}
