// Self-registering pybind11 bindings: each kernel family binds its own functions in its own file
// with K2_BINDINGS(name) { m.def(...); }, and csrc/bindings.cpp calls every registered binder.
// Adding a kernel family therefore means adding files, never editing a central list.
// CUDA-only binders live in csrc/cuda/*.cpp, which CMake compiles only when CUDA is on.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace k2 {

using BindFn = void (*)(pybind11::module_&);

// All binders registered by static initialisers of this module's translation units.
std::vector<std::pair<const char*, BindFn>>& binders();

struct RegisterBinding {
  RegisterBinding(const char* name, BindFn fn) { binders().emplace_back(name, fn); }
};

// Raw pointers cross the Python boundary as integers (torch's data_ptr()).
template <typename T>
inline T* ptr(uintptr_t p) { return reinterpret_cast<T*>(p); }

}  // namespace k2

#define K2_BINDINGS(name)                                                        \
  static void k2_bind_##name(pybind11::module_& m);                              \
  static ::k2::RegisterBinding k2_bind_reg_##name(#name, &k2_bind_##name);       \
  static void k2_bind_##name(pybind11::module_& m)
