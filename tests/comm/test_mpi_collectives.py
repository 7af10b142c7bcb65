"""The mpi backend against gloo: every collective, op and dtype, sync and async, subgroups.

Each case runs the same torch.distributed call with the same per-rank inputs
on a gloo pool and on an mpirun pool, and the results are compared. Where
gloo refuses a case (AVG, PREMUL_SUM, some dtypes), the mpi result is
checked against the reduction computed here from every rank's inputs (NCCL's
meaning), and where both refuse, both must raise. At world 2 a sum has one
order, so floating results must be equal bit for bit; at world 3 MPI's
algorithm may add in another order than gloo's ring, hence a tolerance of a
few units in the last place of the dtype there.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.slow("starts mpirun jobs of 2 and 3 ranks beside gloo pools, about 40 s")

DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "bool",
          "complex64"]
OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG", "PREMUL_SUM"]


def make(dtype_name: str, rank: int, shape: tuple[int, ...] = (5, 3), salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input: small values (products stay in range), the same in every process."""
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(1000 * rank + 17 * salt + 1)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    low = 0 if dtype == torch.uint8 else -3
    return torch.randint(low, 4, shape, generator=g).to(dtype)


def _op(name: str):
    if name == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(0.5) if hasattr(dist, "_make_nccl_premul_sum") else \
            dist.ReduceOp.PREMUL_SUM(0.5)
    return getattr(dist.ReduceOp, name)


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 - the error's type is the outcome
        return ("error", type(e).__name__, str(e).splitlines()[0][:200])


def reductions(dtype_name: str, async_op: bool) -> dict:
    """Every reducing collective with every op, on this rank's inputs; outcomes by case."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for op in OPS:
        def all_reduce():
            t = make(dtype_name, rank)
            work = dist.all_reduce(t, op=_op(op), async_op=async_op)
            if async_op:
                work.wait()
            return t

        def reduce():
            t = make(dtype_name, rank)
            dist.reduce(t, dst=1, op=_op(op))
            return t if rank == 1 else None

        def reduce_scatter_tensor():
            t = torch.zeros(2, 3, dtype=getattr(torch, dtype_name))
            src = make(dtype_name, rank, (2 * world, 3))
            work = dist.reduce_scatter_tensor(t, src, op=_op(op), async_op=async_op)
            if async_op:
                work.wait()
            return t

        def reduce_scatter():
            t = torch.zeros(2, 3, dtype=getattr(torch, dtype_name))
            src = make(dtype_name, rank, (2 * world, 3))
            dist.reduce_scatter(t, list(src.chunk(world)), op=_op(op))
            return t

        for name, fn in (("all_reduce", all_reduce), ("reduce", reduce),
                         ("reduce_scatter_tensor", reduce_scatter_tensor), ("reduce_scatter", reduce_scatter)):
            out[(name, op)] = _outcome(fn)
    return out


def movements(dtype_name: str, async_op: bool) -> dict:
    """Every collective that moves data without reducing it, on this rank's inputs."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, dtype_name)
    x = make(dtype_name, rank, (4, 3))
    cases = {}

    def waited(work):
        if async_op:
            work.wait()

    def broadcast():
        t = x.clone()
        waited(dist.broadcast(t, src=1, async_op=async_op))
        return t

    def all_gather():
        outs = [torch.zeros_like(x) for _ in range(world)]
        waited(dist.all_gather(outs, x, async_op=async_op))
        return outs

    def all_gather_into_tensor():
        out = torch.zeros(world * 4, 3, dtype=dtype)
        waited(dist.all_gather_into_tensor(out, x, async_op=async_op))
        return out

    def all_gather_stacked():
        out = torch.zeros(world, 4, 3, dtype=dtype)
        waited(dist.all_gather_into_tensor(out, x, async_op=async_op))
        return out

    def gather():
        outs = [torch.zeros_like(x) for _ in range(world)] if rank == 1 else None
        waited(dist.gather(x, outs, dst=1, async_op=async_op))
        return outs

    def scatter():
        out = torch.zeros(2, 3, dtype=dtype)
        src = list(make(dtype_name, rank, (2 * world, 3)).chunk(world)) if rank == 0 else None
        waited(dist.scatter(out, src, src=0, async_op=async_op))
        return out

    def all_to_all_single():
        out = torch.zeros(2 * world, 3, dtype=dtype)
        waited(dist.all_to_all_single(out, make(dtype_name, rank, (2 * world, 3)), async_op=async_op))
        return out

    def all_to_all_uneven():
        send = [r + 1 for r in range(world)]  # rank r gets r + 1 rows from everyone
        recv = [rank + 1] * world
        out = torch.zeros(sum(recv), 3, dtype=dtype)
        waited(dist.all_to_all_single(out, make(dtype_name, rank, (sum(send), 3)), recv, send, async_op=async_op))
        return out

    def all_to_all():
        outs = [torch.zeros(2, 3, dtype=dtype) for _ in range(world)]
        ins = list(make(dtype_name, rank, (2 * world, 3)).chunk(world))
        waited(dist.all_to_all(outs, [i.contiguous() for i in ins], async_op=async_op))
        return outs

    def non_contiguous():
        t = make(dtype_name, rank, (3, 5)).t()  # a transposed view: MPI gets a contiguous copy, written back
        waited(dist.broadcast(t, src=0, async_op=async_op))
        return t

    for name, fn in (("broadcast", broadcast), ("all_gather", all_gather),
                     ("all_gather_into_tensor", all_gather_into_tensor), ("all_gather_stacked", all_gather_stacked),
                     ("gather", gather), ("scatter", scatter), ("all_to_all_single", all_to_all_single),
                     ("all_to_all_uneven", all_to_all_uneven), ("all_to_all", all_to_all),
                     ("non_contiguous", non_contiguous)):
        cases[name] = _outcome(fn)
    return cases


def _reference(case: str, op: str, dtype_name: str, world: int) -> torch.Tensor | None:
    """NCCL's meaning of a reduction gloo refuses, from every rank's inputs (None: no meaning, it must raise)."""
    dtype = getattr(torch, dtype_name)
    if op in ("BAND", "BOR", "BXOR") and (dtype.is_floating_point or dtype.is_complex):
        return None
    if op in ("MIN", "MAX", "PRODUCT") and dtype.is_complex:
        return None  # torch's rule (supports_complex)
    if op == "AVG" and dtype == torch.bool:
        return None
    if op == "PREMUL_SUM" and not (dtype.is_floating_point or dtype.is_complex):
        return None  # a floating factor: integer tensors cannot hold the products
    shape = (5, 3) if case in ("all_reduce", "reduce") else (2 * world, 3)
    inputs = [make(dtype_name, r, shape) for r in range(world)]
    if op in ("SUM", "AVG", "PREMUL_SUM"):
        acc = inputs[0] * 0.5 if op == "PREMUL_SUM" else inputs[0].clone()
        for x in inputs[1:]:
            acc = acc + (x * 0.5 if op == "PREMUL_SUM" else x)
        if op == "AVG":
            acc = acc / world if dtype.is_floating_point or dtype.is_complex else torch.div(acc, world,
                                                                                            rounding_mode="trunc")
    elif op == "PRODUCT":
        acc = inputs[0].clone()
        for x in inputs[1:]:
            acc = acc * x if dtype != torch.bool else acc & x
    else:
        combine = {"MIN": torch.minimum, "MAX": torch.maximum, "BAND": torch.bitwise_and, "BOR": torch.bitwise_or,
                   "BXOR": torch.bitwise_xor}[op]
        acc = inputs[0].clone()
        for x in inputs[1:]:
            acc = combine(acc, x)
    acc = acc.to(dtype)
    return acc if case in ("all_reduce", "reduce") else None


def _close(dtype_name: str, world: int):
    """Tolerance of a floating comparison: exact at world 2 (one summation order), a few ulps at world 3."""
    dtype = getattr(torch, dtype_name)
    if world == 2 or not (dtype.is_floating_point or dtype.is_complex):
        return {"rtol": 0, "atol": 0}
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else torch.finfo(torch.float32).eps
    return {"rtol": 4 * eps, "atol": 4 * eps}


def _same(a, b, **tol) -> None:
    if isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y, **tol)
    elif a is None:
        assert b is None
    else:
        torch.testing.assert_close(a, b, equal_nan=True, **tol)


def _compare(gloo: dict, mpi: dict, dtype_name: str, world: int, rank: int) -> list[str]:
    """Where mpi differs from gloo (or, where gloo refuses, from the reference)."""
    wrong = []
    for key, theirs in gloo.items():
        ours = mpi[key]
        case, op = key if isinstance(key, tuple) else (key, None)
        label = f"{case} {op or ''} {dtype_name} rank {rank}"
        if theirs[0] == "ok":
            if ours[0] != "ok":
                wrong.append(f"{label}: gloo gives a result, mpi raises {ours[1:]}")
                continue
            try:
                _same(ours[1], theirs[1], **_close(dtype_name, world))
            except AssertionError as e:
                wrong.append(f"{label}: differs from gloo: {str(e).splitlines()[0]}")
            continue
        expected = _reference(case, op, dtype_name, world) if op is not None else None
        if ours[0] == "error":
            if expected is not None and case == "all_reduce":
                wrong.append(f"{label}: gloo refuses ({theirs[2]}), mpi refuses too ({ours[2]}) though the op "
                             "has a meaning")
            continue
        if expected is None:
            if op is not None and case in ("all_reduce", "reduce") and _reference(case, op, dtype_name, world) is None:
                wrong.append(f"{label}: meaningless, yet mpi returns a result")
            continue
        if case == "reduce" and rank != 1:
            continue
        try:
            _same(ours[1], expected, **_close(dtype_name, world) if world == 3 or op != "PREMUL_SUM" else
                  {"rtol": 0, "atol": 0})
        except AssertionError as e:
            wrong.append(f"{label}: gloo refuses; mpi differs from the reference: {str(e).splitlines()[0]}")
    return wrong


@pytest.mark.parametrize("world", [2, 3])
def test_every_reduction_matches_gloo(world, request):
    gloo_pool, mpi_pool = request.getfixturevalue(f"dist{world}"), request.getfixturevalue(f"mpi{world}")
    wrong = []
    for dtype_name in DTYPES:
        for async_op in (False, True):
            gloo = gloo_pool.run(reductions, dtype_name, async_op)
            mpi = mpi_pool.run(reductions, dtype_name, async_op)
            for rank in range(world):
                wrong += _compare(gloo[rank], mpi[rank], dtype_name, world, rank)
    assert not wrong, "\n".join(wrong)


def expected_movement(case: str, dtype_name: str, rank: int, world: int):
    """What each movement leaves on ``rank``, from every rank's inputs."""
    inputs = [make(dtype_name, r, (4, 3)) for r in range(world)]
    blocks = [make(dtype_name, r, (2 * world, 3)).chunk(world) for r in range(world)]
    send = [r + 1 for r in range(world)]
    uneven = [make(dtype_name, r, (sum(send), 3)).split(send) for r in range(world)]
    return {
        "broadcast": lambda: inputs[1],
        "all_gather": lambda: inputs,
        "all_gather_into_tensor": lambda: torch.cat(inputs),
        "all_gather_stacked": lambda: torch.stack(inputs),
        "gather": lambda: inputs if rank == 1 else None,
        "scatter": lambda: blocks[0][rank],
        "all_to_all_single": lambda: torch.cat([blocks[r][rank] for r in range(world)]),
        "all_to_all_uneven": lambda: torch.cat([uneven[r][rank] for r in range(world)]),
        "all_to_all": lambda: [blocks[r][rank] for r in range(world)],
        "non_contiguous": lambda: make(dtype_name, 0, (3, 5)).t(),
    }[case]()


@pytest.mark.parametrize("world", [2, 3])
def test_every_movement_matches_gloo(world, request):
    """Data moves bit for bit: mpi's result is the one the inputs dictate, and gloo's too wherever gloo has it
    (it lacks int16, complex gather and all_gather into a stacked tensor)."""
    gloo_pool, mpi_pool = request.getfixturevalue(f"dist{world}"), request.getfixturevalue(f"mpi{world}")
    wrong, gloo_refused = [], set()
    for dtype_name in DTYPES:
        for async_op in (False, True):
            gloo = gloo_pool.run(movements, dtype_name, async_op)
            mpi = mpi_pool.run(movements, dtype_name, async_op)
            for rank in range(world):
                for case, ours in mpi[rank].items():
                    label = f"{case} {dtype_name} async={async_op} rank {rank}"
                    expected = expected_movement(case, dtype_name, rank, world)
                    theirs = gloo[rank][case]
                    if theirs[0] == "ok":
                        _same(theirs[1], expected)  # the reference is right where gloo can say
                    else:
                        gloo_refused.add((case, dtype_name))
                    if ours[0] != "ok":
                        wrong.append(f"{label}: mpi raises {ours[1:]}")
                        continue
                    try:
                        _same(ours[1], expected)
                    except AssertionError as e:
                        wrong.append(f"{label}: {str(e).splitlines()[0]}")
    assert not wrong, "\n".join(wrong)
    assert ("broadcast", "float32") not in gloo_refused  # the comparison with gloo did take place
