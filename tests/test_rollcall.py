"""``rollcall``: the reader and its verdicts, on files written by the real writer (``recorder.Recorder``)."""

from __future__ import annotations

import os
import random

import pytest
from test_recorder import EAGER, GRAPH, files, write_rank

from sglang_dp_mtp_fix import cli, recfile, rollcall
from sglang_dp_mtp_fix.errors import RecorderFileError


def run_rollcall(capsys, *args: str) -> tuple[int, str]:
    code = cli.main(["rollcall", "--settle", "0", *args])
    return code, capsys.readouterr().out


def test_rollcall_exit_codes_text_and_json(tmp_path, capsys):
    import json

    agree, split, bad, mixed = (tmp_path / n for n in ("agree", "split", "bad", "mixed"))
    for d in (agree, split, bad, mixed):
        d.mkdir()
    for rank in range(2):
        write_rank(agree, rank, 2, [GRAPH] * 20)  # 20 rounds through a 16-slot ring: the last 16 are compared
        write_rank(split, rank, 2, [GRAPH] * 6 + [EAGER if rank else GRAPH] + [GRAPH] * 3)
    write_rank(mixed, 0, 2, [GRAPH] * 3)
    write_rank(mixed, 1, 4, [GRAPH] * 3)
    (bad / "sglang-dp-mtp-fix-x-dp0-1.rec").write_bytes(b"garbage")
    code, out = run_rollcall(capsys, str(agree))
    assert code == 0 and out.endswith("all 2 ranks agreed up to round 20, the last round of every rank\n"), out
    assert "DP rank 0: last round 20 (16 rounds kept, last entered 20)" in out
    code, out = run_rollcall(capsys, str(split), "--json")
    data = json.loads(out)
    assert code == 1 and data["divergence"]["round"] == 7 and data["verdict"] == "diverge"
    assert data["answer"] == "round 7: rank [0] draft graph (bucket 8), rank [1] eager (after a graph vote: decided " \
        "outside the vote)"  # fmt: skip
    code, out = run_rollcall(capsys, str(bad))
    assert code == 2 and "refused" in out and "truncated: 7 bytes" in out, out
    code, out = run_rollcall(capsys, str(mixed))
    assert code == 2 and "files from different deployments" in out, out
    code, out = run_rollcall(capsys, str(agree / "nothing-here"))
    assert code == 2 and "no such file" in out.lower(), out
    # One directory per node, read together; a rank still behind is named.
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    node0.mkdir(), node1.mkdir()
    write_rank(node0, 0, 2, [GRAPH] * 5)
    write_rank(node1, 1, 2, [GRAPH] * 4)
    code, out = run_rollcall(capsys, str(node0), str(node1))
    assert code == 0 and "all 2 ranks agreed up to round 4; rank [1] never reached round 5" in out, out
    code, out = run_rollcall(capsys, str(node0))
    assert code == 1 and "DP rank [1] of 2 no file" in out, out


def test_forward_mode_values_are_sglangs():
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    assert rollcall._MODES == {ForwardMode.DECODE.value, ForwardMode.IDLE.value}


def test_reader_refuses_truncated_garbage_and_foreign_files_and_reads_the_rest(tmp_path):
    good = tmp_path / "good"
    good.mkdir()
    for rank in range(2):
        write_rank(good, rank, 2, [GRAPH] * 10)
    valid = files(good)[0].read_bytes()
    junk = tmp_path / "junk"
    junk.mkdir()
    rng = random.Random(0)
    cases: dict[str, bytes] = {}
    for n in (0, 1, 8, 100, 255, 256, 257, len(valid) // 2, len(valid) - 1):
        cases[f"trunc{n}"] = valid[:n]
    cases["padded"] = valid + b"\0"
    for i in range(150):
        size = rng.choice((rng.randrange(0, 600), len(valid)))
        prefix = recfile.MAGIC if i % 2 else b""
        cases[f"garbage{i}"] = (prefix + rng.randbytes(size))[: max(size, len(prefix))]
    for i in range(300):
        flipped = bytearray(valid)
        for _ in range(rng.randrange(1, 4)):
            flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        cases[f"flip{i}"] = bytes(flipped)
    outcomes = {"read": 0, "refused": 0}
    for name, content in cases.items():
        path = junk / f"sglang-dp-mtp-fix-{name}.rec"
        path.write_bytes(content)
        try:
            rollcall.read_file(str(path))
            outcomes["read"] += 1
        except RecorderFileError:
            outcomes["refused"] += 1
    assert all(outcomes.values()), outcomes  # both kinds happen: the cases reach past the first check
    os.mkfifo(junk / "sglang-dp-mtp-fix-fifo.rec")  # never opened (would block)
    (junk / "sglang-dp-mtp-fix-link.rec").symlink_to(files(good)[0])
    (junk / "sglang-dp-mtp-fix-dir.rec").mkdir()
    for name in ("fifo", "link", "dir"):
        with pytest.raises(RecorderFileError, match="not a regular file"):
            rollcall.read_file(str(junk / f"sglang-dp-mtp-fix-{name}.rec"))
    (junk / "foreign.rec").write_bytes(b"PK\x03\x04" + bytes(2000))  # e.g. a zip someone named .rec
    with pytest.raises(RecorderFileError, match="not a flight-recorder file"):
        rollcall.read_file(str(junk / "foreign.rec"))
    with pytest.raises(RecorderFileError, match="truncated or padded: 300 bytes, the header promises 1024"):
        (junk / "t.rec").write_bytes(valid[:300])
        rollcall.read_file(str(junk / "t.rec"))
    # The good ranks are still read beside all of it (only the two good files are whole ranks of one deployment: the
    # bit-flipped copies that still read are rank 0's file again, older or newer, or another shape).
    data, code = rollcall.rollcall([str(good), str(junk)], settle_s=0)
    assert len(data["refused"]) >= outcomes["refused"] and code in (1, 2), data["answer"]
    data, code = rollcall.rollcall([str(good)], settle_s=0)
    assert code == 0 and len(data["ranks"]) == 2
