"""The end of a run under ``ddpkit launch --on-failure continue``: its final files written once, by the first member
of the view (``Membership.by_the_first``, as ``ddpkit train``'s loops write their summary). ``WRITER_DIES=1``: the
first member SIGKILLs itself where it would write, so the next first member must write instead. Each writer adds
its member id to the file ``OUT``."""

import os
import signal

import ddpkit
from ddpkit.runtime import membership

ddpkit.init()
members = membership.current()
assert members is not None, "run me under ddpkit launch --on-failure continue"


def write() -> None:
    if os.environ.get("WRITER_DIES") == "1" and members.member == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    with open(os.environ["OUT"], "a") as f:
        f.write(f"{members.member}\n")


view = members.by_the_first(members.latest(), write)
print(f"DONE member {members.member} view {view.generation} {list(view.members)}", flush=True)
