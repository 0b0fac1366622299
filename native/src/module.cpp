// Python bindings: lightning_megatron.transport._native. Buffers cross the boundary as (address, bytes),
// never as torch objects, so the module does not link against torch and one build works with any torch.
// Every call that can block or copy releases the GIL; blocking waits run in short slices and check for
// Ctrl-C between them, so KeyboardInterrupt is never stuck behind a receive.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "buffer_pool.h"
#include "common.h"
#include "mailbox.h"
#include "rdma_channel.h"
#include "ring.h"
#include "shm_channel.h"
#include "tcp_channel.h"
#include "ucx_channel.h"

namespace py = pybind11;
using namespace lmt;

namespace {

// TransportError / PeerLost / TransportTimeout from lightning_megatron.transport.base (looked up when first
// raised, so importing the extension does not import torch).
PyObject* error_class(ErrKind kind) {
  try {
    py::module_ base = py::module_::import("lightning_megatron.transport.base");
    const char* name = kind == ErrKind::PeerLost ? "PeerLost" : kind == ErrKind::Timeout ? "TransportTimeout" : "TransportError";
    return py::object(base.attr(name)).release().ptr();  // leaked on purpose: one reference per raise is harmless
  } catch (py::error_already_set&) {
    PyErr_Clear();
    return kind == ErrKind::Timeout ? PyExc_TimeoutError : PyExc_RuntimeError;
  }
}

// Run `step(slice)` with the GIL released until it returns true or `timeout` passes; between slices check for
// signals (raises KeyboardInterrupt). Returns whether step succeeded.
template <class Step>
bool blocking(double timeout, Step step) {
  const double deadline = now_s() + timeout;
  while (true) {
    const double left = deadline - now_s();
    bool ok;
    {
      py::gil_scoped_release release;
      ok = step(std::max(0.0, std::min(left, 0.05)));
    }
    if (ok) return true;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    if (now_s() >= deadline) return false;
  }
}

py::object message_to_python(Message& msg) {
  py::object payload = py::none();
  if (msg.payload && msg.payload->size > 0) payload = py::cast(msg.payload);
  return py::make_tuple(py::bytes(msg.header), payload);
}

py::object any_to_python(size_t index, Message& msg) {
  py::object payload = py::none();
  if (msg.payload && msg.payload->size > 0) payload = py::cast(msg.payload);
  return py::make_tuple(index, py::bytes(msg.header), payload);
}

// Wait-any keys come from Python: an empty list would wait for nothing, a bad rank would index past the peers.
void check_keys(Engine& e, const std::vector<std::pair<int, uint64_t>>& keys) {
  if (keys.empty()) throw py::value_error(e.label() + ": take_any/wait_take_any need at least one (peer, tag) key");
  for (const auto& key : keys)
    if (key.first < 0 || key.first >= e.world_size() || key.first == e.rank())
      throw py::value_error(e.label() + ": rank " + std::to_string(key.first) + " in the keys is not a peer");
}

const uint8_t* as_ptr(uintptr_t address) { return reinterpret_cast<const uint8_t*>(address); }

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "lightning_megatron's native tensor transports (shared memory, TCP, RDMA, UCX); see native/README.md";
  m.attr("HAVE_IBVERBS") = rdma_compiled();
  m.attr("FRAME_BYTES") = 24;

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      PyErr_SetString(error_class(e.kind), e.what());
    }
  });

  m.def("set_spin_seconds", &Ring::set_spin_seconds,
        "How long ring waits spin before sleeping on the futex (default 20e-6 s).");
  m.def("size_class", &BufferPool::size_class);

  py::class_<Block, std::shared_ptr<Block>>(m, "Buffer", py::buffer_protocol(),
                                              "Received bytes; returns to the receive pool when released.")
      .def_buffer([](Block& b) {
        return py::buffer_info(b.data, 1, py::format_descriptor<uint8_t>::format(), 1, {py::ssize_t(b.size)}, {1}, false);
      })
      .def("__len__", [](const Block& b) { return b.size; })
      .def_property_readonly("address", [](const Block& b) { return reinterpret_cast<uintptr_t>(b.data); })
      .def_property_readonly("capacity", [](const Block& b) { return b.capacity; });

  py::class_<SendOp, SendOpPtr>(m, "SendOp")
      .def_property_readonly("finished", &SendOp::finished, "Done or failed (never raises).")
      .def("done", &SendOp::done, "Whether the data has left the source buffer; raises if the send failed.")
      .def(
          "wait", [](SendOp& op, double timeout) { return blocking(timeout, [&](double s) { return op.wait(s); }); },
          py::arg("timeout"), "Block until done (True) or the timeout (False); raises if the send failed.");

  py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine")
      .def(
          "isend",
          [](Engine& e, int peer, uint64_t tag, py::bytes header, uintptr_t address, size_t nbytes) {
            std::string h = header;
            py::gil_scoped_release release;
            return e.isend(peer, tag, std::move(h), as_ptr(address), nbytes);
          },
          py::arg("peer"), py::arg("tag"), py::arg("header"), py::arg("address"), py::arg("nbytes"),
          "Send nbytes at address (kept alive by the caller until the op is done) with an opaque header.")
      .def(
          "take",
          [](Engine& e, int peer, uint64_t tag) -> py::object {
            Message msg;
            if (!e.mailbox().take(peer, tag, &msg)) return py::none();
            return message_to_python(msg);
          },
          "(header, Buffer | None) of the oldest arrived message for (peer, tag), or None. Never blocks.")
      .def(
          "wait_take",
          [](Engine& e, int peer, uint64_t tag, double timeout) -> py::object {
            Message msg;
            if (!blocking(timeout, [&](double s) { return e.mailbox().wait_take(peer, tag, s, &msg); })) return py::none();
            return message_to_python(msg);
          },
          "Like take, waiting up to timeout seconds (None on timeout).")
      .def(
          "take_any",
          [](Engine& e, const std::vector<std::pair<int, uint64_t>>& keys) -> py::object {
            check_keys(e, keys);
            Message msg;
            size_t index = 0;
            if (!e.mailbox().take_any(keys, &index, &msg)) return py::none();
            return any_to_python(index, msg);
          },
          py::arg("keys"),
          "(index, header, Buffer | None) of the oldest arrived message of the first (peer, tag) in keys that has "
          "one, or None. Never blocks; raises PeerLost if none has arrived and a key's peer is gone.")
      .def(
          "wait_take_any",
          [](Engine& e, const std::vector<std::pair<int, uint64_t>>& keys, double timeout) -> py::object {
            check_keys(e, keys);
            Message msg;
            size_t index = 0;
            if (!blocking(timeout, [&](double s) { return e.mailbox().wait_take_any(keys, s, &index, &msg); }))
              return py::none();
            return any_to_python(index, msg);
          },
          py::arg("keys"), py::arg("timeout"), "Like take_any, waiting up to timeout seconds (None on timeout).")
      .def("pool_stats",
           [](Engine& e) {
             PoolStats s = e.pool().stats();
             py::dict d;
             d["hits"] = s.hits;
             d["misses"] = s.misses;
             d["cached_bytes"] = s.cached_bytes;
             d["live_bytes"] = s.live_bytes;
             return d;
           })
      .def("peer_state", [](Engine& e, int peer) { return int(e.mailbox().state(peer)); },
           "0 unknown, 1 connected, 2 closed by the peer, 3 lost")
      .def("queued", [](Engine& e) { return e.mailbox().queued(); })
      .def("abandon", &Engine::abandon, "After fork, in the child: forget the parent's threads and resources.")
      .def("close", [](Engine& e) {
        py::gil_scoped_release release;
        e.close();
      });

  py::class_<ShmEngine, Engine, std::shared_ptr<ShmEngine>>(m, "ShmEngine")
      .def(py::init([](const std::string& label, int rank, int world, size_t pool_bytes, int copy_threads,
                       size_t inline_bytes, size_t chunk_bytes, size_t streaming_bytes, size_t heap_bytes,
                       size_t heap_min_bytes, size_t copy_slice) {
             ShmOptions o;
             o.copy_slice = copy_slice < 4096 ? 4096 : copy_slice;
             o.streaming_bytes = streaming_bytes;
             o.heap_bytes = heap_bytes;
             o.heap_min_bytes = heap_min_bytes;
             o.pool_bytes = pool_bytes;
             o.copy_threads = copy_threads;
             o.inline_bytes = inline_bytes;
             o.chunk_bytes = chunk_bytes;
             return std::make_shared<ShmEngine>(label, rank, world, o);
           }),
           py::arg("label"), py::arg("rank"), py::arg("world_size"), py::arg("pool_bytes"), py::arg("copy_threads"),
           py::arg("inline_bytes"), py::arg("chunk_bytes"), py::arg("streaming_bytes"), py::arg("heap_bytes"),
           py::arg("heap_min_bytes"), py::arg("copy_slice"))
      .def_property_readonly("received_in_place", &ShmEngine::received_in_place)
      .def_property_readonly("received_streamed", &ShmEngine::received_streamed)
      .def("create_ring", &ShmEngine::create_ring, py::call_guard<py::gil_scoped_release>())
      .def("open_ring", &ShmEngine::open_ring, py::call_guard<py::gil_scoped_release>())
      .def("finish_connect", &ShmEngine::finish_connect, py::call_guard<py::gil_scoped_release>())
      .def("linked_names", &ShmEngine::linked_names);

  py::class_<TcpEngine, Engine, std::shared_ptr<TcpEngine>>(m, "TcpEngine")
      .def(py::init([](const std::string& label, int rank, int world, const std::string& bind_ip, py::bytes token,
                       size_t pool_bytes, int socket_buffer, double handshake_timeout) {
             TcpOptions o;
             o.pool_bytes = pool_bytes;
             o.socket_buffer = socket_buffer;
             o.handshake_timeout = handshake_timeout;
             return std::make_shared<TcpEngine>(label, rank, world, bind_ip, std::string(token), o);
           }),
           py::arg("label"), py::arg("rank"), py::arg("world_size"), py::arg("bind_ip"), py::arg("token"),
           py::arg("pool_bytes"), py::arg("socket_buffer"), py::arg("handshake_timeout"))
      .def_property_readonly("port", &TcpEngine::port)
      .def_property_readonly("rejected", &TcpEngine::rejected)
      .def("expect", &TcpEngine::expect)
      .def(
          "connect_peer",
          [](TcpEngine& e, int peer, const std::string& ip, int port, py::bytes token, double timeout) {
            std::string t = token;
            py::gil_scoped_release release;
            e.connect_peer(peer, ip, port, t, timeout);
          },
          py::arg("peer"), py::arg("ip"), py::arg("port"), py::arg("token"), py::arg("timeout"))
      .def("wait_connected", [](TcpEngine& e, int peer, double timeout) {
        return blocking(timeout, [&](double s) { return e.wait_connected(peer, s); });
      });

  m.def("ucx_load", &ucx_load, py::arg("libucp"), py::call_guard<py::gil_scoped_release>(),
        "dlopen libucp (path or soname) once per process and resolve the UCP API; returns UCX's version.");
  m.def("ucx_loaded", &ucx_loaded);

  py::class_<UcxEngine, Engine, std::shared_ptr<UcxEngine>>(m, "UcxEngine")
      .def(py::init([](const std::string& label, int rank, int world, size_t pool_bytes, double spin_seconds,
                       double close_timeout, const std::vector<std::tuple<std::string, std::string, bool>>& config) {
             UcxOptions o;
             o.pool_bytes = pool_bytes;
             o.spin_seconds = spin_seconds;
             o.close_timeout = close_timeout;
             for (const auto& [name, value, required] : config) o.config.push_back({name, value, required});
             return std::make_shared<UcxEngine>(label, rank, world, o);
           }),
           py::arg("label"), py::arg("rank"), py::arg("world_size"), py::arg("pool_bytes"), py::arg("spin_seconds"),
           py::arg("close_timeout"), py::arg("config"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("address", [](UcxEngine& e) { return py::bytes(e.address()); })
      .def_property_readonly("max_am_header", &UcxEngine::max_am_header)
      .def(
          "connect_peer",
          [](UcxEngine& e, int peer, py::bytes address, int pid, double timeout) {
            std::string a = address;
            py::gil_scoped_release release;
            e.connect_peer(peer, a, pid, timeout);
          },
          py::arg("peer"), py::arg("address"), py::arg("pid"), py::arg("timeout"))
      .def("wait_connected",
           [](UcxEngine& e, int peer, double timeout) {
             return blocking(timeout, [&](double s) { return e.wait_connected(peer, s); });
           })
      .def("transports", &UcxEngine::transports, py::arg("peer"), py::arg("timeout"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "isend_device",
          [](UcxEngine& e, int peer, uint64_t tag, py::bytes header, uintptr_t address, size_t nbytes,
             uint32_t memory_type) {
            std::string h = header;
            py::gil_scoped_release release;
            return e.isend_device(peer, tag, std::move(h), as_ptr(address), nbytes, memory_type);
          },
          py::arg("peer"), py::arg("tag"), py::arg("header"), py::arg("address"), py::arg("nbytes"),
          py::arg("memory_type"), "isend of memory of a ucs_memory_type_t (CUDA: computed already), flagged as such.")
      .def(
          "pull",
          [](UcxEngine& e, int peer, uint64_t token, uintptr_t address, size_t nbytes, uint32_t memory_type) {
            py::gil_scoped_release release;
            return e.pull(peer, token, reinterpret_cast<uint8_t*>(address), nbytes, memory_type);
          },
          py::arg("peer"), py::arg("token"), py::arg("address"), py::arg("nbytes"), py::arg("memory_type"),
          "Receive a deferred device message into address (exactly its length); the op completes when it landed.")
      .def(
          "take_deferred",
          [](UcxEngine& e, int peer, size_t limit) {
            std::vector<std::pair<uint64_t, Message>> taken;
            {
              py::gil_scoped_release release;
              taken = e.take_deferred(peer, limit);
            }
            py::list out;
            for (auto& [tag, msg] : taken) out.append(py::make_tuple(tag, py::bytes(msg.header)));
            return out;
          },
          py::arg("peer"), py::arg("limit"),
          "[(tag, header)] of deferred messages from peer that head their tag's queue, oldest first (at most limit).")
      .def("device_mode", &UcxEngine::device_mode, py::arg("device"), py::arg("flags"),
           py::call_guard<py::gil_scoped_release>(),
           "Progress thread onto the device's primary CUDA context; defer device messages from now on.");

  py::class_<RdmaEngine, Engine, std::shared_ptr<RdmaEngine>>(m, "RdmaEngine")
      .def(py::init([](const std::string& label, int rank, int world, size_t pool_bytes, const std::string& device,
                       int port, int gid_index, size_t slot_bytes, int slots) {
             RdmaOptions o;
             o.pool_bytes = pool_bytes;
             o.device = device;
             o.port = port;
             o.gid_index = gid_index;
             o.slot_bytes = slot_bytes;
             o.slots = slots;
             return std::make_shared<RdmaEngine>(label, rank, world, o);
           }),
           py::arg("label"), py::arg("rank"), py::arg("world_size"), py::arg("pool_bytes"), py::arg("device"),
           py::arg("port"), py::arg("gid_index"), py::arg("slot_bytes"), py::arg("slots"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("device_name", &RdmaEngine::device_name)
      .def("local_info",
           [](RdmaEngine& e, int peer) {
             std::string info;
             {
               py::gil_scoped_release release;  // creates a queue pair, registers memory: milliseconds
               info = e.local_info(peer);
             }
             return py::bytes(info);
           })
      .def("connect_peer", [](RdmaEngine& e, int peer, py::bytes info) {
        std::string s = info;
        py::gil_scoped_release release;
        e.connect_peer(peer, s);
      });
}
