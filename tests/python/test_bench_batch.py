"""`kvstack bench --batch N` (issue 23 item 1): N sequences decoded together
against one alone at the same context, reported as step times, their ratio
and tok/s; bad values are refused naming the flag."""
import json
import os

import pytest

from conftest import KVSTACK_BIN, MODEL, run_kvstack


@pytest.fixture(autouse=True)
def need_binary_and_model():
    if not os.path.exists(KVSTACK_BIN):
        pytest.skip("kvstack binary missing")
    if not os.path.exists(MODEL):
        pytest.skip("model missing")


def test_batch_json_reports_both_step_times():
    p = run_kvstack("bench", "-m", MODEL, "--batch", "4", "--prompt-tokens", "40", "--gen", "3",
                    "--reps", "2", "--threads", "2", "--json")
    row = json.loads(p.stdout.strip().splitlines()[-1])
    assert row["batch"] == 4 and row["context"] == 40 and row["steps"] == 3
    assert row["step_ms_1"] > 0 and row["step_ms_batch"] > 0
    assert row["step_ratio"] == pytest.approx(row["step_ms_batch"] / row["step_ms_1"], rel=1e-2)
    # tok/s: one token per sequence per step.
    assert row["decode_tok_s_1"] == pytest.approx(1e3 / row["step_ms_1"], rel=1e-2)
    assert row["decode_tok_s_batch"] == pytest.approx(4e3 / row["step_ms_batch"], rel=1e-2)


def test_batch_table_names_units():
    p = run_kvstack("bench", "-m", MODEL, "--batch", "2", "--prompt-tokens", "20", "--gen", "2",
                    "--reps", "1", "--threads", "2")
    assert "decode step, 1" in p.stdout and " ms (median)" in p.stdout
    assert "tok/s in total" in p.stdout and "step time ratio" in p.stdout


def test_batch_out_of_range_is_refused():
    p = run_kvstack("bench", "-m", MODEL, "--batch", "0", check=False)
    assert p.returncode != 0
    assert "batch" in p.stderr


def test_mixed_prefill_steps_are_reported():
    p = run_kvstack("bench", "-m", MODEL, "--batch", "3", "--prompt-tokens", "24", "--gen", "2",
                    "--reps", "1", "--threads", "2", "--mix-prefill", "5,9", "--json")
    row = json.loads(p.stdout.strip().splitlines()[-1])
    assert [m["prefill_chunk"] for m in row["mixed"]] == [5, 9]
    for m in row["mixed"]:
        assert m["step_ms"] > 0
        assert m["prefill_tok_s"] == pytest.approx(m["prefill_chunk"] * 1e3 / m["step_ms"],
                                                   rel=1e-2)
        assert m["step_ratio"] == pytest.approx(m["step_ms"] / row["step_ms_batch"], rel=1e-2)


@pytest.mark.parametrize("args, words", [
    (["--batch", "3", "--mix-prefill", "4,zero"], "mix-prefill"),
    (["--batch", "3", "--mix-prefill", "0"], "mix-prefill"),
    (["--mix-prefill", "4"], "--batch"),
])
def test_mixed_prefill_bad_values_are_refused(args, words):
    p = run_kvstack("bench", "-m", MODEL, *args, check=False)
    assert p.returncode != 0 and words in p.stderr
