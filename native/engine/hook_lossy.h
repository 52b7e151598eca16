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

// Entropy in nats of q [n] (terms with q <= 0 contribute 0).
double router_entropy(const float * q, int n);
