#pragma once
// How an op is declared: once, as a struct of named fields, by FLUX8_OP.
//
//   FLUX8_OP(Linear, linear, void, (Tensor, y), (Tensor, x), (Tensor, w), (Tensor, b))
//
// makes the aggregate `op::Linear { Tensor y, x, w, b; }` with
//   name          "linear": the op's name in errors, profiles and graph signatures;
//   result_type   what the op returns to the host (void, or double for the sums it reads back);
//   field_names   {"y", "x", "w", "b"};
//   fields()      a tuple of references to the fields, in declaration order.
// Everything else is derived from fields(): the positional call `ops.linear(y, x, w, b)`
// (backend/ops.h), the CPU and CUDA dispatch (`execute(const op::Linear&)`), the graph
// recorder's signature of a call (backend/step_graph.cpp) and the profiler's row names. A field
// type must not contain a top-level comma (use an alias).
#include <array>
#include <cstddef>
#include <initializer_list>
#include <span>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// ---- FLUX8_OP_FOR_EACH(M, a, b, ...): M(a) M(b) ... for up to 20 arguments ------------------------
#define FLUX8_OP_CAT_(a, b) a##b
#define FLUX8_OP_CAT(a, b) FLUX8_OP_CAT_(a, b)
#define FLUX8_OP_NARG_(_1, _2, _3, _4, _5, _6, _7, _8, _9, _10, _11, _12, _13, _14, _15, _16, _17, _18, _19, _20, N, \
                       ...)                                                                                          \
  N
#define FLUX8_OP_NARG(...) \
  FLUX8_OP_NARG_(__VA_ARGS__, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1)
#define FLUX8_OP_FE_1(M, a) M(a)
#define FLUX8_OP_FE_2(M, a, ...) M(a) FLUX8_OP_FE_1(M, __VA_ARGS__)
#define FLUX8_OP_FE_3(M, a, ...) M(a) FLUX8_OP_FE_2(M, __VA_ARGS__)
#define FLUX8_OP_FE_4(M, a, ...) M(a) FLUX8_OP_FE_3(M, __VA_ARGS__)
#define FLUX8_OP_FE_5(M, a, ...) M(a) FLUX8_OP_FE_4(M, __VA_ARGS__)
#define FLUX8_OP_FE_6(M, a, ...) M(a) FLUX8_OP_FE_5(M, __VA_ARGS__)
#define FLUX8_OP_FE_7(M, a, ...) M(a) FLUX8_OP_FE_6(M, __VA_ARGS__)
#define FLUX8_OP_FE_8(M, a, ...) M(a) FLUX8_OP_FE_7(M, __VA_ARGS__)
#define FLUX8_OP_FE_9(M, a, ...) M(a) FLUX8_OP_FE_8(M, __VA_ARGS__)
#define FLUX8_OP_FE_10(M, a, ...) M(a) FLUX8_OP_FE_9(M, __VA_ARGS__)
#define FLUX8_OP_FE_11(M, a, ...) M(a) FLUX8_OP_FE_10(M, __VA_ARGS__)
#define FLUX8_OP_FE_12(M, a, ...) M(a) FLUX8_OP_FE_11(M, __VA_ARGS__)
#define FLUX8_OP_FE_13(M, a, ...) M(a) FLUX8_OP_FE_12(M, __VA_ARGS__)
#define FLUX8_OP_FE_14(M, a, ...) M(a) FLUX8_OP_FE_13(M, __VA_ARGS__)
#define FLUX8_OP_FE_15(M, a, ...) M(a) FLUX8_OP_FE_14(M, __VA_ARGS__)
#define FLUX8_OP_FE_16(M, a, ...) M(a) FLUX8_OP_FE_15(M, __VA_ARGS__)
#define FLUX8_OP_FE_17(M, a, ...) M(a) FLUX8_OP_FE_16(M, __VA_ARGS__)
#define FLUX8_OP_FE_18(M, a, ...) M(a) FLUX8_OP_FE_17(M, __VA_ARGS__)
#define FLUX8_OP_FE_19(M, a, ...) M(a) FLUX8_OP_FE_18(M, __VA_ARGS__)
#define FLUX8_OP_FE_20(M, a, ...) M(a) FLUX8_OP_FE_19(M, __VA_ARGS__)
#define FLUX8_OP_FOR_EACH(M, ...) FLUX8_OP_CAT(FLUX8_OP_FE_, FLUX8_OP_NARG(__VA_ARGS__))(M, __VA_ARGS__)

// ---- one (type, name) pair --------------------------------------------------------------------
#define FLUX8_OP_FIELD_(type, name) type name{};
#define FLUX8_OP_FIELD(pair) FLUX8_OP_FIELD_ pair
#define FLUX8_OP_FIELD_NAME_(type, name) #name,
#define FLUX8_OP_FIELD_NAME(pair) FLUX8_OP_FIELD_NAME_ pair
#define FLUX8_OP_FIELD_TIE_(type, name) std::tie(name),
#define FLUX8_OP_FIELD_TIE(pair) FLUX8_OP_FIELD_TIE_ pair

#define FLUX8_OP(Type, op_name, Result, ...)                                                                          \
  struct Type {                                                                                                       \
    using result_type = Result;                                                                                       \
    static constexpr std::string_view name = #op_name;                                                                \
    FLUX8_OP_FOR_EACH(FLUX8_OP_FIELD, __VA_ARGS__)                                                                    \
    static constexpr std::array field_names{FLUX8_OP_FOR_EACH(FLUX8_OP_FIELD_NAME, __VA_ARGS__)};                     \
    auto fields() { return std::tuple_cat(FLUX8_OP_FOR_EACH(FLUX8_OP_FIELD_TIE, __VA_ARGS__) std::tuple<>{}); }       \
    auto fields() const { return std::tuple_cat(FLUX8_OP_FOR_EACH(FLUX8_OP_FIELD_TIE, __VA_ARGS__) std::tuple<>{}); } \
  };

namespace flux8 {

namespace op {
// True for an op whose implementation waits for the host (it synchronises): a graph recorder runs
// it at once instead of recording it. Specialised next to such an op's declaration.
template <typename Op>
inline constexpr bool waits_for_host = false;
}  // namespace op

// A list argument an op keeps by value (a recorded call owns its arguments: the caller's array
// may be gone, or hold something else, when the call runs). Built from a span, a vector or a
// braced list; read as a span.
template <typename T>
struct List : std::vector<T> {
  List() = default;
  template <typename R>
  requires std::is_convertible_v<const R&, std::span<const T>> List(const R& items) {
    const std::span<const T> s = items;
    this->assign(s.begin(), s.end());
  }
  List(std::initializer_list<T> items) : std::vector<T>(items) {}
  operator std::span<const T>() const { return {this->data(), this->size()}; }
};

// fn(name, field) for every field of an op or of an argument struct that has fields() and
// field_names, in declaration order. (No lambda inside: an inline function's closure types are
// not guaranteed to agree between nvcc and the host compiler, backend/device.h.)
namespace detail {
template <typename S, typename Refs, typename Fn, size_t... I>
void for_each_field_at(Refs&& refs, Fn& fn, std::index_sequence<I...>) {
  (fn(std::string_view(std::remove_cvref_t<S>::field_names[I]), std::get<I>(refs)), ...);
}
}  // namespace detail
template <typename S, typename Fn>
void for_each_field(S& s, Fn&& fn) {
  detail::for_each_field_at<S>(s.fields(), fn, std::make_index_sequence<std::remove_cvref_t<S>::field_names.size()>{});
}

}  // namespace flux8

// ---- argument structs (the ops' compound fields) ---------------------------------------------------
// FLUX8_FIELDS(a, b, c) inside an aggregate gives it field_names and fields() like an op's, so
// signatures and checks read it field by field; FLUX8_CHECK_FIELDS(T) after it fails the build when
// a field is missing from the list.
#define FLUX8_FIELDS_NAME_(name) #name,
#define FLUX8_FIELDS(...)                                                                      \
  static constexpr std::array field_names{FLUX8_OP_FOR_EACH(FLUX8_FIELDS_NAME_, __VA_ARGS__)}; \
  auto fields() { return std::tie(__VA_ARGS__); }                                              \
  auto fields() const { return std::tie(__VA_ARGS__); }
#define FLUX8_CHECK_FIELDS(T)                                                                                      \
  static_assert(::flux8::aggregate_field_count<T>() == T::field_names.size(), #T ": FLUX8_FIELDS must list every " \
                                                                                 "field")

namespace flux8 {
namespace detail {
// Converts to anything: counts an aggregate's fields by how many initialisers it accepts.
struct AnyField {
  template <typename T>
  operator T() const;
};
template <typename T, typename... A>
concept BraceConstructible = requires {
  T{std::declval<A>()...};
};
template <typename T, size_t... I>
constexpr bool constructs_from_seq(std::index_sequence<I...>) {
  return BraceConstructible<T, decltype((void)I, AnyField{})...>;
}
template <typename T, size_t N>
constexpr bool constructs_from() {
  return constructs_from_seq<T>(std::make_index_sequence<N>{});
}
}  // namespace detail

template <typename T, size_t N = 0>
constexpr size_t aggregate_field_count() {
  if constexpr (N < 32 && detail::constructs_from<T, N + 1>())
    return aggregate_field_count<T, N + 1>();
  else
    return N;
}

}  // namespace flux8
