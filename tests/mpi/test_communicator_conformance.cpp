#include "test_communicator_conformance.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>
#include <vector>

#include "backend_buffer.h"
#include "core/dtype.h"
#include "core/error.h"

namespace flux8::testing {

namespace {

// Odd counts: one element, fewer than a vector's width, and a large prime (no chunking divides it).
const int64_t kCounts[] = {1, 7, 1000003};
const DType kReduceTypes[] = {DType::f64, DType::f32, DType::bf16};
const DType kMoveTypes[] = {DType::f64, DType::f32, DType::bf16, DType::u8};

// Element i of rank r's input `salt`: an integer in [-11, 11] (bytes: [0, 250]), so a sum over a
// few ranks is exact even in bf16.
double value(int rank, int64_t i, int salt, DType t) {
  const int64_t k = (i * 7 + rank * 13 + salt * 5) % (t == DType::u8 ? 251 : 23);
  return static_cast<double>(t == DType::u8 ? k : k - 11);
}

std::vector<uint8_t> encode(const std::vector<double>& v, DType t) {
  std::vector<uint8_t> bytes(v.size() * dtype_size(t));
  if (t == DType::u8)
    for (size_t i = 0; i < v.size(); ++i) bytes[i] = static_cast<uint8_t>(v[i]);
  else
    convert_elements(v.data(), DType::f64, v.size(), t, bytes.data());
  return bytes;
}

void upload(Backend& be, const Tensor& t, const std::vector<double>& v) {
  const std::vector<uint8_t> bytes = encode(v, t.dtype);
  be.upload(t.data, bytes.data(), bytes.size());
}

std::vector<double> download(Backend& be, const Tensor& t) {
  std::vector<uint8_t> bytes(t.bytes());
  be.download(bytes.data(), t.data, bytes.size());
  std::vector<double> v(static_cast<size_t>(t.numel()));
  if (t.dtype == DType::u8)
    for (size_t i = 0; i < v.size(); ++i) v[i] = bytes[i];
  else
    convert_elements(bytes.data(), t.dtype, v.size(), DType::f64, v.data());
  return v;
}

std::vector<double> input(int rank, int64_t n, int salt, DType t) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = value(rank, i, salt, t);
  return v;
}

// Every mismatch counted, the first one described.
void expect_equal(const std::vector<double>& got, const std::vector<double>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t wrong = 0, first = -1;
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i] && wrong++ == 0) first = static_cast<int64_t>(i);
  EXPECT_EQ(wrong, 0) << what << ": first wrong element " << first << " is "
                      << (first >= 0 ? got[static_cast<size_t>(first)] : 0) << ", expected "
                      << (first >= 0 ? want[static_cast<size_t>(first)] : 0);
}

std::string label(const Communicator& c, const char* op, DType t, int64_t n) {
  return fmt::format("{} {} of {} x {} (rank {} of {})", c.describe(), op, n, dtype_name(t), c.rank(), c.size());
}

}  // namespace

std::string kind_name(const ::testing::TestParamInfo<CommunicatorKind>& info) { return info.param.name; }

void CommunicatorConformance::SetUp() {
  if (const std::string why = GetParam().unavailable(); !why.empty()) GTEST_SKIP() << why;
  be = &GetParam().backend();
  comm = GetParam().make(*be);
  ASSERT_TRUE(comm);
}

TEST_P(CommunicatorConformance, AllReduceSumAndMax) {
  const int size = comm->size();
  for (DType t : kReduceTypes)
    for (int64_t n : kCounts)
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::max}) {
        BackendBuffer buf(*be, t, n);
        upload(*be, buf.t, input(comm->rank(), n, 1, t));
        comm->all_reduce(buf.t, op);
        std::vector<double> want(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) {
          double acc = value(0, i, 1, t);
          for (int r = 1; r < size; ++r)
            acc = op == ReduceOp::sum ? acc + value(r, i, 1, t) : std::max(acc, value(r, i, 1, t));
          want[static_cast<size_t>(i)] = acc;
        }
        expect_equal(download(*be, buf.t), want,
                     label(*comm, op == ReduceOp::sum ? "all_reduce sum" : "all_reduce max", t, n));
      }
}

TEST_P(CommunicatorConformance, ReduceScatterSumsEachRanksSlice) {
  const int size = comm->size(), rank = comm->rank();
  for (DType t : kReduceTypes)
    for (int64_t n : kCounts) {
      BackendBuffer in(*be, t, n * size), out(*be, t, n);
      upload(*be, in.t, input(rank, n * size, 2, t));
      comm->reduce_scatter(out.t, in.t);
      std::vector<double> want(static_cast<size_t>(n), 0.0);
      for (int r = 0; r < size; ++r)
        for (int64_t i = 0; i < n; ++i) want[static_cast<size_t>(i)] += value(r, rank * n + i, 2, t);
      expect_equal(download(*be, out.t), want, label(*comm, "reduce_scatter", t, n));
    }
}

TEST_P(CommunicatorConformance, ReduceSumsOnTheRootAndLeavesTheOthers) {
  const int size = comm->size(), rank = comm->rank();
  for (int root = 0; root < size; ++root)
    for (DType t : kReduceTypes)
      for (int64_t n : kCounts) {
        BackendBuffer buf(*be, t, n);
        const std::vector<double> mine = input(rank, n, 8 + root, t);
        upload(*be, buf.t, mine);
        comm->reduce(buf.t, root);
        std::vector<double> want = mine;
        if (rank == root)
          for (int64_t i = 0; i < n; ++i) {
            double acc = value(0, i, 8 + root, t);
            for (int r = 1; r < size; ++r) acc += value(r, i, 8 + root, t);
            want[static_cast<size_t>(i)] = acc;
          }
        expect_equal(
            download(*be, buf.t), want,
            label(*comm, fmt::format("reduce to {}{}", root, rank == root ? "" : " (not the root)").c_str(), t, n));
      }
}

TEST_P(CommunicatorConformance, AllGatherOutOfPlaceAndInPlace) {
  const int size = comm->size(), rank = comm->rank();
  for (DType t : kMoveTypes)
    for (int64_t n : kCounts) {
      std::vector<double> want;
      for (int r = 0; r < size; ++r) {
        const std::vector<double> part = input(r, n, 3, t);
        want.insert(want.end(), part.begin(), part.end());
      }
      BackendBuffer in(*be, t, n), out(*be, t, n * size);
      upload(*be, in.t, input(rank, n, 3, t));
      comm->all_gather(out.t, in.t);
      expect_equal(download(*be, out.t), want, label(*comm, "all_gather", t, n));

      // In place: this rank's part already sits in its slice of out; the rest holds stale values.
      BackendBuffer whole(*be, t, n * size);
      std::vector<double> stale(static_cast<size_t>(n * size), 1.0);
      const std::vector<double> mine = input(rank, n, 3, t);
      std::copy(mine.begin(), mine.end(), stale.begin() + rank * n);
      upload(*be, whole.t, stale);
      const Tensor slice(static_cast<uint8_t*>(whole.mem) + static_cast<size_t>(rank * n) * dtype_size(t), t, Shape{n});
      comm->all_gather(whole.t, slice);
      expect_equal(download(*be, whole.t), want, label(*comm, "all_gather in place", t, n));
    }
}

TEST_P(CommunicatorConformance, BroadcastFromEveryRoot) {
  for (int root = 0; root < comm->size(); ++root)
    for (DType t : kMoveTypes)
      for (int64_t n : kCounts) {
        BackendBuffer buf(*be, t, n);
        upload(*be, buf.t, input(comm->rank(), n, 4, t));
        comm->broadcast(buf.t, root);
        expect_equal(download(*be, buf.t), input(root, n, 4, t),
                     label(*comm, fmt::format("broadcast from {}", root).c_str(), t, n));
      }
}

TEST_P(CommunicatorConformance, SizeMismatchFailsNamingTheGroup) {
  BackendBuffer in(*be, DType::f32, 5), out(*be, DType::f32, 5 * comm->size() + 1);
  try {
    comm->all_gather(out.t, in.t);
    ADD_FAILURE() << comm->describe() << ": all_gather into " << out.t.str() << " from " << in.t.str() << " passed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(comm->describe()), std::string::npos) << e.what();
  }
  try {
    comm->broadcast(in.t, comm->size());
    ADD_FAILURE() << comm->describe() << ": broadcast from rank " << comm->size() << " passed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(comm->describe()), std::string::npos) << e.what();
  }
}

TEST_P(CommunicatorConformance, BarrierWaitsForEveryRank) {
  // Rank 0 names a folder; each rank leaves a mark there, later the higher its rank, then passes
  // the barrier and must find every rank's mark.
  BackendBuffer name_bytes(*be, DType::u8, 256);
  std::string folder;
  if (comm->rank() == 0) {
    folder =
        (std::filesystem::temp_directory_path() /
         fmt::format("flux8_barrier_{}_{}", ::getpid(), std::chrono::steady_clock::now().time_since_epoch().count()))
            .string();
    std::filesystem::create_directories(folder);
  }
  std::vector<uint8_t> bytes(256, 0);
  std::memcpy(bytes.data(), folder.data(), std::min<size_t>(folder.size(), 255));
  be->upload(name_bytes.mem, bytes.data(), bytes.size());
  comm->broadcast(name_bytes.t, 0);
  be->download(bytes.data(), name_bytes.mem, bytes.size());
  folder = reinterpret_cast<const char*>(bytes.data());
  std::this_thread::sleep_for(std::chrono::milliseconds(80 * comm->rank()));
  std::ofstream(std::filesystem::path(folder) / fmt::format("rank_{}", comm->rank())) << "here";
  comm->barrier();
  for (int r = 0; r < comm->size(); ++r)
    EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(folder) / fmt::format("rank_{}", r)))
        << comm->describe() << ": rank " << comm->rank() << " passed the barrier before rank " << r << " reached it";
  comm->barrier();  // every rank has looked before the folder goes
  if (comm->rank() == 0) std::filesystem::remove_all(folder);
}

TEST_P(CommunicatorConformance, SumsOfRandomValuesRepeatBitForBitOnEveryRank) {
  const int64_t n = 1000003;
  std::vector<float> values(static_cast<size_t>(n));
  std::mt19937 rng(1234u + static_cast<unsigned>(comm->rank()));
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (float& v : values) v = uniform(rng);
  std::vector<std::vector<uint8_t>> runs;
  for (int run = 0; run < 2; ++run) {
    BackendBuffer buf(*be, DType::f32, n);
    be->upload(buf.mem, values.data(), buf.t.bytes());
    comm->all_reduce(buf.t);
    runs.emplace_back(buf.t.bytes());
    be->download(runs.back().data(), buf.mem, buf.t.bytes());
  }
  EXPECT_TRUE(runs[0] == runs[1]) << comm->describe() << ": two all-reduces of the same f32 values differ";
  // Every rank must hold the same sum (data-parallel replicas stay identical).
  const int64_t bytes = n * 4;
  BackendBuffer mine(*be, DType::u8, bytes), all(*be, DType::u8, bytes * comm->size());
  be->upload(mine.mem, runs[0].data(), runs[0].size());
  comm->all_gather(all.t, mine.t);
  std::vector<uint8_t> gathered(all.t.bytes());
  be->download(gathered.data(), all.mem, gathered.size());
  for (int r = 0; r < comm->size(); ++r)
    EXPECT_TRUE(std::equal(runs[0].begin(), runs[0].end(), gathered.begin() + r * bytes))
        << comm->describe() << ": rank " << r << "'s sum differs from rank " << comm->rank() << "'s";
}

TEST_P(CommunicatorConformance, AsyncCollectivesSeeEarlierOpsAndJoinOrdersLaterOnes) {
  const int size = comm->size(), rank = comm->rank();
  const int64_t n = 1000003;
  BackendBuffer src(*be, DType::f32, n), a(*be, DType::f32, n), b(*be, DType::f32, n),
      gathered(*be, DType::f32, n * size), scattered(*be, DType::f32, n), wide(*be, DType::f32, n * size),
      after(*be, DType::f32, n), rooted(*be, DType::f32, n), rooted_after(*be, DType::f32, n);
  const int root = size - 1;
  upload(*be, src.t, input(rank, n, 6, DType::f32));
  upload(*be, wide.t, input(rank, n * size, 7, DType::f32));
  // The inputs are written by ops queued just before each collective: no synchronisation between.
  be->copy(a.t, src.t);
  comm->all_reduce(a.t, ReduceOp::sum, true);
  be->copy(b.t, src.t);
  comm->all_gather(gathered.t, b.t, true);
  comm->reduce_scatter(scattered.t, wide.t, true);
  be->copy(rooted.t, src.t);
  comm->reduce(rooted.t, root, true);
  comm->join();
  be->copy(after.t, a.t);  // queued after join(): sees the sum
  be->copy(rooted_after.t, rooted.t);

  std::vector<double> sum(static_cast<size_t>(n), 0.0), scatter(static_cast<size_t>(n), 0.0), gather;
  for (int r = 0; r < size; ++r) {
    const std::vector<double> part = input(r, n, 6, DType::f32);
    gather.insert(gather.end(), part.begin(), part.end());
    for (int64_t i = 0; i < n; ++i) {
      sum[static_cast<size_t>(i)] += part[static_cast<size_t>(i)];
      scatter[static_cast<size_t>(i)] += value(r, rank * n + i, 7, DType::f32);
    }
  }
  expect_equal(download(*be, after.t), sum, label(*comm, "async all_reduce, then join", DType::f32, n));
  expect_equal(download(*be, gathered.t), gather, label(*comm, "async all_gather, then join", DType::f32, n));
  expect_equal(download(*be, scattered.t), scatter, label(*comm, "async reduce_scatter, then join", DType::f32, n));
  expect_equal(download(*be, rooted_after.t), rank == root ? sum : input(rank, n, 6, DType::f32),
               label(*comm, "async reduce, then join", DType::f32, n));
}

}  // namespace flux8::testing
