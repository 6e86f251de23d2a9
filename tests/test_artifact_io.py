"""The owners' readers and writers of the run-dir result files (issue #20): what a writer puts at the `RunDir` path
its reader reads back, and a reader of an optional file says None for an absent or corrupt one (report skips it)
instead of failing. tests/test_artifacts.py checks that nothing else reads or writes these files."""

from __future__ import annotations

import json

import pytest

from dflashkit.bench.results import read_bench_result, write_bench_result
from dflashkit.data.records import (heldout_user_prompts, prepared_file, prepared_lines, read_prepared,
                                    write_prepared)
from dflashkit.decode.evaluation import read_eval_results, write_eval_results
from dflashkit.engines.verify import read_engine_results, write_engine_results
from dflashkit.errors import MissingArtifactError
from dflashkit.generate.conversations import read_settings, regenerated_file, write_settings
from dflashkit.rundir import RunDir
from dflashkit.train.logging import read_curve, read_metrics

RESULT_FILES = [  # (writer, reader, the RunDir path)
    (write_eval_results, read_eval_results, lambda rd: rd.eval_results),
    (write_engine_results, read_engine_results, lambda rd: rd.verify_engine_results),
    (lambda rd, res: write_bench_result(rd, "serve", res), lambda rd: read_bench_result(rd, "serve"),
     lambda rd: rd.bench_result("serve")),
]


@pytest.mark.parametrize("write,read,where", RESULT_FILES)
def test_result_files_round_trip_and_a_missing_or_torn_one_reads_as_none(tmp_path, write, read, where):
    rd = RunDir(tmp_path / "run")
    assert read(rd) is None
    res = {"summary": {"tau": 1.5}, "passed": True, "rows": [1, 2]}
    assert write(rd, res) == where(rd)
    assert read(rd) == res == json.loads(where(rd).read_text())
    where(rd).write_text('{"summary": ')  # a torn write by something else: skipped, not a crash
    assert read(rd) is None


def test_training_metrics_and_curve_readers(tmp_path):
    rd = RunDir(tmp_path / "run")
    assert read_metrics(rd) == [] and read_curve(rd) is None
    rd.train_dir.mkdir(parents=True)
    rd.train_metrics.write_text('{"step": 1}\n{"step": 2}\n{"st')  # torn last line of a killed run
    assert read_metrics(rd) == [{"step": 1}, {"step": 2}]
    curve = {"points": [{"step": 1, "tokens": 10}], "sources": ["a"]}
    rd.train_curve.write_text(json.dumps(curve))
    assert read_curve(rd) == curve == read_curve(rd.train_curve) == read_curve(str(rd.train_curve))
    for text in ("[1, 2]", "not json"):
        rd.train_curve.write_text(text)
        assert read_curve(rd) is None


def test_prepared_conversations_round_trip(tmp_path):
    rd = RunDir(tmp_path / "run")
    with pytest.raises(MissingArtifactError, match="prepared conversations"):
        prepared_file(rd)
    with pytest.raises(MissingArtifactError, match="held-out prompts"):
        prepared_file(rd, "heldout")
    assert prepared_lines(rd) is None and heldout_user_prompts(rd) == []
    train = [{"id": f"{i:016x}", "source": "s", "messages": [{"role": "user", "content": f"q{i}"},
                                                              {"role": "assistant", "content": "a"}]}
             for i in range(3)]
    heldout = [{"id": "f" * 16, "source": "s", "messages": [{"role": "system", "content": "sys"},
                                                             {"role": "user", "content": "held"}]}]
    assert write_prepared(rd, iter(train), iter(heldout)) == [rd.prepared_train, rd.prepared_heldout]
    assert prepared_file(rd) == rd.prepared_train and prepared_file(rd, "heldout") == rd.prepared_heldout
    assert read_prepared(rd.prepared_train) == train
    assert prepared_lines(rd) == (3, rd.prepared_train)
    assert heldout_user_prompts(rd) == ["held"]


def test_generate_settings_and_the_regenerated_file(tmp_path):
    rd = RunDir(tmp_path / "run")
    with pytest.raises(MissingArtifactError, match="generated conversations"):
        regenerated_file(rd)
    assert read_settings(rd.generate_dir) is None
    write_settings(rd.generate_dir, {"temperature": 0.0, "model": "m"})
    assert read_settings(rd.generate_dir) == {"temperature": 0.0, "model": "m"}
    rd.conversations_path.write_text("")
    assert regenerated_file(rd) == rd.conversations_path
