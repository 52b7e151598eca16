// hook_lossy: the rule of the two lossy route rewrites the hook applies in a decode step
// (expert_hook::set_route_bias, set_adaptive_k; off by default), as one pure function, so the rule
// is tested on hand-built routes (epqlab._core.lossy_route) apart from the graph.
//
// Invariant: the rewritten route names each kept slot's expert once (never an expert twice among
// the kept slots, and a substitute is never one of the router's own k choices), keeps at least one slot, and with route bias off (delta <= 0) and adaptive-k off
// it is the input route unchanged.
//
// Adaptive-k (DOI 10.5281/zenodo.18282008; TensorRT-LLM PR #10672): H = -sum_e q_e ln q_e over all
// n_expert router probabilities q; k' = ks[i] for the first i with H < thresholds[i], else
// ks.back(); capped by the graph's k (llama.cpp's n_expert_used) and at least 1. The k' slots of
// highest q are kept (ties: the earlier slot).
// Cache-aware routing (colibri CACHE_ROUTE, colibri issue #258; arXiv 2412.00099): each kept slot
// in order of q, best first, whose expert is not resident is given the resident expert of highest
// q (ties: lower id) that is none of the router's k choices and no kept slot uses yet, when q_orig - q_cand < delta (strict: delta = 0
// substitutes nothing).
// Dropped slots repeat the best kept slot's (final) expert: nothing extra is read; the hook zeroes
// their combination weights (hook.h, "Lossy route rewrites").
//
// lossy_step applies the rule to every token of a step (a single-token decode step, or a batched
// decode step whose tokens belong to different sequences) and adds the two step-level knobs:
// Batch-aware routing (ROUTE_BATCH; after Opportunistic Expert Activation, arXiv 2511.02237): a
// token's kept expert that is neither resident nor chosen by another token of the step (the step
// would read it for this token alone) is given the expert of highest q that is resident or in the
// other tokens' current kept union, under the same margin and distinctness rules as cache-aware
// routing. Tokens are rewritten in step order; each sees the others' routes as rewritten so far.
// With one token it is cache-aware routing.
// Union budget (budget > 0; colibri EXPERT_BUDGET, colibri issue #220; MoE-Spec arXiv 2602.16052):
// when the step's distinct experts exceed budget, the experts kept are the first budget of the
// union ordered by resident first, then aggregate router probability over the step's kept slots
// (sum of q), then lower id; a slot whose expert is outside them is dropped. A token left with no
// kept slot keeps its slot of highest q (counted in budget_overflow: the union may then exceed
// budget by such tokens). Applied after adaptive-k and substitution.
#pragma once

#include <cstdint>
#include <vector>

struct lossy_result {
    int n_keep = 0;            // k' (the k slots without adaptive-k)
    int substituted = 0;       // kept slots given a resident expert instead of the router's
    int unchanged = 0;         // slots kept with the router's own expert
    std::vector<uint8_t> keep; // per slot: 1 = kept (its weight counts), 0 = dropped (weight zeroed)
};

// q: router probabilities [n_expert]; ids: the router's k experts, rewritten in place;
// resident [n_expert]: 1 = resident in the arena before this layer's load. thresholds ascending,
// ks.size() == thresholds.size() + 1 (both empty: adaptive-k off). Throws std::invalid_argument on
// an id outside [0, n_expert) or mismatched thresholds.
lossy_result lossy_route(const float * q, int n_expert, int32_t * ids, int k, const uint8_t * resident, double delta,
                         const std::vector<double> & thresholds, const std::vector<int> & ks);

enum route_mode : int { ROUTE_OFF = 0, ROUTE_CACHE = 1, ROUTE_BATCH = 2 };

struct lossy_step_result {
    int substituted = 0;       // kept slots given another expert (cache-aware or batch-aware routing)
    int unchanged = 0;         // kept slots with the router's own expert
    int adaptive_dropped = 0;  // slots dropped by adaptive-k
    int budget_dropped = 0;    // slots dropped by the union budget
    int budget_overflow = 0;   // tokens whose every slot fell outside the budget (kept their best)
    int union_before = 0;      // the router's distinct experts in the step
    int union_after = 0;       // the distinct experts of the kept slots (what the step reads or finds resident)
    int not_read = 0;          // of the router's union: not resident and not in the rewritten union
    std::vector<uint8_t> keep; // [n_tokens][k]: 1 = kept (weight counts), 0 = dropped (weight zeroed)
    std::vector<int32_t> orig; // [n_tokens][k]: the router's ids
    std::vector<int> n_keep;   // [n_tokens]: kept slots per token
};

// q: router probabilities [n_tokens][n_expert]; ids [n_tokens][k], rewritten in place; resident
// [n_expert] before this layer's load; mode a route_mode (delta ignored when ROUTE_OFF); budget
// 0 = off, else the cap on distinct experts. Throws std::invalid_argument on an id outside
// [0, n_expert), a bad mode, a negative budget or mismatched thresholds.
lossy_step_result lossy_step(const float * q, int n_expert, int32_t * ids, int k, int n_tokens, const uint8_t * resident,
                             int mode, double delta, const std::vector<double> & thresholds, const std::vector<int> & ks,
                             int budget);

// Entropy in nats of q [n] (terms with q <= 0 contribute 0).
double router_entropy(const float * q, int n);
