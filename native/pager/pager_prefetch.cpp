// pager_prefetch: speculative reads of predicted experts, in batches (see pager.h, prefetch_start).
//
// Invariant: a prefetch changes when bytes are read, never which: a unit a batch reads holds a
// slot but is neither resident nor evictable until its batch is finished, and it becomes
// resident only if every read of it completed (the I/O worker that completed the last one maps
// it; the finish flags it). Victims of any slot taken while batches are in flight are units in
// the evictable sets that share no page with a unit being read, so no eviction races with a
// worker's mmap. Pinned units are never victims; a batch's predicted resident units leave the
// evictable sets until the batch's layer is finished. A carried batch (the next token's layers)
// outlives the decode that started it under the same rules: the next request of its layer, or
// any other pager operation, finishes it. Only the compute thread changes pager
// state; workers touch the per-unit atomics and the region pages of the units they read.
#include "pager.h"

#include <algorithm>
#include <exception>
#include <stdexcept>
#include <string>

int pager::prefetch_start(int li, const int32_t * ids, int n, bool background, bool carried) {
    if (li < 0 || li >= (int) layers_.size()) throw std::out_of_range("MoE layer index " + std::to_string(li) + " out of range");
    try {
        check_file();
    } catch (const pager_io_error &) {
        return 0;  // the demand read will report it
    }
    auto b = std::make_unique<pf_batch>();
    b->li = li;
    b->carried = carried;
    // First protect every predicted expert already resident (and evictable): the prefetch must
    // not evict its own predictions to make room for others.
    std::vector<int> want;
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= n_expert_) continue;  // a predictor's garbage is not an error
        const int u = unit_id(li, ids[i]);
        if (std::find(want.begin(), want.end(), u) != want.end()) continue;
        want.push_back(u);
        unit & x = units_[u];
        if (x.slot >= 0 && !x.pinned && !pf_inflight_[u] && !pf_prot_[u]) {
            erase_evictable(u);
            pf_prot_[u] = 1;
            b->protected_.push_back(u);
        }
    }
    if (!background)  // predicted again, one layer ahead: reads queued as background become ordinary
        pool_->promote([&](int u) { return pf_inflight_[u] && std::find(want.begin(), want.end(), u) != want.end(); });
    for (int u : want) {
        if (units_[u].slot >= 0) continue;  // resident, or being read
        int s;
        try {
            if (qpol_) qpol_->admit(u);
            if (admission_refused(li, u)) continue;  // admission staging refuses it a slot: not prefetched
            s = take_slot(li, unit_bytes_[li], true, u);  // victims: evictable, away from pages being read
        } catch (const pager_capacity_error &) {
            break;  // nothing left to evict: prefetch what has a slot
        }
        units_[u].slot = s;
        slots_[s].unit = u;
        policy_insert(u);  // a prefetched unit enters the policy as a miss does, without a request
        pf_inflight_[u] = 1;
        pf_left_[u] = 0;
        pf_bad_[u] = 0;
        pf_mapped_[u] = 0;
        b->units.push_back(u);
        unit_jobs(u, b->jobs, b->job_unit);
        stats_.prefetch_units++;
    }
    const int issued = (int) b->units.size();
    if (b->units.empty() && b->protected_.empty()) return 0;
    for (int u : b->job_unit) pf_left_[u]++;
    // The worker that completes a unit's last read maps it (and prefaults its page tables) while
    // the compute thread works on: no eviction touches a page of a unit being read, so these
    // mmaps race with nothing; the unit becomes resident at its batch's finish.
    for (auto & j : b->jobs) {
        j.notify = j.cancelable = true;  // prefetch_job_done (set_after in init); speculative
        j.background = background;
    }
    pool_->enqueue(files_[0].fd, !direct_, b->jobs);
    pf_.push_back(std::move(b));
    return issued;
}

void pager::prefetch_job_done(io_job & j) {
    const int u = j.tag;
    if (j.cancel || j.err != 0 || j.got < j.need) pf_bad_[u] = 1;
    if (pf_left_[u].fetch_sub(1) != 1 || pf_bad_[u]) return;
    const int64_t t0 = io_now_us();
    pf_mapped_[u] = map_pages(u, true) == 0 ? 1 : 2;
    pf_map_us_ += io_now_us() - t0;
}

void pager::prefetch_cancel_others(int li, const int32_t * ids, int n) {
    if (!prefetch_active(li)) return;
    std::vector<int> keep;
    for (int i = 0; i < n; i++)
        if (ids[i] >= 0 && ids[i] < n_expert_) keep.push_back(unit_id(li, ids[i]));
    auto kept = [&](int u) { return std::find(keep.begin(), keep.end(), u) != keep.end(); };
    pool_->cancel_pending([&](int u) { return u / n_expert_ != li || kept(u); });
    // The requested ones are waited for now: first in the queue, no longer background.
    pool_->promote([&](int u) { return u / n_expert_ == li && pf_inflight_[u] && kept(u); });
}

void pager::prefetch_finish_for(int li, const int32_t * ids, int n) {
    prefetch_cancel_others(li, ids, n);
    finish_batches(li);
}

void pager::prefetch_finish(bool keep_carried) { finish_batches(-1, keep_carried); }

void pager::finish_batches(int li, bool keep_carried) {
    // Taken out of pf_ first: finishing may not recurse into the same batch.
    std::vector<std::unique_ptr<pf_batch>> done;
    for (auto it = pf_.begin(); it != pf_.end();) {
        if ((li < 0 && !(keep_carried && (*it)->carried)) || (*it)->li == li) {
            done.push_back(std::move(*it));
            it = pf_.erase(it);
        } else {
            ++it;
        }
    }
    // Every batch's reads (and so its workers' mmaps) complete before any is settled: settling
    // one may unmap a failed unit's pages, which must not race with a worker of another batch of
    // the same layer mapping a neighbour; and no job outlives its batch if settling throws.
    const int64_t t0 = io_now_us();
    for (auto & b : done) pool_->wait_jobs(b->jobs, 0, b->jobs.size());
    const int64_t waited = io_now_us() - t0;
    stats_.prefetch_wait_us += waited;
    stats_.io_wait_us += waited;
    std::exception_ptr first;
    for (auto & b : done) {
        try {
            finish_batch(*b);
        } catch (...) {
            if (!first) first = std::current_exception();
        }
    }
    if (first) std::rethrow_exception(first);
}

void pager::finish_batch(pf_batch & b) {  // its jobs were waited for (finish_batches)
    std::vector<int> bad;
    for (size_t i = 0; i < b.jobs.size(); i++) {
        const io_job & j = b.jobs[i];
        if (j.cancel) {
            if (std::find(bad.begin(), bad.end(), b.job_unit[i]) == bad.end()) bad.push_back(b.job_unit[i]);
            continue;  // not read
        }
        stats_.bytes_read += j.len;
        stats_.prefetch_bytes += j.len;
        stats_.read_us += j.t_us;
        // O_DIRECT refused at read time (EINVAL) counts as failed too: the demand read redoes it.
        if ((j.err != 0 || j.got < j.need) && std::find(bad.begin(), bad.end(), b.job_unit[i]) == bad.end())
            bad.push_back(b.job_unit[i]);
    }
    stats_.prefetch_map_us += pf_map_us_.exchange(0);
    // First flag every unit a worker mapped, so that unmapping a failed one below restores a
    // shared boundary page from a neighbour mapped in this same batch.
    for (int u : b.units)
        if (pf_mapped_[u] == 1) units_[u].mapped = true;
    for (int u : b.units) {
        unit & x = units_[u];
        pf_inflight_[u] = 0;
        if (pf_mapped_[u] == 2) {  // read, but its mmap failed part-way: give its pages back, count it failed
            x.mapped = true;
            unmap_unit(u);
            if (std::find(bad.begin(), bad.end(), u) == bad.end()) bad.push_back(u);
        }
        if (std::find(bad.begin(), bad.end(), u) != bad.end()) {
            free_unit_slot(u);
            bool cancelled = false;
            for (size_t k = 0; k < b.jobs.size(); k++) cancelled |= b.job_unit[k] == u && b.jobs[k].cancel;
            if (cancelled) stats_.prefetch_cancelled++;
            else stats_.prefetch_failed++;
            continue;
        }
        if (pf_mapped_[u] != 1) map_unit(u);  // else mapped by the worker that completed its reads (flagged above)
        x.prefetched = !x.pinned;  // pinned: requested while in flight, its use counted then (place_misses)
        if (!x.pinned) insert_evictable(u);
    }
    for (int u : b.protected_) {
        pf_prot_[u] = 0;
        if (units_[u].slot >= 0 && !units_[u].pinned) insert_evictable(u);
    }
}

bool pager::inflight_neighbour(int u) const {
    const int li = u / n_expert_, e = u % n_expert_;
    for (const tensor_map & m : maps_[li]) {
        int64_t lo, hi;
        sharing_experts(m, e, lo, hi);
        for (int64_t e2 = lo; e2 <= hi; e2++)
            if (e2 != e && pf_inflight_[li * n_expert_ + e2]) return true;
    }
    return false;
}

void pager::load_failed_prefetches(int li, const int32_t * ids, int n) {
    std::vector<int> late;
    for (int i = 0; i < n; i++) {
        const int u = unit_id(li, ids[i]);
        if (units_[u].slot < 0 && std::find(late.begin(), late.end(), u) == late.end()) late.push_back(u);
    }
    if (late.empty()) return;
    std::vector<io_job> jobs;
    std::vector<int> job_unit;
    size_t placed = 0;
    try {
        for (int u : late) {
            stats_.hits--;  // counted as a hit (and its prefetch as used) while in flight: a miss after all
            stats_.layer_hits[li]--;
            if (!stats_.pass_hits.empty()) stats_.pass_hits.back()--;
            stats_.misses++;
            stats_.prefetch_used--;
            for (const auto & m : maps_[li]) {
                int64_t p0, p1;
                expert_pages(m, u % n_expert_, p0, p1);
                stats_.prefetch_used_bytes -= (p1 - p0) * page_;
            }
            if (qpol_) qpol_->admit(u);
            const int s = take_slot(li, unit_bytes_[li], false, u);
            units_[u].slot = s;
            slots_[s].unit = u;
            policy_insert(u);
            placed++;
            unit_jobs(u, jobs, job_unit);
        }
    } catch (...) {
        for (size_t i = 0; i < placed; i++) free_unit_slot(late[i]);
        release_layer(li);
        throw;
    }
    run_reads(jobs);
    settle_misses(li, late, jobs, job_unit);
}
