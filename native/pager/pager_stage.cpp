// pager_stage: staging a matrix of an oversize ubatch, and lending arena memory to it (pager.h).
//
// Invariant: staging never changes the bytes a matmul reads -- a staged matrix holds, at each
// file page of the union's slices, that page's bytes (copied from a resident slot, or read) --
// and with lending on, the arena's pages plus the staged pages never exceed the arena's size:
// every byte a staged matrix touches was first taken out of the arena as whole slots whose
// memfd pages were punched out (free slots first, then unpinned residents, evicted as any
// victim is), and lent slots hold no unit and take no read until unlend gives them back.
#include "pager.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fcntl.h>

void * pager::stage_tensor(int li, int ti, const int32_t * ids, int n, char * dst) {
    prefetch_finish();
    if (dm_active_) demand_finish();
    const tensor_map & m = maps_.at(li).at(ti);
    std::vector<int32_t> es(ids, ids + n);
    std::sort(es.begin(), es.end());
    es.erase(std::unique(es.begin(), es.end()), es.end());
    if (!es.empty() && (es.front() < 0 || es.back() >= n_expert_))
        throw std::out_of_range("expert id out of range [0, " + std::to_string(n_expert_) + ")");
    // Resident experts: copy their pages from the region (every page of a resident expert's
    // slice is mapped and holds that file page's bytes). Others: page ranges to read, merged.
    std::vector<std::pair<int64_t, int64_t>> want;
    for (int32_t e : es) {
        int64_t p0, p1;
        expert_pages(m, e, p0, p1);
        if (units_[unit_id(li, e)].mapped) {
            const char * src = slot_mode_ ? fill_ + slots_[units_[unit_id(li, e)].slot].offset + m.sub_off
                                          : m.region + (p0 - m.first_page) * page_;
            memcpy(dst + (p0 - m.first_page) * page_, src, (size_t) ((p1 - p0) * page_));
            stats_.staged_copies++;
            continue;
        }
        stats_.staged_reads++;
        if (!want.empty() && p0 <= want.back().second) want.back().second = std::max(want.back().second, p1);
        else want.emplace_back(p0, p1);
    }
    // Split long runs into segments so the pool reads them in parallel.
    const int64_t seg = std::max<int64_t>(page_, (int64_t) (4 << 20) / page_ * page_);
    const int64_t tensor_end = m.offset + (int64_t) n_expert_ * m.expert_bytes;
    std::vector<io_job> jobs;
    for (const auto & w : want) {
        for (int64_t off = w.first * page_; off < w.second * page_; off += seg) {
            io_job j;
            j.offset = off;
            j.len    = std::min(seg, w.second * page_ - off);
            j.need   = std::min(off + j.len, tensor_end) - off;
            j.dst    = dst + (off / page_ - m.first_page) * page_;
            j.fd     = files_[m.file].fd;
            jobs.push_back(j);
        }
    }
    if (!jobs.empty()) {
        check_file();
        run_reads(jobs);
    }
    for (const auto & j : jobs) {
        stats_.bytes_read += j.len;
        stats_.staged_bytes += j.len;
        stats_.read_us += j.t_us;
    }
    for (const auto & j : jobs)
        if (j.err != 0 || j.got < j.need) throw_read_error(j);
    return dst + (m.offset - m.first_page * page_);
}

int64_t pager::stage_need(int li, const int32_t * ids, int n) const {
    std::vector<int32_t> es(ids, ids + n);
    std::sort(es.begin(), es.end());
    es.erase(std::unique(es.begin(), es.end()), es.end());
    int64_t most = 0;
    for (const tensor_map & m : maps_.at(li)) {
        int64_t pages = 0, hi = -1;  // merged page ranges, as stage_tensor touches them
        for (int32_t e : es) {
            if (e < 0 || e >= n_expert_) continue;
            int64_t p0, p1;
            expert_pages(m, e, p0, p1);
            pages += p1 - std::max(p0, hi);
            hi = std::max(hi, p1);
        }
        most = std::max(most, pages * page_);
    }
    return most;
}

int64_t pager::lend(int li, const int32_t * keep, int n, int64_t bytes) {
    prefetch_finish();
    if (dm_active_) demand_finish();
    if (lent_bytes_ >= bytes) return lent_bytes_;
    std::vector<int32_t> kept(keep, keep + n);
    std::sort(kept.begin(), kept.end());
    auto give = [&](int s) {
        punch_slot(s, "staging");
        lent_.push_back(s);
        lent_bytes_ += slots_[s].bytes;
        stats_.stage_lent_bytes += slots_[s].bytes;
    };
    stats_.stage_lends++;
    for (auto & fl : free_) {
        while (lent_bytes_ < bytes && !fl.empty()) {
            const int s = fl.back();
            fl.pop_back();
            give(s);
        }
    }
    // Victims in the evictable order; the staged layer's union last (staging copies those).
    for (int round = 0; round < 2 && lent_bytes_ < bytes; round++) {
        std::vector<int> victims;
        int64_t got = lent_bytes_;
        for (const auto * set : {&stale_, &current_, &hot_}) {
            for (const key_t & k : *set) {
                if (got >= bytes) break;
                const int u = std::get<2>(k);
                const bool own = u / n_expert_ == li && std::binary_search(kept.begin(), kept.end(), u % n_expert_);
                if (own != (round == 1)) continue;
                victims.push_back(u);
                got += slots_[units_[u].slot].bytes;
            }
        }
        for (int u : victims) {
            const int s = units_[u].slot;
            evict(u, li);
            stats_.stage_lent_evictions++;
            give(s);
        }
    }
    if (lent_bytes_ < bytes) {
        const int64_t had = lent_bytes_;
        unlend();
        throw pager_capacity_error("staging needs " + std::to_string(bytes) + " bytes of the arena for layer " +
                                   std::to_string(layers_[li]) + " but only " + std::to_string(had) +
                                   " can be freed (pinned experts hold the rest). Use a larger arena or a smaller ubatch.");
    }
    return lent_bytes_;
}

void pager::unlend() {
    const std::vector<int> back = std::move(lent_);
    lent_.clear();
    lent_bytes_ = 0;
    for (int s : back) {
        if (fill_) {  // reads land in allocated pages (reserve_arena's rule)
            int r;
            do r = posix_fallocate(memfd_, (off_t) slots_[s].offset, (off_t) slots_[s].bytes); while (r == EINTR);
            (void) r;  // a failure leaves a hole: the read that fills the slot allocates it then
        }
        free_[slots_[s].cls].push_back(s);
    }
    // every lent slot is back: pin the chunks again (their pages as they are now); one that cannot be
    // pinned, or holds a slot resize took out, stays out of use and its slots are read with pread
    for (size_t c = 0; c < chunk_out_.size(); c++)
        if (chunk_out_[c] && chunk_clear((int32_t) c) && pool_->set_fixed_buffer((int) c, true) == 0) chunk_out_[c] = 0;
}

