// UCP's C API, resolved at run time. The extension must build and import where UCX is not installed, so it
// compiles against the vendored headers (native/third_party/ucx/include) and never links libucp: ucx_load()
// dlopen()s the library (Python passes the path from the `libucx` wheel, the `ucx` extra) and looks up the
// functions the ucx engine calls into typed pointers, all here. Nothing else in the extension names a ucp_*
// symbol directly; everything goes through ucx_api().
#pragma once

#include <ucp/api/ucp.h>

#include <string>

namespace lmt {

// The API level the ucx engine is written against (active messages with rendezvous receive, ucp_*_nbx, peer
// error handling with keep-alive): libucp must be at least 1.18; newer 1.x libraries keep the ABI (every
// parameter struct has a field mask).
constexpr unsigned kUcpMinMinor = 18;

struct UcxApi {
  decltype(&ucp_config_read) config_read;
  decltype(&ucp_config_modify) config_modify;
  decltype(&ucp_config_release) config_release;
  decltype(&ucp_init_version) init_version;
  decltype(&ucp_cleanup) cleanup;
  decltype(&ucp_get_version_string) version_string;
  decltype(&ucp_worker_create) worker_create;
  decltype(&ucp_worker_destroy) worker_destroy;
  decltype(&ucp_worker_query) worker_query;
  decltype(&ucp_worker_get_address) worker_get_address;
  decltype(&ucp_worker_release_address) worker_release_address;
  decltype(&ucp_worker_set_am_recv_handler) worker_set_am_recv_handler;
  decltype(&ucp_worker_progress) worker_progress;
  decltype(&ucp_worker_get_efd) worker_get_efd;
  decltype(&ucp_worker_arm) worker_arm;
  decltype(&ucp_ep_create) ep_create;
  decltype(&ucp_ep_close_nbx) ep_close_nbx;
  decltype(&ucp_ep_query) ep_query;  // may be null (older libucp): only for introspection
  decltype(&ucp_am_send_nbx) am_send_nbx;
  decltype(&ucp_am_recv_data_nbx) am_recv_data_nbx;
  decltype(&ucp_am_data_release) am_data_release;
  decltype(&ucp_request_check_status) request_check_status;
  decltype(&ucp_request_free) request_free;
  decltype(&ucs_status_string) status_string;
};

// Load libucp from `ucp_path` (a file path or a soname) once per process and resolve the API; returns UCX's
// version string. Throws lmt::Error naming what is missing. Later calls return the first result (the path of a
// later call is ignored: one UCX per process).
std::string ucx_load(const std::string& ucp_path);
// The resolved API; throws if ucx_load() has not succeeded.
const UcxApi& ucx_api();
bool ucx_loaded();

}  // namespace lmt
