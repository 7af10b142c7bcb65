#!/bin/sh
# For --no-python under --on-failure continue: a wrapper script that runs ft_train.py as its child (not by exec),
# so that the worker's own process is the shell and the program that beats is the one below it.
"$PYTHON" "$(dirname "$0")/ft_train.py"
