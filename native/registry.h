// Declarations of each native room's pybind11 registration. Invariant: one
// function per room, defined in that room's own bind_*.cpp file, called from bindings.cpp.
#pragma once
#include <pybind11/pybind11.h>

void register_pager(pybind11::module_ & m);   // bind_pager.cpp
void register_engine(pybind11::module_ & m);  // bind_engine.cpp
void register_probe(pybind11::module_ & m);   // bind_probe.cpp
