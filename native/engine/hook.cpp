// hook: the llama.cpp graph callback that pages routed experts just in time: the callback and
// its barrier, each layer's load (pipelined or not), staging, skip-cold, the time split, and the
// route and router-input logs. The prefetch predictors and their gate are in hook_predict.cpp.
//
// Invariant (hook.h, "the callback barrier"): when ggml computes one of layer il's expert
// matmuls, its weight points at complete bytes: the pager's region with the layer's selected
// experts resident and pinned (pipelined: at least that matrix's slices read and mapped), the
// staging buffer holding that matrix's union, or zeros (skip-cold's skipped experts; all of it
// after a read failure, until the abort lands).
// Nothing here may throw into ggml: every exception is caught, stored, and the decode is stopped
// through the abort callback; the observe pass never returns false.
#include "hook.h"

#include <algorithm>
#include <limits>
#include <cstring>
#include <sys/mman.h>
#include <unistd.h>

#include "ggml.h"
#include "hook_lossy.h"
#include "io_pool.h"

static const char TOPK_PREFIX[] = "ffn_moe_topk-";
static const char LOGITS_PREFIX[] = "ffn_moe_logits-";
static const char WEIGHTS_PREFIX[] = "ffn_moe_weights";
static const char OUT_PREFIX[] = "ffn_moe_out-";  // the routed experts' mixture of layer il (before any shared expert)

// name is exactly prefix + digits (not one of its views, "... (reshaped)").
static bool is_layer_node(const char * name, const char * prefix, size_t n) {
    if (strncmp(name, prefix, n) != 0) return false;
    const char * num = name + n;
    return *num && num[strspn(num, "0123456789")] == 0;
}  // -<il>, _softmax-<il>, _norm-<il>, _scaled-<il>

// ffn_moe_weights-<il> and the later weights nodes (not ffn_moe_weights_sum*: a sum, not weights).
static bool is_weights_name(const char * name) {
    if (strncmp(name, WEIGHTS_PREFIX, sizeof(WEIGHTS_PREFIX) - 1) != 0) return false;
    const char * rest = name + sizeof(WEIGHTS_PREFIX) - 1;
    return rest[0] == '-' || strncmp(rest, "_softmax-", 9) == 0 || strncmp(rest, "_norm-", 6) == 0 ||
           strncmp(rest, "_scaled-", 8) == 0;
}

expert_hook::expert_hook(pager * pg, int n_moe_layers, const std::vector<int32_t> & blocks,
                         const std::vector<std::tuple<std::string, int, int>> & names, bool record)
    : pg_(pg), n_layers_(n_moe_layers), blocks_(blocks), record_(record) {
    int max_ti = 0;
    for (const auto & n : names) {
        names_[std::get<0>(n)] = {std::get<1>(n), std::get<2>(n)};
        max_ti = std::max(max_ti, std::get<2>(n) + 1);
    }
    tensor_bytes_.assign(n_layers_, std::vector<int64_t>(max_ti, 0));
    mode_.assign(n_layers_, REGION);
    layer_union_.assign(n_layers_, 0);
    is_last_mm_.assign(n_layers_, std::vector<uint8_t>(max_ti, 0));
    {
        std::vector<int> last(n_layers_, -1), down(n_layers_, -1);
        for (const auto & n : names) {
            const int li = std::get<1>(n), ti = std::get<2>(n);
            last[li] = std::max(last[li], ti);
            if (std::get<0>(n).find("ffn_down_exps") != std::string::npos) down[li] = ti;
        }
        for (int li = 0; li < n_layers_; li++) {
            const int ti = down[li] >= 0 ? down[li] : last[li];  // llama.cpp computes down last
            if (ti >= 0) is_last_mm_[li][ti] = 1;
        }
    }
    cur_.assign(n_layers_, layer_time{});
    mm_order_.assign(n_layers_, {});
    gate_inp_.assign(n_layers_, nullptr);
    hidden_.assign(n_layers_, nullptr);
    prev_ids_.assign(n_layers_, {});
    pred_.assign(n_layers_, {});
    has_pred_.assign(n_layers_, 0);
    for (auto & g : gate_pred_) g.assign(n_layers_, {});
    stage_ids_.assign(n_layers_, {});
    pend_ids_.assign(n_layers_, {});
    pend_w_.assign(n_layers_, {});
    probs_.assign(n_layers_, nullptr);
    drop_keep_.assign(n_layers_, {});
    layer_k_sum_.assign(n_layers_, 0);
    layer_k_n_.assign(n_layers_, 0);
    slot_ids_t_.assign(n_layers_, nullptr);
    slot_ids_.assign(n_layers_, {});
    slot_lo_.assign(n_layers_, 0);
    slot_span_.assign(n_layers_, 1);
}

expert_hook::~expert_hook() {
    if (zero_) munmap(zero_, (size_t) zero_bytes_);
    if (stage_) munmap(stage_, (size_t) stage_bytes_);
    free_slot_ids();  // not the weights' shapes: the model may be freed already (end_decode gave them back)
}

int64_t expert_hook::stage_capacity() const { return pg_ ? pg_->max_stage_bytes() : 0; }

char * expert_hook::stage_buffer() {
    if (!stage_) {
        const int64_t need = stage_capacity();
        void * p = mmap(nullptr, (size_t) need, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) throw std::runtime_error("cannot map the " + std::to_string(need) + "-byte staging buffer");
        stage_ = (char *) p;
        stage_bytes_ = need;
    }
    stage_used_ = true;
    return stage_;
}

void expert_hook::end_stage_lending() {
    if (stage_used_) {
        madvise(stage_, (size_t) stage_bytes_, MADV_DONTNEED);
        stage_used_ = false;
    }
    if (pg_ && pg_->lent_bytes() > 0) pg_->unlend();  // after the staged pages went: the budget holds
}

void * expert_hook::zero_mapping(int64_t bytes) {
    if (bytes > zero_bytes_) {
        if (zero_) munmap(zero_, (size_t) zero_bytes_);
        zero_ = mmap(nullptr, (size_t) bytes, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        zero_bytes_ = zero_ == MAP_FAILED ? 0 : bytes;
        if (zero_ == MAP_FAILED) zero_ = nullptr;
    }
    return zero_;
}

bool expert_hook::cb_eval(ggml_tensor * t, bool ask, void * user_data) {
    auto * h = (expert_hook *) user_data;
    try {
        if (ask) {
            const bool need = h->on_ask(t);
            h->stats_.graph_asks++;
            if (need) {
                h->stats_.graph_pieces++;
                h->t_need_ = io_now_us();  // ggml computes the piece ending at t next
            }
            return need;
        }
        if (h->timing_ && h->in_decode_) h->charge_compute(t, io_now_us() - h->t_need_);
        if (t->op == GGML_OP_MUL_MAT_ID) return true;  // a matmul's observe needs nothing more
        if (is_weights_name(ggml_get_name(t))) h->on_weights(t);
        else if (is_layer_node(ggml_get_name(t), OUT_PREFIX, sizeof(OUT_PREFIX) - 1)) h->capture_output(t);
        else h->on_topk(t);
    } catch (...) {
        if (!h->error_) h->error_ = std::current_exception();
        h->abort_ = true;
    }
    return true;  // never false in the observe pass: that would truncate the graph silently
}

bool expert_hook::abort_cb(void * user_data) {
    return ((expert_hook *) user_data)->abort_;
}

bool expert_hook::on_ask(ggml_tensor * t) {
    if (t->op == GGML_OP_MUL_MAT_ID) {
        ggml_tensor * w = t->src[0];
        auto it = seen_.find(w);
        if (it == seen_.end()) {
            auto n = names_.find(ggml_get_name(w));
            if (n == names_.end()) return false;  // not a routed-expert weight we page
            it = seen_.emplace(w, n->second).first;
            tensor_bytes_[n->second.first][n->second.second] = (int64_t) ggml_nbytes(w);
            w_shape_[w] = weight_shape{w->ne[2], (int64_t) w->nb[2], (int64_t) w->nb[3]};
            if (pg_) {
                // llama's loader read the whole file; its copy of these experts is not needed:
                // unmap those pages from llama's mapping and drop them from the page cache.
                const int64_t page = sysconf(_SC_PAGESIZE);
                const uintptr_t a = ((uintptr_t) w->data + page - 1) & ~(uintptr_t) (page - 1);
                const uintptr_t b = ((uintptr_t) w->data + ggml_nbytes(w)) & ~(uintptr_t) (page - 1);
                if (b > a) {
                    madvise((void *) a, b - a, MADV_DONTNEED);
                    stats_.dropped_bytes += (int64_t) (b - a);
                }
                pg_->drop_file_cache(n->second.first, n->second.second);
            }
        }
        const int li = it->second.first, ti = it->second.second;
        if (std::find(mm_order_[li].begin(), mm_order_[li].end(), ti) == mm_order_[li].end()) mm_order_[li].push_back(ti);
        if (!pg_) return false;
        if (mode_[li] == REGION && pg_->demand_pending(li)) {
            // Pipelined: wait for this matrix's reads only, and make this matmul a needed node so
            // that the next matrix's ask (and wait) comes after it was computed.
            try {
                pg_->wait_tensor(li, ti);
                if (timing_) charge_pager(li);
                point_at_resident(t, li, ti);
                return true;
            } catch (...) {
                if (!error_) error_ = std::current_exception();
                abort_ = true;
                mode_[li] = ZERO;
            }
        }
        if (mode_[li] == PENDING) {
            try {
                resolve_pending(li);
            } catch (...) {
                if (!error_) error_ = std::current_exception();
                abort_ = true;
                mode_[li] = ZERO;
            }
        }
        if (mode_[li] == STAGE && !abort_) {
            try {
                const auto & ids = stage_ids_[li];
                if (stage_used_ && pg_->lent_bytes() > 0)  // lent memory holds one matrix at a time
                    madvise(stage_, (size_t) stage_bytes_, MADV_DONTNEED);
                point_at(t, li, pg_->stage_tensor(li, ti, ids.data(), (int) ids.size(), stage_buffer()));
                if (timing_) charge_pager(li);
                return true;  // computed before the next ask: the buffer is then free again
            } catch (...) {
                if (!error_) error_ = std::current_exception();
                abort_ = true;
                mode_[li] = ZERO;
            }
        }
        if (timing_) charge_pager(li);
        if (mode_[li] == REGION) {
            try {
                point_at_resident(t, li, ti);
                return timing_ && in_decode_ && is_last_mm_[li][ti];  // time the layer's expert matmuls
            } catch (...) {
                if (!error_) error_ = std::current_exception();
                abort_ = true;
                mode_[li] = ZERO;
            }
        }
        {   // ZERO (or a STAGE layer after a failure): compute on zeros until the abort lands
            void * z = zero_mapping(tensor_bytes_[li][ti]);
            point_at(t, li, z ? z : pg_->tensor_data(li, ti));
        }
        return false;
    }
    const char * name = ggml_get_name(t);
    if (strncmp(name, TOPK_PREFIX, sizeof(TOPK_PREFIX) - 1) == 0) return true;
    if ((pf_mode_ != PF_OFF || capture_) && strncmp(name, LOGITS_PREFIX, sizeof(LOGITS_PREFIX) - 1) == 0 && t->op == GGML_OP_MUL_MAT) {
        const int li = layer_of_block(atoi(name + sizeof(LOGITS_PREFIX) - 1));
        if (li >= 0) {
            gate_inp_[li] = t->src[0];  // a model tensor: the same object in every graph
            hidden_[li]   = t->src[1];  // computed with the router, alive until the expert matmuls
        }
    }
    if (lossy_on() || record_ || (pg_ && pg_->needs_gate_mass())) note_probs(t);  // a pointer, no split
    if (capture_ && is_layer_node(name, OUT_PREFIX, sizeof(OUT_PREFIX) - 1)) return true;  // captured at its observe
    return (skip_tau_ >= 0 || !ak_ks_.empty() || budget_ > 0) && pg_ && is_weights_name(name);
}

int expert_hook::layer_of_block(int il) const {
    for (int i = 0; i < n_layers_; i++)
        if (blocks_[i] == il) return i;
    return -1;
}

void expert_hook::on_weights(ggml_tensor * t) {
    const char * name = ggml_get_name(t);
    const char * dash = strrchr(name, '-');
    if (!dash) return;
    const int li = layer_of_block(atoi(dash + 1));
    if (li >= 0 && !drop_keep_[li].empty()) {  // adaptive-k dropped slots in this layer
        const char * rest = name + sizeof(WEIGHTS_PREFIX) - 1;
        if (rest[0] == '-') zero_dropped(li, t, false);
        else if (strncmp(rest, "_softmax-", 9) == 0) zero_dropped(li, t, true);
        return;
    }
    if (li < 0 || mode_[li] != PENDING) return;
    if (t->type != GGML_TYPE_F32) throw std::runtime_error(std::string(name) + " is not float32");
    const int k = (int) pend_ids_[li].size();
    // [1, k, n_tokens] (get_rows, scale) or [k, n_tokens] (softmax, norm); one token here.
    const bool col = t->ne[0] == 1 && t->ne[1] == k;
    if (!col && t->ne[0] != k) return;  // not the shape we know: leave the weights unknown (no skip)
    const size_t step = col ? t->nb[1] : t->nb[0];
    pend_w_[li].resize((size_t) k);
    for (int i = 0; i < k; i++) pend_w_[li][i] = *(const float *) ((const char *) t->data + i * step);
}

void expert_hook::resolve_pending(int li) {
    const auto & ids = pend_ids_[li];
    const auto & w = pend_w_[li];
    std::vector<int32_t> keep, skip;
    for (size_t i = 0; i < ids.size(); i++) {
        // Weights unknown (a graph we do not know): read everything, skip nothing.
        if (w.size() == ids.size() && w[i] < skip_tau_ && !pg_->is_resident(li, ids[i])) skip.push_back(ids[i]);
        else keep.push_back(ids[i]);
    }
    mode_[li] = ZERO;  // until the load succeeded
    // The hook's own request path (router order for one token); all kept experts fit (k <= slots).
    if (!pg_->request_layer(li, keep.data(), (int) keep.size(), 1, nullptr))
        throw std::logic_error("skip-cold: one token's experts do not fit the layer's slots");
    pg_->zero_overlay(li, skip.data(), (int) skip.size());
    stats_.cold_skipped += (int64_t) skip.size();
    stats_.lossy_slots += (int64_t) ids.size();
    stats_.route_changed += (int64_t) skip.size();
    stats_.lossy_bytes_saved += (int64_t) skip.size() * pg_->unit_bytes(li);
    mode_[li] = REGION;
    stats_.layer_loads++;  // no prefetch here: skip-cold and prefetch are exclusive
}

void expert_hook::begin_decode() {
    in_decode_ = true;
    abort_ = false;
    last_li_ = -1;
    ub_tokens_ = 0;
    std::fill(cur_.begin(), cur_.end(), layer_time{});
    call_tokens0_ = stats_.tokens;
    if (pg_) {
        snap_io_  = pg_->stats().io_wait_us;
        snap_map_ = pg_->stats().map_us;
        snap_busy_ = pg_->io_busy_us();
    }
    t_call0_ = io_now_us();
}

void expert_hook::charge_pager(int li) {
    if (!pg_ || li < 0) return;
    const auto & s = pg_->stats();
    cur_[li].io_us  += s.io_wait_us - snap_io_;
    cur_[li].map_us += s.map_us - snap_map_;
    snap_io_  = s.io_wait_us;
    snap_map_ = s.map_us;
}

void expert_hook::charge_compute(ggml_tensor * t, int64_t dt) {
    if (t->op == GGML_OP_MUL_MAT_ID) {
        auto it = seen_.find(t->src[0]);
        if (it != seen_.end()) cur_[it->second.first].expert_us += dt;
        return;
    }
    const char * dash = strrchr(ggml_get_name(t), '-');
    const int li = dash ? layer_of_block(atoi(dash + 1)) : -1;
    if (li >= 0) cur_[li].attn_us += dt;  // the piece ending at the router (topk, or skip-cold's weights)
}

void expert_hook::end_decode() {
    if (pg_) {
        try {
            pg_->demand_finish();  // a decode stopped inside a pipelined layer: settle its reads
        } catch (...) {
            if (!error_) error_ = std::current_exception();
        }
        // a prediction past the last layer's request: settle it (the oracle's wrapped ones stay
        // in flight for the next token, unless this decode failed)
        pg_->prefetch_finish(pf_mode_ == PF_ORACLE && !error_);
        if (timing_ && last_li_ >= 0) charge_pager(last_li_);
    }
    std::fill(has_pred_.begin(), has_pred_.end(), (uint8_t) 0);
    clear_gate_preds();
    flush_ubatch();
    restore_weight_shapes();  // between decodes the model's tensors have their own shapes
    try {
        end_stage_lending();  // give the staging pages back until the next oversize ubatch
    } catch (...) {
        if (!error_) error_ = std::current_exception();
    }
    if (pg_ && last_li_ >= 0) {
        pg_->release_layer(last_li_);
        if (timing_) charge_pager(last_li_);
    }
    if (timing_ && pg_) {
        const int64_t wall = io_now_us() - t_call0_;
        const int32_t nt = (int32_t) (stats_.tokens - call_tokens0_);
        for (int li = 0; li < n_layers_; li++) {
            layer_time r = cur_[li];
            r.call = n_calls_;
            r.li = li;
            r.n_tokens = nt;
            layer_times_.push_back(r);
        }
        call_times_.push_back(call_time{n_calls_, nt, wall, pg_->io_busy_us() - snap_busy_});
    }
    n_calls_++;
    last_li_ = -1;
    in_decode_ = false;
}

void expert_hook::rethrow_if_failed() {
    if (error_) {
        auto e = error_;
        error_ = nullptr;
        std::rethrow_exception(e);
    }
}

void expert_hook::flush_ubatch() {
    if (record_ && ub_tokens_ > 0) {
        route_.insert(route_.end(), ub_route_.begin(), ub_route_.end());
        route_p_.insert(route_p_.end(), ub_route_p_.begin(), ub_route_p_.end());
        route_ub_.insert(route_ub_.end(), (size_t) ub_tokens_, (int32_t) passes_);
        if (!ub_kept_.empty()) kept_log_.insert(kept_log_.end(), ub_kept_.begin(), ub_kept_.end());
        if (capture_ && in_dim_ > 0) {  // a ubatch that captured no layer still gets its (NaN) rows
            start_ubatch_inputs();
            inputs_.insert(inputs_.end(), ub_inputs_.begin(), ub_inputs_.end());
            if (ub_outputs_.empty()) ub_outputs_.assign(ub_inputs_.size(), std::numeric_limits<float>::quiet_NaN());
            outputs_.insert(outputs_.end(), ub_outputs_.begin(), ub_outputs_.end());
        }
    }
    ub_inputs_.clear();
    ub_outputs_.clear();
    ub_kept_.clear();
    ub_tokens_ = 0;
}

void expert_hook::capture_output(ggml_tensor * t) {
    const int li = layer_of_block(atoi(ggml_get_name(t) + sizeof(OUT_PREFIX) - 1));
    if (li < 0 || !record_ || in_dim_ <= 0 || ub_tokens_ <= 0) return;
    const int n_tokens = (int) t->ne[1];
    if (!t->data || t->type != GGML_TYPE_F32 || t->ne[0] != in_dim_ || n_tokens > ub_tokens_ || t->nb[0] != sizeof(float))
        throw std::runtime_error("MoE output of layer " + std::to_string(li) + " is not a float32 [n_embd, n_tokens] tensor");
    if (ub_outputs_.empty()) ub_outputs_.assign((size_t) ub_tokens_ * n_layers_ * in_dim_, std::numeric_limits<float>::quiet_NaN());
    const int skip = ub_tokens_ - n_tokens;
    for (int j = 0; j < n_tokens; j++) {
        const float * src = (const float *) ((const char *) t->data + j * t->nb[1]);
        std::copy(src, src + in_dim_, &ub_outputs_[((size_t) (j + skip) * n_layers_ + li) * in_dim_]);
    }
}

void expert_hook::start_ubatch_inputs() {  // this ubatch's rows, NaN until a layer fills them
    if (ub_inputs_.empty()) ub_inputs_.assign((size_t) ub_tokens_ * n_layers_ * in_dim_, std::numeric_limits<float>::quiet_NaN());
}

void expert_hook::capture_input(int li, int n_tokens) {
    const ggml_tensor * h = hidden_[li];
    if (!h || !h->data || h->type != GGML_TYPE_F32 || h->ne[1] != n_tokens || h->nb[0] != sizeof(float))
        throw std::runtime_error("router input of MoE layer " + std::to_string(li) + " is not a float32 [n_embd, n_tokens] tensor");
    if (in_dim_ == 0) in_dim_ = h->ne[0];
    if (h->ne[0] != in_dim_) throw std::runtime_error("router inputs differ in width between layers");
    start_ubatch_inputs();
    const int skip = ub_tokens_ - n_tokens;  // as in the route log: the computed rows are the last ones
    for (int j = 0; j < n_tokens; j++) {
        const float * src = (const float *) ((const char *) h->data + j * h->nb[1]);
        std::copy(src, src + in_dim_, &ub_inputs_[((size_t) (j + skip) * n_layers_ + li) * in_dim_]);
    }
}

// The router probabilities of this step's experts: into the route log (NaN when the graph has no
// readable ffn_moe_probs) and, for gate_rank, to the pager as the next request's mass (there an
// unreadable tensor is an error: the policy cannot run without it).
void expert_hook::note_route_probs(int li, const std::vector<int32_t> & ids, int k, int n_tokens) {
    const bool rec = record_ && n_tokens <= ub_tokens_ && k == route_k_;
    const bool gate = pg_ && !abort_ && pg_->needs_gate_mass();
    if (!rec && !gate) return;
    try {
        router_probs(li, n_tokens, prob_buf_);
    } catch (...) {
        if (gate) throw;
        return;
    }
    const int ne = (int) (prob_buf_.size() / n_tokens);
    if (rec) {
        const int skip = ub_tokens_ - n_tokens;
        for (int j = 0; j < n_tokens; j++)
            for (int i = 0; i < k; i++) {
                const size_t at = ((size_t) (j + skip) * n_layers_ + li) * k + i;
                const int32_t e = ub_route_[at];
                if (e >= 0 && e < ne) ub_route_p_[at] = prob_buf_[(size_t) j * ne + e];
            }
    }
    if (gate) {
        gate_w_.assign(ids.size(), 0.0f);
        for (size_t i = 0; i < ids.size(); i++) {
            const int32_t e = ids[i];
            if (e >= 0 && e < ne) gate_w_[i] = prob_buf_[(i / k) * ne + e];
        }
        pg_->set_gate_mass(li, ids.data(), gate_w_.data(), (int) ids.size());
    }
}

void expert_hook::on_topk(ggml_tensor * t) {
    const int li = layer_of_block(atoi(ggml_get_name(t) + sizeof(TOPK_PREFIX) - 1));
    if (li < 0) return;
    if (t->type != GGML_TYPE_I32) throw std::runtime_error("ffn_moe_topk is not int32");
    const int k = (int) t->ne[0];
    const int n_tokens = (int) t->ne[1];

    // A new ubatch starts when the layer index does not increase.
    if (li <= last_li_ || last_li_ < 0) {
        if (pg_ && last_li_ >= 0) pg_->release_layer(last_li_);
        last_li_ = -1;
        flush_ubatch();
        std::fill(mode_.begin(), mode_.end(), (uint8_t) REGION);
        std::fill(has_pred_.begin(), has_pred_.end(), (uint8_t) 0);
        clear_gate_preds();
        stats_.ubatches++;
        passes_++;
        stats_.tokens += n_tokens;
        pass_tokens_ = n_tokens;
        if (pg_) pg_->begin_pass();
        if (record_) {
            route_k_ = k;
            ub_tokens_ = n_tokens;
            ub_route_.assign((size_t) n_tokens * n_layers_ * k, -1);
            ub_route_p_.assign(ub_route_.size(), std::numeric_limits<float>::quiet_NaN());
            if (!ak_ks_.empty()) ub_kept_.assign((size_t) n_tokens * n_layers_, k);
        }
    }

    // ids: [k, n_tokens] int32, possibly a view: row stride nb[1], element stride nb[0].
    std::vector<int32_t> ids((size_t) k * n_tokens);
    const char * base = (const char *) t->data;
    for (int j = 0; j < n_tokens; j++)
        for (int i = 0; i < k; i++)
            ids[(size_t) j * k + i] = *(const int32_t *) (base + j * t->nb[1] + i * t->nb[0]);
    drop_keep_[li].clear();
    // Lossy route rewrites (hook.h): a decode step's ids (every token of it: one per sequence), rewritten in
    // place before anything reads them.
    const bool lossy = pg_ && !abort_ && lossy_on() && decode_step_ && n_tokens == pass_tokens_;
    if (lossy) apply_lossy(li, t, ids, n_tokens);
    int64_t n_union = 0;  // the ubatch's distinct experts in this layer (also decides whether lent slots come back)
    {   // the ubatch's union in this layer: what the tokens of a batch share (counted before any paging)
        std::vector<int32_t> u(ids);
        std::sort(u.begin(), u.end());
        const int64_t nu = n_union = std::unique(u.begin(), u.end()) - u.begin();
        stats_.union_experts += nu;
        if (li >= 0 && li < (int) layer_union_.size()) layer_union_[li] += nu;
    }
    if (record_ && n_tokens <= ub_tokens_ && k == route_k_) {
        // llama.cpp computes the last layer only for tokens that output logits (the ubatch's
        // last ones): their rows are the last n_tokens; the others keep -1 (not routed).
        const int skip = ub_tokens_ - n_tokens;
        for (int j = 0; j < n_tokens; j++)
            std::copy(&ids[(size_t) j * k], &ids[(size_t) j * k] + k, &ub_route_[((size_t) (j + skip) * n_layers_ + li) * k]);
        if (lossy && !drop_keep_[li].empty())  // a dropped slot records the router's own choice (k distinct ids)
            for (int j = 0; j < n_tokens; j++)
                for (int i = 0; i < k; i++)
                    if (!drop_keep_[li][(size_t) j * k + i])
                        ub_route_[((size_t) (j + skip) * n_layers_ + li) * k + i] = lossy_orig_[(size_t) j * k + i];
        if (capture_) capture_input(li, n_tokens);
    }
    note_route_probs(li, ids, k, n_tokens);
    if (!pg_) {
        last_li_ = li;
        return;
    }
    if (abort_) {  // a read already failed in this decode: compute on zeros until the abort lands
        mode_[li] = ZERO;
        return;
    }
    if (n_tokens == 1 && li == 0) oracle_step_++;  // the oracle's clock: single-token ubatches
    if (pf_mode_ != PF_OFF && n_tokens == 1) score_prediction(li, ids);
    if (last_li_ >= 0) {
        try {
            pg_->release_layer(last_li_);  // settles a pipelined load still pending: may throw its read error
        } catch (...) {
            last_li_ = li;
            mode_[li] = ZERO;
            throw;
        }
    }
    last_li_ = li;
    // follow_memory: a shrink asked for by another thread lands here, between layers (nothing pinned)
    pg_->apply_requested_resize();

    if (n_tokens == 1 && skip_tau_ >= 0) {
        // Skip-cold: load at the layer's first MUL_MAT_ID ask, once the weights were observed
        // (a single token's k experts always fit: the arena holds one layer's top-k).
        mode_[li] = PENDING;
        pend_ids_[li] = ids;
        pend_w_[li].clear();
        return;
    }
    try {
        std::vector<int32_t> staged;
        bool queued = false;
        if (lossy && !drop_keep_[li].empty() && n_tokens == 1) {  // the distinct experts, in slot order
            std::vector<int32_t> d;
            for (int32_t e : ids)
                if (std::find(d.begin(), d.end(), e) == d.end()) d.push_back(e);
            ids = d;
        }
        const int kk = n_tokens == 1 ? (int) ids.size() : k;
        // slots lent to an earlier staged layer come back before a load (a layer that fits its slots)
        if (pg_->lent_bytes() > 0 && n_union <= pg_->capacity(li)) end_stage_lending();
        if (pipeline_ && n_tokens == 1) {
            queued = pg_->request_layer_async(li, ids.data(), kk, mm_order_[li]);
        } else if (pipeline_) {
            // A batch (or prefill) ubatch: its sorted union, as request_layer hands load_layer, so the pager's
            // requests, hits and evictions are those of the unpipelined load; false when it needs staging.
            std::vector<int32_t> uni(ids);
            std::sort(uni.begin(), uni.end());
            uni.erase(std::unique(uni.begin(), uni.end()), uni.end());
            queued = pg_->request_layer_async(li, uni.data(), (int) uni.size(), mm_order_[li]);
        }
        if (!queued && !pg_->request_layer(li, ids.data(), kk, n_tokens, &staged)) {
            // More distinct experts than slots: stage this layer matrix by matrix (see hook.h).
            mode_[li] = STAGE;
            if (pg_->stage_lending())  // the staged pages come out of the arena (pager.h, lend)
                pg_->lend(li, staged.data(), (int) staged.size(), pg_->stage_need(li, staged.data(), (int) staged.size()));
            stage_ids_[li] = std::move(staged);
            stats_.staged_layers++;
            stats_.staged_tokens += n_tokens;
            return;
        }
    } catch (...) {
        mode_[li] = ZERO;
        throw;
    }
    if (pg_->slot_addressed()) {
        try {
            fill_slot_ids(li, t);
        } catch (...) {
            mode_[li] = ZERO;
            throw;
        }
    }
    mode_[li] = REGION;
    stats_.layer_loads++;
    if (timing_) charge_pager(li);
    if (pf_mode_ != PF_OFF && n_tokens == 1) start_prefetch(li, k);
    if (timing_) charge_pager(li);  // the prefetch's evictions (map time) belong to this layer
}
