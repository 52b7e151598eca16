// Declarations of each native room's pybind11 registration. Invariant: one
// function per room, defined in that room's own bind_*.cpp file, called from the module file that
// owns the room: pager_core/module.cpp (epqlab._pager_core: pager, probe; no llama.cpp) or
// core/module.cpp (epqlab._core: engine, linked against libllama).
#pragma once
#include <pybind11/pybind11.h>

void register_pager(pybind11::module_ & m);   // pager_core/bind_pager.cpp
void register_engine(pybind11::module_ & m);  // core/bind_engine.cpp
void register_probe(pybind11::module_ & m);   // pager_core/bind_probe.cpp

// The version is pyproject.toml's, passed by CMakeLists.txt as VERSION_INFO (as pybind11's
// scikit_build_example does); epqlab.__version__ reads the same number from the installed metadata.
#define EPQ_STRINGIFY(x) #x
#define EPQ_MACRO_STRINGIFY(x) EPQ_STRINGIFY(x)
#ifdef VERSION_INFO
#define EPQ_VERSION_STRING EPQ_MACRO_STRINGIFY(VERSION_INFO)
#else
#define EPQ_VERSION_STRING "dev"
#endif
