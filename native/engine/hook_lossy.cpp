// hook_lossy: the lossy route rewrites of a decode step (cache-aware routing, adaptive-k; hook.h
// "Lossy route rewrites"): the pure rule (lossy_route) and the hook's part: reading the router's
// probabilities, rewriting ffn_moe_topk-<il> in place before llama.cpp's get_rows and expert
// matmuls read it, and zeroing dropped slots' weights at ffn_moe_weights-<il>.
//
// Invariant: with both knobs off nothing here runs; with them on, the ids llama.cpp's get_rows and
// MUL_MAT_ID read are the rewritten ones (written before either is computed), every kept slot's
// weight is the router's own probability of the expert actually used (normalized by the graph as
// the architecture does), and a dropped slot's weight is zero before the graph's sum/normalization.
#include "hook_lossy.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string>

#include "ggml.h"
#include "hook.h"

double router_entropy(const float * q, int n) {
    double h = 0;
    for (int e = 0; e < n; e++)
        if (q[e] > 0) h -= (double) q[e] * std::log((double) q[e]);
    return h;
}

lossy_result lossy_route(const float * q, int n_expert, int32_t * ids, int k, const uint8_t * resident, double delta,
                         const std::vector<double> & thresholds, const std::vector<int> & ks) {
    if (!ks.empty() && ks.size() != thresholds.size() + 1)
        throw std::invalid_argument("adaptive-k needs one more k than thresholds");
    for (int i = 0; i < k; i++)
        if (ids[i] < 0 || ids[i] >= n_expert) throw std::invalid_argument("expert id " + std::to_string(ids[i]) + " outside [0, n_expert)");
    lossy_result r;
    r.keep.assign((size_t) k, 0);
    std::vector<int> order((size_t) k);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return q[ids[a]] > q[ids[b]]; });
    int kk = k;
    if (!ks.empty()) {
        const double h = router_entropy(q, n_expert);
        size_t i = 0;
        while (i < thresholds.size() && !(h < thresholds[i])) i++;
        kk = std::max(1, std::min(k, ks[i]));
    }
    r.n_keep = kk;
    std::vector<int32_t> orig(ids, ids + k);
    std::vector<uint8_t> used((size_t) n_expert, 0);
    for (int j = 0; j < kk; j++) r.keep[order[j]] = 1;
    for (int i = 0; i < k; i++) used[ids[i]] = 1;  // the router's own choices, dropped ones too, are never substitutes
    if (delta > 0) {
        for (int j = 0; j < kk; j++) {
            const int s = order[j];
            const int32_t e = ids[s];
            if (resident[e]) continue;
            int best = -1;
            for (int c = 0; c < n_expert; c++)
                if (resident[c] && !used[c] && (best < 0 || q[c] > q[best])) best = c;
            if (best >= 0 && (double) q[e] - (double) q[best] < delta) {
                used[e] = 0;
                used[best] = 1;
                ids[s] = best;
                r.substituted++;
            }
        }
    }
    for (int j = kk; j < k; j++) ids[order[j]] = ids[order[0]];
    for (int s = 0; s < k; s++) r.unchanged += r.keep[s] && ids[s] == orig[s];
    return r;
}

lossy_step_result lossy_step(const float * q, int n_expert, int32_t * ids, int k, int n_tokens, const uint8_t * resident,
                             int mode, double delta, const std::vector<double> & thresholds, const std::vector<int> & ks,
                             int budget) {
    if (mode != ROUTE_OFF && mode != ROUTE_CACHE && mode != ROUTE_BATCH) throw std::invalid_argument("unknown route mode " + std::to_string(mode));
    if (budget < 0) throw std::invalid_argument("the union budget must be >= 0 (0: off)");
    if (k < 1 || n_tokens < 1) throw std::invalid_argument("a step needs k >= 1 and n_tokens >= 1");
    const size_t nk = (size_t) k * n_tokens;
    for (size_t i = 0; i < nk; i++)
        if (ids[i] < 0 || ids[i] >= n_expert) throw std::invalid_argument("expert id " + std::to_string(ids[i]) + " outside [0, n_expert)");
    lossy_step_result r;
    r.orig.assign(ids, ids + nk);
    r.keep.assign(nk, 1);
    r.n_keep.assign((size_t) n_tokens, k);
    // cnt[e]: tokens whose kept slots use e (the step's union is cnt > 0)
    std::vector<int> cnt((size_t) n_expert, 0);
    std::vector<uint8_t> mine((size_t) n_expert, 0), avail((size_t) n_expert, 0);
    auto add_token = [&](int j, int sign) {  // token j's distinct kept experts into cnt
        const int32_t * row = ids + (size_t) j * k;
        const uint8_t * kp = r.keep.data() + (size_t) j * k;
        for (int i = 0; i < k; i++)
            if (kp[i] && !mine[row[i]]) { mine[row[i]] = 1; cnt[row[i]] += sign; }
        for (int i = 0; i < k; i++) mine[row[i]] = 0;
    };
    for (int j = 0; j < n_tokens; j++) add_token(j, +1);
    std::vector<uint8_t> before((size_t) n_expert, 0);
    for (int e = 0; e < n_expert; e++) r.union_before += (before[e] = cnt[e] > 0);
    const double d = mode == ROUTE_OFF ? 0.0 : std::max(0.0, delta);
    if (d > 0 || !ks.empty()) {
        for (int j = 0; j < n_tokens; j++) {
            int32_t * row = ids + (size_t) j * k;
            add_token(j, -1);  // cnt: the other tokens only
            for (int e = 0; e < n_expert; e++) avail[e] = resident[e] || (mode == ROUTE_BATCH && cnt[e] > 0);
            lossy_result lr = lossy_route(q + (size_t) j * n_expert, n_expert, row, k, avail.data(), d, thresholds, ks);
            std::copy(lr.keep.begin(), lr.keep.end(), r.keep.begin() + (size_t) j * k);
            r.n_keep[j] = lr.n_keep;
            r.substituted += lr.substituted;
            r.adaptive_dropped += k - lr.n_keep;
            add_token(j, +1);
        }
    }
    int n_union = 0;
    for (int e = 0; e < n_expert; e++) n_union += cnt[e] > 0;
    if (budget > 0 && n_union > budget) {
        std::vector<double> agg((size_t) n_expert, 0.0);
        for (int j = 0; j < n_tokens; j++)
            for (int i = 0; i < k; i++)
                if (r.keep[(size_t) j * k + i]) agg[ids[(size_t) j * k + i]] += q[(size_t) j * n_expert + ids[(size_t) j * k + i]];
        std::vector<int32_t> uni;
        for (int e = 0; e < n_expert; e++)
            if (cnt[e] > 0) uni.push_back(e);
        std::stable_sort(uni.begin(), uni.end(), [&](int32_t a, int32_t b) {
            if (resident[a] != resident[b]) return resident[a] > resident[b];
            return agg[a] > agg[b];  // ties keep the lower id (uni is in id order; stable)
        });
        std::vector<uint8_t> in_budget((size_t) n_expert, 0);
        for (int i = 0; i < budget; i++) in_budget[uni[i]] = 1;
        for (int j = 0; j < n_tokens; j++) {
            int32_t * row = ids + (size_t) j * k;
            uint8_t * kp = r.keep.data() + (size_t) j * k;
            const float * qj = q + (size_t) j * n_expert;
            int best = -1;  // the token's kept slot of highest q (before the budget)
            for (int i = 0; i < k; i++)
                if (kp[i] && (best < 0 || qj[row[i]] > qj[row[best]])) best = i;
            int left = 0;
            for (int i = 0; i < k; i++) {
                if (kp[i] && !in_budget[row[i]]) { kp[i] = 0; r.budget_dropped++; }
                left += kp[i];
            }
            if (left == 0) { kp[best] = 1; r.budget_dropped--; r.budget_overflow++; left = 1; }
            r.n_keep[j] = left;
        }
    }
    // dropped slots repeat their token's best kept expert (nothing extra is read); union and counts
    for (int j = 0; j < n_tokens; j++) {
        int32_t * row = ids + (size_t) j * k;
        const uint8_t * kp = r.keep.data() + (size_t) j * k;
        const float * qj = q + (size_t) j * n_expert;
        int best = -1;
        for (int i = 0; i < k; i++)
            if (kp[i] && (best < 0 || qj[row[i]] > qj[row[best]])) best = i;
        for (int i = 0; i < k; i++)
            if (!kp[i]) row[i] = row[best];
        for (int i = 0; i < k; i++) r.unchanged += kp[i] && row[i] == r.orig[(size_t) j * k + i];
    }
    std::vector<uint8_t> after((size_t) n_expert, 0);
    for (size_t i = 0; i < nk; i++)
        if (r.keep[i]) after[ids[i]] = 1;
    for (int e = 0; e < n_expert; e++) {
        r.union_after += after[e];
        r.not_read += before[e] && !after[e] && !resident[e];
    }
    return r;
}

// ---- the hook's part ------------------------------------------------------------------------

void expert_hook::set_route_bias(double delta, bool batch) {
    if (delta >= 0 && skip_tau_ >= 0)
        throw std::invalid_argument("cache-aware routing and skip-cold are exclusive: both decide what happens to a non-resident expert");
    if (delta >= 0 && pf_mode_ != PF_OFF)
        throw std::invalid_argument("cache-aware routing and prefetch are exclusive: its choice depends on residency");
    if (std::isnan(delta) || !std::isfinite(delta)) throw std::invalid_argument("route delta must be a finite probability margin (< 0: off)");
    route_delta_ = delta < 0 ? -1.0 : delta;
    route_batch_ = delta >= 0 && batch;
}

void expert_hook::set_expert_budget(int n) {
    if (n < 0) throw std::invalid_argument("the expert budget must be >= 0 distinct experts per layer (0: off)");
    if (n > 0 && skip_tau_ >= 0)
        throw std::invalid_argument("the expert budget and skip-cold are exclusive: skip-cold would read the budget's zeroed weights as cold");
    if (n > 0 && pf_mode_ != PF_OFF)
        throw std::invalid_argument("the expert budget and prefetch are exclusive: the budget keeps resident experts first");
    budget_ = n;
}

void expert_hook::set_adaptive_k(const std::vector<double> & thresholds, const std::vector<int> & ks) {
    if (!ks.empty()) {
        if (skip_tau_ >= 0)
            throw std::invalid_argument("adaptive-k and skip-cold are exclusive: skip-cold would read adaptive-k's zeroed weights as cold");
        if (ks.size() != thresholds.size() + 1) throw std::invalid_argument("adaptive-k needs one more k than thresholds");
        for (size_t i = 0; i < ks.size(); i++)
            if (ks[i] < 1) throw std::invalid_argument("adaptive-k's ks must be >= 1");
        for (size_t i = 0; i < thresholds.size(); i++)
            if (!std::isfinite(thresholds[i]) || (i > 0 && !(thresholds[i] > thresholds[i - 1])))
                throw std::invalid_argument("adaptive-k's entropy thresholds must be finite and increasing");
    }
    ak_thr_ = thresholds;
    ak_ks_ = ks;
}

void expert_hook::note_probs(ggml_tensor * t) {
    static const char P[] = "ffn_moe_probs-";
    const char * name = ggml_get_name(t);
    if (strncmp(name, P, sizeof(P) - 1) != 0) return;
    const char * num = name + sizeof(P) - 1;
    if (!*num || num[strspn(num, "0123456789")] != 0) return;  // not its views ("ffn_moe_probs-<il> (reshaped)")
    const int li = layer_of_block(atoi(num));
    if (li >= 0) probs_[li] = t;  // computed before the topk; alive until get_rows reads it
}

// The router's probabilities of each token of the step, [n_tokens][n_expert]: the softmax output as
// is; sigmoid gates divided by their sum; raw logits (softmax-after-top-k architectures) through a softmax.
void expert_hook::router_probs(int li, int n_tokens, std::vector<float> & q) {
    const ggml_tensor * p = probs_[li];
    if (!p || !p->data || p->type != GGML_TYPE_F32 || p->ne[1] != n_tokens || p->nb[0] != sizeof(float))
        throw std::runtime_error("router probabilities of MoE layer " + std::to_string(li) + " (ffn_moe_probs) are not a float32 [n_expert, " +
                                 std::to_string(n_tokens) + "] tensor" +
                                 (p ? " (ne " + std::to_string(p->ne[0]) + "x" + std::to_string(p->ne[1]) + ", type " + std::to_string((int) p->type) +
                                      ", op " + std::to_string((int) p->op) + (p->data ? "" : ", no data") + ")" : " (not seen in this graph)"));
    const int n = (int) p->ne[0];
    q.resize((size_t) n * n_tokens);
    for (int j = 0; j < n_tokens; j++) {
        const float * src = (const float *) ((const char *) p->data + (size_t) j * p->nb[1]);
        float * row = q.data() + (size_t) j * n;
        std::copy(src, src + n, row);
        if (p->op == GGML_OP_SOFT_MAX) continue;
        if (p->op == GGML_OP_UNARY) {  // sigmoid gating
            double s = 0;
            for (int e = 0; e < n; e++) s += row[e];
            for (int e = 0; e < n; e++) row[e] = (float) (row[e] / s);
            continue;
        }
        const float m = *std::max_element(row, row + n);
        double s = 0;
        for (int e = 0; e < n; e++) s += (row[e] = std::exp(row[e] - m));
        for (int e = 0; e < n; e++) row[e] = (float) (row[e] / s);
    }
}

void expert_hook::apply_lossy(int li, ggml_tensor * t, std::vector<int32_t> & ids, int n_tokens) {
    const int k = (int) ids.size() / n_tokens;
    router_probs(li, n_tokens, prob_buf_);
    const int n_expert = (int) prob_buf_.size() / n_tokens;
    res_buf_.assign((size_t) n_expert, 0);
    for (int e = 0; e < n_expert; e++) res_buf_[e] = pg_->is_resident(li, e) ? 1 : 0;
    const int mode = route_delta_ < 0 ? ROUTE_OFF : route_batch_ ? ROUTE_BATCH : ROUTE_CACHE;
    lossy_step_result r = lossy_step(prob_buf_.data(), n_expert, ids.data(), k, n_tokens, res_buf_.data(), mode,
                                     route_delta_, ak_thr_, ak_ks_, budget_);
    char * base = (char *) t->data;
    for (int j = 0; j < n_tokens; j++)
        for (int i = 0; i < k; i++) *(int32_t *) (base + j * t->nb[1] + i * t->nb[0]) = ids[(size_t) j * k + i];
    const int64_t nk = (int64_t) k * n_tokens;
    stats_.lossy_slots += nk;
    stats_.route_changed += nk - r.unchanged;
    stats_.route_substituted += r.substituted;
    stats_.adaptive_dropped += r.adaptive_dropped;
    stats_.budget_dropped += r.budget_dropped;
    stats_.budget_overflow += r.budget_overflow;
    stats_.lossy_union_before += r.union_before;
    stats_.lossy_union_after += r.union_after;
    stats_.lossy_bytes_saved += (int64_t) r.not_read * pg_->unit_bytes(li);  // the router's non-resident experts not read
    if (!ak_ks_.empty()) {
        for (int j = 0; j < n_tokens; j++) layer_k_sum_[li] += r.n_keep[j];
        layer_k_n_[li] += n_tokens;
        if (record_ && ub_kept_.size() >= (size_t) n_tokens * n_layers_)
            for (int j = 0; j < n_tokens; j++) ub_kept_[(size_t) j * n_layers_ + li] = r.n_keep[j];
    }
    bool dropped = false;
    for (uint8_t kp : r.keep) dropped |= !kp;
    lossy_orig_ = std::move(r.orig);
    if (dropped) drop_keep_[li] = std::move(r.keep);
    else drop_keep_[li].clear();
}

// At ffn_moe_weights-<il> (get_rows of the probabilities): dropped slots' weights become 0 before
// the graph sums and normalizes them. At ffn_moe_weights_softmax-<il> (softmax over the selected
// logits, where the architecture has it): the kept weights are renormalized over the kept slots,
// which is that softmax with the dropped slots at -inf.
void expert_hook::zero_dropped(int li, ggml_tensor * t, bool softmax) {
    auto & keep = drop_keep_[li];
    if (t->type != GGML_TYPE_F32) throw std::runtime_error(std::string(ggml_get_name(t)) + " is not float32");
    // [1, k, n_tokens] (get_rows, scale) or [k, n_tokens] (softmax, norm)
    const bool col = t->ne[0] == 1;
    const int k = (int) (col ? t->ne[1] : t->ne[0]);
    const int n_tokens = (int) (col ? t->ne[2] : t->ne[1]);
    if ((size_t) k * n_tokens != keep.size())
        throw std::runtime_error(std::string(ggml_get_name(t)) + ": not the [1, k, n_tokens] or [k, n_tokens] weights of the rewritten step");
    const size_t step = col ? t->nb[1] : t->nb[0];
    const size_t tok = col ? t->nb[2] : t->nb[1];
    for (int j = 0; j < n_tokens; j++) {
        auto w = [&](int i) -> float & { return *(float *) ((char *) t->data + j * tok + i * step); };
        const uint8_t * kp = keep.data() + (size_t) j * k;
        double s = 0;
        for (int i = 0; i < k; i++) {
            if (!kp[i]) w(i) = 0.0f;
            s += w(i);
        }
        if (softmax && s > 0)
            for (int i = 0; i < k; i++) w(i) = (float) (w(i) / s);
    }
}
