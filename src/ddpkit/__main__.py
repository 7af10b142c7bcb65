"""``python -m ddpkit`` is the same as the ``ddpkit`` console script."""

from ddpkit.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
