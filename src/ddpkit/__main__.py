"""``python -m ddpkit`` is the same as the ``ddpkit`` console script."""

from ddpkit.cli import run

if __name__ == "__main__":
    run()
