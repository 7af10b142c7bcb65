"""``ddpkit bench links``: training across shaped links between network namespaces (:mod:`.testbed` makes them)."""
