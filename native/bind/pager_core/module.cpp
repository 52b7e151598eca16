// The pager module, epqlab._pager_core: the expert pager and the device I/O probe, with no llama.cpp
// dependency (the pager's code lives in libepqlab_pager.so, shared with the engine module).
// Invariant: this file only gathers register_* functions (registry.h); no logic lives here.
#include <pybind11/pybind11.h>

#include "registry.h"

PYBIND11_MODULE(_pager_core, m) {
    m.doc() = "epqlab native pager: expert pager and device I/O probe (no llama.cpp)";
    m.attr("__version__") = EPQ_VERSION_STRING;
    register_pager(m);
    register_probe(m);
}
