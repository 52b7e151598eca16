// pager: routed-expert residency in a fixed RAM arena.
//
// Invariant: for every expert tensor the pager owns a virtual range (the "region") laid out
// exactly like the tensor's bytes in the file ("mirror" layout: region page p holds file page
// first_page + p, so a 32-byte-aligned tensor and slices that are not page multiples need no
// copy). A page of the region is readable only while some resident (layer, expert) whose
// slice touches that page backs it with its slot, or while it still maps the slot of the
// evicted expert it belonged to and that slot was not written again (its unmap is deferred
// to the reads that rewrite the slot, off the compute thread: unmap_task); every other page
// is PROT_NONE, so a bug faults instead of computing on stale or foreign bytes. A unit is marked resident only after all of
// its matrices were read completely; a failed read leaves it unmapped and its slot free.
// With slot addressing on (set_slot_addressing) nothing is ever mapped into the region: every
// page of it stays PROT_NONE, ggml reads a resident expert in its slot through the fill mapping,
// and "mapped" below means only "resident"; a unit then lives only in slots of its own class.
// Pinned units (those of the layer being computed) are never victims. The pager knows
// nothing of llama.cpp: it pages byte ranges of one file, or of the shards of a split model
// (one descriptor per file; each tensor is read from its own). The eviction policy decides only
// which unpinned unit loses its slot, never what is read or computed: every policy yields the
// same bytes in the region, so logits do not depend on it.
#pragma once

#include <array>
#include <atomic>

#include <cstdint>
#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <unistd.h>

#include "io_pool.h"
#include "policy_queues.h"

std::string errstr(int e);      // "strerror text (errno N)"
std::string map_error(int err);  // the message of a failed mmap of an expert slot

struct pager_tensor_spec {
    int64_t offset;        // absolute offset of the tensor data in its file, bytes
    int64_t expert_bytes;  // nb[2]: bytes of one expert's slice
    int32_t file = 0;      // index into pager_config::paths (0 unless the model is split)
};

struct pager_layer_spec {
    int32_t                        layer;    // GGUF block id
    std::vector<pager_tensor_spec> tensors;  // gate, up, down (or gate_up, down)
};

// Eviction policy names, indexed by pager::policy_id. The Python side names them in
// epqlab/constants.py (PAGER_POLICIES); the binding exports this list as epqlab._pager_core.POLICIES
// and tests/test_constants.py checks the two agree.
inline constexpr const char * POLICY_NAMES[] = {"lru", "ls", "ls_pos", "lfu", "static", "belady", "fnu",
                                                "lfuda", "heat", "arc", "2q", "sieve", "s3fifo", "wtinylfu", "coact",
                                                "lirs", "gate_rank"};
inline constexpr int N_POLICIES = sizeof(POLICY_NAMES) / sizeof(POLICY_NAMES[0]);

struct pager_config {
    std::string                   path;            // the model file (first shard of a split model)
    std::vector<std::string>      paths;           // every file, shards in order; empty = {path}
    std::vector<pager_layer_spec> layers;          // MoE layers in block order
    int32_t                       n_expert = 0;
    int32_t                       n_expert_used = 0;  // top-k; the arena reserves k largest slots
    int64_t                       arena_bytes = 0;
    std::string                   policy = "lru";  // lru | ls | ls_pos | lfu | static | fnu | belady (replay only)
    double                        fnu_alpha = 0.3;  // fnu: weight of the newest pass in each expert's pick rate
    // The other policies' parameters (heat: half_life; 2q: kin, kout; s3fifo: small_ratio, ghost_ratio,
    // move_threshold; wtinylfu: window, protected, sample_factor), every one present: Python fills the
    // defaults and checks the ranges (epqlab/routes/policy_params.py).
    std::map<std::string, double> policy_params;
    int32_t                       io_threads = 1;
    bool                          direct_io = true;
};

// Thrown when a request cannot fit even after evicting every unpinned expert, or when the
// arena cannot hold one layer's top-k largest experts.
struct pager_capacity_error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// A read failed or came back short. Carries what Python needs to name the problem.
struct pager_io_error : std::runtime_error {
    std::string path;
    int64_t     offset;
    int         err;
    pager_io_error(const std::string & msg, std::string p, int64_t off, int e)
        : std::runtime_error(msg), path(std::move(p)), offset(off), err(e) {}
};

struct pager_stats {
    int64_t requests = 0, hits = 0, misses = 0, evictions = 0;
    int64_t evictions_by_group[4] = {0, 0, 0, 0};  // stale-left, current-left, stale-right, current-right
    int64_t bytes_read = 0;      // bytes requested from the file (whole pages)
    int64_t read_us = 0;         // sum of per-read durations, microseconds
    int64_t io_wait_us = 0;      // wall time load_layer spent waiting for reads, microseconds
    int64_t map_us = 0;          // wall time spent in mmap for residency/eviction, microseconds
    int64_t evict_unmap_us = 0;  // the part of map_us spent unmapping victims (evict): their shared edge pages, µs
    int64_t evict_unmap_io_us = 0;  // I/O threads' time unmapping victims' other pages (not in map_us: off the compute thread), µs
    int64_t load_calls = 0;
    int64_t passes = 0;
    int64_t staged_bytes = 0;    // bytes read by stage_tensor (also counted in bytes_read)
    int64_t staged_reads = 0;    // expert slices stage_tensor read from the file
    int64_t staged_copies = 0;   // expert slices stage_tensor copied from resident slots
    int64_t stage_lends = 0;       // lend calls that freed slots for a staged matrix (stage lending)
    int64_t stage_lent_bytes = 0;  // arena bytes those calls took out of use (slot bytes, summed)
    int64_t stage_lent_evictions = 0;  // residents evicted to lend their slots (also in evictions)
    // Prefetch (speculative reads of a next layer's predicted experts, see prefetch_start):
    int64_t prefetch_units = 0;       // units read speculatively (placed in a slot)
    int64_t prefetch_bytes = 0;       // their bytes (also counted in bytes_read)
    int64_t prefetch_used = 0;        // prefetched units requested while still resident (first request)
    int64_t prefetch_used_bytes = 0;  // their bytes; prefetch_bytes - this = bytes read in vain (so far)
    int64_t prefetch_failed = 0;      // prefetched units whose read failed (slot freed, no error raised)
    int64_t prefetch_wait_us = 0;     // wall time prefetch_finish waited for reads (also in io_wait_us)
    int64_t prefetch_cancelled = 0;   // prefetched units whose reads were cancelled (mispredicted, not started)
    int64_t pipelined_loads = 0;      // request_layer_async calls that queued reads (pipelined layers)
    int64_t pipelined_early = 0;      // ... of them queued while the layer's prefetch was still reading (not waited for first)
    int64_t admission_staged = 0;     // misses the policy refused a slot (admit = stage): read by the layer's staging
    int64_t prefetch_map_us = 0;      // I/O workers' time mapping prefetched units (not in map_us: off the compute thread)
    std::vector<int64_t> layer_requests, layer_hits;  // per MoE layer index
    std::vector<int32_t> pass_requests, pass_hits;    // per forward pass since the reset, in order
};

class pager {
public:
    explicit pager(const pager_config & cfg);
    ~pager();
    pager(const pager &) = delete;
    pager & operator=(const pager &) = delete;

    // Slot bytes one (layer, expert) unit of each layer needs under the mirror layout.
    static std::vector<int64_t> unit_slot_bytes(const std::vector<pager_layer_spec> & layers, int32_t n_expert);

    // Makes the given experts of MoE layer index li resident and pinned. ids may repeat;
    // each distinct id is one request. hit_out[i] = 1 if ids[i] was already resident.
    void load_layer(int li, const int32_t * ids, int n, uint8_t * hit_out);
    // What one ubatch asks of MoE layer index li, the same for the live hook and for replay:
    // ids [n_tokens, k] as the router ranked them. A single token's experts are requested in
    // router order; several tokens' distinct experts sorted. When they outnumber the layer's
    // slots nothing is requested and false is returned with the sorted union in *staged_ids
    // (the caller stages that layer). The caller releases the previous layer first.
    // Admission staging (a policy whose stages() is true: wtinylfu with admit = stage), only when
    // staged_ids is given: a miss the policy refuses a slot (queue_policy::refuse) takes none and
    // evicts nothing; the requests count as usual, the other misses are loaded, and false is returned
    // with the sorted union in *staged_ids, so the caller stages the layer (its residents are copied,
    // the refused experts read). Without staged_ids every miss takes a slot.
    bool request_layer(int li, const int32_t * ids, int k, int n_tokens, std::vector<int32_t> * staged_ids);
    // Drives the pager through a route log exactly as the live hook does: experts [T, L, k]
    // (-1 = that token was not routed through that layer), ubatch [T] (equal consecutive ids form
    // one forward pass), layer_index [L]. For policy "belady" the next use of each request is
    // computed from the log itself (Belady's MIN under the same constraints).
    // probs [T, L, k] (or null): each selected expert's router probability, which gate_rank
    // needs (set_gate_mass before each step, as the hook does); gate_rank without it throws.
    void replay(const int32_t * experts, int64_t T, int L, int k, const int32_t * ubatch, const std::vector<int> & layer_index,
                const float * probs = nullptr);
    // gate_rank: the router probability mass of layer li's next request, p[i] for ids[i] (n entries,
    // summed per expert in the order given); consumed by that request (policy_request). A no-op for
    // the other policies. The hook calls it with the step's ids just before request_layer*.
    void set_gate_mass(int li, const int32_t * ids, const float * p, int n);
    bool needs_gate_mass() const { return policy_ == GATE_RANK; }
    // Policy "static": units (li * n_expert + e) evicted only when no other victim exists.
    void set_hot(const std::vector<int32_t> & units);
    // Staging, for a ubatch whose experts in layer li exceed the slots: copies the slices of the
    // distinct experts ids[0..n) of tensor ti into dst, laid out like the file's pages (dst page
    // p holds file page first_page + p; dst page-aligned, stage_bytes(li, ti) long): resident
    // experts are copied from their slots, the others read from the file with the I/O pool.
    // Residency and eviction state do not change. Returns the tensor's data pointer inside dst.
    // Throws pager_io_error on a failed or short read.
    void * stage_tensor(int li, int ti, const int32_t * ids, int n, char * dst);
    int64_t stage_bytes(int li, int ti) const { return maps_.at(li).at(ti).region_bytes; }
    int32_t n_expert() const { return n_expert_; }  // experts per MoE layer
    int64_t max_stage_bytes() const {
        int64_t mx = 0;
        for (const auto & ms : maps_) for (const auto & m : ms) mx = std::max(mx, m.region_bytes);
        return mx;
    }
    // Stage lending (docs/DESIGN.md §3 item 8): the memory a staged matrix needs comes out of the
    // arena instead of a reserve beside it, so a budget holds the arena and staging together
    // without keeping a whole matrix's span idle for the rare oversize ubatch.
    // stage_need: the bytes stage_tensor touches for the distinct experts ids[0..n) of layer li,
    // the most over its tensors (each matrix's pages are dropped before the next is staged).
    // lend: frees at least `bytes` of arena memory -- free slots first, then unpinned residents by
    // the evictable order (those of layer li listed in keep[0..n) last, since staging copies them) --
    // punching their memfd pages out (the kernel uncharges them) and keeping the slots out of use
    // until unlend. Returns the bytes lent in all; throws pager_capacity_error when the arena
    // cannot free that much. unlend: the lent slots are allocated again (when the fill mapping
    // exists: reads never allocate) and freed; the caller has dropped its staged pages first.
    // Every other load finds no lent slot: the hook unlends before a layer that is not staged.
    int64_t stage_need(int li, const int32_t * ids, int n) const;
    int64_t lend(int li, const int32_t * keep, int n, int64_t bytes);
    void    unlend();
    int64_t lent_bytes() const { return lent_bytes_; }
    void    set_stage_lending(bool on) { lend_on_ = on; }
    bool    stage_lending() const { return lend_on_; }
    // Lossy skip-cold support: until layer li is released, the slices of the experts ids[0..n)
    // of every tensor of layer li read as zeros. The experts must not be resident. Pages only
    // they touch get the zero page; a boundary page shared with a resident expert gets a private
    // copy of the file page with the skipped experts' bytes zeroed, so no neighbour's bytes
    // change. Residency, slots and stats do not change.
    void zero_overlay(int li, const int32_t * ids, int n);
    // Unpins every pinned expert of MoE layer index li and removes its zero overlay.
    void release_layer(int li);
    void release_all();
    // Prefetch (speculation; the bytes computed never depend on it). Starts reading, in the
    // background on the I/O pool, the experts ids[0..n) of MoE layer index li (priority order)
    // that are neither resident nor in flight, each into a free slot or one freed by the policy's
    // victim: a batch. Victims come from the evictable sets only, so pinned experts (the layer
    // being computed) and experts other batches are reading are never evicted, nor an expert
    // sharing a page with one being read; the predicted experts of li already resident are taken
    // out of those sets until li's batches finish, so the prefetch never evicts its own
    // predictions. Stops (without error) at the first unit no slot can be freed for. Returns the
    // units issued. Several batches (of different or equal layers) may be in flight: a request of
    // layer li finishes li's batches only; a demand load that finds no victim finishes all of them
    // and retries; every other pager operation first finishes every batch.
    // background: the batch's reads are io_job::background (deep speculation, a layer beyond the
    // next): few run at once, so they never hold every I/O thread.
    // carried: the batch is for the next forward pass (a prediction past the last layer that
    // wrapped around to the next token's first layers): prefetch_finish(true) leaves it in flight.
    int  prefetch_start(int li, const int32_t * ids, int n, bool background = false, bool carried = false);
    // Waits for every batch in flight (keep_carried: but the carried ones); the units whose reads all completed were mapped by the
    // I/O worker that finished them (page tables prefaulted, off the compute thread) and become
    // resident and evictable, not pinned; frees the slots of failed ones. No-op when none.
    void prefetch_finish(bool keep_carried = false);
    // The same for the batches of layer li only, when li is about to request ids[0..n): reads of
    // other (mispredicted) experts of li that no I/O thread has started are cancelled first, so
    // the wait is only for what is needed (and what is already being read).
    void prefetch_finish_for(int li, const int32_t * ids, int n);
    // Cancels the queued reads of li's batches of experts not in ids[0..n), and moves the others
    // to the front of the queue as ordinary (not background) jobs.
    void prefetch_cancel_others(int li, const int32_t * ids, int n);
    bool prefetch_active() const { return !pf_.empty(); }
    bool in_flight(int li, int e) const { return pf_inflight_[unit_id(li, e)] != 0; }  // a batch is reading it
    bool prefetch_active(int li) const {
        for (const auto & b : pf_) if (b->li == li) return true;
        return false;
    }
    // Pipelined demand load (pager_pipeline.cpp), the hook's path for one token: the same
    // requests, hits, evictions and pins as request_layer(li, ids, k, 1), but the misses' reads
    // are queued on the I/O pool tensor by tensor in `order` (the order the graph computes the
    // layer's matrices; tensors not listed follow in index order) and the call returns at once.
    // wait_tensor(li, ti) then waits only for tensor ti's reads and maps those slices, so the
    // later tensors' reads overlap the earlier matrices' compute. The units become resident
    // once every tensor was waited for (or at demand_finish). Returns false (nothing requested)
    // when the distinct ids outnumber the layer's slots. Every other pager operation first
    // finishes a pending load; a read error is thrown by the wait that meets it (or by
    // demand_finish), after the layer's slots were cleaned up as in load_layer.
    bool request_layer_async(int li, const int32_t * ids, int k, const std::vector<int> & order);
    void wait_tensor(int li, int ti);
    void demand_finish();
    bool demand_pending(int li) const { return dm_active_ && dm_li_ == li; }
    // Segment-parallel reads: each expert slice read on a miss is split into jobs of at most
    // this many bytes (page multiple, rounded down; 0 = one job per slice), spread over the pool.
    void set_read_segment_bytes(int64_t b) { seg_bytes_ = b <= 0 ? 0 : std::max<int64_t>(page_, b / page_ * page_); }
    int64_t read_segment_bytes() const { return seg_bytes_; }
    // Test hook: every read sleeps this many microseconds first (io_pool::set_delay_us).
    void set_read_delay_us(int64_t us) { pool_->set_delay_us(us); }
    int64_t read_delay_us() const { return pool_->delay_us(); }
    // Bench hook: reads served as by a device of this many bytes/s (io_pool::set_rate_limit); 0 = off.
    void set_read_rate_limit(int64_t bps) { pool_->set_rate_limit(bps); }
    int64_t read_rate_limit() const { return pool_->rate_limit(); }
    int64_t unit_bytes(int li) const { return unit_bytes_.at(li); }
    // Starts a new forward pass (token or ubatch): "current" experts become "stale".
    void begin_pass();

    // Data pointer of tensor ti of MoE layer index li inside the region (what ggml should read).
    void * tensor_data(int li, int ti) const;
    // Where resident expert e's slice of tensor ti of layer li is readable now: in the region, or,
    // with slot addressing on, in its slot through the fill mapping. Throws std::invalid_argument if
    // the expert is not resident.
    const char * expert_data(int li, int ti, int e) const;

    // Slot addressing (docs/DESIGN.md §3f). Off: every resident expert is mapped into the region at
    // its own offset (the mirror layout above), and each load or eviction is an mmap. On: nothing
    // is ever mapped into the region; ggml reads an expert tensor through the fill mapping as a
    // tensor of n_slots "experts" with a stride of one slot (slot_view), and the caller rewrites a
    // matmul's expert ids into slot indices (slot_of). A layer's units then take only slots of
    // their own class (one stride per tensor), so every class needs at least top-k slots. It needs
    // every expert slice a whole number of pages (so each expert of a tensor starts at the same
    // offset in its first page), the fill mapping (reserve_arena) and no resident expert yet.
    // Returns "" when on (or off, as asked), else why it cannot be on (it stays off).
    std::string set_slot_addressing(bool on);
    bool slot_addressed() const { return slot_mode_; }
    // With slot addressing on: the address of tensor ti's slice of layer li's unit in the first
    // slot of the layer's class, the stride between slots (bytes) and the class's slot count.
    // ggml reads slot index s's slice at data + s * stride.
    void slot_view(int li, int ti, void ** data, int64_t * stride, int64_t * n_slots) const;
    // The slot of (layer li, expert e), as an index within its class, while resident or being read
    // (pinned or prefetched), else -1.
    int32_t slot_of(int li, int e) const {
        const int32_t s = units_[unit_id(li, e)].slot;
        return s < 0 ? -1 : s - class_first_[slots_[s].cls];
    }
    bool   is_resident(int li, int e) const { return units_[unit_id(li, e)].mapped; }
    // Per slot in use, for live views (epqlab.widgets.ArenaView): {slot class, MoE layer index or -1
    // (free), expert or -1, pinned 0/1, hot 0/1} for each slot in order. Read-only; call it between
    // passes (as any other accessor, not concurrently with a load).
    std::vector<std::array<int32_t, 5>> slot_states() const {
        std::vector<std::array<int32_t, 5>> out;  // slots resize took out are left out
        for (size_t i = 0; i < slots_.size(); i++) {
            if (slots_[i].retired) continue;
            const int u = slots_[i].unit;
            out.push_back({slots_[i].cls, u >= 0 ? u / n_expert_ : -1, u >= 0 ? u % n_expert_ : -1,
                           u >= 0 && units_[u].pinned ? 1 : 0, u >= 0 && units_[u].hot ? 1 : 0});
        }
        return out;
    }
    int    n_layers() const { return (int) layers_.size(); }
    // Slots large enough for one unit of MoE layer index li: the most experts of that layer
    // one load_layer call can hold when nothing else is pinned.
    int    capacity(int li) const;
    int    layer_index(int32_t block) const;  // -1 if block has no experts

    const pager_stats & stats() const {
        stats_.evict_unmap_io_us += deferred_us_.exchange(0);  // includes the few run on this thread
        return stats_;
    }
    void reset_stats();
    bool direct_io() const { return direct_; }
    int  io_threads() const { return pool_->n_threads(); }
    int64_t io_busy_us() const { return pool_->busy_us(); }  // io_pool::busy_us
    // Bytes of the slots in use now (the arena after resize); capacity_bytes(): the memfd's size, the most
    // resize can give back.
    int64_t arena_bytes() const { return arena_size_ - retired_bytes_; }
    int64_t capacity_bytes() const { return arena_size_; }
    // Live resize (docs/DESIGN.md §5, "Resizing the arena"): the arena becomes the slots split_arena gives
    // `bytes` (at most those the memfd was made with; in every class at least min(top-k, slots) with
    // slot addressing, in the largest class without), whole slots taken out of use or given back per
    // class. A slot taken out is a free one (the highest-numbered first) or, when none is free, the
    // policy's victim of that class, evicted as any victim is; its memfd pages are punched out, so
    // the kernel (and a memory cgroup) uncharges them at once. A slot given back is allocated again and
    // its fill-mapping pages populated before it is freed (reads never allocate: reserve_arena's rule).
    // Finishes prefetches and a pending pipelined load first, ends stage lending, and refuses (std::logic_error)
    // while a layer is pinned. Throws pager_capacity_error below min_arena_bytes(). Returns arena_bytes().
    // Queue policies (arc, 2q, s3fifo, wtinylfu, lirs) keep the sizes they derived from the slot count at creation.
    int64_t resize(int64_t bytes);
    // The smallest arena resize accepts, bytes: top-k slots of every class (slot addressing) or of the largest.
    int64_t min_arena_bytes() const;
    int64_t resizes() const { return resizes_; }
    // follow_memory's monitor thread asks for a resize (any thread: an atomic store); the thread that runs the
    // pager applies it at the next point where nothing is pinned or lent: the hook before each layer's load
    // (so a shrink waits one layer, not one forward pass), or apply_requested_resize between passes.
    void request_resize(int64_t bytes) { resize_target_.store(bytes); }
    int64_t requested_resize() const { return resize_target_.load(); }
    // Applies a requested resize (never throws: a refusal keeps the arena and drops the request); true if the
    // arena changed. last_resize_us: how long the last resize took, µs.
    bool apply_requested_resize();
    int64_t last_resize_us() const { return last_resize_us_; }
    int64_t last_resize_evictions() const { return last_resize_evictions_; }  // victims the last resize evicted
    // Slots in use per class (class_n_slots() minus those resize took out).
    std::vector<int32_t> active_class_n() const;
    // How split_arena divides `bytes` among slot classes of class_bytes (largest first) with
    // n_units units each, reserving k of the largest: slots per class.
    static std::vector<int32_t> split_arena(const std::vector<int64_t> & class_bytes, const std::vector<int64_t> & n_units,
                                            int64_t k, int64_t bytes);
    // Allocate every page of the arena memfd now (posix_fallocate) and map the whole memfd once,
    // populated (the fill mapping); returns 0 or the errno. Reads then go O_DIRECT straight into the
    // slot's pages through that mapping: no bounce-buffer copy, no pwrite under the memfd's inode
    // lock, no page allocated during a read (docs/DESIGN.md §3 item 7). The mapping is never zapped
    // or remapped, so it costs no TLB shootdowns; it maps every arena page a second time, which
    // RssShmem counts twice (fill_bytes() lets accounting take it out, §5). Call before the first load.
    int reserve_arena();
    // Reads into the arena through io_uring registered buffers (io_pool::use_fixed_buffers; docs/DESIGN.md
    // §3e): the fill mapping's slots, in chunks of consecutive slots (at most 4096 chunks of <= 1 GiB), are
    // registered once; stage lending takes a chunk out of use before punching a slot of it out of the
    // memfd and registers it again when the slots come back (lend / unlend). Needs the fill mapping
    // (reserve_arena) and no read in flight; "" or why it is not used (reads stay pread).
    std::string use_io_uring();
    // Reads through registered buffers / with pread since the pager started.
    int64_t fixed_reads() const { return pool_->fixed_reads(); }
    int64_t plain_reads() const { return pool_->plain_reads(); }
    // Bytes of the fill mapping (0 before reserve_arena or when it was not made).
    int64_t fill_bytes() const { return fill_ ? arena_size_ - retired_bytes_ : 0; }
    // Bytes of the arena memfd that hold pages (st_blocks): what the arena charges to memory.
    int64_t arena_resident_bytes() const;
    const std::vector<int64_t> & class_slot_bytes() const { return class_bytes_; }
    const std::vector<int32_t> & class_n_slots() const { return class_n_; }
    int64_t n_resident() const;
    const std::string & policy() const { return policy_name_; }
    void inject_fault(int64_t nth, int err) { pool_->inject_fault(nth, err); }
    // Test hook: the n-th mmap of an expert slice into the region from now (1-based, on any
    // thread) fails with ENOMEM, as when vm.max_map_count runs out. 0 disables.
    void inject_map_fault(int64_t nth) { map_fault_countdown_ = nth; }
    // posix_fadvise(DONTNEED) over tensor ti of layer li's bytes in the file.
    void drop_file_cache(int li, int ti) const;

private:
    struct tensor_map {
        int64_t offset, expert_bytes;
        int32_t file;           // index into files_
        int64_t first_page;     // file page index of the tensor's first byte
        char *  region;         // page-aligned base of the reserved range
        int64_t region_bytes;
        int64_t sub_off;        // offset of this tensor's pages inside a unit's slot
        int64_t sub_bytes;      // max pages any expert of this tensor spans, in bytes
    };
    struct unit {
        int32_t  slot = -1;
        uint64_t last_use = 0;
        uint64_t last_pass = 0;
        uint64_t count = 0;       // requests so far (lfu)
        int64_t  next_use = 0;    // step of the next request (belady, replay only)
        int64_t  prio = 0;        // lfuda: K = age + freq; heat, gate_rank: log2(heat) + pass / half_life, as ordered bits
        int64_t  freq = 0;        // lfuda: requests while resident
        double   heat = 0;        // heat: decayed requests at heat_pass; gate_rank: decayed router probability mass
        uint64_t heat_pass = 0;
        bool     hot = false;     // static policy: evicted last
        bool     pinned = false;
        bool     mapped = false;  // its slot backs its pages in the region (it is resident)
        bool     prefetched = false;  // read by a prefetch and not requested since
    };
    struct unmap_task;  // below
    struct slot {
        int64_t offset;
        int64_t bytes;
        int32_t cls;
        int32_t unit = -1;
        bool    retired = false;  // out of the arena until resize gives it back (its pages punched out)
        // The unmap of the previous occupant's pages (see unmap_task); every read into the slot
        // runs it first. Null when the slot never had a victim whose unmap was deferred.
        std::shared_ptr<unmap_task> pending;
    };
    // A victim's deferred unmap. evict only remaps, at once, the edge pages of its slices that a
    // resident (or pinned, being loaded) neighbour also touches; every other page of its slices
    // still maps its old slot afterwards and is listed here, merged into ranges. They must become
    // PROT_NONE before the slot's new bytes are written (every read job into the slot runs the
    // task first, on its I/O thread) and before the expert or a neighbour sharing one of those
    // pages is mapped (map_tensor_pages and zero_overlay run the pending tasks of the experts
    // whose slices touch the pages they map). std::call_once makes every order safe: whoever
    // comes first unmaps, the others wait for it or return. No other unit's mapping covers
    // these pages until then, so the task races with no other region operation.
    struct unmap_task {
        std::once_flag                        once;
        std::vector<std::pair<char *, size_t>> ranges;  // (address, bytes) to make PROT_NONE
    };
    using key_t = std::tuple<int64_t, uint64_t, int32_t>;  // (primary, last_use, unit)

    void init(const pager_config & cfg);
    void release_resources();  // idempotent: what the destructor (or a failed init) gives back
    int  unit_id(int li, int e) const { return li * n_expert_ + e; }
    key_t key_of(int u) const;
    void insert_evictable(int u);
    void erase_evictable(int u);
    // speculative (a prefetch): fail rather than finish the batches in flight when no victim fits.
    // u_in: the unit the slot is for (queue policies' victim choice; -1 unknown).
    // exact: a slot of exactly need_bytes (resize's class) even with region addressing.
    int  take_slot(int li, int64_t need_bytes, bool speculative = false, int u_in = -1, bool exact = false);
    void evict(int u, int loading_li);
    // Gives unit u's slot back to the free list (u is not resident afterwards). Its pages must
    // already be unmapped, or never have been mapped.
    void free_unit_slot(int u);
    void map_unit(int u);
    void unmap_unit(int u);
    // evict's unmap: u is not mapped afterwards; its edge pages that a mapped or pinned neighbour
    // touches are remapped now (restore_page), and the rest is returned as a deferred unmap
    // (null when nothing is left).
    std::shared_ptr<unmap_task> unmap_deferred(int u);
    void run_pending(const std::shared_ptr<unmap_task> & t) const;  // runs it once (any thread)
    // Runs the pending tasks of every expert whose slice of tensor ti of layer li touches a page
    // that expert e's slice touches (e's own included): before e's slice is mapped.
    void run_pending_around(int li, int ti, int e) const;
    // Per unit: its last eviction's deferred unmap. Written by the compute thread (evict) only
    // while no I/O worker maps (no prefetch in flight); read by workers through std::atomic_load.
    std::vector<std::shared_ptr<unmap_task>> unit_pending_;
    mutable std::atomic<int64_t> deferred_us_{0};   // time spent in deferred unmaps (any thread)
    void expert_pages(const tensor_map & t, int e, int64_t & p0, int64_t & p1) const;
    // First and last expert whose slice of tensor t touches file page p.
    void page_experts(const tensor_map & t, int64_t p, int64_t & e_lo, int64_t & e_hi) const;
    // First and last expert whose slice of tensor t shares a page with expert e's slice (e included).
    void sharing_experts(const tensor_map & t, int e, int64_t & e_lo, int64_t & e_hi) const;
    // Maps file page p of tensor ti of layer li as the invariant says: from the slot of a resident
    // expert that touches it, else PROT_NONE.
    void restore_page(int li, int ti, int64_t p);
    void clear_zero_overlay(int li);
    // Runs reads on the pool (redoing O_DIRECT refusals buffered), adds the wait to io_wait_us.
    void run_reads(std::vector<io_job> & jobs);
    // Throws pager_io_error (ESTALE) when a file's size or mtime differ from those at open.
    void check_file() const;
    [[noreturn]] void throw_read_error(const io_job & j) const;
    // Opens every file (O_DIRECT when asked and every file takes it); throws pager_io_error.
    void open_files(const std::vector<std::string> & paths, bool direct);
    void close_files();

    struct file_state {  // owns fd: closed when the pager (or a throwing constructor) lets go
        std::string path;
        int         fd = -1;
        int64_t     size = 0, mtime_ns = 0;  // at open: a read batch refuses a changed file
        file_state() = default;
        file_state(file_state && o) noexcept : path(std::move(o.path)), fd(o.fd), size(o.size), mtime_ns(o.mtime_ns) { o.fd = -1; }
        file_state & operator=(file_state && o) noexcept {
            if (this != &o) { if (fd >= 0) ::close(fd); path = std::move(o.path); fd = o.fd; size = o.size; mtime_ns = o.mtime_ns; o.fd = -1; }
            return *this;
        }
        file_state(const file_state &) = delete;
        ~file_state() { if (fd >= 0) ::close(fd); }
    };
    std::vector<file_state>      files_;           // the model's files (shards), in order
    bool                         direct_ = false;
    int                          memfd_ = -1;
    bool                         lend_on_ = false;  // set_stage_lending
    std::vector<int>             lent_;             // slots lent to staging (out of use until unlend)
    int64_t                      retired_bytes_ = 0;  // bytes of the slots resize took out of use
    int64_t                      resizes_ = 0;
    std::atomic<int64_t>         resize_target_{-1};  // request_resize; -1 none
    int64_t                      last_resize_us_ = 0;
    int64_t                      last_resize_evictions_ = 0;
    std::vector<int64_t>         n_units_;            // units per slot class
    // Gives slot s's memfd pages back to the kernel (FALLOC_FL_PUNCH_HOLE), its deferred unmap run
    // and its io_uring chunk unregistered first; the slot holds no unit. what: for the error message.
    void punch_slot(int s, const char * what);
    // Allocates slot s's memfd pages again and populates them in the fill mapping (when there is one).
    void refill_slot(int s);
    // Whether io_uring chunk ch holds no slot that is retired or lent (it can be registered again).
    bool chunk_clear(int32_t ch) const;
    int64_t                      lent_bytes_ = 0;
    std::vector<int32_t>         slot_chunk_;   // use_io_uring: each slot's registered buffer (-1: none)
    std::vector<uint8_t>         chunk_out_;    // ... buffers taken out of use by stage lending
    char *                       fill_ = nullptr;  // reserve_arena's populated mapping of the whole memfd (reads land here)
    int64_t                      arena_size_ = 0;
    int64_t                      page_ = 4096;
    bool                         slot_mode_ = false;  // set_slot_addressing
    int32_t                      top_k_ = 1;          // the config's n_expert_used, clamped to 1..n_expert
    int32_t                      n_expert_ = 0;
    enum policy_id { LRU = 0, LS = 1, LS_POS = 2, LFU = 3, STATIC = 4, BELADY = 5, FNU = 6, LFUDA = 7, HEAT = 8,
                     ARC = 9, TWOQ = 10, SIEVE = 11, S3FIFO = 12, WTINYLFU = 13, COACT = 14,
                     LIRS = 15, GATE_RANK = 16 };
    // After layer li's router ran (request_layer, request_layer_async): fnu's and the queue policies' update.
    void router_update(int li, const std::vector<int32_t> & picked);
    // The queue-based policies (arc, 2q, sieve, s3fifo, wtinylfu, coact, lirs: policy_queues.h); null for the others,
    // which order the evictable sets by key_of. evictable_: per unit, in an evictable set.
    std::unique_ptr<queue_policy> qpol_;
    std::vector<uint8_t>         evictable_;
    int64_t                      lfuda_age_ = 0;   // lfuda: the last victim's K
    double                       half_life_ = 128;  // heat, gate_rank: forward passes
    std::vector<double>          gate_mass_;        // gate_rank: per unit, the pending request's router probability mass
    std::vector<int>             gate_touched_;     // units with a pending mass (cleared by the next set_gate_mass)
    // Per request (request order): the policy's bookkeeping of unit u, resident or not (place_misses).
    void policy_request(int u, bool resident);
    // A unit took a slot (a miss or a prefetch): the policy's insertion.
    void policy_insert(int u);
    // fnu: after layer li's router ran, updates each of its experts' pick rate and predicted next use.
    void fnu_update(int li, const std::vector<int32_t> & picked);
    double                       fnu_alpha_ = 0.3;
    std::vector<double>          pick_rate_;        // fnu: EMA of "picked in this pass", per unit
    int                          policy_ = LRU;
    std::string                  policy_name_;
    std::vector<int32_t>         layers_;         // block ids
    std::vector<std::vector<tensor_map>> maps_;   // [li][ti]
    std::vector<int64_t>         unit_bytes_;     // slot bytes a unit of layer li needs
    std::vector<int64_t>         class_bytes_;    // slot classes, largest first
    std::vector<int32_t>         class_n_;        // slots per class
    std::vector<int32_t>         class_first_;    // first slot id of each class (slots are grouped by class)
    std::vector<unit>            units_;
    std::vector<slot>            slots_;
    std::vector<std::vector<int32_t>> free_;      // free slot ids per class
    std::set<key_t>              stale_, current_;  // evictable (resident, unpinned) units
    std::set<key_t>              hot_;              // static policy: evictable hot units, last resort
    std::vector<int64_t>         pending_next_;     // belady: next use to give a unit at its request
    std::vector<std::vector<int32_t>> pinned_;    // per layer index
    std::vector<std::vector<std::pair<int, int64_t>>> overlay_;  // per layer: (tensor, file page) zeroed
    uint64_t                     tick_ = 0;
    uint64_t                     pass_ = 1;
    int                          loading_li_ = 0;
    mutable pager_stats          stats_;  // mutable: stats() folds in deferred_us_
    std::unique_ptr<io_pool>     pool_;
    // Builds the read jobs of unit u (one per tensor, split into segments when seg_bytes_ > 0).
    void unit_jobs(int u, std::vector<io_job> & jobs, std::vector<int> & job_unit, std::vector<int> * job_tensor = nullptr) const;
    // load_layer's bookkeeping before any read: counts hits and misses, pins, takes a slot for
    // each miss (undoing on failure) and builds the misses' jobs. Returns the misses.
    std::vector<int> place_misses(int li, const int32_t * ids, int n, uint8_t * hit_out, std::vector<io_job> & jobs,
                                  std::vector<int> & job_unit, std::vector<int> * job_tensor);
    // After the reads: counts bytes, maps the units read completely (the others get their slots
    // back) and throws the first read error after unpinning layer li.
    void settle_misses(int li, const std::vector<int> & misses, std::vector<io_job> & jobs, const std::vector<int> & job_unit);
    // Reads refused with EINVAL although the files were opened O_DIRECT: reopens every file
    // buffered (direct_ off from then on) and redoes the refused reads, a pending pipelined
    // load's included. If a file cannot be reopened nothing changes and those reads stay failed.
    void redo_refused_direct(std::vector<io_job> & jobs);
    // Whether a slice of unit u shares a page with an expert a batch is reading (such a unit is
    // no victim then: its edge pages would race with the I/O worker mapping that expert).
    bool inflight_neighbour(int u) const;
    // After a prefetch finished under a pipelined load of layer li: the requested experts that
    // were counted as hits because their prefetch was in flight, but whose read failed, are read
    // now (counted as misses instead). Throws as load_layer does.
    void load_failed_prefetches(int li, const int32_t * ids, int n);
    int  map_tensor_pages(int u, int ti, bool populate) const;
    // Admission staging (request_layer): refusals allowed now (a caller that stages), and the refused misses.
    bool                         refusing_ = false;
    std::vector<int>             refused_;
    // Whether the policy refuses miss u of layer li a slot now (no free slot fits it and queue_policy::refuse).
    bool admission_refused(int li, int u);
    // The pending pipelined load (request_layer_async).
    bool                         dm_active_ = false;
    int                          dm_li_ = -1;
    std::vector<io_job>          dm_jobs_;
    std::vector<int>             dm_job_unit_, dm_job_tensor_, dm_misses_;
    std::vector<std::pair<int, std::pair<size_t, size_t>>> dm_ranges_;  // (tensor, [from, to) of dm_jobs_) in read order
    std::vector<uint8_t>         dm_done_;        // per dm_ranges_ entry: waited and mapped
    int64_t                      seg_bytes_ = 0;
    // Prefetch batches in flight, oldest first. The jobs live in the batch (never resized after
    // they were queued) until the batch is finished.
    struct pf_batch {
        int                 li = -1;
        std::vector<io_job> jobs;
        std::vector<int>    job_unit;
        std::vector<int>    units;       // units placed by this batch
        std::vector<int>    protected_;  // predicted units already resident: out of the evictable sets
        bool                carried = false;  // for the next pass (prefetch_start)
    };
    std::vector<std::unique_ptr<pf_batch>> pf_;
    void finish_batch(pf_batch & b);     // prefetch_finish of one batch (it is then dropped)
    void finish_batches(int li, bool keep_carried = false);  // every batch of layer li (-1: all; keep_carried: but carried ones)
    std::vector<uint8_t>         pf_inflight_;    // per unit: a batch is reading it (compute thread only)
    std::vector<uint8_t>         pf_prot_;        // per unit: protected by a batch (out of the evictable sets)
    // Per unit being read by a batch: jobs still running, whether one failed or was cancelled,
    // and whether the worker that finished its last job mapped it (1 = mapped, 2 = its mmap
    // failed). Written by I/O workers, read after the batch's jobs were waited for.
    std::unique_ptr<std::atomic<int>[]> pf_left_, pf_bad_, pf_mapped_;
    std::atomic<int64_t>         pf_map_us_{0};   // workers' mmap time (off the compute thread)
    mutable std::atomic<int64_t> map_fault_countdown_{0};  // inject_map_fault
    // The mmaps that back unit u's pages in the region with its slot (populate: prefault the
    // page tables too). Returns 0 or the errno of the failed mmap; touches no pager state.
    int map_pages(int u, bool populate) const;
    void prefetch_job_done(io_job & j);  // the I/O worker's continuation of a prefetch read
};
