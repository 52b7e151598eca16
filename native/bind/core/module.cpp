// The engine module, epqlab._core (links libllama and libepqlab_pager). Invariant: this file only
// gathers the register_* functions of each native room (declared in registry.h); no logic lives here.
// The pager and the I/O probe are in epqlab._pager_core (bind/pager_core/module.cpp), which loads
// without llama.cpp; import it first (epqlab._native does), since the engine takes its Pager objects.
#include <pybind11/pybind11.h>

#include "registry.h"

PYBIND11_MODULE(_core, m) {
    m.doc() = "epqlab native engine: llama.cpp model and context with the expert hook";
    m.attr("__version__") = EPQ_VERSION_STRING;
    register_engine(m);
}
