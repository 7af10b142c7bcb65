"""The nodes' launchers deciding each membership by majority (``ddpkit.launcher.council``), in one process:
real sockets on loopback, one :class:`Council` per "node"."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from ddpkit.launcher.council import SUSPECT_S, Council


def _listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock


def _councils(count: int, tokens: list[str] | None = None, meet_s: float = 10.0) -> list[Council | Exception]:
    listeners = [_listener() for _ in range(count)]
    places = [("127.0.0.1", s.getsockname()[1], f"127.0.0.1:{5000 + n}") for n, s in enumerate(listeners)]
    made: list[Council | Exception] = [RuntimeError("not made")] * count

    def node_of(member: int) -> int:  # two workers a node, replacements numbered as the launcher does
        return member // 2 if member < 2 * count else (member - 2 * count) % count

    def seat(node: int) -> None:
        try:
            made[node] = Council(node, places, listeners[node], list(range(2 * count)), node_of,
                                 (tokens or ["job"] * count)[node], meet_s=meet_s)
        except Exception as e:  # noqa: BLE001 - the test looks at it
            made[node] = e

    threads = [threading.Thread(target=seat, args=(n,)) for n in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return made


def _until(condition, timeout: float = 5.0) -> float:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, "not within the timeout"
        time.sleep(0.01)
    return time.monotonic() - start


def test_a_death_is_decided_once_for_every_node_and_a_lost_node_moves_the_store() -> None:
    councils = _councils(3)
    assert all(isinstance(c, Council) for c in councils), councils
    try:
        councils[2].tell(dead=[5])
        took = _until(lambda: all(c.entry.members == (0, 1, 2, 3, 4) for c in councils))
        assert took < 0.5
        assert {c.entry.index for c in councils} == {1} and {c.entry.epoch for c in councils} == {1}
        councils[0].close()  # node 0 (the leader, the store's host) leaves: its connections close
        took = _until(lambda: all(c.entry.nodes == (1, 2) for c in councils[1:]))
        assert took < 0.5, "a closed connection is a death at once, not after the heartbeat timeout"
        entry = councils[1].entry
        assert entry.members == (2, 3, 4) and entry.epoch == 2 and entry.store == "127.0.0.1:5001"
        assert councils[2].entry == entry
        councils[1].tell(ready=[7])  # node 1's first replacement: the world (6) + its node
        _until(lambda: all(c.entry.members == (2, 3, 4, 7) for c in councils[1:]))
        councils[1].tell(joined=[7])
        _until(lambda: councils[2].entry.joined == (7,))
        assert councils[2].entry.epoch == 3, "a holder of the state is news for the agents, not for the workers"
        for c in councils[1:]:
            c.tell(finished=True, succeeded=True)
        _until(lambda: all(c.entry.done for c in councils[1:]))
        assert councils[1].entry.succeeded and councils[1].cut_off is None
    finally:
        for c in councils[1:]:
            c.close()


def test_a_process_without_the_jobs_secret_never_takes_a_seat() -> None:
    councils = _councils(2, tokens=["job", "another job"], meet_s=1.5)
    assert isinstance(councils[1], RuntimeError) and "did not join the job's council" in str(councils[1])
    assert isinstance(councils[0], RuntimeError)


def test_with_two_nodes_neither_side_of_a_loss_is_a_majority_so_the_survivor_stops() -> None:
    councils = _councils(2)
    assert all(isinstance(c, Council) for c in councils), councils
    start = time.monotonic()
    councils[1].close()
    _until(lambda: councils[0].cut_off is not None, timeout=3 * SUSPECT_S + 2)
    assert time.monotonic() - start >= SUSPECT_S
    assert "not a majority" in councils[0].cut_off and "split brain refused" in councils[0].cut_off
    assert councils[0].entry.nodes == (0, 1), "a minority decides nothing"
    councils[0].close()


@pytest.mark.parametrize("lost", [1, 2])
def test_the_majority_goes_on_without_a_silent_node(lost: int) -> None:
    councils = _councils(3)
    try:
        councils[lost]._stop.set()  # alive but silent: it sends no beat and proposes nothing; its sockets open
        took = _until(lambda: all(lost not in c.entry.nodes for n, c in enumerate(councils) if n != lost),
                      timeout=3 * SUSPECT_S + 2)
        assert SUSPECT_S * 0.9 <= took
    finally:
        for c in councils:
            c.close()
