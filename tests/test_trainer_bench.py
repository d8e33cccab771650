"""bench/train.py runs on CPU (tiny preset, short sequences) and prints its comparison table:
ours on the V4.1 preset, transformers' DeepseekV4 (eager experts) and ours on the V4 twin, and
its grouped-vs-loop MoE check."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# transformers imports torchvision, whose CUDA-built ops need the shim on CPU torch (conftest).
RUN = ("import runpy, sys; sys.path.insert(0, {tests!r}); "
       "from sglang_cpu import install_torchvision_shim; install_torchvision_shim(); "
       "sys.argv = [{bench!r}] + sys.argv[1:]; runpy.run_path({bench!r}, run_name='__main__')")


@pytest.mark.timeout(180)
def test_bench_train_runs_on_cpu():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)  # the interpreted kernel takes minutes; GPUs measure it
    code = RUN.format(tests=os.path.join(ROOT, "tests"),
                      bench=os.path.join(ROOT, "bench", "train.py"))
    out = subprocess.run([sys.executable, "-c", code, "--preset", "tiny", "--seqs", "64,2x32",
                          "--steps", "1", "--warmup", "1", "--transformers", "eager"],
                         env=env, capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    check = next(line for line in lines if line.startswith("grouped vs loop MoE on cpu"))
    errors = [float(x.rstrip(",")) for x in check.split()[-5::2]]
    assert len(errors) == 3 and max(errors) < 1e-5, check
    table = lines[next(i for i, line in enumerate(lines) if line.startswith("run ")) + 1:]
    rows = {(" ".join(line.split()[:-8]), line.split()[-8]): line.split()[-7:] for line in table
            if line.startswith(("ours", "transformers")) and "memory plan" not in line}
    # 2x32: two sequences packed in ours' micro-batch, a batch of two for transformers
    assert set(rows) == {(label, seq) for seq in ("64", "2x32") for label in (
        "ours tiny ac=none", "transformers tiny-v4 experts=eager", "ours tiny-v4 ac=none")}, rows
    for step_ms, tokens_per_s, *_, host_ms, cpu_ms in rows.values():
        # host ms: the main thread's CPU time of a step, within the step's wall time; cpu ms:
        # every thread's, the main thread's among them
        assert float(step_ms) > 0 and float(tokens_per_s) > 0
        assert 0 < float(host_ms) <= 1.05 * float(step_ms) + 0.5, (step_ms, host_ms)
        assert float(host_ms) <= float(cpu_ms) + 0.1, (host_ms, cpu_ms)
    for seq in ("64", "2x32"):
        assert any(line.startswith(f"speed-up at {seq}: ours tiny ac=none") for line in lines)
    assert any("memory plan: fp32 master weights" in line for line in lines)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policies", ["selective", "none,layer"])
def test_bench_train_runs_with_activation_checkpointing(policies):
    """One process, world 1, FSDP2 groups nested in each checkpointed layer: the selective
    recompute used to be refused ("profiler._record_function_enter_new ... not found in
    storage") because those groups' hooks open profiler ranges a different number of times.
    Two micro-batches per optimizer step: each step runs two forwards (counted on the
    policy), and the row counts the tokens of both. A comma list: one model and row per
    policy, and each row's speed-up over layer's."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    count = ("import atexit, trainer_bridge.policy as P; calls = [0]; fwd = P.Policy.forward; "
             "P.Policy.forward = lambda *a, **k: (calls.__setitem__(0, calls[0] + 1), "
             "fwd(*a, **k))[1]; atexit.register(lambda: print('policy forwards', calls[0])); ")
    code = RUN.format(tests=os.path.join(ROOT, "tests"),
                      bench=os.path.join(ROOT, "bench", "train.py"))
    code = code.replace("runpy.run_path", count + "runpy.run_path")
    out = subprocess.run([sys.executable, "-c", code, "--preset", "tiny", "--seqs", "64",
                          "--steps", "1", "--warmup", "1", "--checkpointing", policies,
                          "--micro-batches", "2", "--transformers", "none", "--no-twin"],
                         env=env, capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    for policy in policies.split(","):
        row = next(line for line in lines
                   if line.startswith(f"ours tiny ac={policy} ") and "memory plan" not in line)
        step_ms, tokens_per_s = float(row.split()[-7]), float(row.split()[-6])
        assert tokens_per_s * step_ms / 1e3 == pytest.approx(2 * 64, rel=0.02), row
    # one warm-up and one timed step a policy (the memory plan's probes run on CUDA only)
    forwards = 4 * len(policies.split(","))
    assert f"policy forwards {forwards}" in lines[-1], out.stdout[-500:]
    speedups = [line for line in lines if "/ ours tiny ac=layer = " in line]
    assert len(speedups) == (1 if "layer" in policies else 0), speedups
    if speedups:
        assert speedups[0].startswith("speed-up at 64: ours tiny ac=none / ours tiny ac=layer")


@pytest.mark.timeout(120)
def test_bench_train_reference_pass_with_graphs():
    """--reference-pass: each micro-batch's no-grad forward first in ours and transformers; with
    --cuda-graphs ours runs it through the micro-batch graphs (on the CPU eagerly): a forward
    layout and a training layout, two micro-batches a step over two steps."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    code = RUN.format(tests=os.path.join(ROOT, "tests"),
                      bench=os.path.join(ROOT, "bench", "train.py"))
    out = subprocess.run([sys.executable, "-c", code, "--preset", "tiny", "--seqs", "32",
                          "--steps", "1", "--warmup", "1", "--micro-batches", "2",
                          "--transformers", "eager", "--no-twin", "--one-rank", "copies",
                          "--cuda-graphs", "--reference-pass"],
                         env=env, capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert any(line.startswith("ours tiny ac=none graphs +ref ") for line in lines), lines[-8:]
    assert any(line.startswith("transformers tiny-v4 experts=eager +ref ") for line in lines)
    # 2 steps x 2 micro-batches x (a no-grad forward + a training run), all eager on the CPU;
    # layouts: forward, training first of a step (fresh), training accumulating
    summary = next(line for line in lines if "micro-batch graphs:" in line)
    assert "eager 8, captured 0, replayed 0, capture_failed 0; layouts kept 3" in summary, summary


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, message", [
    (["--seqs", "64,2xk"], "--seqs item '2xk': expected LENGTH or NxLENGTH"),
    (["--seqs", "64", "--profile-seq", "32"], "--profile-seq 32 is not one of --seqs 64"),
    (["--seqs", "64", "--micro-batches", "0"], "--micro-batches 0: at least 1"),
    (["--seqs", "64", "--adamw-tiles", "2048x"], "--adamw-tiles 2048x: ELEMENTSxWARPS"),
    (["--seqs", "64", "--memory-fraction", "1.5"], "--memory-fraction 1.5: in (0, 1]"),
    (["--seqs", "64", "--checkpointing", "layer,full"], "--checkpointing 'full': one of"),
])
def test_bench_train_refuses_bad_flags_before_building(args, message):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    code = RUN.format(tests=os.path.join(ROOT, "tests"),
                      bench=os.path.join(ROOT, "bench", "train.py"))
    out = subprocess.run([sys.executable, "-c", code, "--preset", "tiny", *args], env=env,
                         capture_output=True, text=True, timeout=50)
    assert out.returncode != 0 and message in out.stderr, out.stderr[-2000:]


@pytest.mark.timeout(150)
def test_bench_train_under_torchrun_two_ranks():
    """FSDP over two gloo ranks: one table (rank 0 prints), a row per shape; the transformers
    baseline (one process) is refused there."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    bench = os.path.join(ROOT, "bench", "train.py")
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", bench,
           "--preset", "tiny", "--seqs", "64", "--steps", "1", "--warmup", "1"]
    out = subprocess.run(run + ["--transformers", "none", "--no-twin"], env=env,
                         capture_output=True, text=True, timeout=140)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("cpu x 2, 1 micro-batch(es)") == 1, out.stdout[-2000:]
    rows = [line for line in out.stdout.splitlines()
            if line.startswith("ours tiny ac=none ") and "memory plan" not in line]
    assert len(rows) == 2 and float(rows[0].split()[-6]) > 0, rows  # printed live + table
    refused = subprocess.run(run + ["--transformers", "eager"], env=env, capture_output=True,
                             text=True, timeout=100)
    assert refused.returncode != 0 and "pass --transformers none --no-twin" in refused.stderr


@pytest.mark.timeout(150)
def test_bench_train_profile_prints_and_saves_the_host_profile(tmp_path):
    """--profile-seq: the torch.profiler tables, then one step under cProfile, printed and (with
    --trace-dir) saved for pstats: the host functions a host-bound step is made of."""
    import pstats

    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    code = RUN.format(tests=os.path.join(ROOT, "tests"),
                      bench=os.path.join(ROOT, "bench", "train.py"))
    out = subprocess.run([sys.executable, "-c", code, "--preset", "tiny", "--seqs", "32",
                          "--steps", "1", "--warmup", "0", "--transformers", "none", "--no-twin",
                          "--profile-seq", "32", "--trace-dir", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=140)
    assert out.returncode == 0, out.stderr[-3000:]
    for title in ("top ops by self_cpu_time_total", "host Python profile of one step, top 30 "
                  "by tottime", "host Python profile of one step, top 30 by cumulative"):
        assert title in out.stdout, out.stdout[-2000:]
    stats = pstats.Stats(str(tmp_path / "host_step.pstats"))
    assert any(func[2] == "forward_backward" for func in stats.stats), "trainer step not profiled"
    # the chrome trace under a plain file name (a remote machine's file transfer may refuse
    # "=" or "@"), holding the step's phase ranges that bench/trace_gaps.py reads
    trace = tmp_path / "ours_tiny_ac_none_32.json"
    assert trace.exists(), sorted(p.name for p in tmp_path.iterdir())
    assert '"trainer.backward"' in trace.read_text()


def test_trace_gaps_reports_gpu_busy_time_within_each_phase(tmp_path):
    """bench/trace_gaps.py: the union of device events inside each host phase range (overlaps
    counted once, time outside the range not at all)."""
    import json

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import trace_gaps

    def x(name, cat, ts, dur):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}

    events = [x("trainer.forward", "user_annotation", 0, 100),
              x("trainer.backward", "user_annotation", 100, 200),
              x("k1", "kernel", 10, 30), x("k2", "kernel", 20, 30),      # overlap: 10..50
              x("copy", "gpu_memcpy", 90, 20),                          # 10 in each phase
              x("k3", "kernel", 150, 50), x("cpu op", "cpu_op", 0, 300)]
    assert trace_gaps.busy_us(sorted([(10, 40), (20, 50), (90, 110)]), 0, 100) == 50
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "trace_gaps.py"),
                          str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = {ln.split()[0]: ln.split()[1:] for ln in out.stdout.splitlines()[1:-1]}
    assert rows["trainer.forward"][:2] == ["0.1", "0.1"]      # 100 us host, 40 + 10 busy
    assert rows["trainer.backward"][:2] == ["0.2", "0.1"]     # 200 us host, 10 + 50 busy
    assert rows["trainer.forward"][2] == "50%" and rows["trainer.backward"][2] == "30%"
    path.write_text(json.dumps({"traceEvents": [x("k", "kernel", 0, 5)]}))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "trace_gaps.py"),
                          str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "no trainer.* ranges" in out.stderr


@pytest.mark.timeout(180)
def test_ab_train_alternates_two_trees(tmp_path):
    """bench/ab_train.py: a revision archived into a tree, then A B A B runs of bench/train.py
    (here the same tree twice, once by a relative path, on CPU): every run's step, host and cpu
    times, medians and their ratios; a tree without bench/train.py is refused before anything
    runs."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    ab = [sys.executable, os.path.join(ROOT, "bench", "ab_train.py")]
    prep = subprocess.run(ab + ["--prepare", "HEAD", "--out-dir", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert prep.returncode == 0, prep.stderr[-2000:]
    tree = prep.stdout.split()[-1]
    assert os.path.isfile(os.path.join(tree, "bench", "train.py"))
    # The same tree twice, the second time named relative to the caller's directory (each
    # run's is its tree's).
    out = subprocess.run(ab + [tree, os.path.relpath(tree, tmp_path), "--rounds", "2", "--",
                               "--preset", "tiny", "--seqs", "32", "--steps", "1", "--warmup",
                               "0", "--transformers", "none", "--no-twin"], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    rounds = [re.fullmatch(r"round \d ([AB]) .+: ([\d.]+) ms, host ([\d.]+) ms, cpu ([\d.]+) ms",
                           line) for line in out.stdout.splitlines() if line.startswith("round ")]
    assert len(rounds) == 4 and all(m and 0 < float(m[3]) <= float(m[4]) + 0.1 and
                                    float(m[2]) > 0 for m in rounds), rounds
    assert [m[1] for m in rounds] == ["A", "B", "A", "B"]
    medians = [line for line in out.stdout.splitlines()
               if line.startswith(("A ", "B ")) and not line.startswith("B / A")]
    assert len(medians) == 6 and all(len(line.split()) == 2 + 3 + 2 for line in medians), medians
    for what in ("step", "host", "cpu"):
        assert f"B / A ({what} ms medians): " in out.stdout
    refused = subprocess.run(ab + [tree, str(tmp_path), "--rounds", "1"], env=env,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "has no bench/train.py" in refused.stderr


def test_host_threads_reports_the_busy_main_thread():
    """bench/host_threads.py runs a command, samples its threads and reports the main thread
    (here a 1.5 s busy loop) as the busiest; it passes the command's exit status on and refuses
    a missing command and a sampling interval that is not positive."""
    tool = [sys.executable, os.path.join(ROOT, "bench", "host_threads.py")]
    spin = "import time, sys\nt = time.time()\nwhile time.time() - t < 1.5: pass\nsys.exit(3)"
    out = subprocess.run(tool + ["--every", "0.2", "--", sys.executable, "-c", spin],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 3, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines() if "(main)" in line]
    assert len(rows) == 1 and float(rows[0][2]) > 0.5, out.stdout
    assert "main thread busiest in" in out.stdout
    refused = subprocess.run(tool, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "give the command" in refused.stderr
    refused = subprocess.run(tool + ["--every", "0", "--", sys.executable, "-c", "pass"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--every 0.0: must be > 0" in refused.stderr


def test_ab_train_reads_columns_where_the_header_puts_them():
    """bench/ab_train.py reads the step and host times of the first "ours" row by the table
    header's columns: an OOM row and the memory-plan lines are skipped, and an older tree's
    table without "host ms" still gives its step time."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ab_train", os.path.join(ROOT, "bench",
                                                                           "ab_train.py"))
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    head = (f"{'run':<48} {'seq':>9} {'step ms':>9} {'tokens/s':>9} {'MFU':>6} "
            f"{'attn TFLOP':>10} {'peak GiB':>8}")

    def row(label, step, host=None):
        if step is None:
            return f"{label:<48} {'4096':>9} {'OOM':>9}"
        end = "" if host is None else f" {host:8.1f}"
        return f"{label:<48} {'4096':>9} {step:9.1f} {4096 / step:9.0f} {'4.2%':>6} " \
               f"{1.84:10.2f} {28.37:8.2f}{end}"

    plan = "ours small ac=none @ 4096: memory plan: fp32 master weights 5.45 GiB, peak 28.37 GiB"
    new = "\n".join([plan, row("ours small ac=selective", None), row("ours small ac=none",
                     212.4, 187.9), head + f" {'host ms':>8}", row("ours small ac=none",
                                                                   212.4, 187.9)])
    assert ab.ours_times(new) == {"step": 212.4, "host": 187.9, "cpu": None}
    old = "\n".join([row("ours small ac=none", 230.1), head, row("ours small ac=none", 230.1)])
    assert ab.ours_times(old) == {"step": 230.1, "host": None, "cpu": None}
    both = "\n".join([head + f" {'host ms':>8} {'cpu ms':>8}",
                      row("ours small ac=none", 212.4, 187.9) + f" {301.5:8.1f}"])
    assert ab.ours_times(both) == {"step": 212.4, "host": 187.9, "cpu": 301.5}
    with pytest.raises(ValueError, match="no step time"):
        ab.ours_times("\n".join([plan, head, row("ours small ac=none", None)]))


def test_optimizer_dtensor_bench_times_both_sides():
    """bench/optimizer_dtensor.py on CPU: the four timings, torch's and the trainer's own."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "optimizer_dtensor.py"),
                          "--calls", "2"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    for row in ("clip_grad_norm_ (torch, DTensor)", "clip_grad_norm (ours, local shards)",
                "AdamW.step (torch, DTensor)", "AdamW.step (ours, local shards)"):
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith(row)), None)
        assert line is not None and all(float(v) > 0 for v in line.split()[-2:]), out.stdout
    for what in ("clipping", "AdamW.step"):  # each pair's ratio, from the same run
        assert f"{what}: torch over DTensors " in out.stdout, out.stdout


def test_packed_launches_bench_refuses_bad_packs():
    """bench/packed_launches.py: --packs must be positive integers dividing --tokens; refused
    before anything is built."""
    for packs, msg in (("0,2", "must be >= 1 and divide"), ("3", "must be >= 1 and divide"),
                       ("a", "comma-separated integers")):
        out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "packed_launches.py"),
                              "--packs", packs], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and msg in out.stderr, (packs, out.stderr[-500:])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags", [["--steps", "0"], ["--warmup", "-1"], ["--seq", "1"]])
def test_overlap_probe_refuses_bad_flags(flags):
    """bench/overlap_probe.py: a count that cannot time anything is refused by name, before
    any model is built (on a CPU too, where the probe itself cannot run)."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "overlap_probe.py"), *flags],
                         capture_output=True, text=True, timeout=50)
    assert out.returncode == 2 and f"{flags[0]} {flags[1]}: at least" in out.stderr, out.stderr


@pytest.mark.timeout(60)
def test_train_ops_where_refuses_a_cpu_run():
    """bench/train_ops.py sources --where lists device times: on a CPU it says so and stops
    before building the model, instead of printing an empty table."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "train_ops.py"), "sources",
                          "--device", "cpu", "--where", "aten::copy_"],
                         capture_output=True, text=True, timeout=50)
    assert out.returncode == 2 and "--where aten::copy_: device times need CUDA" in out.stderr, \
        out.stderr


@pytest.mark.timeout(120)
def test_bench_trainer_checkpointing_runs_the_trainer_per_policy():
    """bench/trainer_checkpointing.py: the trainer process once per policy on offline rollouts
    it writes; a row each, layer's speed-up column; a trainer that fails (here a config it
    refuses) is a failed row and a non-zero exit, not a missing one."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    bench = os.path.join(ROOT, "bench", "trainer_checkpointing.py")
    args = [sys.executable, bench, "--model", "tiny", "--length", "96", "--prompt", "16",
            "--steps", "2"]
    out = subprocess.run(args + ["--policies", "none,layer"], env=env, capture_output=True,
                         text=True, timeout=100)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-2000:])
    rows = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()
            if line.startswith(("none ", "layer "))}
    assert set(rows) == {"none", "layer"}, out.stdout
    for step_ms, tokens_per_s, peak, ratio in rows.values():
        # two samples of 96 tokens a step; no device allocator on the CPU
        assert float(tokens_per_s) * float(step_ms) / 1e3 == pytest.approx(2 * 96, rel=0.02)
        assert peak == "n/a" and ratio.endswith("x")
    assert rows["layer"][3] == "1.00x"
    bad = subprocess.run(args + ["--policies", "none", "model.memory_fraction=0"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "none       failed: " in bad.stdout, bad.stdout[-2000:]
    refused = subprocess.run(args + ["--policies", "none,full"], env=env, capture_output=True,
                             text=True, timeout=30)
    assert refused.returncode != 0 and "--policies full: one of" in refused.stderr
