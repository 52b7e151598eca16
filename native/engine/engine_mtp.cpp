// engine_mtp: the MTP (multi-token prediction, "nextn") draft context of an engine, for speculative decoding
// with paged experts (docs/DESIGN.md §3g).
//
// Invariant: the MTP context is a second llama.cpp context over the engine's own model, created with the
// same parameters and the same expert hook, so its graph's MoE layer (the nextn block, GGUF block n_layer)
// asks the hook for its routed experts like a trunk layer does and they come from the one arena, counted in
// the one budget. Its decodes are serialized with the target's (one engine, one caller at a time) and
// bracketed by the hook's begin/end like every decode. The target context outputs the post-norm hidden state
// of every token it decodes (unmasked: row i is batch token i), the MTP context that of its output tokens
// (masked), as llama.cpp's draft-mtp driver sets them (common/speculative.cpp). A failed MTP pass clears both
// contexts, as a failed target decode does. Nothing here changes the target's logits beyond what
// llama_set_embeddings_nextn itself changes (the last layer then computes every row, as for all-logits decodes).
#include "engine.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "llama.h"

// llama.cpp's staging API (src/llama-ext.h, not installed with the headers; C++ linkage, exported by libllama)
LLAMA_API void    llama_set_embeddings_nextn(struct llama_context * ctx, bool value, bool masked);
LLAMA_API float * llama_get_embeddings_nextn(struct llama_context * ctx);
LLAMA_API float * llama_get_embeddings_nextn_ith(struct llama_context * ctx, int32_t i);

static constexpr uint32_t MTP_UBATCH = 64;  // tokens per ubatch of the MTP context (create_mtp_context)

void engine::create_mtp_context(const llama_context_params & cp_tgt) {
    if (llama_model_n_layer_nextn(model_) <= 0)
        throw std::invalid_argument("this model has no MTP (nextn) block: speculative=\"mtp\" needs a GGUF with "
                                    "<arch>.nextn_predict_layers > 0 and its blk.N.nextn.* tensors (e.g. a Qwen3.5/3.6 MTP GGUF)");
    llama_context_params dp = cp_tgt;
    dp.ctx_type = LLAMA_CONTEXT_TYPE_MTP;
    dp.n_rs_seq = 0;  // the MTP context's memory is attention KV only (src/llama-model.cpp, create_memory)
    // Its compute buffer grows with n_ubatch and its output rows: a draft pass outputs one row per sequence and a
    // catch-up pass none, so it is reserved for that many outputs, and a long catch-up (a prompt chunk) runs in
    // ubatches of MTP_UBATCH tokens instead of n_ubatch (the same tokens and positions; memory within the budget).
    dp.n_ubatch = std::min<uint32_t>(cp_tgt.n_ubatch, MTP_UBATCH);
    dp.n_outputs_max = std::max<uint32_t>(1, cp_tgt.n_seq_max);
    mtp_ctx_ = llama_init_from_model(model_, dp);
    if (!mtp_ctx_)
        throw std::runtime_error("llama.cpp could not create the MTP draft context (does this architecture support "
                                 "MTP drafting?)" + engine_take_errors());
    llama_set_embeddings_nextn(ctx_, true, /*masked*/ false);
    llama_set_embeddings_nextn(mtp_ctx_, true, /*masked*/ true);
}

int32_t engine::n_embd() const { return llama_model_n_embd_out(model_); }

int32_t engine::n_rs_seq() const { return (int32_t) llama_n_rs_seq(ctx_); }

void engine::nextn_rows(int n, float * out) const {
    if (!mtp_ctx_) throw std::logic_error("this engine was created without an MTP context");
    if (n < 0 || n > last_n_tokens_)
        throw std::invalid_argument("the last decode had " + std::to_string(last_n_tokens_) + " tokens, not " + std::to_string(n));
    const float * h = llama_get_embeddings_nextn(ctx_);
    if (!h) throw std::runtime_error("llama.cpp kept no hidden states of the last decode");
    memcpy(out, h, sizeof(float) * (size_t) n * (size_t) n_embd());
}

void engine::mtp_seq_rm(int32_t seq, int32_t p0) {
    if (!mtp_ctx_) throw std::logic_error("this engine was created without an MTP context");
    if (seq < 0 || seq >= n_seq_max()) throw std::invalid_argument("sequence " + std::to_string(seq) + " outside 0.." + std::to_string(n_seq_max() - 1) + " (n_seq_max)");
    if (!llama_memory_seq_rm(llama_get_memory(mtp_ctx_), seq, p0 > 0 ? p0 : -1, -1))
        throw std::runtime_error("llama.cpp could not remove positions " + std::to_string(p0) + ".. of the MTP context's sequence " + std::to_string(seq));
}

void engine::mtp_decode(const int32_t * tokens, const int32_t * pos, const float * h, const uint8_t * want, int n,
                        int32_t seq, float * logits_out, float * h_out) {
    if (!mtp_ctx_) throw std::logic_error("this engine was created without an MTP context");
    if (n < 1 || n > n_batch()) throw std::invalid_argument("MTP decode of " + std::to_string(n) + " tokens: must be 1.." + std::to_string(n_batch()) + " (n_batch)");
    if (seq < 0 || seq >= n_seq_max()) throw std::invalid_argument("sequence " + std::to_string(seq) + " outside 0.." + std::to_string(n_seq_max() - 1) + " (n_seq_max)");
    const int32_t nv = n_vocab(), nc = n_ctx(), ne = n_embd();
    for (int i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= nv) throw std::invalid_argument("token id " + std::to_string(tokens[i]) + " outside the vocabulary");
        if (pos[i] < 0 || pos[i] >= nc) throw std::invalid_argument("position " + std::to_string(pos[i]) + " exceeds the context of " + std::to_string(nc));
    }
    llama_batch_ext * b = llama_batch_ext_init(mtp_ctx_);
    std::vector<int32_t> outs;
    for (int i = 0; i < n; i++) {
        const int32_t idx = llama_batch_ext_add_token(b, seq, tokens[i]);
        const llama_pos p = pos[i];
        const llama_embd e{h + (size_t) i * ne, 1, (size_t) ne};
        if (idx < 0 || !llama_batch_ext_set_pos(b, idx, &p) || !llama_batch_ext_set_embd_token(b, idx, e)) {
            llama_batch_ext_free(b);
            throw std::runtime_error("llama.cpp refused MTP batch entry " + std::to_string(i) + engine_take_errors());
        }
        if (want[i]) {
            llama_batch_ext_set_output_logits(b, idx, true);
            outs.push_back(idx);
        }
    }
    if (hook_) hook_->set_decode_step(n == 1);
    const int rc = hooked_call([&] {
        const int r = llama_process(mtp_ctx_, LLAMA_PROCESS_TYPE_DECODE, b);
        llama_batch_ext_free(b);
        return r;
    });
    if (rc != 0) {
        clear();
        throw std::runtime_error("llama.cpp's MTP decode failed with status " + std::to_string(rc) + engine_take_errors());
    }
    for (size_t j = 0; j < outs.size(); j++) {
        const float * lg = llama_get_logits_ith(mtp_ctx_, outs[j]);
        const float * hr = llama_get_embeddings_nextn_ith(mtp_ctx_, outs[j]);
        if (!lg || !hr) {
            clear();
            throw std::runtime_error("llama.cpp returned no MTP output for batch entry " + std::to_string(outs[j]) + engine_take_errors());
        }
        memcpy(logits_out + j * (size_t) nv, lg, sizeof(float) * (size_t) nv);
        memcpy(h_out + j * (size_t) ne, hr, sizeof(float) * (size_t) ne);
    }
}
