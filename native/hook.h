// hook: the llama.cpp graph callback (cb_eval) that makes routed experts resident just in time.
//
// Invariant (the callback barrier): ggml's scheduler asks about every node before computing it
// and, for nodes we "need", calls us again after computing it and before asking about the next.
// We need `ffn_moe_topk-<il>`: when it is observed, the router's ids for layer il are final and
// none of layer il's expert matmuls has been asked about yet. There we release layer il-1, make
// the union of layer il's selected experts resident and pinned, and only then return. When a
// MUL_MAT_ID node is asked about, we point its expert weight (src[0]) at the pager's region.
// A ubatch whose expert union in a layer exceeds the slots that layer can use is *staged*
// instead: at each of that layer's MUL_MAT_ID asks, the union's slices of that one matrix are
// copied or read into one staging buffer laid out like the file, the weight points there, and
// we need the node, so it is computed (and observed) before the next node is asked about and
// the buffer is reused -- one matrix at a time, in memory reserved up front, same bytes, same
// graph. After a read failure the weight points at an all-zero mapping (the decode is being
// aborted, and the zero page keeps the matmul from touching PROT_NONE memory before the abort
// callback stops the graph). The callback never returns false in the observe pass: that would
// silently truncate the graph (docs/DESIGN.md "Pitfalls"). Errors are stored and reported after
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
// biases still contribute. Which experts are resident depends on the arena's history only (no
// prefetch exists); with prefetch, it would depend on I/O timing and the knob would not be
// reproducible unless prefetch were off.
#pragma once

#include <cstdint>
#include <exception>
#include <string>
#include <unordered_map>
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
};

class expert_hook {
public:
    // names[i] = (tensor name, MoE layer index, tensor index) for every routed-expert tensor.
    expert_hook(pager * pg, int n_moe_layers, const std::vector<int32_t> & blocks,
                const std::vector<std::tuple<std::string, int, int>> & names, bool record);
    ~expert_hook();

    static bool cb_eval(ggml_tensor * t, bool ask, void * user_data);
    static bool abort_cb(void * user_data);

    // Attaches the pager after the context exists (the arena is sized from measured usage).
    void set_pager(pager * pg) { pg_ = pg; }
    // Lossy skip-cold threshold (see above); negative = off (the default).
    void set_skip_cold(double tau) { skip_tau_ = tau; }
    double skip_cold() const { return skip_tau_; }

    // Called by the engine around llama_decode.
    void begin_decode();
    void end_decode();
    // Rethrows a failure stored during the last decode (and clears it).
    void rethrow_if_failed();
    bool failed() const { return (bool) error_; }

    const hook_stats & stats() const { return stats_; }
    // Bytes of the staging buffer: the largest expert tensor's file pages (0 without a pager).
    int64_t stage_capacity() const;
    void reset_stats() { stats_ = hook_stats{}; }

    // Route log: tokens in processing order, [n_tokens][n_moe_layers][k] int32.
    const std::vector<int32_t> & route() const { return route_; }
    // Forward pass (ubatch) number of each recorded token, counted from the hook's creation.
    const std::vector<int32_t> & route_ubatch() const { return route_ub_; }
    int route_k() const { return route_k_; }
    void clear_route() { route_.clear(); route_ub_.clear(); }

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
    int64_t                                  stage_bytes_ = 0;
    bool                                     stage_used_ = false;
    std::vector<std::vector<int32_t>>        stage_ids_;         // per layer: the union to stage
    double                                   skip_tau_ = -1.0;   // skip-cold threshold; < 0: off
    std::vector<std::vector<int32_t>>        pend_ids_;          // per PENDING layer: router-order ids
    std::vector<std::vector<float>>          pend_w_;            // per PENDING layer: their weights
    bool                                     record_;
    std::vector<int32_t>                     route_;
    std::vector<int32_t>                     route_ub_;
    std::vector<int32_t>                     ub_route_;     // current ubatch [n_tokens][L][k]
    int                                      ub_tokens_ = 0;
    int                                      route_k_ = 0;
    hook_stats                               stats_;
};
