// pager_pipeline: the pipelined demand load, tensor by tensor (see pager.h,
// request_layer_async).
//
// Invariant: the requests, hits, pins, evictions and slots are exactly those of load_layer for
// the same ids (with this layer's prefetch batches still reading, their experts count as hits
// at once and are waited for after the misses were queued), and so are the bytes in the region
// when ggml reads a matrix: wait_tensor maps a unit's slice of tensor ti only after every read
// of that slice completed, and a unit becomes resident (mapped) only when all of its slices
// were read and mapped. Until then it is pinned, so nothing evicts it; the operations that may
// run meanwhile are later layers' prefetch batches (prefetch_start evicts on this thread before
// queuing its reads; their workers map only their own units) and release of the previous
// layer; every other pager operation first calls demand_finish. A failed read or mmap leaves
// the units unmapped (mapped slices are unmapped again) and their slots free, as in load_layer.
// Demand reads are queued ahead of every speculative read still waiting for a thread.
#include "pager.h"

#include <algorithm>
#include <cerrno>
#include <stdexcept>
#include <string>
#include <sys/mman.h>

static bool job_failed(const io_job & j) { return j.err != 0 || j.got < j.need; }

int pager::map_tensor_pages(int u, int ti, bool populate) const {
    if (slot_mode_) return 0;  // ggml reads the slot through the fill mapping (set_slot_addressing)
    if (map_fault_countdown_.load() > 0 && map_fault_countdown_.fetch_sub(1) == 1) return ENOMEM;  // test hook
    const int li = u / n_expert_, e = u % n_expert_;
    run_pending_around(li, ti, e);  // deferred unmaps of these pages (its own last eviction's, neighbours') first
    const slot & sl = slots_[units_[u].slot];
    const auto & m = maps_[li][ti];
    int64_t p0, p1;
    expert_pages(m, e, p0, p1);
    char * addr = m.region + (p0 - m.first_page) * page_;
    void * r = mmap(addr, (size_t) ((p1 - p0) * page_), PROT_READ | PROT_WRITE,
                    MAP_SHARED | MAP_FIXED | (populate ? MAP_POPULATE : 0), memfd_, (off_t) (sl.offset + m.sub_off));
    return r == MAP_FAILED ? errno : 0;
}

bool pager::request_layer_async(int li, const int32_t * ids, int k, const std::vector<int> & order) {
    if (dm_active_) demand_finish();
    std::vector<int32_t> uni(ids, ids + k);
    std::sort(uni.begin(), uni.end());
    uni.erase(std::unique(uni.begin(), uni.end()), uni.end());
    if ((int) uni.size() > capacity(li)) return false;  // before fnu_update: the caller's request_layer does it
    if (qpol_ && qpol_->stages()) return false;  // admission staging: request_layer may stage the layer instead
    // A batch of this layer still reading: cancel its mispredicted reads no thread started, and
    // queue the misses before waiting for it, so their reads overlap its tail (its experts were
    // requested as hits; place_misses takes no victim sharing a page with them).
    prefetch_cancel_others(li, ids, k);
    const bool early = prefetch_active(li);
    router_update(li, uni);

    std::vector<io_job> jobs;
    std::vector<int> job_unit, job_tensor;
    std::vector<int> misses = place_misses(li, ids, k, nullptr, jobs, job_unit, &job_tensor);
    if (misses.empty()) {
        finish_batches(li);
        load_failed_prefetches(li, ids, k);  // no-op unless a prefetched read of them failed
        return true;
    }

    // Read order: the tensors as the graph computes them, then any other in index order.
    const int nt = (int) maps_[li].size();
    std::vector<int> seq;
    for (int ti : order)
        if (ti >= 0 && ti < nt && std::find(seq.begin(), seq.end(), ti) == seq.end()) seq.push_back(ti);
    for (int ti = 0; ti < nt; ti++)
        if (std::find(seq.begin(), seq.end(), ti) == seq.end()) seq.push_back(ti);
    dm_jobs_.clear();
    dm_job_unit_.clear();
    dm_job_tensor_.clear();
    dm_ranges_.clear();
    for (int ti : seq) {
        const size_t from = dm_jobs_.size();
        for (size_t i = 0; i < jobs.size(); i++) {
            if (job_tensor[i] != ti) continue;
            dm_jobs_.push_back(jobs[i]);
            dm_job_unit_.push_back(job_unit[i]);
            dm_job_tensor_.push_back(ti);
        }
        dm_ranges_.push_back({ti, {from, dm_jobs_.size()}});
    }
    dm_done_.assign(dm_ranges_.size(), 0);
    dm_misses_ = std::move(misses);
    dm_li_ = li;
    dm_active_ = true;
    stats_.pipelined_loads++;
    stats_.pipelined_early += early;
    // Demand reads go ahead of every queued speculative one: the first matrix's first, then (early)
    // this layer's prefetched experts still queued, which it needs as much, then the rest.
    const size_t first_end = dm_ranges_.empty() ? 0 : dm_ranges_[0].second.second;
    pool_->enqueue(files_[0].fd, !direct_, dm_jobs_, first_end, dm_jobs_.size(), true);
    if (early) pool_->promote([&](int u) { return u / n_expert_ == li && pf_inflight_[u]; });
    pool_->enqueue(files_[0].fd, !direct_, dm_jobs_, 0, first_end, true);
    finish_batches(li);
    load_failed_prefetches(li, ids, k);  // no-op unless a prefetched read of them failed
    return true;
}

void pager::wait_tensor(int li, int ti) {
    if (!dm_active_ || dm_li_ != li) return;
    size_t r = 0;
    while (r < dm_ranges_.size() && dm_ranges_[r].first != ti) r++;
    if (r == dm_ranges_.size() || dm_done_[r]) return;
    const size_t from = dm_ranges_[r].second.first, to = dm_ranges_[r].second.second;
    const int64_t t0 = io_now_us();
    pool_->wait_jobs(dm_jobs_, from, to);
    stats_.io_wait_us += io_now_us() - t0;
    bool failed = false;
    for (size_t i = from; i < to; i++) failed |= job_failed(dm_jobs_[i]);
    if (failed) {
        demand_finish();  // waits for the rest, cleans up, throws
        return;
    }
    // Map this tensor's slice of every unit whose reads of it completed (all of them here).
    const int64_t t1 = io_now_us();
    int err = 0;
    for (int u : dm_misses_)
        if (!err) err = map_tensor_pages(u, ti, false);
    stats_.map_us += io_now_us() - t1;
    if (err) {
        // mmap failed part-way (ENOMEM): none of the layer's misses becomes resident. Wait for
        // every read, unmap what was mapped (boundary pages go back to resident neighbours), free
        // the slots, unpin the layer, report.
        dm_active_ = false;
        pool_->wait_jobs(dm_jobs_, 0, dm_jobs_.size());
        for (const auto & j : dm_jobs_) {
            stats_.bytes_read += j.len;
            stats_.read_us += j.t_us;
        }
        dm_jobs_.clear();
        for (int u : dm_misses_) {
            units_[u].mapped = true;
            unmap_unit(u);
            free_unit_slot(u);
        }
        release_layer(li);
        throw std::runtime_error(map_error(err));
    }
    dm_done_[r] = 1;
    if (std::find(dm_done_.begin(), dm_done_.end(), 0) == dm_done_.end()) demand_finish();
}

void pager::demand_finish() {
    if (!dm_active_) return;
    dm_active_ = false;  // first: the calls below may not recurse into a finish
    const int64_t t0 = io_now_us();
    pool_->wait_jobs(dm_jobs_, 0, dm_jobs_.size());
    redo_refused_direct(dm_jobs_);
    stats_.io_wait_us += io_now_us() - t0;
    const int li = dm_li_;
    // Slices mapped by wait_tensor: unmap them again where any read of the unit failed (the
    // unit will not be resident), count the unit mapped where all succeeded.
    std::vector<int> bad;
    for (size_t i = 0; i < dm_jobs_.size(); i++)
        if (job_failed(dm_jobs_[i]) && std::find(bad.begin(), bad.end(), dm_job_unit_[i]) == bad.end()) bad.push_back(dm_job_unit_[i]);
    bool any_mapped = false;
    for (uint8_t d : dm_done_) any_mapped |= d != 0;
    if (any_mapped) {
        for (int u : bad) {
            units_[u].mapped = true;  // unmap_unit restores neighbours' boundary pages
            unmap_unit(u);
        }
    }
    // The rest is load_layer's settlement, for the tensors not mapped yet.
    std::vector<io_job> rest;
    std::vector<int> rest_unit;
    std::vector<int> ok;
    for (size_t r = 0; r < dm_ranges_.size(); r++) {
        const size_t from = dm_ranges_[r].second.first, to = dm_ranges_[r].second.second;
        if (dm_done_[r]) {  // counted here; already mapped
            for (size_t i = from; i < to; i++) {
                stats_.bytes_read += dm_jobs_[i].len;
                stats_.read_us += dm_jobs_[i].t_us;
            }
            continue;
        }
        for (size_t i = from; i < to; i++) {
            rest.push_back(dm_jobs_[i]);
            rest_unit.push_back(dm_job_unit_[i]);
        }
    }
    dm_jobs_.clear();
    if (rest.empty() && bad.empty()) {  // every slice was waited for and mapped: resident now
        for (int u : dm_misses_) units_[u].mapped = true;
        return;
    }
    // settle_misses maps whole units; a unit's slices mapped already are mapped again onto the
    // same slot pages, which changes nothing.
    settle_misses(li, dm_misses_, rest, rest_unit);
}
