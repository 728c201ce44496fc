#include "backend/ops.h"

#include <type_traits>

#include "core/error.h"

namespace flux8 {

std::string_view op_name(const AnyOp& op) {
  return std::visit(
      []<typename Op>(const Op&) -> std::string_view {
        if constexpr (std::is_same_v<Op, std::monostate>)
          return "";
        else
          return Op::name;
      },
      op);
}

std::string_view host_access_name(HostAccess what) {
  switch (what) {
    case HostAccess::release: return "release";
    case HostAccess::upload: return "upload";
    case HostAccess::download: return "download";
    case HostAccess::synchronize: return "synchronize";
    case HostAccess::record_event: return "record_event";
    case HostAccess::wait_event: return "wait_event";
    case HostAccess::timing_mark: return "timing_mark";
  }
  return "?";
}

double Ops::execute_any(const AnyOp& op) {
  struct Inside {  // ops the implementation calls run at once, however it ends
    bool& flag;
    bool was;
    explicit Inside(bool& f) : flag(f), was(f) { flag = true; }
    ~Inside() { flag = was; }
  } inside(inside_interceptor_);
  return std::visit(
      [this]<typename Op>(const Op& o) -> double {
        if constexpr (std::is_same_v<Op, std::monostate>) {
          fail("execute_any: an empty op");
        } else if constexpr (std::is_void_v<typename Op::result_type>) {
          execute(o);
          return 0.0;
        } else {
          return static_cast<double>(execute(o));
        }
      },
      op);
}

void Ops::set_interceptor(OpInterceptor* interceptor) {
  if (interceptor && interceptor_ && interceptor != interceptor_)
    fail("an op interceptor is installed already (graphs and the per-op profiler do not combine)");
  interceptor_ = interceptor;
}

}  // namespace flux8
