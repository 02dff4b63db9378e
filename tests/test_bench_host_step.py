"""bench.host_step's whole-step mode with each kind of request, run small."""
from bench import host_step


def test_whole_step_rows_for_each_kind_of_request(capsys):
    host_step.main(["--whole-step", "--batch", "2", "--contexts", "64", "--iters", "2",
                    "--sampling", "plain", "logprobs=3", "penalties", "logit_bias"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2 | 64 |")]
    assert [r.split("|")[3].strip() for r in rows] == ["plain", "logprobs=3", "penalties", "logit_bias"]
    assert all(float(r.split("|")[4]) > 0 for r in rows)
