// Python bindings of the pager (epqlab._pager_core.Pager; no llama.cpp here). Invariant: every C++ error crosses into
// Python as an epqlab.errors exception (PagerIOError with errno/filename/offset, ArenaTooSmall
// for capacity), and every call that may block on I/O releases the GIL.
#include <cstring>
#include <optional>

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bind_common.h"
#include "pager.h"
#include "registry.h"

namespace py = pybind11;

// [(block, [(offset, expert_bytes, file index)])]
using layer_list = std::vector<std::pair<int32_t, std::vector<std::tuple<int64_t, int64_t, int32_t>>>>;

static std::vector<pager_layer_spec> to_specs(const layer_list & layers) {
    std::vector<pager_layer_spec> out;
    for (const auto & l : layers) {
        pager_layer_spec s{l.first, {}};
        for (const auto & t : l.second) s.tensors.push_back({std::get<0>(t), std::get<1>(t), std::get<2>(t)});
        out.push_back(s);
    }
    return out;
}

// The pager's counters (pager_stats), one row each: Pager.stats() and PAGER_COUNTERS come from this table.
static const std::vector<epq_bind::field<pager_stats>> & stat_fields() {
    static const std::vector<epq_bind::field<pager_stats>> f = {
        EPQ_FIELD(pager_stats, "requests", s.requests),
        EPQ_FIELD(pager_stats, "hits", s.hits),
        EPQ_FIELD(pager_stats, "misses", s.misses),
        EPQ_FIELD(pager_stats, "evictions", s.evictions),
        EPQ_FIELD(pager_stats, "evictions_stale_left", s.evictions_by_group[0]),
        EPQ_FIELD(pager_stats, "evictions_current_left", s.evictions_by_group[1]),
        EPQ_FIELD(pager_stats, "evictions_stale_right", s.evictions_by_group[2]),
        EPQ_FIELD(pager_stats, "evictions_current_right", s.evictions_by_group[3]),
        EPQ_FIELD(pager_stats, "bytes_read", s.bytes_read),
        EPQ_FIELD(pager_stats, "read_us", s.read_us),
        EPQ_FIELD(pager_stats, "io_wait_us", s.io_wait_us),
        EPQ_FIELD(pager_stats, "map_us", s.map_us),
        EPQ_FIELD(pager_stats, "evict_unmap_us", s.evict_unmap_us),
        EPQ_FIELD(pager_stats, "evict_unmap_io_us", s.evict_unmap_io_us),
        EPQ_FIELD(pager_stats, "load_calls", s.load_calls),
        EPQ_FIELD(pager_stats, "passes", s.passes),
        EPQ_FIELD(pager_stats, "staged_bytes", s.staged_bytes),
        EPQ_FIELD(pager_stats, "staged_reads", s.staged_reads),
        EPQ_FIELD(pager_stats, "staged_copies", s.staged_copies),
        EPQ_FIELD(pager_stats, "stage_lends", s.stage_lends),
        EPQ_FIELD(pager_stats, "stage_lent_bytes", s.stage_lent_bytes),
        EPQ_FIELD(pager_stats, "stage_lent_evictions", s.stage_lent_evictions),
        EPQ_FIELD(pager_stats, "prefetch_units", s.prefetch_units),
        EPQ_FIELD(pager_stats, "prefetch_bytes", s.prefetch_bytes),
        EPQ_FIELD(pager_stats, "prefetch_used", s.prefetch_used),
        EPQ_FIELD(pager_stats, "prefetch_used_bytes", s.prefetch_used_bytes),
        EPQ_FIELD(pager_stats, "prefetch_failed", s.prefetch_failed),
        EPQ_FIELD(pager_stats, "prefetch_wait_us", s.prefetch_wait_us),
        EPQ_FIELD(pager_stats, "prefetch_cancelled", s.prefetch_cancelled),
        EPQ_FIELD(pager_stats, "prefetch_map_us", s.prefetch_map_us),
        EPQ_FIELD(pager_stats, "pipelined_loads", s.pipelined_loads),
        EPQ_FIELD(pager_stats, "pipelined_early", s.pipelined_early),
        EPQ_FIELD(pager_stats, "admission_staged", s.admission_staged),
    };
    return f;
}

static py::dict stats_dict(const pager & p) {
    py::dict d = epq_bind::to_dict(p.stats(), stat_fields());
    d["layer_requests"] = p.stats().layer_requests;
    d["layer_hits"] = p.stats().layer_hits;
    d["resident"] = p.n_resident();
    return d;
}

void register_pager(py::module_ & m) {
    epq_bind::register_error_translator();
    m.attr("PAGER_COUNTERS") = epq_bind::names(stat_fields());
    m.attr("BOUNCE_BYTES") = kBounceBytes;  // each reading thread's bounce buffer (io_pool.h)

    py::tuple names(N_POLICIES);
    for (int i = 0; i < N_POLICIES; i++) names[i] = py::str(POLICY_NAMES[i]);
    m.attr("POLICIES") = names;

    py::class_<pager>(m, "Pager")
        .def(py::init([](const std::string & path, const layer_list & layers, int32_t n_expert, int32_t n_expert_used,
                         int64_t arena_bytes, const std::string & policy, int32_t io_threads, bool direct_io,
                         double fnu_alpha, const std::vector<std::string> & paths,
                         const std::map<std::string, double> & policy_params) {
                 pager_config c;
                 c.path = path;
                 c.paths = paths;
                 c.layers = to_specs(layers);
                 c.n_expert = n_expert;
                 c.n_expert_used = n_expert_used;
                 c.arena_bytes = arena_bytes;
                 c.policy = policy;
                 c.io_threads = io_threads;
                 c.direct_io = direct_io;
                 c.fnu_alpha = fnu_alpha;
                 c.policy_params = policy_params;
                 return new pager(c);
             }),
             py::arg("path"), py::arg("layers"), py::arg("n_expert"), py::arg("n_expert_used"), py::arg("arena_bytes"),
             py::arg("policy"), py::arg("io_threads"), py::arg("direct_io"), py::arg("fnu_alpha") = 0.3,
             py::arg("paths") = std::vector<std::string>{},
             py::arg("policy_params") = std::map<std::string, double>{})
        .def_static("unit_slot_bytes", [](const layer_list & layers, int32_t n_expert) {
            return pager::unit_slot_bytes(to_specs(layers), n_expert);
        })
        .def("load_layer", [](pager & p, int li, py::array_t<int32_t, py::array::c_style | py::array::forcecast> ids) {
            py::array_t<uint8_t> hits(ids.size());
            const int32_t * src = ids.data();
            uint8_t * dst = hits.mutable_data();
            const int n = (int) ids.size();
            {
                py::gil_scoped_release nogil;
                p.load_layer(li, src, n, dst);
            }
            return hits;
        })
        .def_property_readonly("fill_bytes", &pager::fill_bytes)
        .def("reserve_arena", [](pager & p) {
            py::gil_scoped_release nogil;
            return p.reserve_arena();
        })
        .def("use_io_uring", [](pager & p) {
            py::gil_scoped_release nogil;  // pins the arena's pages: ~0.1 s per GiB
            return p.use_io_uring();
        }, "Reads into the arena through io_uring registered buffers (after reserve_arena); returns '' or why not.")
        .def_property_readonly("fixed_reads", &pager::fixed_reads)
        .def_property_readonly("plain_reads", &pager::plain_reads)
        .def("set_slot_addressing", &pager::set_slot_addressing, py::arg("on"),
             "Slot addressing on or off (before the first load); returns '' or why it cannot be on.")
        .def_property_readonly("slot_addressed", &pager::slot_addressed)
        .def_property("stage_lending", &pager::stage_lending, &pager::set_stage_lending,
                      "Stage lending (pager.h): a staged matrix's pages come out of the arena, not a reserve beside it.")
        .def_property_readonly("lent_bytes", &pager::lent_bytes)
        .def("stage_need", [](const pager & p, int li, py::array_t<int32_t, py::array::c_style | py::array::forcecast> ids) {
            if (li < 0 || li >= p.n_layers()) throw py::index_error("MoE layer index out of range");
            return p.stage_need(li, ids.data(), (int) ids.size());
        })
        .def("lend", [](pager & p, int li, py::array_t<int32_t, py::array::c_style | py::array::forcecast> keep, int64_t bytes) {
            if (li < 0 || li >= p.n_layers()) throw py::index_error("MoE layer index out of range");
            py::gil_scoped_release nogil;
            return p.lend(li, keep.data(), (int) keep.size(), bytes);
        })
        .def("unlend", &pager::unlend)
        .def("slot_of", [](const pager & p, int li, int e) {
            if (li < 0 || li >= p.n_layers() || e < 0 || e >= p.n_expert()) throw py::index_error("layer or expert out of range");
            return p.slot_of(li, e);
        })
        .def("zero_overlay", [](pager & p, int li, py::array_t<int32_t, py::array::c_style | py::array::forcecast> ids) {
            p.zero_overlay(li, ids.data(), (int) ids.size());
        })
        .def("prefetch_start", [](pager & p, int li, py::array_t<int32_t, py::array::c_style | py::array::forcecast> ids) {
            return p.prefetch_start(li, ids.data(), (int) ids.size());
        }, py::arg("li"), py::arg("ids"))
        .def("prefetch_finish", [](pager & p) {
            py::gil_scoped_release nogil;
            p.prefetch_finish();
        })
        .def_property_readonly("prefetch_active", [](const pager & p) { return p.prefetch_active(); })
        .def_property("read_segment_bytes", &pager::read_segment_bytes, &pager::set_read_segment_bytes)
        .def_property("read_delay_us", &pager::read_delay_us, &pager::set_read_delay_us)
        .def_property("read_rate_limit", &pager::read_rate_limit, &pager::set_read_rate_limit)
        .def("release_layer", &pager::release_layer)
        .def("release_all", &pager::release_all)
        .def("begin_pass", &pager::begin_pass)
        .def("replay", [](pager & p, py::array_t<int32_t, py::array::c_style | py::array::forcecast> experts,
                          py::array_t<int32_t, py::array::c_style | py::array::forcecast> ubatch,
                          std::vector<int> layer_index,
                          std::optional<py::array_t<float, py::array::c_style | py::array::forcecast>> probs) {
            if (experts.ndim() != 3) throw std::invalid_argument("experts must be int32 [T, L, k]");
            const int64_t T = experts.shape(0), L = experts.shape(1), k = experts.shape(2);
            if (ubatch.ndim() != 1 || ubatch.shape(0) != T) throw std::invalid_argument("ubatch must be int32 [T]");
            if (probs && (probs->ndim() != 3 || probs->shape(0) != T || probs->shape(1) != L || probs->shape(2) != k))
                throw std::invalid_argument("probs must be float32 [T, L, k] like experts");
            const int32_t * e = experts.data();
            const int32_t * u = ubatch.data();
            const float * pr = probs ? probs->data() : nullptr;
            py::gil_scoped_release nogil;
            p.replay(e, T, (int) L, (int) k, u, layer_index, pr);
        }, py::arg("experts"), py::arg("ubatch"), py::arg("layer_index"), py::arg("probs") = py::none())
        .def("set_hot", &pager::set_hot)
        .def("pass_history", [](const pager & p) {
            const auto & s = p.stats();
            return py::make_tuple(py::array_t<int32_t>(s.pass_requests.size(), s.pass_requests.data()),
                                  py::array_t<int32_t>(s.pass_hits.size(), s.pass_hits.data()));
        })
        .def("read_expert", [](pager & p, int li, int ti, int e, int64_t expert_bytes) {
            // Copies expert e's slice of tensor ti out of the region, or out of its slot with slot
            // addressing (tests compare it with the file).
            if (li < 0 || li >= p.n_layers()) throw py::index_error("layer out of range");
            return py::bytes(p.expert_data(li, ti, e), (size_t) expert_bytes);
        })
        .def("tensor_data", [](const pager & p, int li, int ti) { return (uintptr_t) p.tensor_data(li, ti); })
        .def("is_resident", &pager::is_resident)
        .def("slot_states", [](const pager & p) {
            const auto st = p.slot_states();
            py::array_t<int32_t> a({(py::ssize_t) st.size(), (py::ssize_t) 5});
            auto r = a.mutable_unchecked<2>();
            for (size_t i = 0; i < st.size(); i++)
                for (int j = 0; j < 5; j++) r(i, j) = st[i][j];
            return a;
        }, "int32 [n_slots, 5]: slot class, MoE layer index (-1 free), expert (-1 free), pinned, hot")
        .def("layer_index", &pager::layer_index)
        .def("arena_resident_bytes", &pager::arena_resident_bytes)
        .def("max_stage_bytes", &pager::max_stage_bytes)
        .def("stats", &stats_dict)
        .def("reset_stats", &pager::reset_stats)
        .def("inject_fault", &pager::inject_fault, py::arg("nth"), py::arg("err"))
        .def("inject_map_fault", &pager::inject_map_fault, py::arg("nth"))
        .def_property_readonly("direct_io", &pager::direct_io)
        .def_property_readonly("io_threads", &pager::io_threads)
        .def_property_readonly("arena_bytes", &pager::arena_bytes)
        .def_property_readonly("capacity_bytes", &pager::capacity_bytes)
        .def_property_readonly("min_arena_bytes", &pager::min_arena_bytes)
        .def_property_readonly("resizes", &pager::resizes)
        .def_property_readonly("last_resize_us", &pager::last_resize_us)
        .def_property_readonly("last_resize_evictions", &pager::last_resize_evictions)
        .def("request_resize", &pager::request_resize, py::arg("bytes"),
             "Ask for a resize from any thread; applied before the next layer's load (or apply_requested_resize).")
        .def_property_readonly("requested_resize", &pager::requested_resize)
        .def("apply_requested_resize", [](pager & p) {
            py::gil_scoped_release nogil;
            return p.apply_requested_resize();
        })
        .def_property_readonly("active_class_n", &pager::active_class_n)
        .def("resize", [](pager & p, int64_t bytes) {
            py::gil_scoped_release nogil;  // waits for reads in flight; punches or allocates pages
            return p.resize(bytes);
        }, py::arg("bytes"), "Live resize (pager.h): the arena becomes the slots `bytes` buys; returns the arena's bytes.")
        .def_property_readonly("class_slot_bytes", &pager::class_slot_bytes)
        .def_property_readonly("class_n_slots", &pager::class_n_slots)
        .def_property_readonly("policy", &pager::policy)
        .def_property_readonly("n_layers", &pager::n_layers);
}
