#!/bin/sh
# For --no-python: a worker that is not a Python program.
echo "SHELL-WORKER RANK=$RANK ROLE=$ROLE_NAME ARGS=$*"
