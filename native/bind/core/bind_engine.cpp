// Python bindings of the llama.cpp engine and its expert hook (epqlab._core.Engine, linked against libllama).
// Pager arguments are epqlab._pager_core.Pager objects: the pager class is registered once, by that
// module, in pybind11's shared type registry, and both modules link the one libepqlab_pager.so.
// Invariant: decode releases the GIL and returns a fresh NumPy array; the engine keeps its
// pager alive (keep_alive), since the hook and the rebinding tensors point into its region; every
// name or code exported to Python (HOOK_COUNTERS, PREFETCH_MODES, DENSE_MODES, the depth bounds)
// is built from the C++ table or constant that defines it, never re-typed here.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bind_common.h"
#include "engine.h"
#include "ggml.h"
#include "hook_lossy.h"
#include "registry.h"

namespace py = pybind11;

// The ggml type the hook keeps a trained predictor's W in, by name (epqlab.engine.predictor.WEIGHT_TYPES).
static int predictor_type(const std::string & name) {
    if (name == "q8_0") return GGML_TYPE_Q8_0;
    if (name == "bf16") return GGML_TYPE_BF16;
    throw std::invalid_argument("the predictor's weight type must be 'q8_0' or 'bf16', got '" + name + "'");
}

// The hook's counters (hook_stats): Engine.hook_stats() and HOOK_COUNTERS come from this table.
static const std::vector<epq_bind::field<hook_stats>> & hook_fields() {
    static const std::vector<epq_bind::field<hook_stats>> f = {
        EPQ_FIELD(hook_stats, "ubatches", s.ubatches),
        EPQ_FIELD(hook_stats, "layer_loads", s.layer_loads),
        EPQ_FIELD(hook_stats, "staged_layers", s.staged_layers),
        EPQ_FIELD(hook_stats, "staged_tokens", s.staged_tokens),
        EPQ_FIELD(hook_stats, "tokens_routed", s.tokens),
        EPQ_FIELD(hook_stats, "dropped_bytes", s.dropped_bytes),
        EPQ_FIELD(hook_stats, "cold_skipped", s.cold_skipped),
        EPQ_FIELD(hook_stats, "union_experts", s.union_experts),
        EPQ_FIELD(hook_stats, "pred_layers", s.pred_layers),
        EPQ_FIELD(hook_stats, "pred_experts", s.pred_experts),
        EPQ_FIELD(hook_stats, "pred_actual", s.pred_actual),
        EPQ_FIELD(hook_stats, "pred_correct", s.pred_correct),
        EPQ_FIELD(hook_stats, "pred_gated", s.pred_gated),
        EPQ_FIELD(hook_stats, "graph_asks", s.graph_asks),
        EPQ_FIELD(hook_stats, "graph_pieces", s.graph_pieces),
        EPQ_FIELD(hook_stats, "lossy_slots", s.lossy_slots),
        EPQ_FIELD(hook_stats, "route_changed", s.route_changed),
        EPQ_FIELD(hook_stats, "route_substituted", s.route_substituted),
        EPQ_FIELD(hook_stats, "adaptive_dropped", s.adaptive_dropped),
        EPQ_FIELD(hook_stats, "lossy_bytes_saved", s.lossy_bytes_saved),
        EPQ_FIELD(hook_stats, "budget_dropped", s.budget_dropped),
        EPQ_FIELD(hook_stats, "budget_overflow", s.budget_overflow),
        EPQ_FIELD(hook_stats, "lossy_union_before", s.lossy_union_before),
        EPQ_FIELD(hook_stats, "lossy_union_after", s.lossy_union_after),
    };
    return f;
}

// What loading the model did (engine_load_report): Engine.load_report().
static const std::vector<epq_bind::field<engine_load_report>> & load_fields() {
    static const std::vector<epq_bind::field<engine_load_report>> f = {
        EPQ_FIELD(engine_load_report, "lazy_load", s.lazy),
        EPQ_FIELD(engine_load_report, "populates_stripped", s.populates_stripped),
        EPQ_FIELD(engine_load_report, "willneeds_skipped", s.willneeds_skipped),
        EPQ_FIELD(engine_load_report, "dense_bytes", s.dense_bytes),
        EPQ_FIELD(engine_load_report, "dense_bytes_read", s.dense_bytes_read),
        EPQ_FIELD(engine_load_report, "dense_bytes_unmapped", s.dense_bytes_unmapped),
        EPQ_FIELD(engine_load_report, "dense_direct", s.dense_direct),
        EPQ_FIELD(engine_load_report, "dense_locked", s.dense_locked),
        EPQ_FIELD(engine_load_report, "dense_s", s.dense_s),
        EPQ_FIELD(engine_load_report, "model_load_s", s.model_s),
        EPQ_FIELD(engine_load_report, "sched_idle_bytes", s.sched_idle_bytes),
    };
    return f;
}

void register_engine(py::module_ & m) {
    epq_bind::register_error_translator();
    m.attr("HOOK_COUNTERS") = epq_bind::names(hook_fields());
    // The codes Python shares with the hook and the engine (epqlab.constants; tests/test_native_codes.py).
    m.attr("PREFETCH_MODES") = epq_bind::codes(PREFETCH_MODE_NAMES);
    m.attr("DENSE_MODES") = epq_bind::codes(DENSE_MODE_NAMES);
    m.attr("MAX_PREFETCH_DEPTH") = expert_hook::kMaxDepth;
    m.attr("MAX_FIT_DEPTH") = expert_hook::kMaxFitDepth;
    m.def("malloc_bytes", &malloc_bytes, "bytes handed out by malloc (mallinfo2 uordblks + hblkhd)");
    m.def("malloc_release", &malloc_release, "return malloc's free heap memory to the system (malloc_trim(0))");
    m.def("set_verbose", &engine_set_verbose, "print llama.cpp's log to stderr");
    m.def("lazy_load_check", [] { return lazy_load_check(); },
          "empty string when libllama's mmap/posix_madvise relocations can be redirected, else the reason");

    m.def("lossy_route", [](py::array_t<float, py::array::c_style | py::array::forcecast> q,
                            py::array_t<int32_t, py::array::c_style | py::array::forcecast> ids,
                            py::array_t<uint8_t, py::array::c_style | py::array::forcecast> resident, double delta,
                            std::vector<double> thresholds, std::vector<int> ks) {
        // The hook's decode-step route rewrite (native/engine/hook_lossy.h) on one token's route:
        // q float32 [n_expert], ids int32 [k], resident uint8 [n_expert] -> (ids', keep uint8 [k], n_substituted).
        if (q.ndim() != 1 || ids.ndim() != 1 || resident.ndim() != 1 || resident.shape(0) != q.shape(0))
            throw std::invalid_argument("lossy_route: q and resident must be [n_expert], ids [k]");
        py::array_t<int32_t> out(ids.shape(0));
        std::copy(ids.data(), ids.data() + ids.shape(0), out.mutable_data());
        lossy_result r = lossy_route(q.data(), (int) q.shape(0), out.mutable_data(), (int) ids.shape(0), resident.data(),
                                     delta, thresholds, ks);
        py::array_t<uint8_t> keep((py::ssize_t) r.keep.size());
        std::copy(r.keep.begin(), r.keep.end(), keep.mutable_data());
        return py::make_tuple(out, keep, r.substituted);
    }, py::arg("q"), py::arg("ids"), py::arg("resident"), py::arg("delta"), py::arg("thresholds"), py::arg("ks"));
    m.def("lossy_step", [](py::array_t<float, py::array::c_style | py::array::forcecast> q,
                           py::array_t<int32_t, py::array::c_style | py::array::forcecast> ids,
                           py::array_t<uint8_t, py::array::c_style | py::array::forcecast> resident, int mode, double delta,
                           std::vector<double> thresholds, std::vector<int> ks, int budget) {
        // The hook's rewrite of one decode step (native/engine/hook_lossy.h, lossy_step): q float32
        // [n_tokens, n_expert], ids int32 [n_tokens, k], resident uint8 [n_expert] -> (ids', keep uint8
        // [n_tokens, k], dict of counts).
        if (q.ndim() != 2 || ids.ndim() != 2 || resident.ndim() != 1 || q.shape(0) != ids.shape(0) || resident.shape(0) != q.shape(1))
            throw std::invalid_argument("lossy_step: q must be [n_tokens, n_expert], ids [n_tokens, k], resident [n_expert]");
        const int n_tokens = (int) ids.shape(0), k = (int) ids.shape(1);
        py::array_t<int32_t> out({(py::ssize_t) n_tokens, (py::ssize_t) k});
        std::copy(ids.data(), ids.data() + (size_t) n_tokens * k, out.mutable_data());
        lossy_step_result r = lossy_step(q.data(), (int) q.shape(1), out.mutable_data(), k, n_tokens, resident.data(), mode,
                                         delta, thresholds, ks, budget);
        py::array_t<uint8_t> keep({(py::ssize_t) n_tokens, (py::ssize_t) k});
        std::copy(r.keep.begin(), r.keep.end(), keep.mutable_data());
        py::dict c;
        c["substituted"] = r.substituted; c["unchanged"] = r.unchanged; c["adaptive_dropped"] = r.adaptive_dropped;
        c["budget_dropped"] = r.budget_dropped; c["budget_overflow"] = r.budget_overflow;
        c["union_before"] = r.union_before; c["union_after"] = r.union_after; c["not_read"] = r.not_read;
        return py::make_tuple(out, keep, c);
    }, py::arg("q"), py::arg("ids"), py::arg("resident"), py::arg("mode"), py::arg("delta"), py::arg("thresholds"),
       py::arg("ks"), py::arg("budget"));
    m.attr("ROUTE_MODES") = py::dict(py::arg("off") = (int) ROUTE_OFF, py::arg("cache") = (int) ROUTE_CACHE, py::arg("batch") = (int) ROUTE_BATCH);
    m.def("router_entropy", [](py::array_t<float, py::array::c_style | py::array::forcecast> q) {
        return router_entropy(q.data(), (int) q.size());
    }, py::arg("q"), "entropy in nats of router probabilities q [n_expert] (adaptive-k's H)");

    py::class_<engine>(m, "Engine")
        .def(py::init([](const std::string & path, pager * pg, const std::string & arch, int expert_used, int n_ctx,
                         int n_batch, int n_ubatch, int n_threads, bool install_hook, std::vector<int32_t> blocks,
                         std::vector<std::tuple<std::string, int, int>> names, bool record, int dense_mode,
                         std::vector<std::pair<int64_t, int64_t>> dense_ranges, std::vector<std::string> paths,
                         std::vector<int32_t> dense_files, int n_seq_max, bool kv_unified, int64_t logits_block_bytes,
                         bool mtp, int n_rs_seq) {
                 engine_config c;
                 c.path = path;
                 c.arch = arch;
                 c.expert_used = expert_used;
                 c.n_ctx = n_ctx;
                 c.n_batch = n_batch;
                 c.n_ubatch = n_ubatch;
                 c.n_threads = n_threads;
                 c.install_hook = install_hook;
                 c.dense_mode = dense_mode;
                 c.dense_ranges = std::move(dense_ranges);
                 c.paths = std::move(paths);
                 c.dense_files = std::move(dense_files);
                 if (n_seq_max < 1) throw std::invalid_argument("n_seq_max must be >= 1");
                 c.n_seq_max = n_seq_max;
                 c.kv_unified = kv_unified;
                 c.logits_block_bytes = logits_block_bytes;
                 c.mtp = mtp;
                 if (n_rs_seq < 0) throw std::invalid_argument("n_rs_seq must be >= 0");
                 c.n_rs_seq = n_rs_seq;
                 py::gil_scoped_release nogil;
                 return new engine(c, pg, blocks, names, record);
             }),
             py::keep_alive<1, 3>(), py::arg("path"), py::arg("pager").none(true), py::arg("arch"), py::arg("expert_used"),
             py::arg("n_ctx"), py::arg("n_batch"), py::arg("n_ubatch"), py::arg("n_threads"), py::arg("install_hook"),
             py::arg("blocks"), py::arg("names"), py::arg("record"), py::arg("dense_mode") = (int) DENSE_MMAP,
             py::arg("dense_ranges") = std::vector<std::pair<int64_t, int64_t>>{},
             py::arg("paths") = std::vector<std::string>{}, py::arg("dense_files") = std::vector<int32_t>{},
             py::arg("n_seq_max") = 1, py::arg("kv_unified") = false, py::arg("logits_block_bytes") = 0,
             py::arg("mtp") = false, py::arg("n_rs_seq") = 0)
        .def_property_readonly("has_mtp", &engine::has_mtp)
        .def_property_readonly("n_embd", &engine::n_embd)
        .def_property_readonly("n_rs_seq", &engine::n_rs_seq)
        .def("nextn_rows", [](const engine & e, int n) {
            // float32 [n, n_embd]: the post-norm hidden rows of the last target decode's first n tokens
            py::array_t<float> out({(py::ssize_t) n, (py::ssize_t) e.n_embd()});
            e.nextn_rows(n, out.mutable_data());
            return out;
        }, py::arg("n"))
        .def("mtp_decode", [](engine & e, py::array_t<int32_t, py::array::c_style | py::array::forcecast> toks,
                              py::array_t<int32_t, py::array::c_style | py::array::forcecast> pos,
                              py::array_t<float, py::array::c_style | py::array::forcecast> h,
                              py::array_t<uint8_t, py::array::c_style | py::array::forcecast> want, int32_t seq) {
            // One MTP-context pass (native/engine/engine.h mtp_decode): returns (logits float32 [n_out, n_vocab],
            // hidden float32 [n_out, n_embd]) of the tokens with want != 0, in order.
            const int n = (int) toks.size();
            if (n == 0) throw std::invalid_argument("mtp_decode needs at least one token");
            if (pos.size() != n || want.size() != n || h.size() != (py::ssize_t) n * e.n_embd())
                throw std::invalid_argument("mtp_decode: tokens, pos and want must have n entries and h n x n_embd");
            int n_out = 0;
            for (int i = 0; i < n; i++) n_out += want.data()[i] != 0;
            py::array_t<float> lg({(py::ssize_t) n_out, (py::ssize_t) e.n_vocab()});
            py::array_t<float> hr({(py::ssize_t) n_out, (py::ssize_t) e.n_embd()});
            const int32_t * t = toks.data(); const int32_t * p = pos.data(); const float * hh = h.data();
            const uint8_t * w = want.data(); float * dl = lg.mutable_data(); float * dh = hr.mutable_data();
            {
                py::gil_scoped_release nogil;
                e.mtp_decode(t, p, hh, w, n, seq, dl, dh);
            }
            return py::make_tuple(lg, hr);
        }, py::arg("tokens"), py::arg("pos"), py::arg("h"), py::arg("want"), py::arg("seq") = 0)
        .def("mtp_seq_rm", &engine::mtp_seq_rm, py::arg("seq"), py::arg("p0") = -1)
        .def("load_report", [](const engine & e) { return epq_bind::to_dict(e.load_report(), load_fields()); })
        .def("tokenize", &engine::tokenize, py::arg("text"), py::arg("add_special"), py::arg("parse_special"))
        .def("piece", [](const engine & e, int32_t tok) { return py::bytes(e.piece(tok)); })
        .def("decode", [](engine & e, py::array_t<int32_t, py::array::c_style | py::array::forcecast> toks, int pos0, bool all,
                          int32_t seq) {
            const int n = (int) toks.size();
            if (n == 0) throw std::invalid_argument("decode needs at least one token");
            const int n_out = all ? n : 1;
            py::array_t<float> out({(py::ssize_t) n_out, (py::ssize_t) e.n_vocab()});
            const int32_t * src = toks.data();
            float * dst = out.mutable_data();
            {
                py::gil_scoped_release nogil;
                e.decode(src, n, pos0, all, dst, seq);
            }
            return out;
        }, py::arg("tokens"), py::arg("pos0"), py::arg("all"), py::arg("seq") = 0)
        .def("decode_seqs", [](engine & e, py::array_t<int32_t, py::array::c_style | py::array::forcecast> toks,
                               py::array_t<int32_t, py::array::c_style | py::array::forcecast> pos,
                               py::array_t<int32_t, py::array::c_style | py::array::forcecast> seq,
                               py::array_t<uint8_t, py::array::c_style | py::array::forcecast> want) {
            // One forward pass over tokens of several sequences (native/engine/engine.h decode_seqs):
            // returns float32 [n_out, n_vocab], the rows of the tokens with want != 0, in order.
            const int n = (int) toks.size();
            if (n == 0) throw std::invalid_argument("decode_seqs needs at least one token");
            if (pos.size() != n || seq.size() != n || want.size() != n)
                throw std::invalid_argument("decode_seqs: tokens, pos, seq and want must have the same length");
            int n_out = 0;
            for (int i = 0; i < n; i++) n_out += want.data()[i] != 0;
            py::array_t<float> out({(py::ssize_t) n_out, (py::ssize_t) e.n_vocab()});
            const int32_t * t = toks.data(), * p = pos.data(), * q = seq.data();
            const uint8_t * w = want.data();
            float * dst = out.mutable_data();
            {
                py::gil_scoped_release nogil;
                e.decode_seqs(t, p, q, w, n, dst);
            }
            return out;
        }, py::arg("tokens"), py::arg("pos"), py::arg("seq"), py::arg("want"))
        .def("seq_rm", &engine::seq_rm, py::arg("seq"), py::arg("p0") = -1)
        .def("seq_pos_max", &engine::seq_pos_max, py::arg("seq"))
        .def("seq_pos_min", &engine::seq_pos_min, py::arg("seq"))
        .def("seq_state", [](const engine & e, int32_t seq) {
            std::vector<uint8_t> v;
            {
                py::gil_scoped_release nogil;
                v = e.seq_state(seq);
            }
            return py::bytes(reinterpret_cast<const char *>(v.data()), v.size());
        }, py::arg("seq"), "Sequence seq's state as llama.cpp serializes it (llama_state_seq_get_data), bytes.")
        .def("set_seq_state", [](engine & e, int32_t seq, py::bytes blob) {
            std::string_view b = blob;
            py::gil_scoped_release nogil;
            return e.set_seq_state(seq, reinterpret_cast<const uint8_t *>(b.data()), b.size());
        }, py::arg("seq"), py::arg("state"), "Restores a seq_state blob into sequence seq (cleared first); False if refused.")
        .def_property_readonly("memory_is_recurrent", &engine::memory_is_recurrent)
        .def_property_readonly("n_swa", &engine::n_swa)
        .def("attach_pager", &engine::attach_pager, py::keep_alive<1, 2>())
        .def("clear", &engine::clear)
        .def("apply_chat_template", &engine::apply_chat_template)
        .def("is_eog", &engine::is_eog)
        .def_property_readonly("n_vocab", &engine::n_vocab)
        .def_property_readonly("n_ctx", &engine::n_ctx)
        .def_property_readonly("n_seq_max", &engine::n_seq_max)
        .def_property_readonly("n_batch", &engine::n_batch)
        .def_property_readonly("n_threads", &engine::n_threads)
        .def("hook_stats", [](engine & e) {
            return e.hook() ? epq_bind::to_dict(e.hook()->stats(), hook_fields()) : py::dict();
        })
        .def("set_skip_cold", [](engine & e, double tau) {
            if (!e.hook()) throw std::logic_error("engine was created without the expert hook");
            e.hook()->set_skip_cold(tau);
        }, py::arg("tau"))
        .def("set_route_bias", [](engine & e, double delta, bool batch) {
            if (!e.hook()) throw std::logic_error("engine was created without the expert hook");
            e.hook()->set_route_bias(delta, batch);
        }, py::arg("delta"), py::arg("batch") = false)
        .def("set_expert_budget", [](engine & e, int n) {
            if (!e.hook()) throw std::logic_error("engine was created without the expert hook");
            e.hook()->set_expert_budget(n);
        }, py::arg("n"))
        .def("set_adaptive_k", [](engine & e, std::vector<double> thresholds, std::vector<int> ks) {
            if (!e.hook()) throw std::logic_error("engine was created without the expert hook");
            e.hook()->set_adaptive_k(thresholds, ks);
        }, py::arg("thresholds"), py::arg("ks"))
        .def("adaptive_k_layers", [](engine & e) {
            // (kept experts summed int64 [n_moe_layers], decode steps int64 [n_moe_layers]) since the last reset
            std::vector<int64_t> s, n;
            if (e.hook()) { s = e.hook()->layer_k_sum(); n = e.hook()->layer_k_steps(); }
            return py::make_tuple(py::array_t<int64_t>((py::ssize_t) s.size(), s.data()),
                                  py::array_t<int64_t>((py::ssize_t) n.size(), n.data()));
        })
        .def("set_prefetch", [](engine & e, int mode, int64_t budget_bytes, int depth, double min_precision) {
            if (!e.hook()) throw std::logic_error("engine was created without the expert hook");
            e.hook()->set_prefetch(mode, budget_bytes, depth, min_precision);
        }, py::arg("mode"), py::arg("budget_bytes") = 0, py::arg("depth") = 1, py::arg("min_precision") = 0.0)
        .def("set_predictor", [](engine & e, py::array_t<float, py::array::c_style | py::array::forcecast> W,
                                 py::array_t<float, py::array::c_style | py::array::forcecast> b, const std::string & w_type) {
            // W float32 [depth, n_layers, n_expert, n_embd], b [depth, n_layers, n_expert] (native/engine/hook.h TRAINED);
            // w_type: "q8_0" or "bf16", the type the hook keeps W in.
            if (!e.hook()) throw std::logic_error("engine was created without the expert hook");
            if (W.ndim() != 4 || b.ndim() != 3 || b.shape(0) != W.shape(0) || b.shape(1) != W.shape(1) || b.shape(2) != W.shape(2))
                throw std::invalid_argument("predictor W must be [depth, n_layers, n_expert, n_embd] and b [depth, n_layers, n_expert]");
            e.hook()->set_predictor(W.data(), b.data(), (int) W.shape(0), (int) W.shape(1), (int) W.shape(2), (int64_t) W.shape(3),
                                    predictor_type(w_type));
        }, py::arg("W"), py::arg("b"), py::arg("w_type") = "q8_0")
        .def("predictor_logits", [](engine & e, int layer, int d, py::array_t<float, py::array::c_style | py::array::forcecast> h) {
            // The trained predictor as the hook applies it: layer+d's router logits from layer's router
            // input h float32 [n_embd] -> float32 [n_expert] (native/engine/hook.h predictor_logits).
            if (!e.hook()) throw std::logic_error("engine was created without the expert hook");
            if (h.ndim() != 1) throw std::invalid_argument("h must be one router input, float32 [n_embd]");
            std::vector<float> out;
            e.hook()->predictor_logits(layer, d, h.data(), (int64_t) h.shape(0), out);
            return py::array_t<float>((py::ssize_t) out.size(), out.data());
        }, py::arg("layer"), py::arg("d"), py::arg("h"))
        .def("set_oracle", [](engine & e, py::array_t<int32_t, py::array::c_style | py::array::forcecast> routes,
                              py::array_t<uint8_t, py::array::c_style | py::array::forcecast> follows) {
            // routes int32 [n_steps, n_layers, k], follows uint8 [n_steps] (native/engine/hook.h ORACLE).
            if (!e.hook()) throw std::logic_error("engine was created without the expert hook");
            if (routes.ndim() != 3 || follows.ndim() != 1 || follows.shape(0) != routes.shape(0))
                throw std::invalid_argument("oracle routes must be [n_steps, n_layers, k] and follows [n_steps]");
            e.hook()->set_oracle(routes.data(), follows.data(), (int64_t) routes.shape(0), (int) routes.shape(1), (int) routes.shape(2));
        }, py::arg("routes"), py::arg("follows"))
        .def("set_pipeline", [](engine & e, bool on) {
            if (!e.hook()) throw std::logic_error("engine was created without the expert hook");
            e.hook()->set_pipeline(on);
        }, py::arg("on"))
        .def("set_timing", [](engine & e, bool on) { if (e.hook()) e.hook()->set_timing(on); }, py::arg("on"))
        .def("take_time_split", [](engine & e) {
            // (layers int64 [n, 8]: call, layer index, n_tokens, attn_us, expert_us, io_us, map_us, predict_us;
            //  calls int64 [m, 4]: call, n_tokens, wall_us, io_busy_us), then clears them.
            static const std::vector<layer_time> no_l;
            static const std::vector<call_time> no_c;
            const auto & L = e.hook() ? e.hook()->layer_times() : no_l;
            const auto & C = e.hook() ? e.hook()->call_times() : no_c;
            py::array_t<int64_t> lt(std::vector<py::ssize_t>{(py::ssize_t) L.size(), 8});
            py::array_t<int64_t> ct(std::vector<py::ssize_t>{(py::ssize_t) C.size(), 4});
            int64_t * a = lt.mutable_data();
            for (const auto & r : L) {
                const int64_t row[8] = {r.call, r.li, r.n_tokens, r.attn_us, r.expert_us, r.io_us, r.map_us, r.predict_us};
                std::copy(row, row + 8, a);
                a += 8;
            }
            int64_t * c = ct.mutable_data();
            for (const auto & r : C) {
                c[0] = r.call; c[1] = r.n_tokens; c[2] = r.wall_us; c[3] = r.io_busy_us;
                c += 4;
            }
            if (e.hook()) e.hook()->clear_times();
            return py::make_tuple(lt, ct);
        })
        .def("reset_hook_stats", [](engine & e) { if (e.hook()) e.hook()->reset_stats(); })
        .def("layer_unions", [](engine & e) {
            // int64 [n_moe_layers]: distinct experts routed per layer, summed over ubatches since the last reset
            const std::vector<int64_t> empty;
            const auto & v = e.hook() ? e.hook()->layer_unions() : empty;
            return py::array_t<int64_t>((py::ssize_t) v.size(), v.data());
        })
        .def("take_route", [](engine & e) {
            // Returns the recorded routes as int32 [n_tokens, n_moe_layers, k] and clears them.
            if (!e.hook()) return py::array_t<int32_t>();
            const auto & r = e.hook()->route();
            py::array_t<int32_t> out(r.size());
            std::copy(r.begin(), r.end(), out.mutable_data());
            return out;
        })
        .def("take_route_probs", [](engine & e) {
            // Router probability of each entry of take_route() (float32, NaN where none); call before
            // take_route_ubatch, which clears the recorded routes.
            if (!e.hook()) return py::array_t<float>();
            const auto & r = e.hook()->route_probs();
            py::array_t<float> out(r.size());
            std::copy(r.begin(), r.end(), out.mutable_data());
            return out;
        })
        .def("take_route_ubatch", [](engine & e) {
            // Ubatch number of each token of the last take_route(); clears the recorded routes.
            if (!e.hook()) return py::array_t<int32_t>();
            const auto & r = e.hook()->route_ubatch();
            py::array_t<int32_t> out(r.size());
            std::copy(r.begin(), r.end(), out.mutable_data());
            e.hook()->clear_route();
            return out;
        })
        .def("route_k", [](engine & e) { return e.hook() ? e.hook()->route_k() : 0; })
        .def("take_adaptive_k_log", [](engine & e) {
            // Adaptive-k's kept experts per recorded token and MoE layer, int32 flat [n_tokens * n_moe_layers]; clears it.
            if (!e.hook()) return py::array_t<int32_t>();
            const auto & r = e.hook()->adaptive_k_log();
            py::array_t<int32_t> out(r.size());
            std::copy(r.begin(), r.end(), out.mutable_data());
            e.hook()->clear_adaptive_k_log();
            return out;
        })
        .def("set_capture_inputs", [](engine & e, bool on) {
            // Router-input log on/off (native/engine/hook.h); needs route recording.
            if (!e.hook()) throw std::invalid_argument("capturing router inputs needs route recording (route_log)");
            e.hook()->set_capture_inputs(on);
        })
        .def("moe_outputs", [](engine & e) {
            // The MoE-output log, float32 flat, laid out as the router-input log (not cleared: take_router_inputs clears both).
            if (!e.hook()) return py::array_t<float>();
            const auto & r = e.hook()->moe_outputs();
            py::array_t<float> out(r.size());
            std::copy(r.begin(), r.end(), out.mutable_data());
            return out;
        })
        .def("take_router_inputs", [](engine & e) -> py::tuple {
            // The router-input log as float32 [n_tokens * n_moe_layers * n_embd] (flat) and n_embd; clears it.
            if (!e.hook()) return py::make_tuple(py::array_t<float>(), (int64_t) 0);
            const auto & r = e.hook()->router_inputs();
            py::array_t<float> out(r.size());
            std::copy(r.begin(), r.end(), out.mutable_data());
            const int64_t dim = e.hook()->router_input_dim();
            e.hook()->clear_router_inputs();
            return py::make_tuple(out, (int64_t) dim);
        });
}
