"""``ddpkit bench``: its measurements on the rank pool, its report, its config, and the command end to end."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from procs import base_env

from ddpkit.bench.bench_config import BenchConfig
from ddpkit.bench.report.stats import quartiles, relative_spread
from ddpkit.bench.sections.engines import WorkloadResult, bench_workload, format_results
from ddpkit.cli import main

TOY = dict(steps=3, warmup=1, block=1, samples_per_rank=4, mlp_hidden=16, mlp_batch=4, resnet_batch=4)
# Parameter counts of the toy workloads: the tutorial's ConvNet, and the MLP
# 784-16-16-10 with biases.
PARAMS = {"convnet": 29_034, "mlp": 784 * 16 + 16 + 16 * 16 + 16 + 16 * 10 + 10, "resnet": 77_754}


def _measure(name: str) -> WorkloadResult:
    return bench_workload(name, BenchConfig(**TOY))


@pytest.mark.parametrize("name", ["convnet", *(pytest.param(n, marks=pytest.mark.slow("another workload on the same path as "
                                                                         "the convnet's")) for n in ("mlp", "resnet"))])
def test_each_workload_is_measured_on_real_ranks(dist2, name):
    r = dist2.run(_measure, name)[0]
    assert r.workload == name and r.params == PARAMS[name] and r.buckets >= 1
    assert r.ddpkit_ms > 0 and r.torch_ms > 0 and r.compute_ms > 0 and r.comm_ms > 0
    assert r.exposed_ddpkit_ms > 0  # the timed wait really ran at every end of backward
    # The derived columns follow from the measured ones as documented.
    expected = min(1.0, max(0.0, (r.compute_ms + r.comm_ms - r.ddpkit_ms) / r.comm_ms))
    assert r.hidden_ddpkit == pytest.approx(expected)
    assert r.hidden_ddpkit_direct == pytest.approx(min(1.0, max(0.0, 1 - r.exposed_ddpkit_ms / r.comm_ms)))


def _measure_cost() -> WorkloadResult:
    return bench_workload("convnet", BenchConfig(**TOY, engine_cost=True))


def test_engine_cost_times_both_engines_with_the_noop_hook(dist2):
    r = dist2.run(_measure_cost)[0]
    assert r.ddpkit_noop_ms > 0 and r.torch_noop_ms > 0 and r.noop_ratio > 0 and len(r.noop_ratio_iqr) == 2
    assert r.ddpkit_peak_mib is None and r.torch_peak_mib is None  # GPU memory, on CUDA only
    table = format_results([r], 2)
    assert "engine cost: both engines with the same no-op comm hook" in table
    assert BenchConfig(device="cuda").measures_engine_cost  # on by default on CUDA
    assert not BenchConfig().measures_engine_cost


def _measure_linear200_cost() -> WorkloadResult:
    return bench_workload("linear200", BenchConfig(**TOY, engine_cost=True))


@pytest.mark.slow("both engines and the plain model, timed and profiled in fresh ranks")
def test_engine_cost_counts_what_each_engine_dispatches_per_step(dist2):
    from ddpkit._reference import torch_ddp_accepts

    r = dist2.run(_measure_linear200_cost)[0]
    assert r.param_tensors == 400 and r.buckets >= 1
    engines = ["ddpkit", "torch"] + (["torch batched"] if torch_ddp_accepts("batched_grad_copy") else [])
    assert list(r.engine_ops) == list(r.engine_us) == engines + ["python hook"]
    assert r.engine_ops["python hook"] == 0, r.engine_ops  # the floor row: a Python call per parameter, no operation
    # Machine-independent: ddpkit works per bucket, torch's C++ reducer copies each of the 400 gradients into
    # its bucket and back (fewer with batched_grad_copy, still more than ddpkit's).
    assert 0 < r.engine_ops["ddpkit"] <= 8 * r.buckets + 8, r.engine_ops
    assert r.engine_ops["torch"] >= r.param_tensors, r.engine_ops
    if "torch batched" in r.engine_ops:
        assert r.engine_ops["ddpkit"] < r.engine_ops["torch batched"] < r.engine_ops["torch"], r.engine_ops
    assert all(isinstance(us, float) for us in r.engine_us.values())  # a difference of medians: any sign
    table = format_results([r], 2)
    assert "us/param" in table and "ops/step" in table and "python hook = no engine" in " ".join(table.split())


def _noop_keeps_local_gradients() -> list:
    import torch
    import torch.distributed as dist
    from ddp_models import make

    from ddpkit._reference import torch_ddp
    from ddpkit.hooks import noop_hook
    from ddpkit.parallel.ddp.wrapper import DistributedDataParallel

    out = []
    for wrap in (DistributedDataParallel, torch_ddp):
        model = wrap(make("convbn"))
        model.register_comm_hook(None, noop_hook)
        g = torch.Generator().manual_seed(dist.get_rank())
        model(torch.randn(4, 1, 8, 8, generator=g)).sum().backward()
        out.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    return out


def test_noop_hook_leaves_each_ranks_own_gradients_on_both_engines(dist2):
    (ours0, theirs0), (ours1, theirs1) = dist2.run(_noop_keeps_local_gradients)
    assert ours0.equal(theirs0) and ours1.equal(theirs1) and not ours0.equal(ours1)  # not averaged


def test_format_results_has_one_row_per_workload():
    rows = [WorkloadResult(workload=w, params=PARAMS[w], ddpkit_ms=2.0, torch_ms=4.0, ratio=0.5, compute_ms=1.0,
                           comm_ms=1.5, hidden_ddpkit=0.3, hidden_torch=0.1, exposed_ddpkit_ms=0.5,
                           hidden_ddpkit_direct=0.66, buckets=1) for w in ("convnet", "mlp")]
    lines = format_results(rows, 2).splitlines()
    body = [line for line in lines if line.startswith(("convnet", "mlp"))]
    # Two tables of a row each per workload: the times, then where the time goes.
    assert [line.split()[0] for line in body] == ["convnet", "mlp", "convnet", "mlp"]
    assert all("0.500" in line and "2.00" in line and "4.00" in line for line in body[:2])
    assert all("1.50" in line and "66%" in line for line in body[2:])
    assert max(len(line) for line in lines) <= 100  # a terminal's width, a pasted log's


def test_median_confidence_interval_covers_the_median_and_narrows():
    import random

    from ddpkit.bench.report.stats import median_ci, verdict

    assert median_ci([3.0, 1.0, 2.0]) == (1.0, 3.0)  # few samples: the whole range
    r = random.Random(0)
    xs = [r.gauss(0.97, 0.05) for _ in range(400)]
    lo, hi = median_ci(xs)
    assert lo < statistics.median(xs) < hi and hi - lo < 0.02  # ±1.96·1.25·0.05/√400 ≈ 0.006 each side
    assert verdict((lo, hi)) == "faster" and verdict((0.99, 1.01)) == "level" and verdict((1.01, 1.02)) == "slower"
    # The 95 % interval misses the true median in about 5 % of samples, not 0 % and not 30 %.
    misses = sum(not (median_ci(s)[0] <= 1.0 <= median_ci(s)[1])
                 for s in ([r.lognormvariate(0, 0.3) for _ in range(100)] for _ in range(1000)))
    assert 20 <= misses <= 80


def test_bench_cli_end_to_end(tmp_path):
    # In a process of its own: the ranks fork from the command's forkserver, which holds the file descriptors of
    # the process that started it first (in a pytest worker, an earlier test's capture), as a user's shell does not.
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, "-m", "ddpkit", "bench", "--workloads", "convnet", "--steps", "2",
                           "--warmup", "1", "--samples-per-rank", "4", "--json", str(out)],
                          capture_output=True, text=True, timeout=120, env=base_env())
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    results = report["ddp"]
    assert [r["workload"] for r in results] == ["convnet"] and results[0]["params"] == PARAMS["convnet"]
    r = results[0]
    assert r["steps"] == 2 and r["ratio_iqr"][0] <= r["ratio"] <= r["ratio_iqr"][1]
    assert r["ratio_ci"][0] <= r["ratio"] <= r["ratio_ci"][1]
    assert r["ddpkit_iqr_ms"][0] <= r["ddpkit_ms"] <= r["ddpkit_iqr_ms"][1]
    # Enough for a script to compare two runs.
    assert report["settings"]["steps"] == 2 and report["world_size"] == 2 and report["backend"] == "gloo"
    for when in ("machine_at_start", "machine_at_end"):
        m = report[when]
        assert m["torch"] and m["ddpkit"] and m["cpu_count"] >= 1 and len(m["load_average"]) == 3
    assert "ratio" in done.stdout and "convnet" in done.stdout and "load average" in done.stdout
    # Progress: not a terminal here, so one line as each workload starts and ends, on stderr.
    assert "ddpkit bench: convnet (1/1): 2 steps per engine" in done.stderr
    assert "ddpkit bench: convnet done in " in done.stderr and "\r" not in done.stderr


@pytest.mark.parametrize("where, message", [
    ("missing/b.json", "the folder"), (".", "is a directory"),
])
def test_an_unwritable_json_path_fails_before_the_benchmark(tmp_path, capsys, where, message):
    code = main(["bench", "--workloads", "convnet", "--json", str(tmp_path / where)])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("ddpkit bench: error: --json ") and message in err


def _measure_until(spread: float) -> WorkloadResult:
    return bench_workload("convnet", BenchConfig(**{**TOY, "steps": 2}, target_spread=spread, time_budget=5))


def _measure_compiled(name: str) -> tuple[WorkloadResult, int]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    result = bench_workload(name, BenchConfig(**TOY, compile=True, compile_backend="aot_eager"))
    return result, counters["stats"]["unique_graphs"]


@pytest.mark.slow("torch.compile of the bench's models on two ranks")
def test_compile_times_compiled_models(dist2):
    r, graphs = dist2.run(_measure_compiled, "convnet")[0]
    assert r.ddpkit_ms > 0 and r.torch_ms > 0 and r.steps == TOY["steps"]
    assert graphs >= 1  # the models were really compiled (one graph serves the three copies of one class)


def test_compile_config_is_checked():
    with pytest.raises(ValueError, match="--compile-backend aot_eager: add --compile"):
        BenchConfig(compile_backend="aot_eager")
    with pytest.raises(ValueError, match="drop --memory"):
        BenchConfig(compile=True, memory=True)


@pytest.mark.slow("rounds added until a spread or a time budget is met")
def test_target_spread_adds_rounds_until_tight_or_out_of_time(dist2):
    tight = dist2.run(_measure_until, 1e-9)[0]  # never tight enough: rounds until the time budget
    assert tight.steps > 2
    loose = dist2.run(_measure_until, 10.0)[0]  # tight at once: exactly --steps
    assert loose.steps == 2


def test_quartiles_and_spread():
    assert quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 4.0)
    assert quartiles([0.5], 1000.0) == (500.0, 500.0)
    assert relative_spread([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(2 / 3)
    assert relative_spread([1.0]) == 0.0


def test_bench_config_validation():
    with pytest.raises(ValueError, match="workloads"):
        BenchConfig(workloads=("resnet9000",))
    with pytest.raises(ValueError, match="--steps 0"):
        BenchConfig(steps=0)
    with pytest.raises(ValueError, match="--target-spread -1"):
        BenchConfig(target_spread=-1)
    assert main(["bench", "--steps", "-1"]) == 2


def _dp_vs_ddp():
    from ddpkit.bench.sections.dp_vs_ddp import bench_dp_vs_ddp

    return bench_dp_vs_ddp(BenchConfig(**TOY))


def test_dp_vs_ddp_is_measured_on_real_ranks(dist2):
    a, b = dist2.run(_dp_vs_ddp)
    assert a == b  # rank 0's figures, on every rank
    assert a.replicas == 2 and a.global_batch == 8 and a.rounds == TOY["steps"]
    assert a.dp_ms > 0 and a.ddp_ms > 0 and a.ratio_q1 <= a.ratio <= a.ratio_q3


def test_trace_is_chrome_json_with_every_span_per_rank(tmp_path):
    out = tmp_path / "t.json"
    assert main(["bench", "--workloads", "mlp", "--steps", "3", "--warmup", "1", "--mlp-hidden", "64",
                 "--mlp-batch", "4", "--bucket-cap-mb", "0.01", "--trace", str(out), "--no-progress"]) == 0
    events = json.loads(out.read_text())["traceEvents"]
    assert {e["args"]["name"] for e in events if e["ph"] == "M"} == {"rank 0", "rank 1"}
    spans = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] > 0 for e in spans)
    for rank in (0, 1):
        mine = [(e["tid"], e["name"]) for e in spans if e["pid"] == rank]
        for engine in ("ddpkit", "torch"):
            for phase in ("forward", "backward", "optimizer"):
                assert mine.count((f"{engine} step", phase)) == 3
            assert mine.count((f"{engine} gradients", "computing gradients")) == 3
            buckets = {tid for tid, name in mine if tid.startswith(f"{engine} bucket")}
            assert len(buckets) >= 2  # a 0.01 MB cap splits the MLP
            assert all(mine.count((b, f"all-reduce bucket {b.split()[-1]}")) == 3 for b in buckets)
        assert mine.count(("ddpkit wait", "wait for buckets")) == 3


def test_overlap_is_the_share_of_communication_inside_the_gradient_computation():
    from ddpkit.parallel.common.trace import merge, overlap

    assert merge([(3, 4), (0, 2), (1, 2.5)]) == [(0, 2.5), (3, 4)]
    # All-reduce runs 0-2 and 3-4 (3 s in all); gradients are computed 1-3.5: 1 s + 0.5 s inside.
    assert overlap([(0, 2), (3, 4)], (1, 3.5)) == pytest.approx(0.5)
    assert overlap([], (0, 1)) is None


def test_report_directory_holds_json_traces_plot_and_summary(tmp_path):
    import matplotlib.image

    report = tmp_path / "new" / "report"  # created by the bench, parents too
    assert main(["bench", "--workloads", "convnet", "mlp", "--steps", "2", "--warmup", "1", "--samples-per-rank",
                 "4", "--mlp-hidden", "16", "--report", str(report), "--no-progress"]) == 0
    assert sorted(p.name for p in report.iterdir()) == [
        "bench.json", "ratios.png", "summary.md", "trace-convnet.json", "trace-mlp.json"]
    summary = (report / "summary.md").read_text()
    assert "`ddpkit bench --samples-per-rank 4 --mlp-hidden 16 --workloads convnet mlp --steps 2 --warmup 1" in summary
    rows = [line for line in summary.splitlines() if line.startswith(("| convnet", "| mlp"))]
    data = json.loads((report / "bench.json").read_text())
    for row, r in zip(rows, data["ddp"]):
        assert f"| {r['ratio']:.3f} (" in row and f"| {r['ddpkit_ms']:.2f} (" in row
    assert "![ratio and overlap per workload](ratios.png)" in summary
    assert matplotlib.image.imread(report / "ratios.png").ndim == 3
    (tmp_path / "a-file").write_text("")
    assert main(["bench", "--report", str(tmp_path / "a-file" / "report")]) == 2


@pytest.mark.slow("each engine's peak memory in processes of its own, twice")
def test_memory_measures_each_engine_in_its_own_processes(tmp_path, capfd):
    out = tmp_path / "m.json"
    assert main(["bench", "--workloads", "mlp", "--steps", "2", "--warmup", "1", "--mlp-hidden", "2048",
                 "--memory", "--json", str(out), "--no-progress"]) == 0
    memory = json.loads(out.read_text())["memory"]
    # 5.8 M parameters: weights, gradients and momentum are 70 MB before anything the engines add.
    m = memory["mlp"]
    for engine in ("ddpkit", "torch"):  # three runs each in processes of their own, the median reported
        for suffix in ("", "_rss"):  # private memory, and the resident set with shared code pages
            runs = m[f"{engine}{suffix}_runs"]
            assert len(runs) == 3 and sorted(runs)[1] == m[f"{engine}{suffix}_mb"]
            assert all(run > 50 for run in runs), (engine, suffix, runs)
    assert "peak memory per rank" in capfd.readouterr().out


def _strategies():
    from ddpkit.bench.sections.averaging import bench_averaging

    cfg = BenchConfig(**TOY, strategy_workloads=("mlp",), local_sgd_period=2, powersgd_rank=1)
    return bench_averaging(cfg)


def test_strategies_send_what_each_strategy_should(dist2):
    rows = {r.strategy: r for r in dist2.run(_strategies)[0]}
    assert list(rows) == ["ddp", "optimizer", "local-sgd", "powersgd", "ft", "ft:4n", "ft-det", "ft-det:4n"]
    grads = PARAMS["mlp"] * 4  # float32 bytes: what DDP and the optimizer all-reduce every step
    assert rows["ddp"].bytes_per_step == grads and rows["optimizer"].bytes_per_step == grads
    assert rows["local-sgd"].bytes_per_step == grads / 2  # the parameters, every second step
    assert 0 < rows["powersgd"].bytes_per_step < grads / 5  # rank-1 factors of three matrices, and the biases
    # FaultTolerance: the gradient and a few bookkeeping words in one all-reduce, at V = n and 4n alike (a rank's
    # shards summed before it); deterministic: the partial sums of the rank's run of shards (one where V and n
    # are powers of two: its run is one node of the shards' tree), then the block sums.
    for name, gradients in (("ft", 1), ("ft:4n", 1), ("ft-det", 2), ("ft-det:4n", 2)):
        assert gradients <= rows[name].bytes_per_step / grads < gradients * 1.01, name
    for r in rows.values():
        assert r.ms > 0 and r.steps_per_block == 2 and r.blocks == 2
        assert r.iqr_ms[0] <= r.ms <= r.iqr_ms[1]
    assert rows["ddp"].ratio_to_ddp == 1.0


def test_strategies_in_the_report(tmp_path, capfd):
    code = main(["bench", "--workloads", "strategies", "--strategy-workloads", "convnet", "--steps", "2",
                 "--warmup", "1", "--samples-per-rank", "4", "--local-sgd-period", "2", "--report", str(tmp_path)])
    assert code == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    assert [r["strategy"] for r in data["strategies"]] == ["ddp", "optimizer", "local-sgd", "powersgd", "ft", "ft:4n",
                                                           "ft-det", "ft-det:4n"]
    summary = (tmp_path / "summary.md").read_text()
    assert "## Strategies on ddpkit's engine" in summary and "| convnet | local-sgd |" in summary
    assert "MB sent/step" in capfd.readouterr().out


@pytest.mark.slow("a script that times both engines' phases in fresh ranks")
def test_phase_times_script_reports_both_engines_and_the_reducer():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "phase_times.py"
    done = subprocess.run([sys.executable, str(script), "--workload", "linear200", "--steps", "2"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "linear200, world size 2, 2 steps per engine, medians in ms"
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:6]}
    assert set(rows) == {"forward", "backward", "optimizer", "step"}
    assert all(float(v) > 0 for k, row in rows.items() for v in (row[0], row[1], row[3]))
    assert any(line.strip().startswith("_finish_backward") for line in lines)


@pytest.mark.slow("seven ZeRO setups timed, then each in processes of its own for its peak")
def test_zero_table_counts_what_each_stage_keeps(tmp_path, capfd):
    # World 2 alone (the default worlds, 2 and 3, are checked below without processes).
    out = tmp_path / "z.json"
    assert main(["bench", "--zero", "--workloads", "mlp", "--world-sizes", "2", "--steps", "2", "--warmup", "1",
                 "--mlp-hidden", "512", "--json", str(out), "--no-progress"]) == 0
    found = json.loads(out.read_text())["zero"]
    assert sorted(found) == ["mlp world 2"]
    for key, world in (("mlp world 2", 2),):
        row = found[key]
        ddp, zero1, zero2, torch1 = row["ddp"], row["zero1"], row["zero2"], row["torch zero1"]
        assert ddp["params"] == row["torch ddp"]["params"] == zero2["params"]
        # AdamW: two tensors per parameter, and a scalar step each
        assert ddp["grads"] == ddp["params"] and ddp["state"] == pytest.approx(2 * ddp["params"], abs=1e-3)
        assert zero1["state"] == torch1["state"] < ddp["state"]  # torch's partition, the fullest rank
        assert zero2["state"] <= ddp["state"] / world * 1.01 + 0.01  # elements: 1/W
        assert zero2["grads"] <= ddp["grads"] / world * 1.01 + 0.01
        for sharded in (row["zero3"], row["torch fsdp2"]):  # parameters, gradients and state: 1/W each
            assert all(sharded[k] <= ddp[k] / world * 1.01 + 0.01 for k in ("params", "grads", "state"))
        assert all(m["peak"] > 0 and m["step_s"] > 0 for m in row.values())
    assert "ZeRO: MB per rank" in capfd.readouterr().out


@pytest.mark.skipif(__import__("ddpkit.bench.runners.memory_cap").bench.runners.memory_cap.unavailable() is not None,
                    reason="no memory cap here (a memory cgroup needs root, or a delegated cgroup)")
@pytest.mark.slow("three jobs of up to four ranks under a kernel memory cap, one killed")
def test_zero_cap_trains_a_model_larger_than_the_cap_at_world_4_where_ddp_is_killed(tmp_path, capfd):
    out = tmp_path / "cap.json"
    assert main(["bench", "--zero", "--zero-cap-mb", "96", "--world-sizes", "2", "4", "--json", str(out),
                 "--no-progress"]) == 0
    found = json.loads(out.read_text())["capped"]
    assert found["model_mb"] >= 1.5 * found["cap_mb"]
    outcome = {(r["setup"], r["world"]): r for r in found["rows"]}
    assert not outcome[("ddp", 2)]["trained"] and outcome[("ddp", 2)]["why"] == "killed by the kernel past the cap"
    assert not outcome[("zero3", 2)]["trained"]  # its rows of the weights and of their gradients: the whole
    assert outcome[("zero3", 4)]["trained"] and 0 < outcome[("zero3", 4)]["peak"] <= found["cap_mb"]
    assert "Under a memory cap of 96 MB per rank" in capfd.readouterr().out


def test_zero_measures_worlds_2_and_3_unless_told(monkeypatch):
    import ddpkit.bench.runners.ranks
    from ddpkit.bench.sections.zero import SETUPS, measure_zero

    worlds = []

    def spawn_ranks(fn, nprocs, args, backend="gloo"):  # records the worlds; writes what a worker would
        worlds.append((fn.__name__, nprocs))
        Path(args[-1]).write_text(json.dumps({s: {"peak": 1.0} for s in SETUPS} if fn.__name__ == "_time_worker"
                                             else {"peak": 1.0}))

    monkeypatch.setattr(ddpkit.bench.runners.ranks, "spawn_ranks", spawn_ranks)
    assert list(measure_zero(BenchConfig(zero=True, workloads=("mlp",)))) == ["mlp world 2", "mlp world 3"]
    assert worlds == [(name, w) for w in (2, 3) for name in ("_time_worker", *["_peak_worker"] * len(SETUPS))]
    worlds.clear()
    assert list(measure_zero(BenchConfig(zero=True, workloads=("mlp",), world_sizes=(4,)))) == ["mlp world 4"]
    assert {w for _, w in worlds} == {4}


def test_zero_config_is_checked():
    with pytest.raises(ValueError, match="--zero --world-sizes 1 2: each must be at least 2"):
        BenchConfig(zero=True, workloads=("mlp",), world_sizes=(1, 2))
    with pytest.raises(ValueError, match="--world-sizes 2 applies to --scaling and --zero"):
        BenchConfig(world_sizes=(2,))
    with pytest.raises(ValueError, match="--zero runs the transformer and the MLP"):
        BenchConfig(zero=True, workloads=("convnet",))
    with pytest.raises(ValueError, match="--zero measures its own table; drop --scaling"):
        BenchConfig(zero=True, scaling=True)


@pytest.mark.parametrize("settings, message", [
    ({"zero": True, "workloads": ("mlp",), "trace": "t.json"}, "--trace does not apply to --zero"),
    ({"zero": True, "workloads": ("mlp",), "engine_cost": True}, "--engine-cost does not apply to --zero"),
    ({"zero": True, "workloads": ("mlp",), "memory": True}, "--memory does not apply to --zero"),
    ({"zero": True, "workloads": ("mlp",), "block": 2}, "--block does not apply to --zero"),
    ({"zero": True, "workloads": ("mlp",), "target_spread": 0.02}, "--target-spread does not apply to --zero"),
    ({"scaling": True, "trace": "t.json"}, "--trace does not apply to --scaling, whose sweeps record no trace"),
    ({"scaling": True, "workloads": ("dp", "strategies")}, "--scaling sweeps the DDP workloads"),
    ({"plot": "p.png"}, "--plot draws --scaling's sweeps"),
])
def test_a_flag_the_measurement_would_not_read_is_refused(tmp_path, monkeypatch, settings, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=message):
        BenchConfig(**settings)


def test_scaling_sweeps_the_ddp_workloads_of_the_default_list():
    from ddpkit.bench.sections.scaling import plan

    jobs = plan(BenchConfig(scaling=True, world_sizes=(1,), mlp_sizes=()))  # dp and strategies (no batch) left out
    assert {name for sweep, name, _ in jobs[1]} == {"convnet", "mlp", "resnet", "transformer", "linear200"}


def test_the_ranks_are_forked_from_one_server_that_imported_torch(tmp_path):
    # Every group of ranks the bench starts (--memory and --zero several per command) comes ready-imported,
    # from a server that is not this process, instead of paying seconds of imports per rank. In a process of its
    # own, as the command's: a process's forkserver keeps the preload it started with, and a test before this one
    # on the same pytest worker may have started one with another.
    import textwrap

    from procs import base_env

    driver = textwrap.dedent(f"""
        import json, os, sys
        from pathlib import Path

        def found(rank, caller, out):
            Path(out, f"{{rank}}.json").write_text(json.dumps(
                {{"preloaded": "torch._dynamo" in sys.modules and "ddpkit.bench.sections.zero" in sys.modules,
                  "parent_is_caller": os.getppid() == caller}}))

        if __name__ == "__main__":
            from ddpkit.bench.runners.ranks import spawn_ranks
            for attempt in range(2):
                spawn_ranks(found, 2, args=(os.getpid(), {str(tmp_path)!r}))
                print(json.dumps([json.loads(Path({str(tmp_path)!r}, f"{{r}}.json").read_text()) for r in range(2)]))
    """)
    (tmp_path / "driver.py").write_text(driver)
    done = subprocess.run([sys.executable, str(tmp_path / "driver.py")], capture_output=True, text=True,
                          timeout=120, env=base_env(), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [json.loads(line) for line in done.stdout.splitlines()] == \
        [[{"preloaded": True, "parent_is_caller": False}] * 2] * 2


def test_the_capped_tables_report_holds_its_summary(tmp_path, monkeypatch):
    # --report with --zero-cap-mb wrote the JSON only (its summary.md never came); the measurement itself is
    # test_zero_cap_...'s, so it is replaced here.
    import ddpkit.bench.runners.memory_cap
    import ddpkit.bench.sections.capped
    from ddpkit.bench.command import run

    monkeypatch.setattr(ddpkit.bench.runners.memory_cap, "unavailable", lambda: None)
    monkeypatch.setattr(ddpkit.bench.sections.capped, "measure_capped", lambda cfg: {"rows": []})
    monkeypatch.setattr(ddpkit.bench.sections.capped, "format_capped", lambda found: "THE CAPPED TABLE")
    assert run(BenchConfig(zero=True, zero_cap_mb=96, workloads=("mlp",), report=tmp_path / "r")) == []
    assert "THE CAPPED TABLE" in (tmp_path / "r" / "summary.md").read_text()
    assert json.loads((tmp_path / "r" / "bench.json").read_text())["capped"] == {"rows": []}


def test_the_capped_table_sizes_its_model_from_the_cap_and_says_each_outcome():
    # The cap's bench, without the cap (that is test_zero_cap_...): the model is 1.5 times the cap or more, and
    # the table says which setup trained and which the kernel killed.
    from ddpkit.bench.sections.capped import _WIDTH, _depth, format_capped

    for cap in (16, 64, 1000):
        weights = _depth(cap) * (_WIDTH * _WIDTH + _WIDTH) * 4 / 1e6
        assert 1.5 * cap <= weights < 1.5 * cap + 1.1  # at most one layer more than 1.5 times the cap
    table = format_capped({"cap_mb": 64, "model_mb": 96.7, "layers": 92, "rows": [
        {"setup": "ddp", "world": 2, "trained": False, "peak": None, "why": "killed by the kernel past the cap"},
        {"setup": "zero3", "world": 4, "trained": True, "peak": 61.4}]})
    assert "1.51 x the cap" in table and "killed by the kernel past the cap" in table and "61.4" in table


def test_the_memory_figures_read_this_process():
    from ddpkit.bench.sections.memory import fix_mmap_threshold, in_use, peaks

    fix_mmap_threshold()
    rss, private = in_use()
    peak_rss, peak_private = peaks()
    assert 0 < private <= rss and peak_rss >= rss - 1 and peak_private > 0  # two counters, rounded apart


def test_the_scaling_tables_fit_a_terminal_and_carry_every_recorded_point() -> None:
    from ddpkit.bench.sections.scaling import ScalingPoint, format_scaling

    recorded = json.loads((Path(__file__).parents[2] / "docs" / "bench" / "scaling" / "bench.json").read_text())
    points = [ScalingPoint(**{**p, "ratio_iqr": tuple(p["ratio_iqr"])}) for p in recorded["points"]]
    lines = format_scaling(points).splitlines()
    assert max(len(line) for line in lines) <= 100
    rows = [line.split() for line in lines if line.startswith(("weak", "strong", "size"))]
    assert len(rows) == 2 * len(points)  # the times, then the throughput
    for p, times, rates in zip(points, rows, rows[len(points):]):
        assert times[:4] == rates[:4] == [p.sweep, p.workload, str(p.world_size), f"{p.params:,}"]
        assert times[5:] == [f"{p.ddpkit_ms:.2f}", f"{p.torch_ms:.2f}", f"{p.ratio:.3f}"]
        assert rates[4:6] == [f"{p.throughput('ddpkit'):.1f}", f"{p.throughput('torch'):.1f}"]
