// hook_predict: the hook's prefetch predictors (LOOKAHEAD, PREVIOUS, UNION, TRAINED, ORACLE), the
// gate, and the scoring of their predictions: expert_hook members declared in hook.h, whose
// "Prefetch" section describes the mechanism.
//
// Invariant: a prediction changes only which experts are resident when, never the bytes in the
// region or what ggml computes. This file only chooses expert ids of later layers and hands them to
// pager::prefetch_start (which never evicts pinned experts nor a batch's own predictions), and
// scores them at the predicted layer's topk. Predictors read what the callback captured (each
// layer's router input and router weights), the TRAINED weights (set_predictor) or the ORACLE's
// routes (set_oracle); their setters settle the batches in flight first. An error here (a trained
// predictor that does not fit the model's routers) is thrown to the callback, which stores it and
// stops the decode (hook.cpp); nothing here throws into ggml.
#include "hook.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "ggml-cpu.h"
#include "ggml.h"
#include "io_pool.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

void expert_hook::clear_gate_preds() {
    for (auto & g : gate_pred_)
        for (auto & v : g) v.clear();
}

void expert_hook::set_prefetch(int mode, int64_t budget_bytes, int depth, double min_precision) {
    if (depth < 1 || depth > kMaxDepth) throw std::invalid_argument("prefetch depth must be 1.." + std::to_string(kMaxDepth) + " layers ahead, got " + std::to_string(depth));
    if (!(min_precision >= 0 && min_precision <= 1)) throw std::invalid_argument("prefetch min_precision must be in [0, 1]");
    if (mode == PF_TRAINED && depth > pw_depth_)
        throw std::invalid_argument("the trained predictor has depth " + std::to_string(pw_depth_) + ", asked for " + std::to_string(depth));
    if (mode < PF_OFF || mode > PF_ORACLE) throw std::invalid_argument("unknown prefetch mode " + std::to_string(mode));
    if (mode != PF_OFF && skip_tau_ >= 0)
        throw std::invalid_argument("prefetch and skip-cold are exclusive: skip-cold's choice depends on residency");
    if (mode != PF_OFF && route_delta_ >= 0)
        throw std::invalid_argument("prefetch and cache-aware routing are exclusive: its choice depends on residency");
    if (mode != PF_OFF && budget_ > 0)
        throw std::invalid_argument("prefetch and the expert budget are exclusive: the budget keeps resident experts first");
    if (budget_bytes < 0) throw std::invalid_argument("prefetch budget must be >= 0 bytes");
    if (pg_) pg_->prefetch_finish();
    pf_mode_   = mode;
    pf_budget_ = budget_bytes;
    pf_depth_  = depth;
    pf_min_prec_ = min_precision;
    std::fill(has_pred_.begin(), has_pred_.end(), (uint8_t) 0);
    for (int d = 0; d < kMaxDepth; d++) {
        rank_prec_[d].clear();
        gate_pred_[d].assign(n_layers_, {});
    }
}

// A dot product with 8 independent partial sums (vectorizable; a predictor need not match ggml's rounding).
static float dot8(const float * r, const float * x, int64_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += r[i + j] * x[i + j];
    for (; i < n; i++) acc[0] += r[i] * x[i];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// A dot product of bfloat16 weights with float32 inputs. A bfloat16 is the high half of a float32,
// so widening is a 16-bit shift (SSE2: interleave with zeros); two 4-wide partial sums. Memory-bound
// on the weights: bfloat16 halves what a token streams (84 MB -> 42 MB for 40 layers x 256 x 2048).
static float dot_bf16(const uint16_t * r, const float * x, int64_t n) {
    int64_t i = 0;
    float s = 0.0f;
#if defined(__SSE2__)
    __m128 a0 = _mm_setzero_ps(), a1 = _mm_setzero_ps();
    const __m128i z = _mm_setzero_si128();
    for (; i + 8 <= n; i += 8) {
        const __m128i v = _mm_loadu_si128((const __m128i *) (r + i));
        a0 = _mm_add_ps(a0, _mm_mul_ps(_mm_castsi128_ps(_mm_unpacklo_epi16(z, v)), _mm_loadu_ps(x + i)));
        a1 = _mm_add_ps(a1, _mm_mul_ps(_mm_castsi128_ps(_mm_unpackhi_epi16(z, v)), _mm_loadu_ps(x + i + 4)));
    }
    float t[4];
    _mm_storeu_ps(t, _mm_add_ps(a0, a1));
    s = (t[0] + t[1]) + (t[2] + t[3]);
#endif
    for (; i < n; i++) {
        const uint32_t u = (uint32_t) r[i] << 16;
        float w;
        std::memcpy(&w, &u, 4);
        s += w * x[i];
    }
    return s;
}

void expert_hook::set_predictor(const float * W, const float * b, int depth, int n_layers, int n_expert, int64_t n_embd,
                                int w_type) {
    if (n_layers != n_layers_) throw std::invalid_argument("the predictor has " + std::to_string(n_layers) + " layers, the model " + std::to_string(n_layers_));
    if (depth < 1 || depth > kMaxDepth || n_expert < 1 || n_embd < 1) throw std::invalid_argument("bad predictor shape");
    if (w_type != GGML_TYPE_BF16 && w_type != GGML_TYPE_Q8_0)
        throw std::invalid_argument("the predictor's weight type must be bf16 or q8_0 (ggml type " + std::to_string(w_type) + " given)");
    const ggml_type t = (ggml_type) w_type;
    if (n_embd % ggml_blck_size(t) != 0)
        throw std::invalid_argument("the predictor's width " + std::to_string(n_embd) + " is not a multiple of " + ggml_type_name(t) +
                                    "'s block of " + std::to_string(ggml_blck_size(t)) + " weights: use bf16");
    if (pg_ && n_expert != pg_->n_expert())
        throw std::invalid_argument("the predictor has " + std::to_string(n_expert) + " experts per layer, the model " + std::to_string(pg_->n_expert()));
    if (pf_mode_ == PF_TRAINED && depth < pf_depth_)
        throw std::invalid_argument("the trained prefetch runs at depth " + std::to_string(pf_depth_) + ", the new predictor has " + std::to_string(depth));
    const size_t nb = (size_t) depth * n_layers * n_expert, nw = nb * (size_t) n_embd;
    if (!std::all_of(W, W + nw, [](float v) { return std::isfinite(v); }))
        throw std::invalid_argument("the predictor's weights are not finite (NaN or inf): refit it");
    if (!std::all_of(b, b + nb, [](float v) { return std::isfinite(v); }))
        throw std::invalid_argument("the predictor's biases are not finite (NaN or inf): refit it");
    if (pg_) pg_->prefetch_finish();
    pw_row_ = ggml_row_size(t, n_embd);
    pw_.assign(pw_row_ * nb, 0);
    pw_.shrink_to_fit();  // a smaller type frees the old weights' memory
    // ggml's reference quantization (BF16: round to nearest, ties to even), row by row
    ggml_quantize_chunk(t, W, pw_.data(), 0, (int64_t) nb, n_embd, nullptr);
    if (t != GGML_TYPE_BF16) xq_.assign(ggml_row_size(ggml_get_type_traits_cpu(t)->vec_dot_type, n_embd), 0);
    pb_.assign(b, b + nb);
    pw_depth_ = depth;
    pw_exp_ = n_expert;
    pw_embd_ = n_embd;
    pw_type_ = w_type;
}

void expert_hook::set_oracle(const int32_t * routes, const uint8_t * follows, int64_t n_steps, int n_layers, int k) {
    if (n_layers != n_layers_) throw std::invalid_argument("the oracle's routes have " + std::to_string(n_layers) + " layers, the model " + std::to_string(n_layers_));
    if (k < 1 || n_steps < 0) throw std::invalid_argument("the oracle's routes need k >= 1 experts per layer and n_steps >= 0");
    const size_t n = (size_t) n_steps * n_layers * k;
    const int64_t n_exp = pg_ ? pg_->n_expert() : INT32_MAX;
    if (!std::all_of(routes, routes + n, [&](int32_t e) { return e >= 0 && e < n_exp; }))
        throw std::invalid_argument("the oracle's routes hold an expert id outside [0, " + std::to_string(n_exp) + ")");
    if (pg_) pg_->prefetch_finish();
    oracle_.assign(routes, routes + n);
    oracle_follow_.assign(follows, follows + n_steps);
    oracle_steps_ = n_steps;
    oracle_k_ = k;
    oracle_step_ = -1;
}

const int32_t * expert_hook::oracle_row(int64_t step, int nl) const {
    return step >= 0 && step < oracle_steps_ ? &oracle_[((size_t) step * n_layers_ + nl) * oracle_k_] : nullptr;
}

int64_t expert_hook::budget_units(int nl) const {
    return pf_budget_ > 0 ? pf_budget_ / std::max<int64_t>(1, pg_->unit_bytes(nl)) : INT64_MAX;
}

void expert_hook::predict(int li, int nl, int k, std::vector<int32_t> & out) {
    if (pf_mode_ == PF_ORACLE) {  // the replayed step's routes; none past the table's end
        if (const int32_t * r = oracle_row(oracle_step_, nl)) out.assign(r, r + std::min(k, oracle_k_));
        return;
    }
    if (pf_mode_ != PF_TRAINED) return lookahead(li, nl, k, out);
    const ggml_tensor * h = hidden_[li];
    const int d = nl - li;
    if (!h || !h->data || h->type != GGML_TYPE_F32 || h->ne[1] != 1 || d > pw_depth_) return;
    const ggml_tensor * g = gate_inp_[nl];  // the model's router of nl (seen in an earlier pass)
    if (!g) return;  // not seen yet (a first pass of one token): no prediction, as for lookahead
    if (h->ne[0] != pw_embd_ || g->ne[1] != pw_exp_)  // stored and reported after llama_decode
        throw std::runtime_error("the trained predictor (" + std::to_string(pw_exp_) + " experts x width " + std::to_string(pw_embd_) +
                                 ") does not fit this model's routers (" + std::to_string(g->ne[1]) + " x " + std::to_string(h->ne[0]) + ")");
    trained_logits(li, d, (const float *) h->data, logit_buf_);
    top_of_logits(k, out);
}

void expert_hook::trained_logits(int li, int d, const float * x, std::vector<float> & out) {
    const int64_t n_embd = pw_embd_, n_exp = pw_exp_;
    const size_t base = ((size_t) (d - 1) * n_layers_ + li) * n_exp;
    out.assign((size_t) n_exp, 0.0f);
    const uint8_t * rows = pw_.data() + base * pw_row_;
    if (pw_type_ == GGML_TYPE_BF16) {
        for (int64_t e = 0; e < n_exp; e++) out[e] = pb_[base + e] + dot_bf16((const uint16_t *) (rows + e * pw_row_), x, n_embd);
    } else {  // ggml-cpu's kernels: the input quantized to the vec_dot type, then one dot per row
        const auto * tr = ggml_get_type_traits_cpu((ggml_type) pw_type_);
        ggml_get_type_traits_cpu(tr->vec_dot_type)->from_float(x, xq_.data(), n_embd);
        for (int64_t e = 0; e < n_exp; e++) {
            float s = 0.0f;
            tr->vec_dot((int) n_embd, &s, 0, rows + e * pw_row_, 0, xq_.data(), 0, 1);
            out[e] = pb_[base + e] + s;
        }
    }
}

void expert_hook::predictor_logits(int li, int d, const float * x, int64_t n_embd, std::vector<float> & out) {
    if (pw_depth_ == 0) throw std::invalid_argument("no trained predictor is set (set_predictor)");
    if (d < 1 || d > pw_depth_ || li < 0 || li + d >= n_layers_)
        throw std::invalid_argument("layer " + std::to_string(li) + " + depth " + std::to_string(d) + " is outside the predictor (" +
                                    std::to_string(n_layers_) + " layers, depth " + std::to_string(pw_depth_) + ")");
    if (n_embd != pw_embd_) throw std::invalid_argument("the router input has width " + std::to_string(n_embd) + ", the predictor " + std::to_string(pw_embd_));
    trained_logits(li, d, x, out);
}

void expert_hook::top_of_logits(int k, std::vector<int32_t> & out) {
    const int64_t n_exp = (int64_t) logit_buf_.size();
    std::vector<int32_t> idx((size_t) n_exp);
    for (int64_t e = 0; e < n_exp; e++) idx[e] = (int32_t) e;
    const int kk = (int) std::min<int64_t>(k, n_exp);
    std::partial_sort(idx.begin(), idx.begin() + kk, idx.end(),
                      [&](int32_t a, int32_t b) { return logit_buf_[a] > logit_buf_[b] || (logit_buf_[a] == logit_buf_[b] && a < b); });
    out.assign(idx.begin(), idx.begin() + kk);
}

void expert_hook::lookahead(int li, int nl, int k, std::vector<int32_t> & out) {
    const ggml_tensor * w = gate_inp_[nl];
    const ggml_tensor * h = hidden_[li];
    if (!w || !h || !h->data || !w->data || h->type != GGML_TYPE_F32 || h->ne[0] != w->ne[0] || h->ne[1] != 1) return;
    const int64_t n_embd = w->ne[0], n_exp = w->ne[1];
    const float * x = (const float *) h->data;
    logit_buf_.assign((size_t) n_exp, 0.0f);
    const auto * tr = ggml_get_type_traits(w->type);
    if (w->type != GGML_TYPE_F32 && !tr->to_float) return;
    row_buf_.resize((size_t) n_embd);
    for (int64_t e = 0; e < n_exp; e++) {
        const char * row = (const char *) w->data + e * w->nb[1];
        const float * r = (const float *) row;
        if (w->type != GGML_TYPE_F32) {
            tr->to_float(row, row_buf_.data(), n_embd);
            r = row_buf_.data();
        }
        logit_buf_[e] = dot8(r, x, n_embd);
    }
    top_of_logits(k, out);
}

void expert_hook::start_prefetch(int li, int k) {
    const int64_t t0 = io_now_us();
    const int64_t map0 = pg_->stats().map_us;
    for (int d = 1; d <= pf_depth_; d++) {
        int nl = li + d;
        const bool wrap = nl >= n_layers_;  // the next token's layer nl - n_layers_
        if (wrap) {
            nl -= n_layers_;
            if (pf_mode_ != PF_ORACLE || nl >= li) break;
            // the oracle's next row, read in a carried batch, when it is the next forward pass
            const int32_t * r = oracle_row(oracle_step_ + 1, nl);
            const int n = (int) std::min<int64_t>(std::min(k, oracle_k_), budget_units(nl));
            if (r && oracle_step_ >= 0 && oracle_follow_[oracle_step_] && n > 0) pg_->prefetch_start(nl, r, n, true, true);
            continue;
        }
        std::vector<int32_t> pred;
        if (pf_mode_ == PF_LOOKAHEAD || pf_mode_ == PF_UNION || pf_mode_ == PF_TRAINED || pf_mode_ == PF_ORACLE) predict(li, nl, k, pred);
        if (pf_mode_ == PF_PREVIOUS || pf_mode_ == PF_UNION)
            for (int32_t e : prev_ids_[nl])
                if (std::find(pred.begin(), pred.end(), e) == pred.end()) pred.push_back(e);
        if ((int64_t) pred.size() > budget_units(nl)) pred.resize((size_t) budget_units(nl));
        if (d == 1) {  // scored: the prediction made one layer ahead (the last one made for nl)
            pred_[nl] = pred;
            has_pred_[nl] = !pred.empty();
        }
        // The gate: resident predictions stay (the batch protects them); the others are read
        // only while their rank has been right often enough, and are scored at nl's topk.
        auto & rp = rank_prec_[d - 1];
        auto & gp = gate_pred_[d - 1][nl];
        if (rp.size() < pred.size()) rp.resize(pred.size(), 1.0);
        gp.clear();
        std::vector<int32_t> issue;
        for (size_t r = 0; r < pred.size(); r++) {
            const int32_t e = pred[r];
            if (pg_->is_resident(nl, e) || pg_->in_flight(nl, e)) {  // no read to gate
                issue.push_back(e);
                continue;
            }
            gp.push_back({e, (int32_t) r});
            if (pf_min_prec_ > 0 && rp[r] < pf_min_prec_) {
                stats_.pred_gated++;
                continue;
            }
            issue.push_back(e);
        }
        if (!issue.empty()) pg_->prefetch_start(nl, issue.data(), (int) issue.size(), d > 1);
    }
    // the predictor and issuing its reads; the evictions' unmap time is map time (charged after)
    cur_[li].predict_us += io_now_us() - t0 - (pg_->stats().map_us - map0);
}

void expert_hook::score_prediction(int li, const std::vector<int32_t> & ids) {
    std::vector<int32_t> act(ids);
    std::sort(act.begin(), act.end());
    act.erase(std::unique(act.begin(), act.end()), act.end());
    for (int d = 0; d < kMaxDepth; d++) {  // the gate's score of each rank
        if (gate_pred_[d].empty()) continue;
        for (const auto & er : gate_pred_[d][li]) {
            const double hit = std::binary_search(act.begin(), act.end(), er.first) ? 1.0 : 0.0;
            rank_prec_[d][er.second] = (1 - kGateAlpha) * rank_prec_[d][er.second] + kGateAlpha * hit;
        }
        gate_pred_[d][li].clear();
    }
    if (has_pred_[li]) {
        stats_.pred_layers++;
        stats_.pred_experts += (int64_t) pred_[li].size();
        stats_.pred_actual += (int64_t) act.size();
        for (int32_t e : pred_[li]) stats_.pred_correct += std::binary_search(act.begin(), act.end(), e);
        has_pred_[li] = 0;
    }
    prev_ids_[li] = std::move(act);
}
