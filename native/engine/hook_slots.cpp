// hook_slots: slot addressing, the hook's half (the pager's half is pager::set_slot_addressing).
//
// Invariant: while the pager is slot-addressed, every MUL_MAT_ID node of a REGION layer that ggml
// computes reads its expert weight as a tensor of n_slots "experts", one slot apart, through the
// pager's fill mapping, and reads its expert ids from this hook's own ids tensor for the layer, in
// which each of the router's ids has been replaced by the slot that holds that expert (filled at
// the layer's topk, after the experts were pinned, so the slots cannot change before the layer's
// matmuls are done). llama.cpp's own ids tensor is left as the router wrote it: get_rows of the
// router weights, expert biases (add_id), the route log and the lossy rewrites read real expert
// ids. Each expert's bytes are the file's, and MUL_MAT_ID computes each (expert, token) row on its
// own, whatever the expert's index, so the logits are those of the region addressing
// (tests/test_slot_addressing.py). STAGE and ZERO layers, and every layer when the pager is
// region-addressed, get the weight's own shape and ids back. docs/DESIGN.md §3f.
#include "hook.h"

#include <algorithm>
#include <climits>
#include <stdexcept>
#include <string>

#include "ggml.h"

void expert_hook::fill_slot_ids(int li, const ggml_tensor * t) {
    const int k = (int) t->ne[0], n_tokens = (int) t->ne[1];
    auto & v = slot_ids_[li];
    v.resize((size_t) k * n_tokens);
    const char * base = (const char *) t->data;
    int32_t lo = INT32_MAX, hi = -1;
    for (int j = 0; j < n_tokens; j++)
        for (int i = 0; i < k; i++) {
            const int32_t e = *(const int32_t *) (base + j * t->nb[1] + i * t->nb[0]);
            const int32_t s = pg_->slot_of(li, e);
            if (s < 0) throw std::logic_error("slot addressing: expert " + std::to_string(e) + " of MoE layer " + std::to_string(li) + " has no slot at its matmuls");
            v[(size_t) j * k + i] = s;
            lo = std::min(lo, s);
            hi = std::max(hi, s);
        }
    // The matmul sees only the slots from the lowest to the highest it reads: ggml's MUL_MAT_ID does
    // bookkeeping per matrix (a row count, a chunk counter on its own cache line) for all ne[2] of them.
    if (hi < 0) lo = hi = 0;
    for (auto & x : v) x -= lo;
    slot_lo_[li] = lo;
    slot_span_[li] = hi - lo + 1;
    ggml_tensor *& x = slot_ids_t_[li];
    if (!x) x = new ggml_tensor();
    *x = ggml_tensor{};
    x->type = GGML_TYPE_I32;
    x->buffer = t->buffer;  // host memory, as the ids it stands for
    x->ne[0] = k;
    x->ne[1] = n_tokens;
    x->ne[2] = x->ne[3] = 1;
    x->nb[0] = sizeof(int32_t);
    x->nb[1] = (size_t) k * sizeof(int32_t);
    x->nb[2] = x->nb[3] = x->nb[1] * n_tokens;
    x->data = v.data();
    snprintf(x->name, sizeof(x->name), "epq_slot_ids-%d", li);
}

void expert_hook::point_at_slots(ggml_tensor * mm, int li, int ti) {
    ggml_tensor * w = mm->src[0];
    ggml_tensor * own = mm->src[2];
    if (own != slot_ids_t_[li]) mm_ids_[mm] = own;  // a (re)built graph: remember its ids tensor
    if (!slot_ids_t_[li] || slot_ids_t_[li]->ne[1] != own->ne[1] || slot_ids_t_[li]->ne[0] != own->ne[0])
        throw std::logic_error("slot addressing: layer " + std::to_string(li) + "'s slot ids do not match its matmul's ids");
    void * data;
    int64_t stride, n;
    pg_->slot_view(li, ti, &data, &stride, &n);
    if (slot_lo_[li] + slot_span_[li] > n) throw std::logic_error("slot addressing: slot index past the class's slots");
    n = slot_span_[li];
    w->data = (char *) data + slot_lo_[li] * stride;
    w->ne[2] = n;
    w->nb[2] = (size_t) stride;
    w->nb[3] = (size_t) stride * n;
    mm->src[2] = slot_ids_t_[li];
}

static void give_shape(ggml_tensor * w, const expert_hook_weight_shape & sh) {
    w->ne[2] = sh.ne2;
    w->nb[2] = (size_t) sh.nb2;
    w->nb[3] = (size_t) sh.nb3;
}

void expert_hook::point_at(ggml_tensor * mm, int li, void * data) {
    ggml_tensor * w = mm->src[0];
    auto it = w_shape_.find(w);
    if (it != w_shape_.end()) give_shape(w, it->second);
    if (slot_ids_t_[li] && mm->src[2] == slot_ids_t_[li]) {
        auto o = mm_ids_.find(mm);
        if (o == mm_ids_.end()) throw std::logic_error("slot addressing: a matmul's own ids tensor was lost");
        mm->src[2] = o->second;
    }
    w->data = data;
}

void expert_hook::point_at_resident(ggml_tensor * mm, int li, int ti) {
    if (pg_->slot_addressed()) point_at_slots(mm, li, ti);
    else point_at(mm, li, pg_->tensor_data(li, ti));
}

void expert_hook::restore_weight_shapes() {
    for (auto & [w, sh] : w_shape_) give_shape(w, sh);
}

void expert_hook::free_slot_ids() {
    for (ggml_tensor *& x : slot_ids_t_) {
        delete x;
        x = nullptr;
    }
}
