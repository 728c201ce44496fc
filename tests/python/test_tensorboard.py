#!/usr/bin/env python3
"""A short demo run's logs read back by the tools users read them with.

    python3 tests/python/test_tensorboard.py <flux8 binary> <source dir>

Needs the `tensorboard` and `mlperf-logging` pip packages (scripts/install_deps.sh installs
them); outside CI (no CI variable in the environment) it exits 77, skipped, without them. Trains configs/demo.yaml, its model shrunk, on the CPU for a few steps (FP8 hybrid,
telemetry every 2 steps), then checks:
  1. metrics.jsonl: every record has a known `kind`, a wall `time` within the run, an integer
     `step` and the device memory (allocated <= peak); each step is logged once.
  2. TensorBoard, through its own event reader (event_accumulator, which checks each record's
     CRCs): every scalar tag, with the value and step of the metrics.jsonl record it shows (loss,
     lr, grad norm, step time, throughput, memory, validation loss, FP8 saturation and underflow
     as the worst of each tensor group, the timers); the samples image equals samples.png.
  3. A resume after a checkpoint was lost: metrics.jsonl and TensorBoard hold each step once.
  4. The MLPerf log: the lines' order and values (run_stop success, eval_accuracy = the
     validation loss at samples_count = step x batch), and mlperf-logging's compliance checker
     (rulesets 6.0.0 and 6.1.0, open division) with no failure but the convergence target (a
     validation loss <= 0.586, which a demo of a few steps cannot reach).
  5. target_eval_loss stops the run at the first interval validation that reaches it.
"""
from __future__ import annotations

import glob
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time

KINDS = {"step", "eval", "fp8", "checkpoint", "sample", "run"}


def train(flux8, src, tmp, name, *sets, resume=False):
    data = os.path.join(tmp, "data")
    run = os.path.join(tmp, name)
    cmd = [flux8, "train", "-c", os.path.join(src, "configs", "demo.yaml")]
    # The demo config with its model shrunk (one block of each kind, 8x8 images): seconds a run.
    for s in ["backend=cpu", "threads=2", "hidden_size=24", "num_attention_heads=2", "axes_dim=[2,4,6]",
              "num_double_blocks=1", "num_single_blocks=1", "context_dim=8", "vec_dim=8", "text_seq_len=4",
              "image_size=8", f"save_dir={run}", f"train_data={data}/train-*.tar",
              f"valid_data={data}/val-*.tar", f"empty_prompt_file={data}/empty_prompt", "demo_train_samples=32",
              "demo_val_samples=8", "data_shuffle_buffer=8", "micro_batch_size=2", "train_iters=4",
              "eval_interval=2", "save_interval=2", "keep_last_checkpoints=0", "log_interval=1", "fp8=hybrid",
              "fp8_stats_interval=2", "sample_prompts=red circle top left", "sample_steps=1", "samples_per_prompt=1",
              "log_timers_to_tensorboard=true", "mlperf_logging=true", *sets]:
        cmd += ["--set", s]
    if resume:
        cmd.append("--resume")
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, f"{' '.join(cmd)}\n{out.stdout}\n{out.stderr}"
    return run, out.stdout


def records(run):
    with open(os.path.join(run, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def check_records(recs, t0, t1):
    for r in recs:
        assert r["kind"] in KINDS, r
        assert isinstance(r["step"], int), r
        assert t0 <= r["time"] <= t1, (t0, r["time"], t1)
        assert 0 < r["mem_allocated_bytes"] <= r["mem_peak_bytes"], r
    steps = [r["step"] for r in recs if r["kind"] == "step"]
    assert steps == [1, 2, 3, 4], steps
    assert [r["step"] for r in recs if r["kind"] == "eval"] == [0, 2, 4], recs
    assert [r["step"] for r in recs if r["kind"] == "fp8"] == [2, 4], recs
    assert sorted(r["step"] for r in recs if r["kind"] == "checkpoint") == [2, 4], recs
    assert [r["step"] for r in recs if r["kind"] == "sample"] == [4], recs


def load_events(tb_dir):
    from tensorboard.backend.event_processing import event_accumulator as ea
    acc = ea.EventAccumulator(tb_dir, size_guidance={ea.SCALARS: 0, ea.IMAGES: 0})
    acc.Reload()
    return acc


def near(a, b):
    return math.isclose(a, b, rel_tol=2e-7, abs_tol=1e-30)  # float32 summaries of doubles


def expect_scalar(acc, tag, points):
    """points: [(step, value)] from metrics.jsonl."""
    got = [(e.step, e.value) for e in acc.Scalars(tag)]
    assert [s for s, _ in got] == [s for s, _ in points], (tag, got, points)
    for (s, g), (_, want) in zip(got, points):
        assert near(g, want), (tag, s, g, want)


def fp8_group(tensor, role):
    return ".".join(p for p in tensor.split(".") if not p.isdigit()) + "." + role


def check_tensorboard(run, recs):
    acc = load_events(os.path.join(run, "tensorboard"))  # tensorboard_dir's default
    steps = [r for r in recs if r["kind"] == "step"]
    gib = 1.0 / (1 << 30)
    for tag, field, scale in [("train/loss", "loss", 1), ("train/lr", "lr", 1), ("train/grad_norm", "grad_norm", 1),
                              ("perf/step_time_s", "step_time_s", 1), ("perf/samples_per_s", "samples_per_s", 1),
                              ("perf/tokens_per_s", "tokens_per_s", 1),
                              ("perf/model_tflops_per_s", "model_tflops_per_s", 1),
                              ("memory/allocated_gib", "mem_allocated_bytes", gib),
                              ("memory/peak_gib", "mem_peak_bytes", gib), ("timers/step_s", "step_time_s", 1),
                              ("timers/data_wait_s", "data_wait_s", 1), ("timers/data_read_s", "data_read_s", 1),
                              ("timers/data_assemble_s", "data_assemble_s", 1),
                              ("timers/data_upload_s", "data_upload_s", 1)]:
        expect_scalar(acc, tag, [(r["step"], r[field] * scale) for r in steps])
    evals = [r for r in recs if r["kind"] == "eval"]
    expect_scalar(acc, "val/loss", [(r["step"], r["val_loss"]) for r in evals])
    expect_scalar(acc, "timers/validation_s", [(r["step"], r["seconds"]) for r in evals])
    saves = [r for r in recs if r["kind"] == "checkpoint"]
    expect_scalar(acc, "timers/checkpoint_save_s", sorted((r["step"], r["seconds"]) for r in saves))
    tags = set(acc.Tags()["scalars"])
    # The CPU has no energy counter: no energy tags.
    assert not any(t.startswith("energy/") for t in tags), tags
    # FP8 health: the worst fraction over each group's tensors, at each telemetry step.
    fp8 = [r for r in recs if r["kind"] == "fp8"]
    groups = {}
    for r in fp8:
        for t in r["fp8"]:
            if "saturated" in t:
                g = groups.setdefault(fp8_group(t["tensor"], t["role"]), {})
                sat, under = g.get(r["step"], (0.0, 0.0))
                g[r["step"]] = (max(sat, t["saturated"]), max(under, t["underflow"]))
    assert "double_blocks.img_attn.qkv.input" in groups and "single_blocks.linear1.weight" in groups, groups.keys()
    for group, by_step in groups.items():
        expect_scalar(acc, "fp8/saturated/" + group, [(s, v[0]) for s, v in sorted(by_step.items())])
        expect_scalar(acc, "fp8/underflow/" + group, [(s, v[1]) for s, v in sorted(by_step.items())])
    fp8_tags = {t for t in tags if t.startswith("fp8/")}
    assert fp8_tags == {f"fp8/{k}/{g}" for g in groups for k in ("saturated", "underflow")}, fp8_tags
    # The sample grid as an image summary: samples.png's bytes and size.
    [img] = acc.Images("samples/final")
    with open(os.path.join(run, "samples.png"), "rb") as f:
        png = f.read()
    width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk
    assert (img.step, img.width, img.height) == (4, width, height), (img.step, img.width, img.height)
    assert img.encoded_image_string == png
    return acc


def check_mlperf_lines(run, recs, batch):
    with open(os.path.join(run, "mlperf.log"), encoding="utf-8") as f:
        lines = [json.loads(line[len(":::MLLOG "):]) for line in f]
    keys = [m["key"] for m in lines]
    for m in lines:
        assert set(m) == {"namespace", "time_ms", "event_type", "key", "value", "metadata"}, m
        assert m["event_type"] in ("POINT_IN_TIME", "INTERVAL_START", "INTERVAL_END"), m
    times = [m["time_ms"] for m in lines]
    assert times == sorted(times), "time_ms goes back"
    assert keys.index("init_start") < keys.index("init_stop") < keys.index("run_start") < keys.index("block_start")
    assert keys[-1] == "run_stop" and lines[-1]["metadata"]["status"] == "success", lines[-1]
    # Blocks alternate, each closed before the evaluation that follows it.
    blocks = [k for k in keys if k in ("block_start", "block_stop")]
    assert blocks == ["block_start", "block_stop"] * 2, blocks
    acc = [(m["metadata"]["samples_count"], m["value"]) for m in lines if m["key"] == "eval_accuracy"]
    want = [(r["step"] * batch, r["val_loss"]) for r in recs if r["kind"] == "eval"]
    assert acc == want, (acc, want)
    value = {m["key"]: m["value"] for m in lines}
    assert value["submission_benchmark"] == "flux1" and value["global_batch_size"] == batch, value
    assert value["lowest_numerical_precision_in_linear"] == "fp8", value


def check_compliance(log, tmp):
    for ruleset in ("6.0.0", "6.1.0"):
        out = subprocess.run([sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training",
                              "--ruleset", ruleset, "--log_output", os.path.join(tmp, "checker.log"), log],
                             capture_output=True, text=True)
        text = out.stdout + out.stderr
        failed = [line for line in text.splitlines() if "Failed" in line or "ERROR" in line or "Required" in line]
        # The one failure allowed: the benchmark's quality target, out of a short demo's reach.
        target = "Failed checks for averaged_validation_loss : v['value'] <= 0.586 and v['value'] > 0.0"
        unexpected = [line for line in failed if target not in line and line.strip() != "ERROR - FAILED"]
        assert not unexpected, f"ruleset {ruleset}:\n{text}"
        assert any(target in line for line in failed), f"ruleset {ruleset}: expected the target check\n{text}"


def main(argv):
    try:
        import mlperf_logging  # noqa: F401  (installed by scripts/install_deps.sh)
        import tensorboard  # noqa: F401
    except ImportError as e:  # only outside CI: CI installs them
        if os.environ.get("CI"):
            raise
        print(f"test_tensorboard: skipped: {e} (pip install tensorboard mlperf-logging)")
        return 77
    flux8 = argv[1]
    src = argv[2] if len(argv) > 2 else os.path.join(os.path.dirname(__file__), "..", "..")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        run, _ = train(flux8, src, tmp, "run")
        t1 = time.time()
        recs = records(run)
        check_records(recs, t0, t1)
        check_tensorboard(run, recs)
        check_mlperf_lines(run, recs, batch=2)
        check_compliance(os.path.join(run, "mlperf.log"), tmp)

        # A crash after step 4's records but before its checkpoint: the resume from step 2 takes
        # steps 3 and 4 again, and each is recorded once.
        shutil.rmtree(os.path.join(run, "step-0000004"))
        t2 = time.time()
        _, log = train(flux8, src, tmp, "run", resume=True)
        assert "resumed from" in log and "at step 2" in log, log
        again = records(run)
        check_records(again, t0, time.time())
        assert [r["step"] for r in again if r.get("event") == "resume"] == [2], again
        assert all(r["time"] >= t2 for r in again if r["step"] > 2), "a record from before the resume survived"
        assert len(glob.glob(os.path.join(run, "tensorboard", "events.out.tfevents.*"))) == 2
        check_tensorboard(run, again)

        # target_eval_loss: the first interval validation at or below it ends the run, a success.
        run, log = train(flux8, src, tmp, "target", "eval_interval=1", "target_eval_loss=100", "sample_prompts=")
        assert "reached target_eval_loss 100 at step 1: stopping" in log, log
        recs = records(run)
        assert [r["step"] for r in recs if r["kind"] == "step"] == [1], recs
        assert [r["step"] for r in recs if r["kind"] == "checkpoint"] == [1], recs
        with open(os.path.join(run, "mlperf.log"), encoding="utf-8") as f:
            last = json.loads(f.read().splitlines()[-1][len(":::MLLOG "):])
        assert last["key"] == "run_stop" and last["metadata"] == {"file": "flux8", "status": "success",
                                                                  "samples_count": 2}, last
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
