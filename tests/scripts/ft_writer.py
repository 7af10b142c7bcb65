"""The end of a run under ``ddpkit launch --on-failure continue``: its final files written once, by the first member
of the view (``Membership.by_the_first``, as ``ddpkit train``'s loops write their summary). ``WRITER_DIES=1``: the
first member SIGKILLs itself where it would write, so the next first member must write instead. Each writer adds
its member id to the file ``OUT``. ``TEARDOWN_S``: each process's interpreter teardown takes that long (a module
global whose destructor waits, as a large native object's may), after its beats have stopped."""

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
    if os.environ.get("WRITER_DIES") == "1" and members.member == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    with open(os.environ["OUT"], "a") as f:
        f.write(f"{members.member} {alive}\n")


members.by_the_first(members.latest(), write)
print(f"DONE member {members.member}", flush=True)
