"""The one port allocator (``harness/ports.py``): a range per process, so the test matrix's two lanes never hand out
the same port."""

from __future__ import annotations

import pytest

from sglang_dp_mtp_fix.harness import ports


@pytest.mark.parametrize("span", [(0,), (0, 1, 39, 247)])
def test_every_port_of_a_block_lies_inside_the_lanes_range(monkeypatch, span):
    monkeypatch.setenv(ports.PORTS_ENV, "21000-21400")
    for _ in range(20):
        base = ports.port_block(span)
        assert all(21000 <= base + offset <= 21400 for offset in span), base


def test_two_lanes_ranges_are_disjoint(monkeypatch):
    seen: dict[str, set[int]] = {}
    for lane, raw in (("unit", "10000-10400"), ("launch", "10401-10800")):
        monkeypatch.setenv(ports.PORTS_ENV, raw)
        seen[lane] = {ports.free_port() for _ in range(50)}
    assert not seen["unit"] & seen["launch"]
    assert max(seen["unit"]) <= 10400 < min(seen["launch"])


@pytest.mark.parametrize("raw", ["21000", "21000-", "a-b", "30000-20000", "80-90", "21000-70000"])
def test_a_bad_range_is_refused_naming_the_variable(monkeypatch, raw):
    monkeypatch.setenv(ports.PORTS_ENV, raw)
    with pytest.raises(ValueError, match=ports.PORTS_ENV):
        ports.free_port()


def test_a_range_without_room_for_the_block_says_so(monkeypatch):
    monkeypatch.setenv(ports.PORTS_ENV, "21000-21100")
    with pytest.raises(RuntimeError, match="room for \\+247"):
        ports.port_block((0, 247))
