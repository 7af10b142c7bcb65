"""What a benchmark says: statistics over its samples, tables that fit a terminal, progress while it runs, and the
report directory (``ddpkit bench --report``)."""
