// The one pybind11 module, epqlab._core. Invariant: this file only gathers the
// register_* functions of each native room (declared in registry.h); no logic lives here.
#include <pybind11/pybind11.h>

#include "registry.h"

// The version is pyproject.toml's, passed by CMakeLists.txt as VERSION_INFO (as pybind11's
// scikit_build_example does); epqlab.__version__ reads the same number from the installed metadata.
#define EPQ_STRINGIFY(x) #x
#define EPQ_MACRO_STRINGIFY(x) EPQ_STRINGIFY(x)

PYBIND11_MODULE(_core, m) {
    m.doc() = "epqlab native core: expert pager, llama.cpp hook, I/O probe";
#ifdef VERSION_INFO
    m.attr("__version__") = EPQ_MACRO_STRINGIFY(VERSION_INFO);
#else
    m.attr("__version__") = "dev";
#endif
    register_pager(m);
    register_engine(m);
    register_probe(m);
}
