"""``ddpkit doctor``: the environment report, then the self-test; exit 1 when anything failed.

Text by default, one JSON document with ``--json``. Each failure names the
backend and device and says what to do.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ddpkit.doctor.doctor_config import DoctorConfig
from ddpkit.doctor.environment import collect, problems
from ddpkit.doctor.selftest import plan, run_group

__all__ = ["format_report", "run"]


def run(cfg: DoctorConfig) -> int:
    """Check this machine (see the module notes); print the report; return the exit code."""
    start = time.perf_counter()
    report: dict[str, Any] = {"environment": collect()}
    report["problems"] = problems(report["environment"])
    groups: list[dict[str, Any]] = []
    if cfg.selftest:
        gpus = len(report["environment"]["gpus"])
        nproc = cfg.nproc_per_node or (gpus or 2)
        for group in plan(report["environment"]["backends"], gpus, nproc, cfg.backends):
            group["timeout"] = cfg.timeout
            if "fail" in group or "skip" in group:
                name = f"{group['backend']} / {group['device']}"
                groups.append({**group, "name": name, "ok": "skip" in group,
                               "error": group.get("fail", ""), "fix": group.get("skip", "")})
                continue
            groups.append(run_group(group))
    report["selftest"] = groups
    report["ok"] = not report["problems"] and all(g["ok"] for g in groups)
    report["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(report, indent=2) if cfg.json else format_report(report), flush=True)
    return 0 if report["ok"] else 1


def format_report(report: dict[str, Any]) -> str:
    env = report["environment"]
    t = env["torch"]
    cuda = (f"CUDA {t['cuda']}, cuDNN {t['cudnn']}, NCCL {t['nccl']}" if t["cuda_available"]
            else f"no CUDA device (torch built {'with CUDA ' + t['cuda'] if t['cuda'] else 'for the CPU'})")
    lines = ["ddpkit doctor", "",
             f"python   {env['python']['version']} ({env['python']['executable']}), {env['platform']}, "
             f"{env['cpus']} CPUs",
             f"torch    {t['version']}; {cuda}; ddpkit {env['ddpkit']}"]
    for gpu in env["gpus"]:
        lines.append(f"gpu {gpu['index']}    {gpu['name']}, {gpu['memory_gib']} GiB, compute capability "
                     f"{gpu['capability']}")
    lines.append("backends " + "; ".join(f"{b} {'yes' if i['available'] else 'no (' + i['why'] + ')'}"
                                         for b, i in env["backends"].items()))
    mpi = env["backends"]["mpi"]
    if "name" in mpi:
        aware = {True: "CUDA-aware", False: "not CUDA-aware", None: "CUDA-awareness unknown"}[mpi["cuda_aware"]]
        lines.append(f"mpi      {mpi['name']} (MPI {mpi['standard']}, mpi4py {mpi['mpi4py']}), thread level "
                     f"{mpi['thread_level']}, {aware}; {mpi.get('mpirun', 'no mpirun')}")
    net = env["network"]
    lines.append(f"network  gloo uses {net['interface'] or '?'} ({net['why']}; set GLOO_SOCKET_IFNAME to choose)")
    if env["env"]:
        lines.append("env      " + " ".join(f"{k}={v}" for k, v in env["env"].items()))
    for problem in report["problems"]:
        lines.append(f"PROBLEM  {problem}")
    if report["selftest"]:
        lines += ["", f"self-test ({report['selftest'][0]['world']} ranks)"]
    for group in report["selftest"]:
        if "checks" not in group:
            verdict = "skipped" if group["ok"] else "FAILED"
            lines.append(f"  {group['name']}: {verdict}: {group.get('error') or group.get('fix')}")
            if not group["ok"] and group.get("fix"):
                lines.append(f"    fix: {group['fix']}")
            continue
        lines.append(f"  {group['name']}: {'ok' if group['ok'] else 'FAILED'} ({group['seconds']:.1f} s)")
        for check in group["checks"]:
            lines.append(f"    {'ok  ' if check['ok'] else 'FAIL'} {check['check']}: {check['detail']}")
        if not group["ok"]:
            lines.append(f"    fix: {group['fix']}")
    failed = [g["name"] for g in report["selftest"] if not g["ok"]]
    lines += ["", f"result: {'ok' if report['ok'] else 'FAILED'}"
              + (f" ({', '.join(failed)})" if failed else "")
              + (f", {len(report['problems'])} problem(s) in the environment" if report["problems"] else "")
              + f" in {report['seconds']} s"]
    return "\n".join(lines)
