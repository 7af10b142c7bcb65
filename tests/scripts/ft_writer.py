"""The end of a run under ``ddpkit launch --on-failure continue``: its final files written once, by the first member
of the view (``Membership.by_the_first``, as ``ddpkit train``'s loops write their summary). ``WRITER_DIES=1``: the
first member SIGKILLs itself where it would write (``raise``: it fails to write), so the next first member must
write instead. Each writer adds its member id to the file ``OUT``, member 0 after ``WRITE_S`` seconds of writing.
``TEARDOWN_S``: each process's interpreter teardown takes that long (a module global whose destructor waits, as a
large native object's may), after its beats have stopped. ``GO_FILE``: each member builds the first view's group,
then waits for that file before it writes (what an intruder does meanwhile is the test's)."""

import os
import signal
import time

import ddpkit
from ddpkit.runtime import membership

ddpkit.init()
members = membership.current()
assert members is not None, "run me under ddpkit launch --on-failure continue"


class SlowToGo:
    def __del__(self) -> None:
        time.sleep(float(os.environ.get("TEARDOWN_S", "0")))


kept = SlowToGo()  # a module global: destroyed in the teardown, once the daemon threads are stopped


def write(alive: list[int]) -> None:
    print(f"WRITING member {members.member}", flush=True)
    if os.environ.get("WRITER_DIES") == "1" and members.member == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get("WRITER_DIES") == "raise" and members.member == 0:
        raise OSError(28, "No space left on device")  # its own failure, not the store's
    if members.member == 0:
        time.sleep(float(os.environ.get("WRITE_S", "0")))  # (a large model's files)
    with open(os.environ["OUT"], "a") as f:
        f.write(f"{members.member} {alive}\n")


print(f"READY member {members.member}", flush=True)
if os.environ.get("GO_FILE"):
    members.barrier()  # the first view's group built: its keys are in the store
    while not os.path.exists(os.environ["GO_FILE"]):
        time.sleep(0.02)
members.by_the_first(members.latest(), write)
print(f"DONE member {members.member}", flush=True)
