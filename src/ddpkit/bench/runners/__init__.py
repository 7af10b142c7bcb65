"""How a benchmark's measurements run: ranks spawned for it, a memory cap around them, the engine's dispatch counted.

The bottom of ``bench/``: nothing here knows a workload, a section or the report.
"""
