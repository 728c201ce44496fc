// `flux8 bench --peer`: tools/peer_bench.py's JSON read (src/bench/peer.h), the ratios of a run to
// the peer where both ran on one device at one shape, and why there is no ratio otherwise.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "bench/peer.h"
#include "test_util.h"

namespace flux8::testing {
namespace {

using nlohmann::json;

// A peer file as tools/peer_bench.py writes it: W1 on an H100 in the three modes, torchao skipped.
json peer_json(const std::string& device = "NVIDIA H100 80GB HBM3") {
  return {{"tool", "tools/peer_bench.py"},
          {"device", device},
          {"versions", {{"python", "3.12.3"}, {"torch", "2.11.0"}, {"diffusers", "0.42.1"}, {"torchao", nullptr}}},
          {"workloads",
           {{{"workload", "W1"},
             {"model", "flux_535m"},
             {"batch", 32},
             {"txt_tokens", 256},
             {"img_tokens", 256},
             {"modes",
              {{{"mode", "eager"}, {"status", "ran"}, {"median_ms", 80.0}, {"peak_gib", 12.5}, {"steps", 10}},
               {{"mode", "compile"}, {"status", "ran"}, {"median_ms", 50.0}, {"peak_gib", 10.0}, {"steps", 10}},
               {{"mode", "torchao-fp8"}, {"status", "skipped"}, {"why", "torchao is not installed"}}}}}}}};
}

const StepShape kW1{32, 256, 256};

TEST(BenchPeer, ReadsThePeerFile) {
  const PeerFile p = parse_peer_file(peer_json().dump(), "peer.json");
  EXPECT_EQ(p.path, "peer.json");
  EXPECT_EQ(p.device, "NVIDIA H100 80GB HBM3");
  EXPECT_EQ(p.torch_version, "2.11.0");
  EXPECT_EQ(p.diffusers_version, "0.42.1");
  EXPECT_EQ(p.torchao_version, "") << "null: torchao was missing";
  ASSERT_EQ(p.workloads.size(), 1u);
  const PeerWorkload& w = p.workloads[0];
  EXPECT_EQ(w.workload, "W1");
  EXPECT_EQ(w.shape.batch, 32);
  EXPECT_EQ(w.shape.txt_tokens, 256);
  EXPECT_EQ(w.shape.img_tokens, 256);
  ASSERT_EQ(w.modes.size(), 3u);
  EXPECT_TRUE(w.modes[0].ran);
  EXPECT_DOUBLE_EQ(w.modes[1].median_ms, 50.0);
  EXPECT_DOUBLE_EQ(w.modes[1].peak_gib, 10.0);
  EXPECT_EQ(w.modes[1].steps, 10);
  EXPECT_FALSE(w.modes[2].ran);
  EXPECT_EQ(w.modes[2].why, "torchao is not installed");
}

TEST(BenchPeer, RatiosOnTheSameDeviceAndShape) {
  const PeerFile p = parse_peer_file(peer_json().dump(), "peer.json");
  const PeerComparison c = compare_to_peer(p, "NVIDIA H100 80GB HBM3", "W1", kW1, 40.0, 15.0);
  EXPECT_EQ(c.why, "");
  ASSERT_EQ(c.ratios.size(), 2u);
  EXPECT_EQ(c.ratios[0].mode, "eager");
  EXPECT_DOUBLE_EQ(c.ratios[0].speedup, 2.0);
  EXPECT_DOUBLE_EQ(c.ratios[0].memory_ratio, 1.2);
  EXPECT_DOUBLE_EQ(c.ratios[1].speedup, 1.25);
  EXPECT_DOUBLE_EQ(c.ratios[1].memory_ratio, 1.5);
  EXPECT_EQ(describe(c),
            "PyTorch's step / flux8's: 2.00x eager, 1.25x compile; flux8's peak memory / PyTorch's: 1.20x eager, "
            "1.50x compile; skipped by the peer: torchao-fp8 (torchao is not installed)");
}

TEST(BenchPeer, NoRatioAgainstAnotherGpu) {
  const PeerFile p = parse_peer_file(peer_json("NVIDIA H200").dump(), "peer.json");
  const PeerComparison c = compare_to_peer(p, "NVIDIA H100 80GB HBM3", "W1", kW1, 40.0, 15.0);
  EXPECT_TRUE(c.ratios.empty());
  EXPECT_EQ(c.why, "the peer ran on NVIDIA H200, this bench on NVIDIA H100 80GB HBM3");
  EXPECT_EQ(describe(c).rfind("no ratio: the peer ran on NVIDIA H200", 0), 0u) << describe(c);
  EXPECT_EQ(describe(c).find("x eager"), std::string::npos) << describe(c);
  // A bench that could not name its device compares with nothing.
  EXPECT_FALSE(compare_to_peer(p, "", "W1", kW1, 40.0, 15.0).why.empty());
}

TEST(BenchPeer, NoRatioForAnotherWorkloadOrShape) {
  const PeerFile p = parse_peer_file(peer_json().dump(), "peer.json");
  const std::string gpu = "NVIDIA H100 80GB HBM3";
  EXPECT_EQ(compare_to_peer(p, gpu, "W2", StepShape{2, 512, 4096}, 90.0, 20.0).why,
            "peer.json has no W2 (run tools/peer_bench.py --workload W2)");
  EXPECT_EQ(compare_to_peer(p, gpu, "W1", StepShape{16, 256, 256}, 40.0, 15.0).why,
            "the peer's W1 is batch 32, 256 text + 256 image tokens, this run's batch 16, 256 text + 256 image tokens");
  // Every mode skipped: nothing to compare with.
  json only_skipped = peer_json();
  only_skipped["workloads"][0]["modes"] = {{{"mode", "eager"}, {"status", "skipped"}, {"why", "no diffusers"}}};
  const PeerComparison c = compare_to_peer(parse_peer_file(only_skipped.dump(), "p.json"), gpu, "W1", kW1, 40.0, 15.0);
  EXPECT_EQ(c.why, "no mode of the peer's W1 ran");
  EXPECT_EQ(c.skipped, std::vector<std::string>{"eager (no diffusers)"});
}

// A peer on the CPU measures no memory (peak_gib null): the step ratio alone.
TEST(BenchPeer, StepRatioAloneWhereThePeerMeasuredNoMemory) {
  json cpu = peer_json("cpu: Some Processor");
  cpu["workloads"][0]["modes"] = {
      {{"mode", "eager"}, {"status", "ran"}, {"median_ms", 30.0}, {"peak_gib", nullptr}, {"steps", 3}}};
  const PeerComparison c =
      compare_to_peer(parse_peer_file(cpu.dump(), "cpu.json"), "cpu: Some Processor", "W1", kW1, 60.0, 1.0);
  ASSERT_EQ(c.ratios.size(), 1u);
  EXPECT_LT(c.ratios[0].memory_ratio, 0.0);
  EXPECT_EQ(describe(c),
            "PyTorch's step / flux8's: 0.50x eager; flux8's peak memory / PyTorch's: not measured by the peer");
}

TEST(BenchPeer, MalformedFileNamesTheFileAndTheKey) {
  TempDir dir;
  const auto error_for = [&](const json& j) {
    const std::string path = dir.write("peer.json", j.dump());
    return error_of([&] { load_peer_file(path); });
  };
  json no_device = peer_json();
  no_device.erase("device");
  expect_mentions(error_for(no_device), {dir.file("peer.json"), "'device' is missing", "tools/peer_bench.py"});
  json bad_ms = peer_json();
  bad_ms["workloads"][0]["modes"][1]["median_ms"] = "fast";
  expect_mentions(error_for(bad_ms), {dir.file("peer.json"), "'workloads[0].modes[1].median_ms' is not a number"});
  json no_shape = peer_json();
  no_shape["workloads"][0].erase("img_tokens");
  expect_mentions(error_for(no_shape), {"'workloads[0].img_tokens' is missing"});
  json bad_status = peer_json();
  bad_status["workloads"][0]["modes"][0]["status"] = "done";
  expect_mentions(error_for(bad_status), {"'workloads[0].modes[0].status' is 'done'"});
  json skipped_without_reason = peer_json();
  skipped_without_reason["workloads"][0]["modes"][2].erase("why");
  expect_mentions(error_for(skipped_without_reason), {"'workloads[0].modes[2].why' is missing"});
  json workloads_not_list = peer_json();
  workloads_not_list["workloads"] = "W1";
  expect_mentions(error_for(workloads_not_list), {"'workloads' is not a list"});

  const std::string text = dir.write("text.json", "W1 80 ms\n");
  expect_mentions(error_of([&] { load_peer_file(text); }), {text, "not JSON"});
  expect_mentions(error_of([&] { load_peer_file(dir.file("absent.json")); }),
                  {dir.file("absent.json"), "No such file"});
}

TEST(BenchPeer, CpuDeviceNameIsTheProcessorsModel) {
  const std::string name = cpu_device_name();
  EXPECT_TRUE(name == "cpu" || name.rfind("cpu: ", 0) == 0) << name;
  EXPECT_NE(name.back(), ' ');
}

TEST(BenchPeer, GpuNameOfTheCheckLine) {
  EXPECT_EQ(gpu_name_of_check_line("NVIDIA H100 80GB HBM3, 79.1 GiB, 132 SMs"), "NVIDIA H100 80GB HBM3");
  EXPECT_EQ(gpu_name_of_check_line("NVIDIA H200, 139.8 GiB, 132 SMs"), "NVIDIA H200");
}

// `flux8 bench --peer` on the CPU backend with a tiny config, whose workload is its model's name.
struct PeerCli {
  TempDir dir;
  std::string log;
  int run(const std::string& args) { return run_flux8(args, dir.file("log.txt"), &log); }
  std::string config() {
    return dir.write("tiny.yaml", "include: " + std::string(FLUX8_SOURCE_DIR) +
                                      "/configs/models/flux_tiny_demo.yaml\n"
                                      "micro_batch_size: 2\nimage_size: 16\ntext_seq_len: 8\n");
  }
  // A peer of the tiny config at its shape (2 samples, 8 text + 64 image tokens) on `device`.
  std::string peer(const std::string& device) {
    json p = peer_json(device);
    p["workloads"][0].update({{"workload", "flux_tiny_demo"}, {"batch", 2}, {"txt_tokens", 8}, {"img_tokens", 64}});
    return dir.write("peer.json", p.dump());
  }
  json bench(const std::string& args) {
    const std::string out = dir.file("bench.json");
    EXPECT_EQ(
        run("bench --backend cpu -c " + config() + " --precision bf16 --steps 1 --warmup 0 " + args + " --json " + out),
        0)
        << log;
    return json::parse(read_bytes(out));
  }
};

TEST(BenchCli, PeerRatiosOnlyOnTheSameDevice) {
  PeerCli cli;
  const json same = cli.bench("--peer " + cli.peer(cpu_device_name()));
  EXPECT_EQ(same["device"], cpu_device_name());
  EXPECT_EQ(same["peer"]["device"], cpu_device_name());
  const json& vs = same["steps"][0]["vs_peer"];
  ASSERT_EQ(vs["ratios"].size(), 2u) << same.dump();
  EXPECT_EQ(vs["ratios"][0]["mode"], "eager");
  EXPECT_NEAR(vs["ratios"][0]["speedup"].get<double>(), 80.0 / same["steps"][0]["median_step_ms"].get<double>(), 1e-9);
  EXPECT_EQ(vs["skipped"][0], "torchao-fp8 (torchao is not installed)");
  EXPECT_FALSE(vs.contains("why"));
  EXPECT_NE(cli.log.find("flux_tiny_demo against PyTorch"), std::string::npos) << cli.log;
  EXPECT_NE(cli.log.find("BF16: PyTorch's step / flux8's:"), std::string::npos) << cli.log;

  const json other = cli.bench("--peer " + cli.peer("NVIDIA H200"));
  EXPECT_TRUE(other["steps"][0]["vs_peer"]["ratios"].empty()) << other.dump();
  EXPECT_EQ(other["steps"][0]["vs_peer"]["why"], "the peer ran on NVIDIA H200, this bench on " + cpu_device_name());
  EXPECT_NE(cli.log.find("BF16: no ratio: the peer ran on NVIDIA H200"), std::string::npos) << cli.log;
  EXPECT_EQ(cli.log.find("x eager"), std::string::npos) << cli.log;

  const json none = cli.bench("");
  EXPECT_FALSE(none.contains("peer"));
  EXPECT_FALSE(none["steps"][0].contains("vs_peer"));
  EXPECT_EQ(cli.log.find("PyTorch"), std::string::npos) << "no ratio without --peer:\n" << cli.log;
}

TEST(BenchCli, MalformedPeerFileStopsTheBenchFirst) {
  PeerCli cli;
  json p = peer_json();
  p["workloads"][0]["modes"][0].erase("median_ms");
  const std::string file = cli.dir.write("broken.json", p.dump());
  EXPECT_NE(cli.run("bench --backend cpu -c " + cli.config() + " --precision bf16 --steps 1 --peer " + file), 0);
  expect_mentions(cli.log, {file, "'workloads[0].modes[0].median_ms' is missing"});
  EXPECT_EQ(cli.log.find("flux_tiny_demo "), std::string::npos) << "no run before the error:\n" << cli.log;
}

}  // namespace
}  // namespace flux8::testing
