// engine: one llama.cpp model + context with the expert hook (engine.h states the invariant).
//
// Invariant kept here: the model is loaded with the parameters paging needs (mmap, no repacking,
// no tensor checks, no GPU layers) in every dense mode, and llama.cpp is never handed what it
// would abort the process for: decode refuses token counts outside 1..n_batch, positions past
// n_ctx and token ids outside the vocabulary before calling llama_decode. A failed or aborted
// decode clears the context's memory before its error is thrown; llama.cpp's own error lines are
// folded into the exception's message as valid UTF-8.
#include "engine.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cstdlib>
#include <cstring>
#include <malloc.h>
#include <mutex>
#include <stdexcept>

#include "dense_weights.h"
#include "ggml-backend.h"
#include "llama.h"

static bool g_verbose = false;
static std::mutex g_log_mu;
static std::string g_errors;  // llama.cpp's error lines since the last take_errors() (capped)

static int64_t g_sched_nodes = 0;  // graph size of the last scheduler llama.cpp created ("max_nodes = N", sched_reserve)

static void log_cb(ggml_log_level level, const char * text, void *) {
    if (g_verbose) fputs(text, stderr);
    if (level == GGML_LOG_LEVEL_ERROR) {
        std::lock_guard<std::mutex> lk(g_log_mu);
        if (g_errors.size() < 4096) g_errors += text;
    }
    if (const char * m = strstr(text, "max_nodes = "); m && strstr(text, "sched_reserve")) {
        std::lock_guard<std::mutex> lk(g_log_mu);
        g_sched_nodes = atoll(m + 12);
    }
}

// Bytes of one scheduler's context buffer that a CPU-only graph never touches (engine.h, sched_idle_bytes): the
// buffer ggml_backend_sched_new mallocs holds graph_size x GGML_SCHED_MAX_SPLIT_INPUTS (30) x 2 tensor headers for
// the copies of split inputs, then the graph (ggml/src/ggml-backend.cpp); ggml_init does not clear a buffer it is
// given, and with one backend and no pipeline copies no split input is copied, so only the graph at its start is
// written. SCHED_TOUCH_MARGIN of it is charged anyway.
static constexpr int64_t SCHED_TOUCH_MARGIN = 16ll << 20;
static int64_t sched_idle(int64_t nodes) {
    // only where every backend device is the CPU: with another backend (BLAS, a GPU) split inputs are copied there
    for (size_t i = 0; i < ggml_backend_dev_count(); i++)
        if (ggml_backend_dev_type(ggml_backend_dev_get(i)) != GGML_BACKEND_DEVICE_TYPE_CPU) return 0;
    const int64_t inputs = nodes * 30 * 2 * (int64_t) sizeof(struct ggml_tensor);
    return std::max<int64_t>(0, inputs - SCHED_TOUCH_MARGIN);
}

// s with every byte that is not part of valid UTF-8 written as \xNN: llama.cpp quotes names
// and keys from the file, and a corrupt file's bytes must not make the message itself unreadable
// (pybind11 decodes exception messages as UTF-8).
static std::string valid_utf8(const std::string & s) {
    std::string out;
    const auto * b = (const unsigned char *) s.data();
    const size_t n = s.size();
    for (size_t i = 0; i < n;) {
        const unsigned char c = b[i];
        size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
        bool ok = len > 0 && i + len <= n;
        for (size_t k = 1; ok && k < len; k++) ok = (b[i + k] & 0xC0) == 0x80;
        if (ok && len == 2) ok = c >= 0xC2;                                   // no overlong forms
        if (ok && len == 3) ok = !(c == 0xE0 && b[i + 1] < 0xA0) && !(c == 0xED && b[i + 1] >= 0xA0);
        if (ok && len == 4) ok = c <= 0xF4 && !(c == 0xF0 && b[i + 1] < 0x90) && !(c == 0xF4 && b[i + 1] >= 0x90);
        if (ok) {
            out.append(s, i, len);
            i += len;
        } else {
            char hex[5];
            snprintf(hex, sizeof(hex), "\\x%02X", c);
            out += hex;
            i++;
        }
    }
    return out;
}

// llama.cpp's error lines logged since the last call, newlines folded, for exception messages.
static std::string take_errors() {
    std::lock_guard<std::mutex> lk(g_log_mu);
    std::string s;
    s.swap(g_errors);
    s = valid_utf8(s);
    while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
    for (auto & c : s) if (c == '\n') c = ';';
    return s.empty() ? s : " [llama.cpp: " + s + "]";
}

void engine_set_verbose(bool verbose) { g_verbose = verbose; }

std::string engine_take_errors() { return take_errors(); }

bool malloc_release() { return malloc_trim(0) != 0; }

int64_t malloc_bytes() {
    struct mallinfo2 mi = mallinfo2();
    return (int64_t) (mi.uordblks + mi.hblkhd);
}

static std::once_flag g_backend_once;

engine::engine(const engine_config & cfg, pager * hook_pager, const std::vector<int32_t> & blocks,
               const std::vector<std::tuple<std::string, int, int>> & names, bool record_routes) {
    std::call_once(g_backend_once, [] { llama_backend_init(); });
    llama_log_set(log_cb, nullptr);
    take_errors();

    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers    = 0;
    mp.load_mode       = LLAMA_LOAD_MODE_MMAP;
    mp.use_extra_bufts = false;  // repacking would copy quantized experts into RAM
    mp.check_tensors   = false;
    mp.load_mtp        = cfg.mtp;  // the nextn blocks are TENSOR_SKIP otherwise (src/models/qwen35moe.cpp)
    std::vector<llama_model_kv_override> kvo;
    if (cfg.expert_used > 0) {
        llama_model_kv_override o{};
        o.tag = LLAMA_KV_OVERRIDE_TYPE_INT;
        snprintf(o.key, sizeof(o.key), "%s.expert_used_count", cfg.arch.c_str());
        o.val_i64 = cfg.expert_used;
        kvo.push_back(o);
        llama_model_kv_override end{};
        kvo.push_back(end);
        mp.kv_overrides = kvo.data();
    }
    const auto t0 = std::chrono::steady_clock::now();
    // One file, or the shards of a split model: llama.cpp maps each file on its own.
    const std::vector<std::string> paths = cfg.paths.empty() ? std::vector<std::string>{cfg.path} : cfg.paths;
    std::vector<file_mapping> fmaps(paths.size());
    std::vector<bool> have_map(paths.size(), false);
    if (cfg.dense_mode != DENSE_MMAP) {
        std::vector<struct stat> sts(paths.size());
        for (size_t i = 0; i < paths.size(); i++)
            if (stat(paths[i].c_str(), &sts[i]) != 0) throw std::runtime_error("cannot stat " + paths[i]);
        lazy_load_scope scope;  // throws, naming the reason, if libllama's relocations are not found
        model_ = llama_model_load_from_file(cfg.path.c_str(), mp);
        for (const auto & m : scope.mappings()) {
            for (size_t i = 0; i < paths.size(); i++) {
                if (m.dev == (uint64_t) sts[i].st_dev && m.ino == (uint64_t) sts[i].st_ino &&
                    (!have_map[i] || m.length > fmaps[i].length)) {
                    fmaps[i] = m;
                    have_map[i] = true;
                }
            }
        }
        load_.lazy = true;
        load_.populates_stripped = scope.populates_stripped();
        load_.willneeds_skipped = scope.willneeds_skipped();
    } else {
        model_ = llama_model_load_from_file(cfg.path.c_str(), mp);
    }
    load_.model_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!model_) throw std::runtime_error("llama.cpp could not load " + cfg.path + take_errors());
    if (cfg.dense_mode != DENSE_MMAP) {
        try {
            if (!cfg.dense_files.empty() && cfg.dense_files.size() != cfg.dense_ranges.size())
                throw std::invalid_argument("dense_files must give one file index per dense range");
            load_.dense_direct = true;
            for (size_t i = 0; i < paths.size(); i++) {
                std::vector<std::pair<int64_t, int64_t>> ranges;
                for (size_t j = 0; j < cfg.dense_ranges.size(); j++)
                    if ((cfg.dense_files.empty() ? 0 : cfg.dense_files[j]) == (int32_t) i) ranges.push_back(cfg.dense_ranges[j]);
                if (!ranges.empty()) {
                    if (!have_map[i]) throw std::runtime_error("llama.cpp did not map " + paths[i] + " while loading it; use dense_weights=\"mmap\"");
                    const dense_report r = dense_to_anon(paths[i], fmaps[i], ranges, cfg.dense_mode == DENSE_MLOCK);
                    load_.dense_bytes += r.bytes;
                    load_.dense_bytes_read += r.bytes_read;
                    load_.dense_bytes_unmapped += r.bytes_unmapped;
                    load_.dense_direct = load_.dense_direct && r.direct;
                    load_.dense_locked = r.locked;
                    load_.dense_s += r.seconds;
                }
                // Whatever the header reads left in the page cache is not ours to keep.
                int fd = open(paths[i].c_str(), O_RDONLY | O_CLOEXEC);
                if (fd >= 0) {
                    posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
                    close(fd);
                }
            }
        } catch (...) {
            llama_model_free(model_);
            model_ = nullptr;
            throw;
        }
    }
    vocab_ = llama_model_get_vocab(model_);

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx    = (uint32_t) cfg.n_ctx;
    cp.n_batch  = (uint32_t) cfg.n_batch;
    cp.n_ubatch = (uint32_t) cfg.n_ubatch;
    if (cfg.n_threads > 0) {
        cp.n_threads = cfg.n_threads;
        cp.n_threads_batch = cfg.n_threads;
    }
    cp.no_perf = true;
    cp.n_seq_max = (uint32_t) std::max(1, cfg.n_seq_max);
    cp.kv_unified = cfg.kv_unified;
    cp.n_rs_seq = (uint32_t) std::max(0, cfg.n_rs_seq);
    if (cfg.logits_block_bytes > 0) {  // engine.h: reserve the graph for the outputs a ubatch can really have
        const int64_t n_vocab = std::max<int32_t>(1, llama_vocab_n_tokens(vocab_));
        const int64_t rows = std::max<int64_t>(1, std::min<int64_t>(cfg.n_batch, cfg.logits_block_bytes / (4 * n_vocab)));
        cp.n_outputs_max = (uint32_t) std::max<int64_t>(rows, cp.n_seq_max);
    }
    {
        std::lock_guard<std::mutex> lk(g_log_mu);
        g_sched_nodes = 0;
    }
    if (cfg.install_hook) {
        hook_ = std::make_unique<expert_hook>(hook_pager, (int) blocks.size(), blocks, names, record_routes);
        cp.cb_eval = expert_hook::cb_eval;
        cp.cb_eval_user_data = hook_.get();
        cp.abort_callback = expert_hook::abort_cb;
        cp.abort_callback_data = hook_.get();
    }
    ctx_ = llama_init_from_model(model_, cp);
    if (!ctx_) {
        llama_model_free(model_);
        model_ = nullptr;
        throw std::runtime_error("llama.cpp could not create a context (n_ctx=" + std::to_string(cfg.n_ctx) +
                                 "; a smaller n_ctx needs less memory)" + take_errors());
    }
    {
        std::lock_guard<std::mutex> lk(g_log_mu);
        load_.sched_idle_bytes += sched_idle(g_sched_nodes);
        g_sched_nodes = 0;
    }
    if (cfg.mtp) {
        try {
            create_mtp_context(cp);
            std::lock_guard<std::mutex> lk(g_log_mu);
            load_.sched_idle_bytes += sched_idle(g_sched_nodes);
            g_sched_nodes = 0;
        } catch (...) {
            llama_free(ctx_);
            ctx_ = nullptr;
            llama_model_free(model_);
            model_ = nullptr;
            throw;
        }
    }
}

engine::~engine() {
    if (mtp_ctx_) llama_free(mtp_ctx_);
    if (ctx_) llama_free(ctx_);
    if (model_) llama_model_free(model_);
}

std::vector<int32_t> engine::tokenize(const std::string & text, bool add_special, bool parse_special) const {
    int n = -llama_tokenize(vocab_, text.data(), (int32_t) text.size(), nullptr, 0, add_special, parse_special);
    std::vector<int32_t> out((size_t) std::max(n, 0));
    if (n > 0) llama_tokenize(vocab_, text.data(), (int32_t) text.size(), out.data(), n, add_special, parse_special);
    return out;
}

std::string engine::piece(int32_t token) const {
    char buf[256];
    int n = llama_token_to_piece(vocab_, token, buf, sizeof(buf), 0, false);
    if (n < 0) {
        std::string s((size_t) -n, '\0');
        llama_token_to_piece(vocab_, token, s.data(), -n, 0, false);
        return s;
    }
    return std::string(buf, (size_t) n);
}

int32_t engine::n_vocab() const { return llama_vocab_n_tokens(vocab_); }
int32_t engine::n_ctx() const { return (int32_t) llama_n_ctx_seq(ctx_); }
int32_t engine::n_seq_max() const { return (int32_t) llama_n_seq_max(ctx_); }
int32_t engine::n_batch() const { return (int32_t) llama_n_batch(ctx_); }
int32_t engine::n_threads() const { return llama_n_threads(ctx_); }
bool engine::is_eog(int32_t token) const { return llama_vocab_is_eog(vocab_, token); }

void engine::attach_pager(pager * pg) {
    if (!hook_) throw std::logic_error("engine was created without the expert hook");
    hook_->set_pager(pg);
}

void engine::clear() {
    llama_memory_clear(llama_get_memory(ctx_), true);
    if (mtp_ctx_) llama_memory_clear(llama_get_memory(mtp_ctx_), true);
}

void engine::seq_rm(int32_t seq, int32_t p0) {
    if (seq < 0 || seq >= n_seq_max()) throw std::invalid_argument("sequence " + std::to_string(seq) + " outside 0.." + std::to_string(n_seq_max() - 1) + " (n_seq_max)");
    if (!llama_memory_seq_rm(llama_get_memory(ctx_), seq, p0 > 0 ? p0 : -1, -1))
        throw std::runtime_error("llama.cpp could not remove positions " + std::to_string(p0) + ".. of sequence " + std::to_string(seq));
}

int32_t engine::seq_pos_max(int32_t seq) const {
    if (seq < 0 || seq >= n_seq_max()) throw std::invalid_argument("sequence " + std::to_string(seq) + " outside 0.." + std::to_string(n_seq_max() - 1) + " (n_seq_max)");
    return llama_memory_seq_pos_max(llama_get_memory(ctx_), seq);
}

std::vector<uint8_t> engine::seq_state(int32_t seq) const {
    if (seq < 0 || seq >= n_seq_max()) throw std::invalid_argument("sequence " + std::to_string(seq) + " outside 0.." + std::to_string(n_seq_max() - 1) + " (n_seq_max)");
    std::vector<uint8_t> out(llama_state_seq_get_size(ctx_, seq));
    const size_t got = llama_state_seq_get_data(ctx_, out.data(), out.size(), seq);
    out.resize(got);
    return out;
}

bool engine::set_seq_state(int32_t seq, const uint8_t * src, size_t n) {
    if (seq < 0 || seq >= n_seq_max()) throw std::invalid_argument("sequence " + std::to_string(seq) + " outside 0.." + std::to_string(n_seq_max() - 1) + " (n_seq_max)");
    llama_memory_seq_rm(llama_get_memory(ctx_), seq, -1, -1);
    if (llama_state_seq_set_data(ctx_, src, n, seq) == 0) {
        llama_memory_seq_rm(llama_get_memory(ctx_), seq, -1, -1);
        return false;
    }
    return true;
}

int32_t engine::seq_pos_min(int32_t seq) const {
    if (seq < 0 || seq >= n_seq_max()) throw std::invalid_argument("sequence " + std::to_string(seq) + " outside 0.." + std::to_string(n_seq_max() - 1) + " (n_seq_max)");
    return llama_memory_seq_pos_min(llama_get_memory(ctx_), seq);
}

bool engine::memory_is_recurrent() const { return llama_model_is_recurrent(model_) || llama_model_is_hybrid(model_); }

int32_t engine::n_swa() const { return llama_model_n_swa(model_); }

int engine::hooked_call(const std::function<int()> & call) {
    if (hook_) hook_->begin_decode();
    const int rc = call();
    if (hook_) hook_->end_decode();
    if (hook_ && hook_->failed()) {
        clear();
        hook_->rethrow_if_failed();
    }
    return rc;
}

void engine::run(llama_batch & b) {
    const int rc = hooked_call([&] {
        const int r = llama_decode(ctx_, b);
        llama_batch_free(b);
        return r;
    });
    if (rc != 0) {
        clear();
        throw std::runtime_error("llama_decode failed with status " + std::to_string(rc) +
                                 (rc == 1 ? " (no KV slot: the context is full; use a larger n_ctx)" : ""));
    }
}

void engine::decode(const int32_t * tokens, int n, int pos0, bool all, float * out, int32_t seq) {
    // llama_decode aborts the process (GGML_ASSERT) on these; refuse them here instead.
    if (n < 1 || n > n_batch()) throw std::invalid_argument("decode of " + std::to_string(n) + " tokens: must be 1.." + std::to_string(n_batch()) + " (n_batch)");
    if (pos0 < 0 || pos0 + n > n_ctx()) throw std::invalid_argument("positions " + std::to_string(pos0) + ".." + std::to_string(pos0 + n) + " exceed the context of " + std::to_string(n_ctx()));
    if (seq < 0 || seq >= n_seq_max()) throw std::invalid_argument("sequence " + std::to_string(seq) + " outside 0.." + std::to_string(n_seq_max() - 1) + " (n_seq_max)");
    const int32_t nv = n_vocab();
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= nv) throw std::invalid_argument("token id " + std::to_string(tokens[i]) + " outside the vocabulary");
    llama_batch b = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        b.token[i] = tokens[i];
        b.pos[i] = pos0 + i;
        b.n_seq_id[i] = 1;
        b.seq_id[i][0] = seq;
        b.logits[i] = all || i == n - 1;
    }
    b.n_tokens = n;
    if (hook_) hook_->set_decode_step(n == 1);  // one token is a decode step; a prompt chunk of several is exact (hook.h, lossy rewrites)
    run(b);
    last_n_tokens_ = n;
    const int n_out = all ? n : 1;
    // nv: vocabulary size (checked above)
    const float * lg = llama_get_logits(ctx_);
    memcpy(out, lg, sizeof(float) * (size_t) n_out * nv);
}

void engine::decode_seqs(const int32_t * tokens, const int32_t * pos, const int32_t * seq, const uint8_t * want, int n,
                         float * out) {
    if (n < 1 || n > n_batch()) throw std::invalid_argument("decode of " + std::to_string(n) + " tokens: must be 1.." + std::to_string(n_batch()) + " (n_batch)");
    const int32_t nv = n_vocab(), nc = n_ctx(), ns = n_seq_max();
    int n_out = 0;
    for (int i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= nv) throw std::invalid_argument("token id " + std::to_string(tokens[i]) + " outside the vocabulary");
        if (seq[i] < 0 || seq[i] >= ns) throw std::invalid_argument("sequence " + std::to_string(seq[i]) + " outside 0.." + std::to_string(ns - 1) + " (n_seq_max)");
        if (pos[i] < 0 || pos[i] >= nc) throw std::invalid_argument("position " + std::to_string(pos[i]) + " of sequence " + std::to_string(seq[i]) + " exceeds its context of " + std::to_string(nc));
        n_out += want[i] != 0;
    }
    llama_batch b = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        b.token[i] = tokens[i];
        b.pos[i] = pos[i];
        b.n_seq_id[i] = 1;
        b.seq_id[i][0] = seq[i];
        b.logits[i] = want[i] != 0;
    }
    b.n_tokens = n;
    {   // a decode step: one token per sequence (the lossy rewrites act on these only; hook.h)
        std::vector<int32_t> sq(seq, seq + n);
        std::sort(sq.begin(), sq.end());
        if (hook_) hook_->set_decode_step(std::adjacent_find(sq.begin(), sq.end()) == sq.end());
    }
    run(b);
    last_n_tokens_ = n;
    // llama_get_logits holds the output rows in batch order of the tokens that asked for them
    const float * lg = llama_get_logits(ctx_);
    memcpy(out, lg, sizeof(float) * (size_t) n_out * nv);
}

std::string engine::apply_chat_template(const std::vector<std::pair<std::string, std::string>> & msgs, bool add_assistant) const {
    const char * tmpl = llama_model_chat_template(model_, nullptr);
    if (!tmpl) throw std::invalid_argument("this GGUF has no chat template (tokenizer.chat_template); use generate() with a plain prompt");
    std::vector<llama_chat_message> cm;
    size_t total = 0;
    for (const auto & m : msgs) {
        cm.push_back({m.first.c_str(), m.second.c_str()});
        total += m.first.size() + m.second.size();
    }
    std::vector<char> buf(total * 2 + 256);
    int n = llama_chat_apply_template(tmpl, cm.data(), cm.size(), add_assistant, buf.data(), (int32_t) buf.size());
    if (n < 0) throw std::invalid_argument("llama.cpp does not support this GGUF's chat template");
    if ((size_t) n > buf.size()) {
        buf.resize((size_t) n + 1);
        n = llama_chat_apply_template(tmpl, cm.data(), cm.size(), add_assistant, buf.data(), (int32_t) buf.size());
    }
    return std::string(buf.data(), (size_t) n);
}
