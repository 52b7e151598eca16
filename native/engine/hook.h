// hook: the llama.cpp graph callback (cb_eval) that makes routed experts resident just in time.
// Implemented in hook.cpp (the callback, layer loads, staging, skip-cold, time split, route and
// router-input logs) and hook_predict.cpp (the prefetch predictors and their gate).
//
// Invariant (the callback barrier): ggml's scheduler asks about every node before computing it
// and, for nodes we "need", calls us again after computing it and before asking about the next.
// We need `ffn_moe_topk-<il>`: when it is observed, the router's ids for layer il are final and
// none of layer il's expert matmuls has been asked about yet. There we release layer il-1, make
// the union of layer il's selected experts resident and pinned, and only then return. When a
// MUL_MAT_ID node is asked about, we point its expert weight (src[0]) at the pager's region, or,
// with the pager slot-addressed, at the arena's slots with the node's ids (src[2]) replaced by the
// experts' slot indices (hook_slots.cpp states that invariant).
// A ubatch whose expert union in a layer exceeds the slots that layer can use is *staged*
// instead: at each of that layer's MUL_MAT_ID asks, the union's slices of that one matrix are
// copied or read into one staging buffer laid out like the file, the weight points there, and
// we need the node, so it is computed (and observed) before the next node is asked about and
// the buffer is reused -- one matrix at a time, same bytes, same graph. With the pager's stage
// lending on (under a budget) the layer's staged pages are first lent by the arena (pager::lend),
// the buffer's pages are dropped before each matrix, and the lent slots come back (unlend) before
// the next layer that is not staged and at the end of the decode. After a read failure the weight points at an all-zero mapping (the decode is being
// aborted, and the zero page keeps the matmul from touching PROT_NONE memory before the abort
// callback stops the graph). The callback never returns false in the observe pass: that would
// silently truncate the graph (docs/DESIGN.md §4 "Pitfalls"). Errors are stored and reported after
// llama_decode.
//
// Lossy skip-cold (off by default; set_skip_cold(tau), tau >= 0): in a single-token ubatch, a
// selected expert that is not resident and whose router weight is below tau is not read; its
// slices compute on zeros (pager::zero_overlay), the graph is unchanged. The weight is the one
// llama.cpp multiplies the expert's output by: the last of ffn_moe_weights-<il>,
// ffn_moe_weights_softmax-<il>, ffn_moe_weights_norm-<il>, ffn_moe_weights_scaled-<il> the model
// computes. llama.cpp expands that node into the graph before the expert matmuls ("call early"
// in build_moe_ffn), so with the knob on the layer's load moves from ffn_moe_topk-<il> to the
// layer's first MUL_MAT_ID ask, when the weights are known. A skipped expert's output is
// weight x down(act(gate(0)) * up(0)): zero without expert biases; with them (gpt-oss) the
// biases still contribute. Which experts are resident depends on the arena's history only, so
// skip-cold and prefetch are exclusive (set_prefetch / set_skip_cold refuse the second): with
// prefetch, residency would depend on the predictor and the knob would change which experts
// are skipped.
//
// Lossy route rewrites (off by default; set_route_bias(delta), set_adaptive_k(thresholds, ks);
// hook_lossy.h states the rule and its sources): in a single-token ubatch (a decode step: the
// pass's first MoE layer routed one token), at the observe of ffn_moe_topk-<il> the hook reads the
// router's probabilities (ffn_moe_probs-<il>, noted at its ask; still alive: get_rows reads it
// later), rewrites the ids in place and only then loads the layer. llama.cpp's get_rows
// (ffn_moe_weights-<il>) and MUL_MAT_ID read the rewritten ids, so a substituted expert's weight is
// the router's own probability of it, normalized by the graph as the architecture does
// (ffn_moe_weights_norm where norm_w). Adaptive-k keeps llama.cpp's fixed-k graph: a dropped slot
// repeats the best kept expert (resident: nothing extra is read; the matmul computes it again)
// and its weight is zeroed at ffn_moe_weights-<il>'s observe, before the graph sums and normalizes
// (with a softmax over the selected logits, ffn_moe_weights_softmax-<il>, the kept ones are
// renormalized there), so the output is the kept experts' renormalized mixture. The route log records
// the experts computed, and for a dropped slot the router's own choice (k distinct ids, as skip-cold
// records its skipped experts); adaptive_k_log() gives the k kept per (token, layer). Exclusive with
// skip-cold (both act on non-resident experts / skip-cold would take the zeroed weights as cold);
// cache-aware routing is exclusive with prefetch (its choice depends on residency). Both work with
// pipelined reads: the rewrite comes before the layer's request.
//
// Time split (set_timing, on by default): each part has its own timestamps. The callback also
// needs each layer's last expert matmul (ffn_down_exps), so ggml computes a layer in two pieces
// whose wall times are taken between the need-ask's return and its observe (nothing but ggml
// runs in between): the piece ending at ffn_moe_topk-<il> (attention, norms, router: "attn")
// and the piece ending at the down matmul (expert matmuls and their elementwise ops: "expert").
// A staged matmul is its own piece ("expert"). I/O wait and map/unmap are the pager's own
// timestamps (io_wait_us, map_us), charged to the layer the callback was serving; "predict" is
// the prefetch predictor's own time plus issuing its reads (slot choice; evictions' unmaps are "map"). Everything else in a decode call's wall time (embedding
// before layer 0's attention is in layer 0's "attn"; the output head, the hook's bookkeeping,
// llama.cpp's graph build and sampling prep) is "other", the only remainder. With pipelined reads
// every expert matmul of a layer with misses is a needed node, so "expert" is summed over those
// pieces and each matrix's wait is "io". Splitting the graph
// at needed nodes computes the same nodes in the same order with the same kernels: logits do
// not change (tests/test_overlap.py checks bit-identity).
//
// Prefetch (set_prefetch; off by default): when layer l's experts are resident and pinned (its
// topk observe, single-token ubatches only), the predicted experts of layer l+1 are read in the
// background into free or evictable slots (pager::prefetch_start: never pinned experts, never
// l+1's own predictions) while ggml computes layer l's expert matmuls and l+1's attention; at
// l+1's topk the hook requests l+1's real experts as always: the prefetch's reads of experts the
// router did not select that no I/O thread has started are cancelled, the hook waits for the
// rest, and only what is still missing is read. Predictors: LOOKAHEAD applies layer l+1's router weights
// (ffn_gate_inp, captured from the graph) to layer l's router input (the src[1] of
// ffn_moe_logits-<il>) and takes the top-k; PREVIOUS takes the experts layer l+1 used for the
// previous token; UNION is lookahead first, then previous, capped at a byte budget; TRAINED is
// lookahead with learned weights: W[d-1][l] (n_expert x n_embd) and b[d-1][l] map layer l's router
// input to layer l+d's router logits (set_predictor; fitted by epqlab/predictor.py). With depth
// d > 1, layer l's topk also starts the predictions of layers l+2 .. l+d (the same predictor
// applied that many layers ahead), queued behind l+1's, so the device has work queued while
// l+1 computes; each layer's batch stays in flight until that layer's topk. The gate
// (min_precision > 0): a predicted expert that is not resident is read only while predictions
// of its rank (position in the predictor's list, per depth) that were not resident have been
// selected at their layer at least that often (an EMA, scored at each layer's topk whether they
// were read or not, so a closed rank can reopen). Resident predictions cost nothing and are
// where a predictor is right most often, so the reads it would issue can be mostly wrong even
// when its precision is high. ORACLE is the ceiling of any predictor, for studies: it replays
// the routes of an earlier identical run (set_oracle: one row per single-token ubatch, in the
// order this hook sees them), so what it still waits for is the mechanism's own cost. Its
// predictions past the last MoE layer wrap around to the next token's first layers (the next
// row), in carried batches end_decode leaves in flight, so the device also works through
// sampling and the next token's first attention; they are not scored (precision/recall count
// predictions made within a pass). The other predictors stop at the last layer: the learned
// ones have no hidden state of the next token, and the previous token's experts, tried there,
// removed 3 of 145 misses on the skewed 8 GiB model (docs/DESIGN.md §3c, "Oracle"). Prefetch
// changes only which experts are resident when, never the bytes in the region.
//
// Pipelined reads (set_pipeline; off here, on by default in epqlab.Session): the hook requests a layer with
// pager::request_layer_async (a multi-token ubatch, a batch step or a prefill, by its sorted union of experts,
// as request_layer loads it; one that needs staging is not pipelined), so the misses' reads are queued matrix by matrix in the
// order the graph computes them (learned from the asks), and each expert matmul's ask waits
// only for its own matrix (pager::wait_tensor) and is a needed node: ggml computes up to it, so
// the next matrix's reads overlap this matmul. The bytes each matmul reads are the same.
#pragma once

#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "pager.h"

struct ggml_tensor;

struct hook_stats {
    int64_t ubatches = 0;        // forward passes seen (one per ubatch)
    int64_t layer_loads = 0;     // (ubatch, layer) pairs paged through the arena
    int64_t staged_layers = 0;   // (ubatch, layer) pairs staged matrix by matrix (union > slots)
    int64_t staged_tokens = 0;   // tokens in those ubatches, summed over layers
    int64_t tokens = 0;          // tokens routed (counted at the first MoE layer)
    int64_t dropped_bytes = 0;   // llama-mapped expert bytes dropped from memory at capture
    int64_t cold_skipped = 0;    // experts not read by skip-cold (computed on zeros)
    int64_t union_experts = 0;   // distinct experts routed per (ubatch, MoE layer), summed: a batch's union
    // Prefetch predictions scored at the predicted layer's topk (single-token ubatches):
    int64_t pred_layers = 0;     // (token, layer) pairs that had a prediction
    int64_t pred_experts = 0;    // experts predicted (sum of |predicted set|)
    int64_t pred_actual = 0;     // experts the router then selected (sum of |actual set|)
    int64_t pred_correct = 0;    // |predicted ∩ actual|, summed: precision = correct/experts, recall = correct/actual
    int64_t pred_gated = 0;      // predicted non-resident experts not read: their rank's precision was below the gate
    // The callback's own cost: every ask answered "needed" ends a graph piece, and each piece is one
    // ggml_graph_compute (a thread-pool kick-off and barrier) of its own.
    int64_t graph_asks = 0;      // nodes ggml asked about
    int64_t graph_pieces = 0;    // asks answered "needed": the pieces the graph was split into, less one
    // Lossy knobs (skip-cold, cache-aware routing, adaptive-k), decode steps only:
    int64_t lossy_slots = 0;       // (token, layer, slot) choices a lossy knob examined
    int64_t route_changed = 0;     // of those, not computed with the router's own expert (substituted, dropped, skipped)
    int64_t route_substituted = 0; // slots given a resident expert instead (cache-aware routing)
    int64_t adaptive_dropped = 0;  // slots dropped by adaptive-k (weight zeroed)
    int64_t lossy_bytes_saved = 0; // slot bytes (pager unit_bytes) of router-chosen non-resident experts not read
    int64_t budget_dropped = 0;    // slots dropped by the union budget (set_expert_budget; weight zeroed)
    int64_t budget_overflow = 0;   // tokens the budget left with no slot, that kept their best one
    int64_t lossy_union_before = 0; // the router's distinct experts per (rewritten step, layer), summed
    int64_t lossy_union_after = 0;  // the same steps' distinct experts after the rewrites
};

// One decode call's time in one MoE layer, microseconds (see "Time split" above).
struct layer_time {
    int32_t call = 0, li = 0, n_tokens = 0;
    int64_t attn_us = 0, expert_us = 0, io_us = 0, map_us = 0, predict_us = 0;
};
// One decode call: tokens and wall time from begin_decode to end_decode, microseconds.
struct call_time {
    int32_t call = 0, n_tokens = 0;
    int64_t wall_us = 0;
    int64_t io_busy_us = 0;  // wall time with at least one expert read in progress (pager::io_busy_us)
};

enum prefetch_mode : int { PF_OFF = 0, PF_LOOKAHEAD = 1, PF_PREVIOUS = 2, PF_UNION = 3, PF_TRAINED = 4, PF_ORACLE = 5 };
// Each mode's name as Python spells it (epqlab.constants.PrefetchMode, lower case): the engine
// module exports this table as PREFETCH_MODES, and tests/test_native_codes.py checks the two agree.
inline constexpr std::pair<const char *, prefetch_mode> PREFETCH_MODE_NAMES[] = {
    {"off", PF_OFF}, {"lookahead", PF_LOOKAHEAD}, {"previous", PF_PREVIOUS},
    {"union", PF_UNION}, {"trained", PF_TRAINED}, {"oracle", PF_ORACLE},
};
static_assert(sizeof(PREFETCH_MODE_NAMES) / sizeof(PREFETCH_MODE_NAMES[0]) == PF_ORACLE + 1,
              "one name per prefetch mode (set_prefetch accepts PF_OFF..PF_ORACLE)");

// An expert weight's own ne[2], nb[2], nb[3] (slot addressing re-describes them; hook_slots.cpp).
struct expert_hook_weight_shape { int64_t ne2, nb2, nb3; };

class expert_hook {
public:
    // Layers ahead a prefetch reads at most (set_prefetch's depth), and the most depths a trained
    // predictor may carry (set_predictor's W[depth]). Exported as MAX_PREFETCH_DEPTH.
    static constexpr int kMaxDepth = 8;
    // Layers ahead a trained predictor is fitted for at most (epqlab/predictor.py fits and loads
    // W with depth <= this: W [depth][n_layers][n_expert][n_embd] float32 grows by every layer's
    // router weights per depth).
    // The hook itself accepts a predictor of any depth up to kMaxDepth; this is the fitter's bound,
    // kept here so that one constant is exported (as MAX_FIT_DEPTH) and checked against Python's.
    static constexpr int kMaxFitDepth = 4;
    static_assert(kMaxFitDepth <= kMaxDepth, "a fitted depth must be a depth the hook can prefetch");

    // names[i] = (tensor name, MoE layer index, tensor index) for every routed-expert tensor.
    expert_hook(pager * pg, int n_moe_layers, const std::vector<int32_t> & blocks,
                const std::vector<std::tuple<std::string, int, int>> & names, bool record);
    ~expert_hook();

    static bool cb_eval(ggml_tensor * t, bool ask, void * user_data);
    static bool abort_cb(void * user_data);

    // Attaches the pager after the context exists (the arena is sized from measured usage).
    void set_pager(pager * pg) { pg_ = pg; }
    // Lossy skip-cold threshold (see above); negative = off (the default).
    void set_skip_cold(double tau) {
        if (tau >= 0 && pg_ && pg_->slot_addressed())
            throw std::invalid_argument("skip-cold needs region addressing (it maps zeros over a skipped expert's pages): open with expert_addressing='region'");
        if (tau >= 0 && route_delta_ >= 0)
            throw std::invalid_argument("skip-cold and cache-aware routing are exclusive: both decide what happens to a non-resident expert");
        if (tau >= 0 && budget_ > 0)
            throw std::invalid_argument("skip-cold and the expert budget are exclusive: skip-cold would read the budget's zeroed weights as cold");
        if (tau >= 0 && !ak_ks_.empty())
            throw std::invalid_argument("skip-cold and adaptive-k are exclusive: skip-cold would read adaptive-k's zeroed weights as cold");
        if (tau >= 0 && pf_mode_ != PF_OFF)
            throw std::invalid_argument("skip-cold and prefetch are exclusive: skip-cold's choice depends on residency");
        if (tau >= 0 && pipeline_)
            throw std::invalid_argument("skip-cold and pipelined reads are exclusive: skip-cold loads at the first matmul");
        skip_tau_ = tau;
    }
    double skip_cold() const { return skip_tau_; }
    // Lossy cache-aware routing (see "Lossy route rewrites"; hook_lossy.cpp); delta < 0 = off (the
    // default), 0 = on but substitutes nothing. Throws std::invalid_argument with skip-cold or prefetch on.
    // batch = true: batch-aware routing (hook_lossy.h): the other tokens' union counts as available too.
    void set_route_bias(double delta, bool batch = false);
    double route_bias() const { return route_delta_; }
    bool route_batch() const { return route_batch_; }
    // Lossy union budget (hook_lossy.h, lossy_step): at most n distinct experts per layer in a step; 0 = off.
    // Throws std::invalid_argument with skip-cold or prefetch on, or n < 0.
    void set_expert_budget(int n);
    int expert_budget() const { return budget_; }
    // Set by the engine before each llama_decode: true when the call is a decode step (one token per
    // sequence, including any one-token pass), the only calls the lossy rewrites act on (a prompt chunk
    // of several tokens is evaluated exactly).
    void set_decode_step(bool on) { decode_step_ = on; }
    // Lossy adaptive-k (see above); ks empty = off; ks.size() == thresholds.size() + 1, thresholds
    // increasing (nats). Throws std::invalid_argument with skip-cold on or on bad thresholds.
    void set_adaptive_k(const std::vector<double> & thresholds, const std::vector<int> & ks);
    // Per MoE layer: adaptive-k's kept experts summed, and decode steps counted, since the last reset.
    const std::vector<int64_t> & layer_k_sum() const { return layer_k_sum_; }
    const std::vector<int64_t> & layer_k_steps() const { return layer_k_n_; }
    // Next-layer prefetch (see above); budget_bytes caps each layer's prediction (0 = no cap
    // beyond the predictor's own size). Throws std::invalid_argument with skip-cold on.
    // depth: layers ahead, 1..kMaxDepth (8); min_precision: the gate (see "Prefetch" above), 0 = read every prediction.
    void set_prefetch(int mode, int64_t budget_bytes, int depth = 1, double min_precision = 0);
    int  prefetch() const { return pf_mode_; }
    // The TRAINED predictor's weights: W float32 [depth][n_layers][n_expert][n_embd], b [depth][n_layers][n_expert].
    // W is kept in w_type, the bytes a token streams per depth (40 layers x 256 x 2048 weights):
    //   GGML_TYPE_BF16: rounded to nearest, ties to even, applied to the float32 router input (42 MB);
    //   GGML_TYPE_Q8_0: ggml's own quantization of each row (22 MB), applied by ggml-cpu's vec_dot
    //   to the router input quantized to Q8_0 (the type's vec_dot_type), as a llama.cpp matmul of
    //   Q8_0 weights computes; n_embd must be a multiple of 32. (Q4_0 lost 8 points of recall.)
    // b stays float32. epqlab.engine.predictor.ExpertPredictor.logits applies the same roundings in NumPy.
    // Throws std::invalid_argument for another type or a width the type's blocks do not divide.
    void set_predictor(const float * W, const float * b, int depth, int n_layers, int n_expert, int64_t n_embd,
                       int w_type);
    // The TRAINED predictor applied to router input x [n_embd] of MoE layer li: layer li+d's predicted
    // router logits into out [n_expert], exactly as predict computes them. Throws std::invalid_argument
    // without a predictor, for li / d outside it, or for another width.
    void predictor_logits(int li, int d, const float * x, int64_t n_embd, std::vector<float> & out);
    // The ORACLE's routes: int32 [n_steps][n_layers][k], row i = the experts each MoE layer
    // selects in the i-th single-token ubatch counted from this call; follows[i] != 0 when the
    // forward pass right after row i's is row i+1's (its predictions past the last layer then
    // wrap around to it; not at the end of a generation, whose next pass is a prompt). Throws
    // std::invalid_argument on a wrong layer count, k < 1 or (with a pager attached) an id outside
    // [0, n_expert).
    void set_oracle(const int32_t * routes, const uint8_t * follows, int64_t n_steps, int n_layers, int k);
    // Pipelined reads (see above). Throws std::invalid_argument with skip-cold on.
    void set_pipeline(bool on) {
        if (on && skip_tau_ >= 0)
            throw std::invalid_argument("pipelined reads and skip-cold are exclusive: skip-cold loads at the first matmul");
        if (pg_) pg_->demand_finish();
        pipeline_ = on;
    }
    bool pipeline() const { return pipeline_; }
    // Time split (see above); on by default.
    void set_timing(bool on) { timing_ = on; }
    bool timing() const { return timing_; }
    const std::vector<layer_time> & layer_times() const { return layer_times_; }
    const std::vector<call_time> &  call_times() const { return call_times_; }
    void clear_times() { layer_times_.clear(); call_times_.clear(); }

    // Called by the engine around llama_decode.
    void begin_decode();
    void end_decode();
    // Rethrows a failure stored during the last decode (and clears it).
    void rethrow_if_failed();
    bool failed() const { return (bool) error_; }

    const hook_stats & stats() const { return stats_; }
    // Bytes of the staging buffer: the largest expert tensor's file pages (0 without a pager).
    int64_t stage_capacity() const;
    void reset_stats() {
        stats_ = hook_stats{};
        std::fill(layer_union_.begin(), layer_union_.end(), 0);
        std::fill(layer_k_sum_.begin(), layer_k_sum_.end(), 0);
        std::fill(layer_k_n_.begin(), layer_k_n_.end(), 0);
    }
    // Per MoE layer: distinct experts routed, summed over ubatches since the last reset (the union a
    // batched decode step reads once for all its tokens; docs/DESIGN.md §3d).
    const std::vector<int64_t> & layer_unions() const { return layer_union_; }

    // Route log: tokens in processing order, [n_tokens][n_moe_layers][k] int32.
    const std::vector<int32_t> & route() const { return route_; }
    // Forward pass (ubatch) number of each recorded token, counted from the hook's creation.
    const std::vector<int32_t> & route_ubatch() const { return route_ub_; }
    // The router's probability (ffn_moe_probs, normalised over all experts: router_probs) of each
    // entry of route(), float32 aligned with it; NaN where the graph gave none.
    const std::vector<float> & route_probs() const { return route_p_; }
    int route_k() const { return route_k_; }
    // With adaptive-k and route recording: the k kept per recorded token and MoE layer, [n_tokens][n_moe_layers]
    // int32 aligned with route() (the graph's k where adaptive-k did not act: prefill, unrouted rows).
    const std::vector<int32_t> & adaptive_k_log() const { return kept_log_; }
    void clear_adaptive_k_log() { kept_log_.clear(); }
    void clear_route() { route_.clear(); route_ub_.clear(); route_p_.clear(); }

    // Router-input log (set_capture_inputs; off by default), the training data of a learned
    // predictor: for every routed token, every MoE layer's router input (the src[1] of
    // ffn_moe_logits-<il>, float32) in processing order, [n_tokens][n_moe_layers][n_embd]; rows
    // of a layer that did not compute the token (the last layer outside the output rows) are NaN.
    // Needs route recording on (the rows align with route()).
    void set_capture_inputs(bool on) {
        if (on && !record_) throw std::invalid_argument("capturing router inputs needs route recording (route_log)");
        capture_ = on;
    }
    const std::vector<float> & router_inputs() const { return inputs_; }
    int64_t router_input_dim() const { return in_dim_; }
    void clear_router_inputs() { inputs_.clear(); outputs_.clear(); }
    // With capture on, also each MoE layer's output (ffn_moe_out-<il>: the routed experts' weighted sum,
    // before any shared expert), same layout as router_inputs(): the NumPy reference of a layer compares
    // to it (tests/test_lossy_route.py). Needing that node splits the graph there: logits unchanged.
    const std::vector<float> & moe_outputs() const { return outputs_; }

private:
    enum mode : uint8_t { REGION = 0, STAGE = 1, ZERO = 2, PENDING = 3 };

    bool on_ask(ggml_tensor * t);
    void on_topk(ggml_tensor * t);
    void on_weights(ggml_tensor * t);
    // Skip-cold: loads a PENDING layer's kept experts and zero-maps the skipped ones.
    void resolve_pending(int li);
    int  layer_of_block(int il) const;
    char * stage_buffer();
    void flush_ubatch();
    void * zero_mapping(int64_t bytes);
    // Time split: charges the pager's io/map time since the last charge to layer li.
    void charge_pager(int li);
    void charge_compute(ggml_tensor * t, int64_t dt);
    // Prefetch (hook_predict.cpp): predicts layers li+1 .. li+depth from layer li's router input and starts reading them.
    void start_prefetch(int li, int k);
    void lookahead(int li, int nl, int k, std::vector<int32_t> & out);
    void score_prediction(int li, const std::vector<int32_t> & ids);

    pager *                                  pg_;
    int                                      n_layers_;
    std::vector<int32_t>                     blocks_;       // GGUF block id per MoE layer index
    std::unordered_map<std::string, std::pair<int, int>> names_;
    std::unordered_map<const ggml_tensor *, std::pair<int, int>> seen_;
    std::vector<std::vector<int64_t>>        tensor_bytes_; // whole-tensor bytes per [li][ti]
    std::vector<uint8_t>                     mode_;         // per layer, for the current ubatch
    int                                      last_li_ = -1;
    bool                                     in_decode_ = false;
    bool                                     abort_ = false;
    std::exception_ptr                       error_;
    void *                                   zero_ = nullptr;
    int64_t                                  zero_bytes_ = 0;
    char *                                   stage_ = nullptr;   // staging buffer (anonymous)
    void end_stage_lending();  // drops the staged pages, then gives lent arena slots back (pager::unlend)
    int64_t                                  stage_bytes_ = 0;
    bool                                     stage_used_ = false;
    std::vector<std::vector<int32_t>>        stage_ids_;         // per layer: the union to stage
    double                                   skip_tau_ = -1.0;   // skip-cold threshold; < 0: off
    std::vector<std::vector<int32_t>>        pend_ids_;          // per PENDING layer: router-order ids
    std::vector<std::vector<float>>          pend_w_;            // per PENDING layer: their weights
    // lossy route rewrites (hook_lossy.cpp)
    double                                   route_delta_ = -1;  // cache-aware routing margin; < 0: off (0: on, changes nothing)
    bool                                     route_batch_ = false; // batch-aware routing (route_delta_ its margin)
    int                                      budget_ = 0;        // union budget; 0: off
    bool                                     decode_step_ = true; // the current llama_decode is a decode step
    std::vector<double>                      ak_thr_;            // adaptive-k entropy thresholds (nats)
    std::vector<int>                         ak_ks_;             // adaptive-k's k per band; empty: off
    int                                      pass_tokens_ = 0;   // tokens of this pass (its first MoE layer's)
    std::vector<ggml_tensor *>               probs_;             // per layer: ffn_moe_probs-<il> of this pass
    std::vector<std::vector<uint8_t>>        drop_keep_;         // per layer: kept slots [n_tokens][k] (empty: none dropped)
    std::vector<int64_t>                     layer_k_sum_, layer_k_n_;
    std::vector<float>                       prob_buf_;
    std::vector<int32_t>                     lossy_orig_;        // the router's ids of the last rewrite [n_tokens][k]
    std::vector<int32_t>                     kept_log_, ub_kept_;  // adaptive_k_log(), current ubatch
    std::vector<uint8_t>                     res_buf_;
    bool lossy_on() const { return route_delta_ >= 0 || !ak_ks_.empty() || budget_ > 0; }
    void note_probs(ggml_tensor * t);
    void router_probs(int li, int n_tokens, std::vector<float> & q);
    void apply_lossy(int li, ggml_tensor * t, std::vector<int32_t> & ids, int n_tokens);
    void zero_dropped(int li, ggml_tensor * t, bool softmax);
    bool                                     record_;
    std::vector<int32_t>                     route_;
    std::vector<int32_t>                     route_ub_;
    std::vector<int64_t>                     layer_union_;  // see layer_unions()
    int64_t                                  passes_ = 0;   // forward passes since creation (reset_stats keeps it)
    std::vector<int32_t>                     ub_route_;     // current ubatch [n_tokens][L][k]
    std::vector<float>                       route_p_;      // route_probs()
    std::vector<float>                       ub_route_p_;   // current ubatch, aligned with ub_route_
    std::vector<float>                       gate_w_;       // gate_rank: the step's ids' router probabilities
    void note_route_probs(int li, const std::vector<int32_t> & ids, int k, int n_tokens);
    int                                      ub_tokens_ = 0;
    int                                      route_k_ = 0;
    bool                                     capture_ = false;
    std::vector<float>                       inputs_;       // router-input log [tokens][L][in_dim_]
    std::vector<float>                       ub_inputs_;    // current ubatch
    std::vector<float>                       outputs_, ub_outputs_;  // MoE-output log (moe_outputs), current ubatch
    void capture_output(ggml_tensor * t);
    int64_t                                  in_dim_ = 0;
    void capture_input(int li, int n_tokens);
    void start_ubatch_inputs();
    hook_stats                               stats_;
    // time split
    bool                                     timing_ = true;
    std::vector<std::vector<uint8_t>>        is_last_mm_;   // [li][ti]: the layer's last expert matmul (down)
    int64_t                                  t_need_ = 0;   // when the last needed ask returned, µs
    int64_t                                  t_call0_ = 0;
    int64_t                                  snap_io_ = 0, snap_map_ = 0, snap_busy_ = 0;
    int32_t                                  n_calls_ = 0;
    int64_t                                  call_tokens0_ = 0;
    std::vector<layer_time>                  cur_;          // per layer, this decode call
    std::vector<layer_time>                  layer_times_;
    std::vector<call_time>                   call_times_;
    // pipelined reads
    bool                                     pipeline_ = false;
    std::vector<std::vector<int>>            mm_order_;     // per layer: tensor indices in the order their matmuls are asked
    // prefetch (hook_predict.cpp)
    int                                      pf_mode_ = PF_OFF;
    int64_t                                  pf_budget_ = 0;
    int                                      pf_depth_ = 1;
    double                                   pf_min_prec_ = 0;
    // The gate: per depth, per rank in the prediction, an EMA (weight kGateAlpha on the newest) of
    // "a prediction of this rank that was not resident when made was selected at its layer";
    // starts at 1. And per depth, per layer, those predictions (expert, rank) awaiting the layer's topk.
    static constexpr double                  kGateAlpha = 0.05;
    std::vector<double>                      rank_prec_[kMaxDepth];
    std::vector<std::vector<std::pair<int32_t, int32_t>>> gate_pred_[kMaxDepth];
    void clear_gate_preds();
    std::vector<int32_t>                     oracle_;       // ORACLE: [steps][n_layers_][oracle_k_]
    int                                      oracle_k_ = 0;
    int64_t                                  oracle_steps_ = 0;
    std::vector<uint8_t>                     oracle_follow_;  // per row: the next pass is the next row
    const int32_t * oracle_row(int64_t step, int nl) const;  // the table's routes of nl at step, or null
    int64_t budget_units(int nl) const;  // experts of layer nl prefetch_budget allows (no budget: INT64_MAX)
    int64_t                                  oracle_step_ = -1; // single-token ubatches since set_oracle, minus one
    std::vector<ggml_tensor *>               gate_inp_;     // per layer: router weights (model tensor)
    std::vector<ggml_tensor *>               hidden_;       // per layer: router input of this pass
    std::vector<std::vector<int32_t>>        prev_ids_;     // per layer: previous single token's experts
    std::vector<std::vector<int32_t>>        pred_;         // per layer: this pass's prediction
    std::vector<uint8_t>                     has_pred_;
    std::vector<float>                       row_buf_, logit_buf_;
    std::vector<uint8_t>                     pw_;           // TRAINED predictor's W rows in pw_type_ (set_predictor)
    std::vector<float>                       pb_;           // and its b, float32
    std::vector<uint8_t>                     xq_;           // the router input in the vec_dot type (quantized types)
    int                                      pw_depth_ = 0, pw_exp_ = 0, pw_type_ = 0;
    int64_t                                  pw_embd_ = 0;
    size_t                                   pw_row_ = 0;   // bytes per row of W
    void predict(int li, int nl, int k, std::vector<int32_t> & out);
    void trained_logits(int li, int d, const float * x, std::vector<float> & out);  // W h + b of the TRAINED predictor
    void top_of_logits(int k, std::vector<int32_t> & out);  // top-k of logit_buf_ (ties: lower id)
    // Slot addressing (hook_slots.cpp; pager::set_slot_addressing, docs/DESIGN.md §3f).
    using weight_shape = expert_hook_weight_shape;
    std::unordered_map<ggml_tensor *, weight_shape> w_shape_;   // each expert weight's own ne[2], nb[2], nb[3]
    std::unordered_map<const ggml_tensor *, ggml_tensor *> mm_ids_;  // MUL_MAT_ID node -> its graph's ids tensor
    std::vector<ggml_tensor *>               slot_ids_t_;   // per layer: the ids as slot indices (owned)
    std::vector<std::vector<int32_t>>        slot_ids_;     // and their data, [n_tokens][k], minus slot_lo_
    std::vector<int64_t>                     slot_lo_, slot_span_;  // per layer: lowest slot index read, and the span
    // At layer li's topk, once its experts are pinned: the topk's ids (as the matmuls will read
    // them, after any lossy rewrite) translated into slot indices.
    void fill_slot_ids(int li, const ggml_tensor * topk);
    // A MUL_MAT_ID node's expert weight read as the arena's slots, its ids as slot_ids_t_[li].
    void point_at_slots(ggml_tensor * mm, int li, int ti);
    // A MUL_MAT_ID node of layer li: its expert weight with its own shape and ids, its data at data.
    void point_at(ggml_tensor * mm, int li, void * data);
    // A REGION layer's matmul: point_at_slots with slot addressing, else point_at the region.
    void point_at_resident(ggml_tensor * mm, int li, int ti);
    void restore_weight_shapes();  // every captured weight's own ne[2], nb[2], nb[3]
    void free_slot_ids();
};
