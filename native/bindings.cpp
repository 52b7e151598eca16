// The one pybind11 module, epqlab._core. Invariant: this file only gathers the
// register_* functions of each native room (declared in registry.h); no logic lives here.
#include <pybind11/pybind11.h>

#include "registry.h"

PYBIND11_MODULE(_core, m) {
    m.doc() = "epqlab native core: expert pager, llama.cpp hook, I/O probe";
    m.attr("__version__") = "0.1.0";
    register_pager(m);
    register_engine(m);
    register_probe(m);
}
