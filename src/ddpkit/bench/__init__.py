"""``ddpkit bench``: ddpkit's engines timed side by side with torch's.

Made of the few things a benchmark is: ``bench_config`` (the flags), ``workloads`` (the models and batches timed,
one step of each), ``runners/`` (ranks, a memory cap, dispatch counted), ``report/`` (statistics, tables, progress,
the report directory), ``sections/`` (one module per table) and ``command`` (plain ``ddpkit bench``: its sections
in order). Imports run down that list's reverse: ``tests/test_layers.py`` keeps it.
"""

RANKS_IMPORT = ("torch", "torch._dynamo", "ddpkit.bench.command", "ddpkit.bench.sections.memory",
                "ddpkit.bench.sections.zero", "ddpkit.bench.sections.capped", "ddpkit.bench.sections.scaling",
                "ddpkit.bench.sections.allreduce_perf")
"""What the server that the bench's ranks are forked from imports once for all of them (``runners/ranks.py``):
the ranks' modules and what they import. Here, named by the package, since the ranks run every layer of it."""
