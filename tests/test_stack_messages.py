"""What a user is told: the messages of the usual mistakes (a mistyped artifact path, an uncached repo offline, a
missing C compiler, beam search that certifies nothing) and the call's stats (every row counted, never None or NaN).
For people, `python scripts/first_hour.py` replays a newcomer's first hour and prints every message."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

import hf_csv
from hf_csv import CSVArtifact, CSVConfig, IndexFormatError
from conftest import tiny_llama


@pytest.mark.parametrize("name", ["./artifacts/smol", "~/no/such/artifact", "artifacts/x/y", "/tmp/hf-csv-none"])
def test_a_mistyped_artifact_path_names_the_path(name):
    with pytest.raises(IndexFormatError, match="no artifact at") as e:
        CSVArtifact.from_pretrained(name)
    assert repr(name) in str(e.value)


def test_an_uncached_repo_offline_names_both_readings(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(IndexFormatError, match="no such local directory, and not in the local Hub cache"):
        CSVArtifact.from_pretrained("artifacts/smol", cache_dir=tmp_path, local_files_only=True)


def test_a_mistyped_path_in_csv_config_fails_the_call_with_the_path():
    m = hf_csv.enable(tiny_llama())
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(IndexFormatError, match="no artifact at './typo'"):
        m.generate(input_ids=ids, max_new_tokens=2, do_sample=False, csv_config=CSVConfig(index="./typo"))
    # nothing was lost: the model still generates, stock and certified
    assert torch.equal(m.generate(input_ids=ids, max_new_tokens=3, do_sample=False),
                       m.generate(input_ids=ids, max_new_tokens=3, do_sample=False, csv_config=CSVConfig()))


def test_cli_inspect_on_a_missing_path_is_one_line_and_status_2(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", "hf_csv.cli", "inspect", str(tmp_path / "nope")], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "no artifact at" in r.stderr


def test_a_missing_c_compiler_warns_once_with_the_fix(tmp_path):
    code = ("import logging, torch; from hf_csv_kernels import native; "
            "print('avail', native.available()); print('avail', native.available())")
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), HF_CSV_KERNEL_CACHE=str(tmp_path / "cache"))
    env.pop("HF_CSV_NATIVE", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "avail False" in r.stdout
    lines = [l for l in r.stderr.splitlines() if "could not build the native int8 kernel" in l]
    if "avx2" not in open("/proc/cpuinfo").read():  # (the kernel is not tried without AVX2: nothing to warn about)
        assert not lines
        return
    assert len(lines) == 1 and "no C compiler" in lines[0] and "apt install gcc" in lines[0], r.stderr


def test_beam_search_warns_once_per_call_that_nothing_is_certified(caplog):
    from transformers.utils import logging as tlogging

    m = hf_csv.enable(tiny_llama())
    ids = torch.tensor([[1, 2, 3]])
    tlogging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            out = m.generate(input_ids=ids, max_new_tokens=3, num_beams=3, do_sample=False, csv_config=CSVConfig(),
                             return_dict_in_generate=True)
    finally:
        tlogging.disable_propagation()
    msgs = [r.getMessage() for r in caplog.records if "num_beams=3 runs the full LM head" in r.getMessage()]
    assert len(msgs) == 1 and "num_beams=1" in msgs[0]
    assert out.csv_stats["summary"].startswith("full head (beam search")
    assert torch.equal(out.sequences, m.generate(input_ids=ids, max_new_tokens=3, num_beams=3, do_sample=False))


def test_stats_count_every_row_and_are_never_none_or_nan():
    m = hf_csv.enable(tiny_llama(scale=8.0))
    ids = torch.tensor([[1, 2, 3]])
    out = m.generate(input_ids=ids, max_new_tokens=6, do_sample=False, csv_config=CSVConfig(),
                     return_dict_in_generate=True)
    s = out.csv_stats
    for k, v in s.items():
        assert v is not None, k
        assert not (isinstance(v, float) and v != v), k
    assert s["head_rows"] == s["rows"] + s["declined_rows"]
    assert s["certified_fraction"] == pytest.approx(s["certified"] / s["head_rows"])
    assert s["summary"].startswith(("certified ", "full head ("))
    # a call with nothing certified: a fraction of 0, a summary that says why, no None / nan
    out = m.generate(input_ids=ids, max_new_tokens=3, num_beams=2, do_sample=False, csv_config=CSVConfig(),
                     return_dict_in_generate=True)
    s = out.csv_stats
    assert s["certified_fraction"] == 0.0 and s["summary"].startswith("full head (")
    assert all(not (isinstance(v, float) and v != v) and v is not None for v in s.values())
