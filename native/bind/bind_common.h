// Helpers every binding file shares. Invariants: one translation of native errors into Python
// exceptions (register_error_translator, called by each module's init; pybind11 keeps translators in
// its shared internals, so either module's registration covers both), and one way to turn a stats
// struct into a dict: a field table (name, getter) per struct, from which both the dict and the tuple
// of counter names exported to Python are built, so the two cannot drift apart; likewise a
// code table (name, enumerator) per C++ enum, from which the exported {name: code} dict is built.
#pragma once
#include <cstddef>
#include <exception>
#include <utility>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "io_probe.h"
#include "pager.h"

namespace epq_bind {

namespace py = pybind11;

// Translates pager_io_error -> epqlab.errors.PagerIOError(errno, message, filename) with .offset,
// pager_capacity_error -> epqlab.errors.ArenaTooSmall, IoProbeError -> OSError(errno, message,
// filename) (the errno subclass: FileNotFoundError, ...) with .offset. std::invalid_argument and
// other standard exceptions keep pybind11's own translation (ValueError, RuntimeError, ...).
inline void register_error_translator() {
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const pager_io_error & e) {
            py::object cls = py::module_::import("epqlab.errors").attr("PagerIOError");
            py::object exc = cls(e.err, e.what(), e.path);
            exc.attr("offset") = e.offset;
            PyErr_SetObject(cls.ptr(), exc.ptr());
        } catch (const pager_capacity_error & e) {
            py::object cls = py::module_::import("epqlab.errors").attr("ArenaTooSmall");
            PyErr_SetObject(cls.ptr(), py::str(e.what()).ptr());
        } catch (const IoProbeError & e) {
            py::object exc = py::module_::import("builtins").attr("OSError")(e.errno_value, e.detail, e.path);
            exc.attr("offset") = e.offset;
            PyErr_SetObject(reinterpret_cast<PyObject *>(Py_TYPE(exc.ptr())), exc.ptr());
        }
    });
}

// One field of a stats struct S: its Python name and a getter (a captureless lambda).
template <class S>
using field = std::pair<const char *, py::object (*)(const S &)>;

// A field whose value is the expression `expr` of `s` (a const S &).
#define EPQ_FIELD(S, name, expr) epq_bind::field<S>{name, [](const S & s) -> pybind11::object { return pybind11::cast(expr); }}

// {name: getter(s)} for every field, in table order.
template <class S>
py::dict to_dict(const S & s, const std::vector<field<S>> & fields) {
    py::dict d;
    for (const auto & f : fields) d[f.first] = f.second(s);
    return d;
}

// {name: int(code)} of a table of (name, enumerator) pairs (PREFETCH_MODE_NAMES, ...): the codes
// exported to Python come from the C++ enum itself, so Python never re-types them.
template <class E, size_t N>
py::dict codes(const std::pair<const char *, E> (&table)[N]) {
    py::dict d;
    for (const auto & c : table) d[c.first] = static_cast<int>(c.second);
    return d;
}

// The field names, in table order (exported to Python so it never re-types them).
template <class S>
py::tuple names(const std::vector<field<S>> & fields) {
    py::tuple t(fields.size());
    for (size_t i = 0; i < fields.size(); i++) t[i] = py::str(fields[i].first);
    return t;
}

}  // namespace epq_bind
