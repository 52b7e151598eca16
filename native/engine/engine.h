// engine: one llama.cpp model + context, owned exclusively, optionally with the expert hook.
//
// Invariant: the model is loaded the way paging needs (mmap, no weight repacking, no tensor
// checks, CPU only) in both modes, so pager on and off run the same kernels on the same bytes
// and produce bit-identical logits. Rebinding expert tensors changes the model's own tensors,
// so an engine never shares its model with another context, and decodes are serialized.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "hook.h"
#include "lazy_load.h"

struct llama_model;
struct llama_context;
struct llama_vocab;

// Where the dense (non-expert) weights live, engine_config::dense_mode: llama's file mapping as
// loaded (stock: the loader reads the whole file), anonymous copies (the load reads only the
// header; see lazy_load.h and dense_weights.h), or anonymous copies mlock'ed.
enum dense_weights_mode : int32_t { DENSE_MMAP = 0, DENSE_ANON = 1, DENSE_MLOCK = 2 };
// Each mode's name as Python spells it (epqlab.constants.DenseMode, lower case): the engine
// module exports this table as DENSE_MODES, and tests/test_native_codes.py checks the two agree.
inline constexpr std::pair<const char *, dense_weights_mode> DENSE_MODE_NAMES[] = {
    {"mmap", DENSE_MMAP}, {"anon", DENSE_ANON}, {"mlock", DENSE_MLOCK},
};

struct engine_config {
    std::string path;
    std::string arch;             // for the <arch>.expert_used_count override
    int32_t     expert_used = 0;  // 0 = the model's top-k
    int32_t     n_ctx = 2048;
    int32_t     n_batch = 512;
    int32_t     n_ubatch = 512;
    int32_t     n_threads = 0;    // 0 = hardware threads
    // Sequences the context decodes side by side (llama_context_params::n_seq_max). With kv_unified
    // false (the default) each sequence has its own KV stream of n_ctx / n_seq_max cells, so its
    // attention runs over its own cells only, as if it were decoded alone (docs/DESIGN.md §3d).
    int32_t     n_seq_max = 1;
    bool        kv_unified = false;
    // The most logits bytes one ubatch returns (epqlab's decoder asks in blocks of at most this much):
    // llama_context_params::n_outputs_max becomes max(1, min(n_batch, this / (4 x n_vocab)), n_seq_max), so
    // the worst-case graph llama.cpp reserves holds that many logits rows, not n_batch of them. 0: llama.cpp's
    // default (n_batch outputs).
    int64_t     logits_block_bytes = 0;
    bool        install_hook = false;
    int32_t     dense_mode = DENSE_MMAP;  // a dense_weights_mode (above)
    std::vector<std::pair<int64_t, int64_t>> dense_ranges;  // (file offset, bytes) of non-expert tensors
    // A split model: every shard in order (paths[0] == path; llama.cpp finds the others by name),
    // and the index in paths of the file holding each dense range. Empty: one file.
    std::vector<std::string> paths;
    std::vector<int32_t>     dense_files;
    // MTP speculative decoding (engine_mtp.cpp): load the model's nextn (MTP) blocks and create a second
    // context of type LLAMA_CONTEXT_TYPE_MTP over the same model, with the same expert hook, so the MTP
    // block's routed experts are paged like any layer's. n_rs_seq: recurrent-state snapshots per sequence
    // kept by the target context, so a hybrid model's state can roll back that many rejected tokens.
    bool        mtp = false;
    int32_t     n_rs_seq = 0;
};

struct engine_load_report {
    bool    lazy = false;               // loaded with populate/WILLNEED stripped
    int64_t populates_stripped = 0;
    int64_t willneeds_skipped = 0;
    int64_t dense_bytes = 0;            // anonymous bytes holding dense weights
    int64_t dense_bytes_read = 0;       // bytes read for them
    int64_t dense_bytes_unmapped = 0;   // dense pages llama.cpp had unmapped after the load (tensors it skipped)
    bool    dense_direct = false;
    bool    dense_locked = false;
    double  dense_s = 0.0;
    double  model_s = 0.0;              // llama_model_load_from_file, seconds
    // Of the bytes malloc handed out to the contexts' schedulers, those a CPU-only graph never writes (engine.cpp,
    // sched_idle): malloc'd address space that stays untouched, so the Session does not charge it to the budget.
    int64_t sched_idle_bytes = 0;
};

class engine {
public:
    // hook_pager may be null (hook only records routes). names: routed-expert tensors.
    engine(const engine_config & cfg, pager * hook_pager, const std::vector<int32_t> & blocks,
           const std::vector<std::tuple<std::string, int, int>> & names, bool record_routes);
    ~engine();
    engine(const engine &) = delete;
    engine & operator=(const engine &) = delete;

    std::vector<int32_t> tokenize(const std::string & text, bool add_special, bool parse_special) const;
    std::string          piece(int32_t token) const;
    // Decodes n tokens at positions pos0.. in sequence seq; writes logits of every token (all=true)
    // or of the last one into out ([n_out, n_vocab] floats). Throws on failure; on a failed or
    // aborted decode the context's memory is cleared (every sequence).
    void decode(const int32_t * tokens, int n, int pos0, bool all, float * out, int32_t seq = 0);
    // One forward pass over n tokens of any sequences: token i at position pos[i] of sequence
    // seq[i]; writes the logits of each token with want[i] != 0, in order, into out ([n_out,
    // n_vocab]). A decode step of a batch is one token per active sequence. Same failure rule.
    void decode_seqs(const int32_t * tokens, const int32_t * pos, const int32_t * seq, const uint8_t * want, int n,
                     float * out);
    void clear();
    // Frees the KV cells of one sequence from position p0 on (p0 <= 0: all of them); the others keep theirs.
    void seq_rm(int32_t seq, int32_t p0 = -1);
    int32_t seq_pos_max(int32_t seq) const;  // the last position sequence seq holds, -1 when empty
    int32_t seq_pos_min(int32_t seq) const;  // the first position sequence seq still holds (SWA prunes), -1 when empty
    // Sequence seq's state (its KV cells, or recurrent state) as llama.cpp serializes it (llama_state_seq_get_data):
    // the bytes a later set_seq_state restores, in this context or one of the same model and parameters.
    std::vector<uint8_t> seq_state(int32_t seq) const;
    // Clears sequence seq and restores a seq_state() blob into it (llama_state_seq_set_data). Returns false when
    // llama.cpp refuses the blob (another model or context shape, truncated): the sequence is left empty.
    bool set_seq_state(int32_t seq, const uint8_t * src, size_t n);
    bool memory_is_recurrent() const;  // recurrent or hybrid memory: a sequence's tail cannot be removed
    int32_t n_swa() const;              // sliding-window size of the model's SWA layers, 0 when none
    std::string apply_chat_template(const std::vector<std::pair<std::string, std::string>> & msgs, bool add_assistant) const;

    int32_t n_vocab() const;
    int32_t n_ctx() const;      // cells one sequence may use (llama_n_ctx_seq)
    int32_t n_seq_max() const;
    int32_t n_batch() const;
    int32_t n_threads() const;
    bool    is_eog(int32_t token) const;
    expert_hook * hook() { return hook_.get(); }

    // MTP speculation (engine_mtp.cpp; engine_config::mtp). The target context outputs the post-norm hidden
    // state of every token of a decode (llama_set_embeddings_nextn, unmasked), the MTP context that of its
    // output tokens only.
    bool    has_mtp() const { return mtp_ctx_ != nullptr; }
    int32_t n_embd() const;
    int32_t n_rs_seq() const;  // snapshots the target keeps per sequence (0: no partial rollback)
    // The hidden rows [n, n_embd] of the last target decode's first n tokens (n <= its token count).
    void    nextn_rows(int n, float * out) const;
    // One pass of the MTP context over n tokens of sequence seq: token i at position pos[i], paired with the
    // target's hidden row h[i] ([n, n_embd]); logits ([n_out, n_vocab]) and hidden rows ([n_out, n_embd]) of
    // the tokens with want[i] != 0, in order. Same refusals and failure rule as decode (both contexts are
    // cleared on failure).
    void    mtp_decode(const int32_t * tokens, const int32_t * pos, const float * h, const uint8_t * want, int n,
                       int32_t seq, float * logits_out, float * h_out);
    // Frees the MTP context's cells of sequence seq from p0 on (p0 <= 0: all).
    void    mtp_seq_rm(int32_t seq, int32_t p0);
    const engine_load_report & load_report() const { return load_; }
    void attach_pager(pager * pg);

private:
    void run(struct llama_batch & b);  // llama_decode with the hook's begin/end; throws as decode() says
    // A llama.cpp decode call (which frees its batch) bracketed by the hook's begin/end: a hook failure clears both
    // contexts and is rethrown; otherwise returns the call's status.
    int hooked_call(const std::function<int()> & call);
    llama_model *                 model_ = nullptr;
    llama_context *               ctx_ = nullptr;
    llama_context *               mtp_ctx_ = nullptr;  // engine_config::mtp
    int32_t                       last_n_tokens_ = 0;   // tokens of the last target decode (nextn_rows)
    void create_mtp_context(const struct llama_context_params & cp);
    const llama_vocab *           vocab_ = nullptr;
    std::unique_ptr<expert_hook>  hook_;
    engine_load_report            load_;
};

// Bytes malloc has handed out (arena + mmapped chunks), from mallinfo2: counts buffers llama
// allocated but has not touched yet, which RSS does not.
int64_t malloc_bytes();
// Returns the free memory of malloc's heap to the system (glibc malloc_trim(0)), so that RSS counts only
// what is in use and a later allocation that reuses the heap shows as growth: the budget's sample before a
// load is then not inflated by an earlier load's freed heap.
bool malloc_release();
void    engine_set_verbose(bool verbose);
// llama.cpp's error lines logged since the last call, folded into " [llama.cpp: ...]" (empty when none).
std::string engine_take_errors();
