"""Every tensor the package hands a collective is on the group's device (NCCL takes no CPU tensor).

The CPU suite runs on gloo, where a CPU tensor is as good as any, so the
check reads the code (:mod:`device_lint`). It is tested three ways: on the
package (no finding), on the bugs that crashed ``ddpkit train`` and
``ddpkit bench`` on the first GPU machine planted back into today's code
(each found), and on every site that takes its device the package's one way
(:mod:`ddpkit.runtime.devices`), each turned into a plain ``torch.tensor``
in turn (each found: the check sees every site, it cannot pass by seeing
nothing).
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest
from device_lint import check_source, check_tree, package_wrappers

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "ddpkit"


def test_the_package_hands_collectives_only_tensors_on_the_groups_device():
    found = check_tree(PACKAGE)
    assert not found, "tensors made off the group's device and handed to a collective (make them with " \
                      "ddpkit.runtime.devices.comm_tensor / comm_device):\n" + "\n".join(map(str, found))


def _planted(relative: str, old: str, new: str) -> list:
    path = PACKAGE / relative
    source = path.read_text()
    assert old in source, f"{relative} no longer holds the line this test plants a bug into: update the test"
    return check_source(source.replace(old, new, 1), relative)


def test_the_bug_that_crashed_ddpkit_train_on_cuda_is_found_when_planted_back():
    # train/loop.py before the fix: the epoch's totals made on the CPU, then all-reduced on the NCCL group.
    found = _planted(
        "train/loop.py",
        "    totals = comm_tensor([loss_sum.item(), count, count - resumed_with], torch.float64)\n",
        "    totals = torch.tensor([0.0, count, count - resumed_with], dtype=torch.float64)\n"
        "    totals[0] = loss_sum.cpu()\n",
    )
    assert [(f.collective, "without device=" in f.why) for f in found] == [("dist.all_reduce", True)], found


def test_the_bug_that_crashed_ddpkit_bench_on_cuda_is_found_when_planted_back():
    found = _planted(
        "bench/sections/engines.py",
        "    mine = comm_tensor(exposed, torch.float64)\n",
        "    mine = torch.tensor(exposed, dtype=torch.float64)\n",
    )
    assert [f.collective for f in found] == ["dist.all_gather"], found


class _OneSiteOffDevice(ast.NodeTransformer):
    """Rewrites the ``index``-th use of the device rule in a module the way it was written before it."""

    def __init__(self, index: int) -> None:
        self.index, self.seen, self.done = index, -1, False
        self.order: list[ast.Call] = []
        """The uses met, in the order they are numbered."""

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        if not isinstance(node.func, ast.Name) or node.func.id not in ("comm_tensor", "comm_device"):
            return node
        name = node.func.id
        self.seen += 1
        self.order.append(node)
        if self.seen != self.index:
            return node
        self.done = True
        if name == "comm_device":  # the device it names becomes the CPU
            return ast.parse('torch.device("cpu")', mode="eval").body
        dtype = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "dtype"),
                                                              None)
        data = node.args[0]
        if isinstance(data, (ast.List, ast.ListComp, ast.Constant, ast.Tuple)):
            # comm_tensor([...], dtype) as it used to be written: torch.tensor([...], dtype=dtype)
            return ast.Call(func=ast.parse("torch.tensor", mode="eval").body, args=[data],
                            keywords=[ast.keyword("dtype", dtype)] if dtype is not None else [])
        return ast.Call(func=ast.Attribute(value=data, attr="cpu"), args=[], keywords=[])  # a tensor: left on the CPU


def _sites() -> list[tuple[str, int]]:
    """Each use of the rule in the package, but those a function returns to its callers (the reducer's
    ``comm_device()`` method): what a caller does with a returned device is not followed."""
    sites = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "devices.py":
            continue
        tree = ast.parse(path.read_text())
        returned = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Return)}
        mutant = _OneSiteOffDevice(-1)
        mutant.visit(tree)
        uses = [n for n in mutant.order]
        sites += [(str(path.relative_to(PACKAGE)), i) for i, n in enumerate(uses) if id(n) not in returned]
    return sites


SITES = _sites()


def test_the_package_uses_the_device_rule_at_its_collectives():
    # The places that crashed on the GPU and the ones that had a rule of their own now share one.
    users = {site for site, _ in SITES}
    assert {"train/loop.py", "train/evaluate.py", "train/checkpoint.py", "train/state.py", "bench/sections/engines.py",
            "runtime/objects.py", "parallel/syncbn.py", "comm/allreduce.py"} <= users, users


@pytest.mark.parametrize("relative, index", SITES, ids=[f"{s}#{i}" for s, i in SITES])
def test_each_site_of_the_device_rule_is_seen_by_the_check(relative, index):
    source = (PACKAGE / relative).read_text()
    before = check_source(source, relative, package_wrappers(PACKAGE))
    mutant = _OneSiteOffDevice(index)
    tree = mutant.visit(ast.parse(source))
    assert mutant.done
    after = check_source(ast.unparse(ast.fix_missing_locations(tree)), relative, package_wrappers(PACKAGE))
    assert len(after) > len(before), f"{relative}: use #{index} of comm_tensor/comm_device turned into a CPU " \
                                     "tensor, and the check did not see it"


# -- the check on its own terms: what it follows, what it accepts -------------------------------------------

def _findings(body: str) -> list[str]:
    source = "import torch\nimport torch.distributed as dist\n\n\ndef f(x, device):\n" + \
             textwrap.indent(textwrap.dedent(body), "    ")
    return [f.why for f in check_source(source)]


@pytest.mark.parametrize("body", [
    "dist.all_reduce(torch.tensor([1.0]))",
    "t = torch.zeros(3, dtype=torch.float64)\nt[0] = x.sum()\ndist.all_reduce(t)",
    "t = torch.zeros(3, device='cpu')\ndist.all_reduce(t)",
    "t = torch.zeros(3, device=torch.device('cpu'))\ndist.broadcast(t, src=0)",
    "d = torch.device('cpu')\nt = torch.ones(2, device=d)\ndist.all_reduce(t)",
    "t = x.detach().cpu()\nparts = [torch.empty_like(t) for _ in range(2)]\ndist.all_gather(parts, t.to(device))",
    "parts = []\nparts.append(torch.zeros(1))\ndist.all_gather(parts, x)",
    "t = torch.stack([x.cpu(), x.cpu()])\ndist.all_reduce(t.clone().view(-1))",
    "t = x.to('cpu')\ndist.all_reduce(t, op=dist.ReduceOp.MAX)",
    "t = x.to(device).double()\nt = t.cpu()\ndist.all_reduce(t)",
    "import ddpkit.comm.allreduce as c\nc.all_reduce(torch.ones(3))",
])
def test_the_check_finds_a_tensor_off_the_device(body):
    assert len(_findings(body)) == 1


@pytest.mark.parametrize("body", [
    "dist.all_reduce(torch.tensor([1.0], device=device))",
    "t = torch.tensor(1.0)\nt = t.to(device)\ndist.all_reduce(t)",
    "t = x.detach().to(torch.float64)\ndist.all_reduce(t)",
    "if x:\n    t = x.cpu()\n    y = t\nelse:\n    t = x.to(device)\n    dist.all_reduce(t)",
    "parts = [torch.empty_like(x) for _ in range(2)]\ndist.all_gather(parts, x)\nparts = [p.cpu() for p in parts]",
    "t = torch.zeros(1)\ndist.all_reduce(t)  # cpu group: the servers' gloo channel",
    "dist.all_reduce(x.grad)",
])
def test_the_check_accepts_a_tensor_on_the_device_or_from_elsewhere(body):
    assert _findings(body) == []
