"""The namespaces testbed (``ddpkit.bench.sections.links.testbed``) and ``ddpkit bench links`` across it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from procs import base_env

from ddpkit.bench.sections.links.section import RUNS, LinksBenchConfig
from ddpkit.bench.sections.links.testbed import Testbed, parse_rate
from ddpkit.runtime.options import ConfigError

SHAKESPEARE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "tinyshakespeare"
needs_testbed = pytest.mark.skipif(Testbed.why_not() is not None, reason=f"the testbed {Testbed.why_not()}")


def _qdisc(argv: list[str]) -> str:
    return subprocess.run([*argv], capture_output=True, text=True, check=True).stdout


def _reaches(bed: Testbed, src: int, dst: int) -> bool:
    probe = (f"import socket; s = socket.socket(); s.settimeout(1.5); "
             f"print(s.connect_ex(({bed.nodes[dst].address!r}, 9)))")
    out = subprocess.run(bed.command(src, [sys.executable, "-c", probe]), capture_output=True, text=True).stdout
    return out.strip() == str(111)  # refused by the peer's kernel: it answered; a timeout prints 11 or 110


@pytest.mark.parametrize("rate,bits", [("100mbit", 10**8), ("1gbit", 10**9), ("2.5gbit", 25 * 10**8),
                                       ("800kbit", 8 * 10**5), ("5000", 5000), ("10MBIT", 10**7)])
def test_rates_read_as_tc_writes_them(rate, bits):
    assert parse_rate(rate) == bits


@pytest.mark.parametrize("rate", ["fast", "0mbit", "-1gbit", "1tbit", "", "0.5"])
def test_a_rate_in_another_form_is_refused_naming_it(rate):
    with pytest.raises(ValueError, match=f"rate {rate!r}: give bits per second"):
        parse_rate(rate)


@needs_testbed
def test_the_testbed_shapes_both_ends_of_every_cable_cuts_one_and_leaves_nothing_behind():
    with Testbed(3) as bed:
        names = [n.namespace for n in bed.nodes]
        assert _reaches(bed, 0, 2) and _reaches(bed, 2, 1)
        bed.shape("100mbit")
        for node in bed.nodes:
            inside = _qdisc(["ip", "netns", "exec", node.namespace, "tc", "qdisc", "show", "dev", node.inner])
            outside = _qdisc(["tc", "qdisc", "show", "dev", node.link])
            assert "tbf" in inside and "rate 100Mbit" in inside, inside
            assert "tbf" in outside and "rate 100Mbit" in outside, outside
        bed.shape(None)
        assert "tbf" not in _qdisc(["tc", "qdisc", "show", "dev", bed.nodes[1].link])
        bed.cut(1)
        assert not _reaches(bed, 0, 1) and _reaches(bed, 0, 2)
        bed.mend(1)
        assert _reaches(bed, 0, 1)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names)
    assert subprocess.run(["ip", "link", "show", bed.bridge], capture_output=True).returncode != 0


def test_bad_settings_of_the_bench_are_refused_naming_the_flag():
    with pytest.raises(ConfigError, match="give --data-dir"):
        LinksBenchConfig()
    with pytest.raises(ConfigError, match="--runs fast: not a run; choose among ddp, local-sgd, diloco, diloco-int8, streaming"):
        LinksBenchConfig(data_dir=Path("x"), runs=("fast",))
    with pytest.raises(ConfigError, match="--rates: rate '1tbit': give bits per second"):
        LinksBenchConfig(data_dir=Path("x"), rates=("1tbit",))
    with pytest.raises(ConfigError, match="--nodes 1 must be from 2 to 8"):
        LinksBenchConfig(data_dir=Path("x"), nodes=1)
    with pytest.raises(ConfigError, match="--model convnet: not a GPT; choose among gpt, gpt-10m, gpt-25m"):
        LinksBenchConfig(data_dir=Path("x"), model="convnet")
    with pytest.raises(ConfigError, match=r"--fragment-delay 4 must be a whole number from 0 to --sync-every - 1 "
                                          r"\(3\)"):
        LinksBenchConfig(data_dir=Path("x"), sync_every=4, fragment_delay=4)
    for bad in (True, 2.0):
        with pytest.raises(ConfigError, match=f"--fragment-delay {bad!r} must be a whole number"):
            LinksBenchConfig(data_dir=Path("x"), fragment_delay=bad)
    with pytest.raises(ConfigError, match="--sync-every 2: the streaming run's 4 fragments need at least 4"):
        LinksBenchConfig(data_dir=Path("x"), sync_every=2)
    # tau: the streaming paper's 5, within a short H; checked only where a streaming run uses it
    assert LinksBenchConfig(data_dir=Path("x"), sync_every=100).fragment_delay == 5
    assert LinksBenchConfig(data_dir=Path("x"), sync_every=4).fragment_delay == 3
    assert LinksBenchConfig(data_dir=Path("x"), runs=("ddp",), sync_every=1, fragment_delay=1).sync_every == 1
    flags = RUNS["streaming"](100, 5)
    assert flags[flags.index("--fragment-delay") + 1] == "5"


def test_the_table_names_the_gpt_it_trained_with_its_size():
    from ddpkit.bench.sections.links.section import GPT_SIZES, format_rows
    from ddpkit.models import build_model

    for name, size in GPT_SIZES.items():
        params = sum(p.numel() for p in build_model(name, vocab_size=65, block_size=64).parameters())
        assert f"{params / 1e6:.1f} M" == size
    text = format_rows([], LinksBenchConfig(data_dir=Path("x"), model="gpt-10m"))
    assert "the GPT --model gpt-10m (10.7 M) on tiny Shakespeare" in " ".join(text.split())
    assert "streaming: 4 fragments, tau 5, int8" in " ".join(text.split())  # the default runs include it
    assert "tau" not in format_rows([], LinksBenchConfig(data_dir=Path("x"), runs=("ddp",)))
    text = format_rows([], LinksBenchConfig(data_dir=Path("x"), runs=("diloco", "streaming"), sync_every=100))
    assert "streaming: 4 fragments, tau 5, int8" in " ".join(text.split()) and "diloco-int8" not in text
    text = format_rows([], LinksBenchConfig(data_dir=Path("x"), runs=("diloco-int8",), sync_every=100))
    assert "diloco-int8: the outer gradients in int8" in " ".join(text.split()) and "tau" not in text
    assert RUNS["diloco-int8"](100, 5) == ["--sync-every", "100", "--outer-codec", "int8"]  # plain DiLoCo's exchange


@needs_testbed
@pytest.mark.skipif(not SHAKESPEARE.is_dir(), reason="needs ../shared/data/tinyshakespeare")
@pytest.mark.slow("two ddpkit train runs of two nodes each, in network namespaces at 100 Mbit/s")
def test_the_bench_trains_across_shaped_nodes_and_diloco_sends_less(tmp_path: Path):
    out = tmp_path / "links.json"
    done = subprocess.run([sys.executable, "-m", "ddpkit", "bench", "links", "--data-dir", str(SHAKESPEARE),
                           "--rates", "100mbit", "--runs", "ddp", "diloco", "--train-samples", "512",
                           "--sync-every", "4", "--json", str(out)], capture_output=True, text=True, timeout=400,
                          env=base_env(), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| 100mbit | ddp |" in done.stdout and "| 100mbit | diloco |" in done.stdout, done.stdout
    rows = {r["run"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["ddp"]["steps"] == rows["diloco"]["steps"] == 8 and rows["ddp"]["vs_ddp"] == 1.0
    # DDP sends the 3.24 MB of gradients every step; DiLoCo its pseudo-gradient after steps 4 and 8, and at the end
    # (the last epoch's) the average of the AdamW state that makes one of the ranks' inner states.
    assert rows["ddp"]["sent_mb_per_step"] == pytest.approx(3.24, rel=0.01)
    assert rows["diloco"]["sent_mb_per_step"] < 0.7 * rows["ddp"]["sent_mb_per_step"]


def test_a_testbed_names_its_things_apart_from_any_other_and_checks_its_subnet():
    a, b = Testbed(2), Testbed(2)
    assert a.tag != b.tag and {n.namespace for n in a.nodes}.isdisjoint(n.namespace for n in b.nodes)
    assert all(len(n.link) <= 15 and len(n.inner) <= 15 for n in Testbed(250).nodes)
    with pytest.raises(ValueError, match="subnet=999: the second octet"):
        Testbed(2, subnet=999)


def test_the_testbed_is_refused_with_the_reason_where_it_cannot_be_made(monkeypatch):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert Testbed.why_not() == "needs root (network namespaces, a bridge and tc)"
    from ddpkit.bench.sections.links.testbed import TestbedError

    with pytest.raises(TestbedError, match="needs root"):
        with Testbed(2):
            pass
