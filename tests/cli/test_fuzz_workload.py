"""`kvcheck fuzz --sut vllm --workload chat`: the chat workloads from the command line; a bad
value or a SUT without workloads is one line, exit 2."""
from __future__ import annotations

import json

import pytest

from badinput import run


@pytest.mark.parametrize("argv, names", [
    (("fuzz", "--sut", "vllm", "--layout", "full+swa", "--workload", "bogus"), "bogus"),
    (("fuzz", "--sut", "spec", "--workload", "chat"), "--sut vllm only"),
    (("fuzz", "--sut", "sglang", "--workload", "chat"), "--sut vllm only"),
])
def test_bad_workload_is_one_line_exit_2(capsys, argv, names):
    code, out, err = run(capsys, *argv)
    assert code == 2 and not out
    assert len(err.strip().splitlines()) == 1 and names in err and "--workload" in err


def test_chat_workload_runs_and_is_in_the_rerun_command(capsys, tmp_path):
    pytest.importorskip("vllm")
    code, out, _ = run(capsys, "fuzz", "--sut", "vllm", "--layout", "full+swa", "--workload", "chat",
                       "--budget", "400", "--json", "--out", str(tmp_path))
    res = json.loads(out)
    assert code == res["exit_code"] and res["workload"] == "chat" and res["steps"] == 400
    assert "--workload chat" in res["command"]
    pts = res["reuse_profile"]["full+swa"]          # every layout's reuse profile, in the JSON
    assert [d for d, _ in pts] == list(range(33)) and pts[-1][1] > 0
    code, out, _ = run(capsys, "fuzz", "--sut", "vllm", "--layout", "full+swa", "--budget", "400", "--json",
                       "--out", str(tmp_path))
    assert json.loads(out)["workload"] == "random" and "--workload" not in json.loads(out)["command"]
