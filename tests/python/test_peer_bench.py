#!/usr/bin/env python3
"""tools/peer_bench.py --tiny on the CPU, and `flux8 bench --peer` reading what it wrote.

    python3 tests/python/test_peer_bench.py <flux8 binary> <source dir>

Needs torch and diffusers; exits 77 (skipped) where either does not import.
"""
import json
import os
import subprocess
import sys
import tempfile


def main(argv):
    try:
        import diffusers  # noqa: F401
        import torch
    except Exception as e:
        print(f"skipped: torch and diffusers are needed ({type(e).__name__}: {e})")
        return 77
    flux8 = argv[1]
    src = argv[2] if len(argv) > 2 else os.path.join(os.path.dirname(__file__), "..", "..")
    sys.path.insert(0, os.path.join(src, "tools"))
    import peer_bench

    with tempfile.TemporaryDirectory() as tmp:
        peer = os.path.join(tmp, "peer.json")
        subprocess.run([sys.executable, os.path.join(src, "tools", "peer_bench.py"), "--tiny", "--mode",
                        "eager,torchao-fp8", "--steps", "2", "--warmup", "1", "--out", peer], check=True)
        with open(peer, encoding="utf-8") as f:
            p = json.load(f)
        assert p["device"] == peer_bench.cpu_device_name(), p["device"]
        assert p["versions"]["torch"] and p["versions"]["diffusers"], p["versions"]
        [w] = p["workloads"]
        assert (w["workload"], w["batch"], w["txt_tokens"], w["img_tokens"]) == ("flux_tiny_demo", 2, 8, 64), w
        eager, fp8 = w["modes"]
        assert eager["mode"] == "eager" and eager["status"] == "ran", eager
        assert eager["median_ms"] > 0 and eager["steps"] == 2 and len(eager["step_ms"]) == 2, eager
        assert eager["peak_gib"] is None, "the CPU has no allocator peak"
        # float8 training needs a GPU (or torchao): reported, not a crash.
        assert fp8["mode"] == "torchao-fp8" and fp8["status"] == "skipped" and fp8["why"], fp8

        # Each mode in a process of its own (the GPU's default): the same record from the child.
        own = os.path.join(tmp, "own.json")
        subprocess.run([sys.executable, os.path.join(src, "tools", "peer_bench.py"), "--tiny", "--mode", "eager",
                        "--steps", "2", "--warmup", "1", "--processes", "per-mode", "--out", own], check=True)
        with open(own, encoding="utf-8") as f:
            [w_own] = json.load(f)["workloads"]
        [eager_own] = w_own["modes"]
        assert {k: w_own[k] for k in w_own if k != "modes"} == {k: w[k] for k in w if k != "modes"}, w_own
        assert eager_own["status"] == "ran" and eager_own["steps"] == 2 and eager_own["median_ms"] > 0, eager_own
        assert set(eager_own) == set(eager), (eager_own, eager)
        assert peer_bench.per_mode_processes(peer_bench.parse_args(["--out", "x"]), torch.device("cuda", 0))
        assert not peer_bench.per_mode_processes(peer_bench.parse_args(["--out", "x", "--tiny"]), torch.device("cpu"))

        # The same device and shape: flux8's run of the tiny config gets its ratio to the peer.
        config = os.path.join(tmp, "tiny.yaml")
        with open(config, "w", encoding="utf-8") as f:
            f.write(f"include: {src}/configs/models/flux_tiny_demo.yaml\n"
                    "micro_batch_size: 2\nimage_size: 16\ntext_seq_len: 8\n")
        out = os.path.join(tmp, "bench.json")
        log = subprocess.run([flux8, "bench", "--backend", "cpu", "-c", config, "--precision", "bf16", "--steps", "1",
                              "--warmup", "0", "--peer", peer, "--json", out], check=True, capture_output=True,
                             text=True).stdout
        with open(out, encoding="utf-8") as f:
            vs = json.load(f)["steps"][0]["vs_peer"]
        assert "why" not in vs, vs
        assert [r["mode"] for r in vs["ratios"]] == ["eager"] and vs["ratios"][0]["speedup"] > 0, vs
        assert vs["ratios"][0]["memory_ratio"] is None, vs
        assert vs["skipped"] and vs["skipped"][0].startswith("torchao-fp8 ("), vs
        assert "BF16: PyTorch's step / flux8's:" in log, log

    # U1, the shape flux8 is not tuned for, goes under the model's name at the shape of
    # `flux8 bench -c configs/models/flux_535m.yaml --set image_size=512 --set micro_batch_size=8`.
    u1 = peer_bench.load_model_config(src, peer_bench.WORKLOADS["U1"])
    assert (u1["workload_model"], u1["batch"], u1["txt_tokens"], u1["img_tokens"]) == ("flux_535m", 8, 256, 1024), u1
    assert peer_bench.parse_args(["--out", "x", "--workload", "W1,U1"]).workload == "W1,U1"
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
