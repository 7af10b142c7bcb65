"""``ddpkit bench``: ddpkit's engines timed side by side with torch's."""
