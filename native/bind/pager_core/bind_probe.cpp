// pybind11 binding of the device I/O probe (io_probe.h) as epqlab._pager_core.IoProbe.
//
// Invariant: the GIL is released for the whole of a cell's I/O (threads read while Python may run
// a progress bar), and re-taken only to build the result; every C++ error crosses into Python as an
// exception — IoProbeError as OSError(errno, message, filename) with an extra `offset` attribute,
// std::invalid_argument as ValueError — never as a crash.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include "bind_common.h"
#include "io_probe.h"
#include "registry.h"

namespace py = pybind11;

// The scalar fields of one probe cell (the latency samples are added as a NumPy array).
static const std::vector<epq_bind::field<IoProbeCell>> & cell_fields() {
    static const std::vector<epq_bind::field<IoProbeCell>> f = {
        EPQ_FIELD(IoProbeCell, "request_bytes", s.request_bytes),
        EPQ_FIELD(IoProbeCell, "read_bytes", s.read_bytes),
        EPQ_FIELD(IoProbeCell, "concurrency", s.concurrency),
        EPQ_FIELD(IoProbeCell, "n_requests", s.n_requests),
        EPQ_FIELD(IoProbeCell, "total_bytes", s.total_bytes),
        EPQ_FIELD(IoProbeCell, "wall_s", s.wall_s),
    };
    return f;
}

void register_probe(py::module_ & m) {
    epq_bind::register_error_translator();

    py::class_<IoProbe>(m, "IoProbe",
                        "An open file for the device I/O probe. Use epqlab.probe_io(); this is its native core.\n\n"
                        "IoProbe(path, direct) opens `path` read-only, with O_DIRECT when `direct` and the filesystem\n"
                        "allows it (else buffered; see .mode).")
        .def(py::init<const std::string &, bool>(), py::arg("path"), py::arg("direct") = true)
        .def_property_readonly("path", &IoProbe::path)
        .def_property_readonly("file_size", &IoProbe::file_size, "bytes")
        .def_property_readonly("direct", &IoProbe::direct)
        .def_property_readonly("mode", &IoProbe::mode, "'direct' or 'buffered': the I/O mode that runs")
        .def("drop_cache", &IoProbe::drop_cache, py::call_guard<py::gil_scoped_release>(),
             "posix_fadvise(POSIX_FADV_DONTNEED) over the whole file")
        .def(
            "run",
            [](IoProbe & self, int64_t request_bytes, int32_t concurrency, int64_t requests_per_thread, uint64_t seed,
               bool drop_cache) {
                IoProbeCell cell;
                {
                    py::gil_scoped_release nogil;
                    cell = self.run(request_bytes, concurrency, requests_per_thread, seed, drop_cache);
                }
                py::array_t<double> lat((py::ssize_t) cell.latency_us.size());
                std::copy(cell.latency_us.begin(), cell.latency_us.end(), lat.mutable_data());
                py::dict d = epq_bind::to_dict(cell, cell_fields());
                d["latency_us"]    = lat;
                d["mode"]          = self.mode();
                return d;
            },
            py::arg("request_bytes"), py::arg("concurrency"), py::arg("requests_per_thread"), py::arg("seed") = 0,
            py::arg("drop_cache") = true,
            "One cell: `concurrency` threads each pread `requests_per_thread` random 4096-aligned ranges of\n"
            "`request_bytes`. Returns a dict with request_bytes, read_bytes, concurrency, n_requests,\n"
            "total_bytes, wall_s (seconds), latency_us (float64 array, microseconds) and mode.\n"
            "Raises ValueError (bad arguments, file smaller than the request) or OSError (I/O).");
}
