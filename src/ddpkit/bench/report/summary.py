"""``ddpkit bench --report DIR``: the measurements as a directory a person reads.

``DIR`` holds ``bench.json`` (everything, for scripts), the Chrome traces
(``trace-WORKLOAD.json``), ``ratios.png`` (each workload's ratio with its
quartiles, and the overlap of both engines) or, with ``--scaling``,
``scaling.png`` and ``scaling-sizes.png``, and ``summary.md``: the command
that reproduces it, the machine, the tables and the pictures. The README's
benchmark section is this summary.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ddpkit.bench.bench_config import BenchConfig
from ddpkit.bench.report.stats import verdict


def memory_ratio(m: dict[str, Any], suffix: str = "") -> float:
    """ddpkit / torch of one workload's private (``suffix=""``) or resident (``"_rss"``) peak memory."""
    torch_mb = m.get(f"torch{suffix}_mb", 0.0)
    return m[f"ddpkit{suffix}_mb"] / torch_mb if torch_mb > 0 else float("nan")


def command_line(cfg: BenchConfig) -> str:
    """The ``ddpkit bench`` command with these settings (the flags that differ from their defaults)."""
    words = ["ddpkit", "bench"]
    derived = {"json_path", "trace", "plot"} if cfg.report is not None else set()
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.name in derived or value == default or value in ((), None) and default in ((), None):
            continue
        flag = (f.metadata.get("flags") or ["--" + f.name.replace("_", "-")])[-1]
        if isinstance(value, bool):
            words.append(flag if value else (f.metadata.get("negate") or ""))
        elif isinstance(value, tuple):
            words += [flag, *(f"{v:g}" if isinstance(v, float) else str(v) for v in value)]
        else:
            words += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    return " ".join(w for w in words if w)


def table_page(title: str, cfg: BenchConfig, table: str, *after: str) -> str:
    """A ``summary.md`` of one table: its title, the command that made it, the table, then ``after``'s lines."""
    return "\n".join([f"# {title}", "", f"`{command_line(cfg)}`", "", "```", table, "```", "", *after])


def _machine(data: dict[str, Any]) -> list[str]:
    start, end = data["machine_at_start"], data["machine_at_end"]
    load = (f"load average (1 min) {start['load_average'][0]:.2f} at start, {end['load_average'][0]:.2f} at end"
            if start.get("load_average") else "load average unknown")
    where = "gloo, 1 thread per rank" if data.get("backend", "gloo") == "gloo" else \
        f"{data['backend']}, one GPU per rank" + (f" ({start['gpu']})" if start.get("gpu") else "")
    return [f"torch {start['torch']}, ddpkit {start['ddpkit']}, Python {start['python']}, {start['platform']}; "
            f"{start['cpu_count']} CPUs; {load}; {where}."]


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def ratio_plot(rows: list[dict[str, Any]], path: Path) -> Path:
    """Each workload's ratio with its quartiles, and both engines' overlap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["workload"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    at = range(len(rows))
    left.errorbar(at, [r["ratio"] for r in rows], fmt="o", capsize=4, label="IQR of the pairs",
                  yerr=[[r["ratio"] - r["ratio_iqr"][0] for r in rows], [r["ratio_iqr"][1] - r["ratio"] for r in rows]])
    cis = [r.get("ratio_ci") or (r["ratio"], r["ratio"]) for r in rows]
    left.errorbar([i + 0.12 for i in at], [r["ratio"] for r in rows], fmt="none", capsize=6, elinewidth=3,
                  yerr=[[r["ratio"] - c[0] for r, c in zip(rows, cis)], [c[1] - r["ratio"] for r, c in zip(rows, cis)]],
                  label="95% CI of the median")
    left.axhline(1.0, linestyle=":", color="grey")
    left.legend(fontsize="small")
    left.set_ylabel("ddpkit / torch step time (median ratio)")
    left.set_title("ratio (below 1: ddpkit faster)")
    width = 0.38
    for k, engine in enumerate(("ddpkit", "torch")):
        right.bar([i + (k - 0.5) * width for i in range(len(rows))],
                  [r[f"overlap_{engine}"] or 0.0 for r in rows], width, label=engine)
    right.set_ylim(0, 1)
    right.set_ylabel("all-reduce time hidden behind gradient computation")
    right.set_title("overlap (from the traced steps)")
    right.legend()
    for ax in (left, right):
        ax.set_xticks(range(len(rows)), names)
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_report(cfg: BenchConfig, data: dict[str, Any]) -> Path:
    """``summary.md`` (and ``ratios.png``) for an engine bench whose JSON is ``data``."""
    assert cfg.report is not None
    rows = data["ddp"]
    lines = ["# ddpkit bench", "", f"`{command_line(cfg)}`", "", *_machine(data), ""]
    if rows:
        ratio_plot(rows, cfg.report / "ratios.png")
        lines += [
            f"## DDP: ddpkit against torch, world size {cfg.world_size}", "",
            "| workload | params | steps | ddpkit ms (IQR) | torch ms (IQR) | ratio (IQR) | ratio 95% CI | ddpkit is "
            "| comm alone ms | exposed ms | overlap ddpkit / torch |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
        ]
        for r in rows:
            ci = r.get("ratio_ci") or r["ratio_iqr"]
            lines.append(
                f"| {r['workload']} | {r['params']:,} | {r['steps']} | {r['ddpkit_ms']:.2f} "
                f"({r['ddpkit_iqr_ms'][0]:.2f}-{r['ddpkit_iqr_ms'][1]:.2f}) | {r['torch_ms']:.2f} "
                f"({r['torch_iqr_ms'][0]:.2f}-{r['torch_iqr_ms'][1]:.2f}) | {r['ratio']:.3f} "
                f"({r['ratio_iqr'][0]:.3f}-{r['ratio_iqr'][1]:.3f}) | {ci[0]:.3f}-{ci[1]:.3f} | {verdict(ci)} | "
                f"{r['comm_ms']:.2f} | {r['exposed_ddpkit_ms']:.2f} | "
                f"{_share(r['overlap_ddpkit'])} / {_share(r['overlap_torch'])} |")
        traces = sorted(p.name for p in cfg.report.glob("trace*.json"))
        lines += [
            "", "![ratio and overlap per workload](ratios.png)", "",
            "- *ratio*: the median over back-to-back pairs of steps (one per engine) of ddpkit / torch, with its "
            "quartiles; below 1, ddpkit is faster. It can sit on the other side of 1 than the two medians when the "
            "pairs disagree; the IQR shows it.",
            "- *ratio 95% CI*: where the median ratio itself lies (order statistics over the pairs; more `--steps` "
            "narrow it). *ddpkit is* faster or slower when the interval lies on one side of 1, level otherwise.",
            "- *comm alone*: all-reduce of ddpkit's gradient buckets with nothing else running.",
            "- *exposed*: ddpkit's median wait for communication at the end of backward (on the rank that arrived "
            "last, so skew between ranks is left out).",
            "- *overlap*: the share of all-reduce time (union of the bucket spans) that ran while gradients were "
            "still being computed (from backward's start to the last gradient), median over traced steps run after "
            "the timed ones.",
            f"- Traces (open in https://ui.perfetto.dev): {', '.join(traces) if traces else 'none'}.",
        ]
    costed = [r for r in rows if r.get("noop_ratio") is not None]
    if costed:
        lines += ["", "## The engines' own cost", "",
                  "Both engines with the same no-op comm hook (`ddpkit.hooks.noop_hook`): neither communicates, so "
                  "the ratio is each engine's bookkeeping alone, fair at world 1 too (where ddpkit skips the "
                  "all-reduce that torch's DDP still runs). Peak memory: each engine's steps on the GPU above what "
                  "was allocated before it was built, the largest over ranks.", "",
                  "| workload | ddpkit ms | torch ms | ratio (IQR) | ratio with defaults | peak MiB ddpkit | peak MiB "
                  "torch |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in costed:
            peak = " | ".join("-" if r.get(k) is None else f"{r[k]:,.0f}"
                               for k in ("ddpkit_peak_mib", "torch_peak_mib"))
            lines.append(f"| {r['workload']} | {r['ddpkit_noop_ms']:.2f} | {r['torch_noop_ms']:.2f} | "
                         f"{r['noop_ratio']:.3f} ({r['noop_ratio_iqr'][0]:.3f}-{r['noop_ratio_iqr'][1]:.3f}) | "
                         f"{r['ratio']:.3f} | {peak} |")
    if data.get("memory"):
        lines += ["", "## Peak memory per rank", "",
                  "Above each process's own baseline (interpreter, torch, process group), each engine and workload "
                  "in processes of its own, the largest over ranks (`--memory`). *Private*: the process's own "
                  "pages (tensors, heap, Python objects); *RSS*: with the pages of shared libraries' code it touched, "
                  "which the ranks of a machine share.", "",
                  "| workload | ddpkit private MB | torch private MB | ddpkit / torch | ddpkit RSS MB | torch RSS MB "
                  "| ddpkit / torch |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for name, m in data["memory"].items():
            rss = (f"{m['ddpkit_rss_mb']:.1f} | {m['torch_rss_mb']:.1f} | {memory_ratio(m, '_rss'):.3f}"
                   if "ddpkit_rss_mb" in m else "- | - | -")
            lines.append(f"| {name} | {m['ddpkit_mb']:.1f} | {m['torch_mb']:.1f} | {memory_ratio(m):.3f} | {rss} |")
    if data.get("dp"):
        dp = data["dp"]
        lines += ["", "## DataParallel against DDP", "",
                  f"The ConvNet on a global batch of {dp['global_batch']}: `ddpkit.DataParallel` ({dp['replicas']} "
                  f"replicas in one process) against ddpkit's DDP ({dp['replicas']} processes), rounds interleaved.",
                  "", "| DataParallel ms | DDP ms | DP / DDP (IQR) | rounds |", "| ---: | ---: | ---: | ---: |",
                  f"| {dp['dp_ms']:.2f} | {dp['ddp_ms']:.2f} | {dp['ratio']:.2f} ({dp['ratio_q1']:.2f}-"
                  f"{dp['ratio_q3']:.2f}) | {dp['rounds']} |"]
    if data.get("strategies"):
        lines += _strategies_section(cfg, data["strategies"])
    path = cfg.report / "summary.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _strategies_section(cfg: BenchConfig, rows: list[dict[str, Any]]) -> list[str]:
    ddp_bytes = {r["workload"]: r["bytes_per_step"] for r in rows if r["strategy"] == "ddp"}
    lines = ["", "## Strategies on ddpkit's engine", "",
             f"DDP, `DistributedOptimizer`, `LocalSGD` (parameters averaged every {cfg.local_sgd_period} steps, no "
             f"warm-up) and PowerSGD (rank {cfg.powersgd_rank}) trained side by side, rounds interleaved, each timed "
             "over blocks of one averaging period.", "",
             "| workload | strategy | ms/step (IQR) | / DDP (IQR) | MB sent/step | bytes / DDP |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        base = ddp_bytes.get(r["workload"]) or float("nan")
        lines.append(
            f"| {r['workload']} | {r['strategy']} | {r['ms']:.2f} ({r['iqr_ms'][0]:.2f}-{r['iqr_ms'][1]:.2f}) | "
            f"{r['ratio_to_ddp']:.3f} ({r['ratio_iqr'][0]:.3f}-{r['ratio_iqr'][1]:.3f}) | "
            f"{r['bytes_per_step'] / 1e6:.3f} | {r['bytes_per_step'] / base:.3f} |")
    lines += ["", "- *MB sent/step*: the payload one rank hands to all-reduce and broadcast per step (a ring sends "
              "about twice that over the wire)."]
    return lines


def write_scaling_report(cfg: BenchConfig, data: dict[str, Any], table: str, plots: list[Path]) -> Path:
    """``summary.md`` for ``--scaling``: the table and the plots."""
    assert cfg.report is not None
    lines = ["# ddpkit bench --scaling", "", f"`{command_line(cfg)}`", "", *_machine(data), "", "```", table, "```",
             "", *(f"![{p.stem}]({p.name})" for p in plots), "",
             "Weak scaling keeps the batch per rank, strong scaling the global batch; efficiency is throughput over "
             "linear scaling from the smallest world size. On fewer cores than ranks efficiency falls for reasons "
             "that are not the engines'."]
    path = cfg.report / "summary.md"
    path.write_text("\n".join(lines) + "\n")
    return path
