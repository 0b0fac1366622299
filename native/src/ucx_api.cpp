#include "ucx_api.h"

#include <dlfcn.h>

#include <mutex>

#include "common.h"

namespace lmt {

namespace {

std::mutex g_mu;
UcxApi g_api{};
bool g_loaded = false;
std::string g_version;

template <class Fn>
void resolve(void* handle, const char* name, Fn* out, bool required) {
  void* sym = dlsym(handle, name);
  if (sym == nullptr && required)
    fail(std::string("ucx transport: libucp has no ") + name + " (too old a UCX?): pip install 'lightning-megatron[ucx]'");
  *out = reinterpret_cast<Fn>(sym);
}

}  // namespace

std::string ucx_load(const std::string& ucp_path) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_loaded) return g_version;
  // RTLD_LOCAL: UCX's symbols stay out of the global namespace (another copy of UCX in the process, loaded by
  // someone else, keeps its own). The handle is never closed: UCX keeps process-wide state.
  void* handle = dlopen(ucp_path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    fail("ucx transport: cannot load " + ucp_path + " (" + (why ? why : "unknown error") +
         "); install the UCX libraries: pip install 'lightning-megatron[ucx]'");
  }
  UcxApi api{};
  resolve(handle, "ucp_config_read", &api.config_read, true);
  resolve(handle, "ucp_config_modify", &api.config_modify, true);
  resolve(handle, "ucp_config_release", &api.config_release, true);
  resolve(handle, "ucp_init_version", &api.init_version, true);
  resolve(handle, "ucp_cleanup", &api.cleanup, true);
  resolve(handle, "ucp_get_version_string", &api.version_string, true);
  resolve(handle, "ucp_worker_create", &api.worker_create, true);
  resolve(handle, "ucp_worker_destroy", &api.worker_destroy, true);
  resolve(handle, "ucp_worker_query", &api.worker_query, true);
  resolve(handle, "ucp_worker_get_address", &api.worker_get_address, true);
  resolve(handle, "ucp_worker_release_address", &api.worker_release_address, true);
  resolve(handle, "ucp_worker_set_am_recv_handler", &api.worker_set_am_recv_handler, true);
  resolve(handle, "ucp_worker_progress", &api.worker_progress, true);
  resolve(handle, "ucp_worker_get_efd", &api.worker_get_efd, true);
  resolve(handle, "ucp_worker_arm", &api.worker_arm, true);
  resolve(handle, "ucp_ep_create", &api.ep_create, true);
  resolve(handle, "ucp_ep_close_nbx", &api.ep_close_nbx, true);
  resolve(handle, "ucp_ep_query", &api.ep_query, false);
  resolve(handle, "ucp_am_send_nbx", &api.am_send_nbx, true);
  resolve(handle, "ucp_am_recv_data_nbx", &api.am_recv_data_nbx, true);
  resolve(handle, "ucp_am_data_release", &api.am_data_release, true);
  resolve(handle, "ucp_request_check_status", &api.request_check_status, true);
  resolve(handle, "ucp_request_free", &api.request_free, true);
  resolve(handle, "ucs_status_string", &api.status_string, true);  // libucs, a dependency: found through the handle
  using GetVersion = void (*)(unsigned*, unsigned*, unsigned*);
  GetVersion get_version = nullptr;
  resolve(handle, "ucp_get_version", &get_version, true);
  unsigned major = 0, minor = 0, release = 0;
  get_version(&major, &minor, &release);
  if (major != UCP_API_MAJOR || minor < kUcpMinMinor)
    fail("ucx transport: UCX " + std::to_string(major) + "." + std::to_string(minor) + " at " + ucp_path +
         " is too old (needs 1." + std::to_string(kUcpMinMinor) + "+): pip install 'lightning-megatron[ucx]'");
  g_api = api;
  g_version = api.version_string();
  g_loaded = true;
  return g_version;
}

const UcxApi& ucx_api() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_loaded) fail("ucx transport: UCX is not loaded (pip install 'lightning-megatron[ucx]')");
  return g_api;
}

bool ucx_loaded() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_loaded;
}

}  // namespace lmt
