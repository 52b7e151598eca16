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

// ---- the hook's part ------------------------------------------------------------------------

void expert_hook::set_route_bias(double delta) {
    if (delta >= 0 && skip_tau_ >= 0)
        throw std::invalid_argument("cache-aware routing and skip-cold are exclusive: both decide what happens to a non-resident expert");
    if (delta >= 0 && pf_mode_ != PF_OFF)
        throw std::invalid_argument("cache-aware routing and prefetch are exclusive: its choice depends on residency");
    if (std::isnan(delta) || !std::isfinite(delta)) throw std::invalid_argument("route delta must be a finite probability margin (< 0: off)");
    route_delta_ = delta < 0 ? -1.0 : delta;
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

// The router's probabilities of one token: the softmax output as is; sigmoid gates divided by
// their sum; raw logits (softmax-after-top-k architectures) through a softmax.
void expert_hook::router_probs(int li, std::vector<float> & q) {
    const ggml_tensor * p = probs_[li];
    if (!p || !p->data || p->type != GGML_TYPE_F32 || p->ne[1] != 1 || p->nb[0] != sizeof(float))
        throw std::runtime_error("router probabilities of MoE layer " + std::to_string(li) + " (ffn_moe_probs) are not a float32 [n_expert, 1] tensor" +
                                 (p ? " (ne " + std::to_string(p->ne[0]) + "x" + std::to_string(p->ne[1]) + ", type " + std::to_string((int) p->type) +
                                      ", op " + std::to_string((int) p->op) + (p->data ? "" : ", no data") + ")" : " (not seen in this graph)"));
    const int n = (int) p->ne[0];
    q.assign((const float *) p->data, (const float *) p->data + n);
    if (p->op == GGML_OP_SOFT_MAX) return;
    if (p->op == GGML_OP_UNARY) {  // sigmoid gating
        double s = 0;
        for (float v : q) s += v;
        for (float & v : q) v = (float) (v / s);
        return;
    }
    const float m = *std::max_element(q.begin(), q.end());
    double s = 0;
    for (float & v : q) s += (v = std::exp(v - m));
    for (float & v : q) v = (float) (v / s);
}

void expert_hook::apply_lossy(int li, ggml_tensor * t, std::vector<int32_t> & ids) {
    const int k = (int) ids.size();
    router_probs(li, prob_buf_);
    const int n_expert = (int) prob_buf_.size();
    res_buf_.assign((size_t) n_expert, 0);
    for (int e = 0; e < n_expert; e++) res_buf_[e] = pg_->is_resident(li, e) ? 1 : 0;
    lossy_orig_ = ids;
    const std::vector<int32_t> & orig = lossy_orig_;
    lossy_result r = lossy_route(prob_buf_.data(), n_expert, ids.data(), k, res_buf_.data(), std::max(0.0, route_delta_), ak_thr_, ak_ks_);
    char * base = (char *) t->data;
    for (int i = 0; i < k; i++) *(int32_t *) (base + i * t->nb[0]) = ids[i];
    stats_.lossy_slots += k;
    stats_.route_changed += k - r.unchanged;
    stats_.route_substituted += r.substituted;
    stats_.adaptive_dropped += k - r.n_keep;
    for (int32_t e : orig)  // the router's non-resident experts that are not read
        if (!res_buf_[e] && std::find(ids.begin(), ids.end(), e) == ids.end()) stats_.lossy_bytes_saved += pg_->unit_bytes(li);
    if (!ak_ks_.empty()) {
        layer_k_sum_[li] += r.n_keep;
        layer_k_n_[li] += 1;
        if (record_ && !ub_kept_.empty()) ub_kept_[li] = r.n_keep;  // one token: row 0
    }
    if (r.n_keep < k) drop_keep_[li] = std::move(r.keep);
    else drop_keep_[li].clear();
}

// At ffn_moe_weights-<il> (get_rows of the probabilities): dropped slots' weights become 0 before
// the graph sums and normalizes them. At ffn_moe_weights_softmax-<il> (softmax over the selected
// logits, where the architecture has it): the kept weights are renormalized over the kept slots,
// which is that softmax with the dropped slots at -inf.
void expert_hook::zero_dropped(int li, ggml_tensor * t, bool softmax) {
    auto & keep = drop_keep_[li];
    const int k = (int) keep.size();
    if (t->type != GGML_TYPE_F32) throw std::runtime_error(std::string(ggml_get_name(t)) + " is not float32");
    const bool col = t->ne[0] == 1 && t->ne[1] == k;
    if (!col && t->ne[0] != k) throw std::runtime_error(std::string(ggml_get_name(t)) + ": not the [1, k] or [k] weights of one token");
    const size_t step = col ? t->nb[1] : t->nb[0];
    auto w = [&](int i) -> float & { return *(float *) ((char *) t->data + i * step); };
    double s = 0;
    for (int i = 0; i < k; i++) {
        if (!keep[i]) w(i) = 0.0f;
        s += w(i);
    }
    if (softmax && s > 0)
        for (int i = 0; i < k; i++) w(i) = (float) (w(i) / s);
}
