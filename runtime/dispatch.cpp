// The signature table of runtime/dispatch.py, in C++: a call whose signature (every
// property validation reads) was validated before launches from its packed-Args template
// with the data pointers filled in. libtorch reads a tensor's metadata in nanoseconds;
// Python's attribute reads cost ~1 µs per tensor on the H200's host, which was most of
// the per-call overhead. Built by torch's extension builder (runtime/dispatch.py).
#define PY_SSIZE_T_CLEAN  // y# formats take Py_ssize_t lengths
#include <Python.h>

#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <cstring>
#include <deque>
#include <new>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

using LaunchFn = int (*)(const void* args, void* stream);

struct Entry {
  std::string tmpl;                        // the packed Args of the validated call
  std::vector<std::pair<int, int>> slots;  // (64-bit word of Args, argument index) per data pointer
  LaunchFn fn = nullptr;
  int device = 0;
  PyObject* on_error = nullptr;            // owned: raises for a launch's error code
};

struct Table {
  std::unordered_map<std::string, Entry> entries;
  std::deque<std::string> order;  // oldest first, for eviction
  size_t capacity = 1;
  PyObject* get_device = nullptr;  // owned: () -> current device index
  PyObject* get_stream = nullptr;  // owned: (device) -> current raw stream
};

Table& table() {
  static Table t;
  return t;
}

template <class T>
void put(std::string& key, T v) {
  key.append(reinterpret_cast<const char*>(&v), sizeof(v));
}

// Appends argument `x`'s signature to `key` (its data pointer to `ptr`). False when `x`
// is something only the Python path judges: then the call is validated in full.
bool sign(PyObject* x, std::string& key, intptr_t& ptr) {
  ptr = 0;
  if (x == Py_None) {
    key.push_back('N');
  } else if (THPVariable_Check(x)) {
    const at::Tensor& t = THPVariable_Unpack(x);
    // Plain strided tensors with storage; subclasses that dispatch in Python (fake,
    // functional) and meta tensors go the Python way.
    if (!t.defined() || t.layout() != at::kStrided || !t.has_storage() || t.is_meta() ||
        t.unsafeGetTensorImpl()->is_python_dispatch())
      return false;
    ptr = reinterpret_cast<intptr_t>(t.data_ptr());  // materializes a copy-on-write tensor, as Python's does
    key.push_back('T');
    put(key, static_cast<int8_t>(t.scalar_type()));
    put(key, static_cast<int8_t>(t.device().type()));
    put(key, static_cast<int8_t>(t.device().index()));
    put(key, static_cast<int8_t>(ptr & 15));
    put(key, static_cast<int8_t>(t.dim()));
    for (int64_t s : t.sizes()) put(key, s);
    for (int64_t s : t.strides()) put(key, s);
  } else if (PyBool_Check(x)) {  // before int: True == 1 but is not valid alike
    key.push_back(x == Py_True ? 'Y' : 'n');
  } else if (PyLong_CheckExact(x)) {
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(x, &overflow);
    if (overflow) return false;
    key.push_back('I');
    put(key, static_cast<int64_t>(v));
  } else if (PyFloat_CheckExact(x)) {
    key.push_back('F');
    put(key, PyFloat_AS_DOUBLE(x));
  } else if (PyUnicode_CheckExact(x)) {
    Py_ssize_t n = 0;
    const char* s = PyUnicode_AsUTF8AndSize(x, &n);
    if (s == nullptr) {
      PyErr_Clear();
      return false;
    }
    key.push_back('S');
    put(key, static_cast<int64_t>(n));
    key.append(s, static_cast<size_t>(n));
  } else {
    return false;
  }
  return true;
}

// The signature of a tuple of arguments; false if some argument has none here.
bool signature(PyObject* argv, std::string& key, std::vector<intptr_t>& ptrs) {
  const Py_ssize_t n = PyTuple_GET_SIZE(argv);
  try {  // no C++ exception may cross into Python; whatever throws is validation's to judge
    key.reserve(64 * static_cast<size_t>(n));
    ptrs.resize(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i)
      if (!sign(PyTuple_GET_ITEM(argv, i), key, ptrs[static_cast<size_t>(i)])) return false;
  } catch (...) {
    return false;
  }
  return true;
}

long long call_long(PyObject* fn, PyObject* arg) {
  PyObject* r = arg ? PyObject_CallOneArg(fn, arg) : PyObject_CallNoArgs(fn);
  if (r == nullptr) return -1;
  const long long v = PyLong_AsLongLong(r);
  Py_DECREF(r);
  return v;
}

// configure(get_device, get_stream, capacity): how to read the current device and its
// stream, and how many signatures to hold.
PyObject* configure(PyObject*, PyObject* args) {
  PyObject *dev = nullptr, *stream = nullptr;
  Py_ssize_t capacity = 0;
  if (!PyArg_ParseTuple(args, "OOn", &dev, &stream, &capacity)) return nullptr;
  Table& t = table();
  t.capacity = capacity > 0 ? static_cast<size_t>(capacity) : 1;
  Py_INCREF(dev);
  Py_INCREF(stream);
  Py_XSETREF(t.get_device, dev);
  Py_XSETREF(t.get_stream, stream);
  Py_RETURN_NONE;
}

// bind(argv, template, slots, fn, device, on_error): remember a validated call. Each
// slot (word, argument) names an argument that is a tensor.
PyObject* bind(PyObject*, PyObject* args) {
  PyObject *argv = nullptr, *slots = nullptr, *on_error = nullptr;
  const char* tmpl = nullptr;
  Py_ssize_t tmpl_len = 0;
  unsigned long long fn = 0;
  int device = 0;
  if (!PyArg_ParseTuple(args, "O!y#O!KiO", &PyTuple_Type, &argv, &tmpl, &tmpl_len, &PyTuple_Type,
                        &slots, &fn, &device, &on_error))
    return nullptr;
  std::string key;
  std::vector<intptr_t> ptrs;
  if (!signature(argv, key, ptrs)) Py_RETURN_FALSE;
  // References the table gives up are released once it is consistent again (a
  // finalizer may use it).
  std::vector<PyObject*> dropped;
  Py_INCREF(on_error);  // the entry's
  try {
    Entry e;
    e.tmpl.assign(tmpl, static_cast<size_t>(tmpl_len));
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(slots); ++i) {
      int word = 0, arg = 0;
      if (!PyArg_ParseTuple(PyTuple_GET_ITEM(slots, i), "ii", &word, &arg)) {
        Py_DECREF(on_error);
        return nullptr;
      }
      if (word < 0 || static_cast<size_t>(word + 1) * 8 > e.tmpl.size() || arg < 0 ||
          arg >= PyTuple_GET_SIZE(argv) || !THPVariable_Check(PyTuple_GET_ITEM(argv, arg))) {
        Py_DECREF(on_error);
        PyErr_SetString(PyExc_ValueError,
                        "bind: a slot outside the template, or naming an argument that is not a tensor");
        return nullptr;
      }
      e.slots.emplace_back(word, arg);
    }
    e.fn = reinterpret_cast<LaunchFn>(static_cast<uintptr_t>(fn));
    e.device = device;
    e.on_error = on_error;
    Table& t = table();
    auto it = t.entries.find(key);
    // Room for every reference given up, before anything is erased (no throw after).
    dropped.reserve(t.entries.size() >= t.capacity ? t.entries.size() - t.capacity + 1 : 1);
    if (it != t.entries.end()) {
      dropped.push_back(it->second.on_error);
      it->second = std::move(e);
    } else {
      while (t.entries.size() >= t.capacity && !t.order.empty()) {
        auto old = t.entries.find(t.order.front());
        if (old != t.entries.end()) {
          dropped.push_back(old->second.on_error);
          t.entries.erase(old);
        }
        t.order.pop_front();
      }
      t.order.push_back(key);
      t.entries.emplace(std::move(key), std::move(e));
    }
  } catch (const std::bad_alloc&) {
    Py_DECREF(on_error);  // (an entry it would have named is not in the table)
    for (PyObject* o : dropped) Py_DECREF(o);
    return PyErr_NoMemory();
  }
  for (PyObject* o : dropped) Py_DECREF(o);
  Py_RETURN_TRUE;
}

// launch(argv) -> bool: launched a call validated before, or False (validate it).
PyObject* launch(PyObject*, PyObject* argv) {
  if (!PyTuple_Check(argv)) {
    PyErr_SetString(PyExc_TypeError, "launch: expected the arguments as a tuple");
    return nullptr;
  }
  Table& t = table();
  if (t.entries.empty()) Py_RETURN_FALSE;
  if (t.get_device == nullptr || t.get_stream == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "launch: configure() was not called");
    return nullptr;
  }
  std::string key;
  std::vector<intptr_t> ptrs;
  if (!signature(argv, key, ptrs)) Py_RETURN_FALSE;
  auto it = t.entries.find(key);
  if (it == t.entries.end()) Py_RETURN_FALSE;
  // Everything the launch needs is copied out before Python runs again (the stream and
  // device getters), which could bind or clear and so move or free the entry.
  const Entry& e = it->second;
  std::string args;
  try {
    args = e.tmpl;
  } catch (const std::bad_alloc&) {
    return PyErr_NoMemory();
  }
  for (const auto& [word, arg] : e.slots) {
    const uint64_t p = static_cast<uint64_t>(ptrs[static_cast<size_t>(arg)]);
    std::memcpy(&args[static_cast<size_t>(word) * 8], &p, sizeof(p));
  }
  const LaunchFn fn = e.fn;
  const int device = e.device;
  PyObject* on_error = e.on_error;
  Py_INCREF(on_error);
  const long long dev = call_long(t.get_device, nullptr);
  if (dev != device) {  // an error, or another current device: the Python path switches
    Py_DECREF(on_error);
    if (PyErr_Occurred()) return nullptr;
    Py_RETURN_FALSE;
  }
  PyObject* idx = PyLong_FromLong(device);
  const long long stream = idx ? call_long(t.get_stream, idx) : -1;
  Py_XDECREF(idx);
  if (PyErr_Occurred()) {
    Py_DECREF(on_error);
    return nullptr;
  }
  int code = 0;
  Py_BEGIN_ALLOW_THREADS  // as ctypes does: a launch may block on a full queue
  code = fn(args.data(), reinterpret_cast<void*>(static_cast<intptr_t>(stream)));
  Py_END_ALLOW_THREADS
  PyObject* r = code != 0 ? PyObject_CallFunction(on_error, "i", code) : Py_None;
  Py_DECREF(on_error);
  if (r == nullptr) return nullptr;
  if (code != 0) Py_DECREF(r);
  Py_RETURN_TRUE;
}

// size() -> entries held; clear(): forget them all.
PyObject* size(PyObject*, PyObject*) { return PyLong_FromSize_t(table().entries.size()); }

PyObject* clear(PyObject*, PyObject*) {
  Table& t = table();
  std::vector<PyObject*> held;
  for (auto& kv : t.entries) held.push_back(kv.second.on_error);
  t.entries.clear();
  t.order.clear();
  for (PyObject* o : held) Py_DECREF(o);  // after: a finalizer may use the table
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
    {"configure", configure, METH_VARARGS, "configure(get_device, get_stream, capacity)"},
    {"bind", bind, METH_VARARGS, "bind(argv, template, slots, fn, device, on_error) -> bool"},
    {"launch", launch, METH_O, "launch(argv) -> bool"},
    {"size", size, METH_NOARGS, "size() -> int"},
    {"clear", clear, METH_NOARGS, "clear()"},
    {nullptr, nullptr, 0, nullptr},
};

// torch's builder passes the module's name as -DTORCH_EXTENSION_NAME=<name>.
#define KVF_STR2(x) #x
#define KVF_STR(x) KVF_STR2(x)
#define KVF_CONCAT2(a, b) a##b
#define KVF_CONCAT(a, b) KVF_CONCAT2(a, b)

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, KVF_STR(TORCH_EXTENSION_NAME), nullptr, -1, kMethods,
                       nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC KVF_CONCAT(PyInit_, TORCH_EXTENSION_NAME)() { return PyModule_Create(&kModule); }
