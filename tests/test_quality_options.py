"""``tierkv eval``'s quality runs: a result is reused and reported only with the options it was measured with, and
``--budgets`` is refused in its own terms."""

from __future__ import annotations

import json

import pytest

from tierkv.cli import main
from tierkv.commands import eval as eval_command
from tierkv.errors import InvalidConfigError
from tierkv.quality import harness, report


@pytest.mark.parametrize("budgets", ["0", "0.1,0", "0.0", "1.5", "nan"])
def test_budgets_outside_zero_to_one_are_refused_while_parsing(budgets, capsys, tmp_path, monkeypatch):
    """Regression: ``--budgets 0`` passed the CLI's ``[0, 1]`` check, loaded the model, then failed in the library's
    words (``sparse tokens=0.0``, an int for a count): refused while parsing, saying ``(0, 1]``."""
    monkeypatch.setattr("tierkv.models.load", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["eval", "--tasks", "needle", "--budgets", budgets, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tierkv eval: error: --budgets=") and "(0, 1]" in err and "\n" not in err, err
    assert "tokens=" not in err and "[0, 1]" not in err, err


@pytest.mark.parametrize("option", ["block_tokens", "page_tokens", "sinks", "recent", "dense_layers", "rest_bits"])
def test_every_option_that_changes_a_result_names_its_own_results_file(option):
    """Regression: runs with other ``--sinks``, ``--recent`` or ``--dense-layers`` shared ``tierkv.json``."""
    other = harness.CacheSetup(**{option: {"block_tokens": 8}.get(option, 2)})
    assert harness.results_file(other) != harness.results_file(harness.CacheSetup()) == "tierkv.json"


def test_measure_with_other_sparse_options_measures_again_into_its_own_file(tmp_path, capsys):
    """Regression: ``--stage measure`` with only ``--sinks``, ``--recent`` or ``--dense-layers`` changed reused the
    earlier run's records (measuring nothing), and a later save rewrote the file's setup so that the old records
    claimed the new options."""
    base = ["eval", "--tasks", "needle", "--lengths", "512", "--depths", "0.5", "--samples", "1", "--methods",
            "sparse", "--budgets", "0.05", "--out", str(tmp_path)]
    assert main(base) == 0, capsys.readouterr().err
    first = (tmp_path / "tierkv.json").read_text()
    options = ["--sinks", "0", "--recent", "1", "--dense-layers", "2"]
    assert main([*base, "--stage", "measure", *options]) == 0, capsys.readouterr().err
    assert (tmp_path / "tierkv.json").read_text() == first  # the default run's records and setup untouched
    other = json.loads((tmp_path / "tierkv-sinks0-recent1-dense2.json").read_text())
    assert {k: other["setup"][k] for k in ("sinks", "recent", "dense_layers")} == \
        {"sinks": 0, "recent": 1, "dense_layers": 2}
    assert [r["method"] for r in other["results"]] == ["sparse@0.05"]


def test_a_results_file_of_other_options_is_refused_not_resumed(tmp_path):
    """A file whose setup says other options (written before its name said them all) is neither resumed nor
    relabelled: the error names the options it holds."""
    path = tmp_path / "tierkv.json"
    setup = harness.CacheSetup(sinks=0, dense_layers=2).to_dict()
    path.write_text(json.dumps({"setup": setup, "results": [{"prompt": "p", "method": "sparse@0.1"}]}))
    with pytest.raises(InvalidConfigError, match=r"measured with --sinks 0, --dense-layers 2, not this run's"):
        eval_command._resumed_records(path, harness.CacheSetup())
    assert eval_command._resumed_records(path, harness.CacheSetup(sinks=0, dense_layers=2)) == \
        [{"prompt": "p", "method": "sparse@0.1"}]


def test_report_gives_other_sparse_options_rows_of_their_own(tmp_path):
    """Runs that differ only in sinks, recent window or dense layers are reported apart, each labelled with them."""
    prompt = {"task": "needle", "length": 2048, "depth": 0.5, "sample": 0, "answer": "12345"}
    record = dict(prompt, prompt="needle/2048/d0.50/#0")
    (tmp_path / "reference.json").write_text(json.dumps(
        {"prompts": [prompt], "results": [dict(record, method="full", correct=True)]}))
    for setup, correct in ((harness.CacheSetup(), False), (harness.CacheSetup(sinks=0, recent=32, dense_layers=1),
                                                           True)):
        (tmp_path / harness.results_file(setup)).write_text(json.dumps(
            {"setup": setup.to_dict(), "results": [dict(record, method="sparse@0.1", budget=0.1, correct=correct)]}))
    text = report.markdown(report.load_results(tmp_path))
    assert "| tierkv sparse 10% | 0% (1) |" in text, text
    assert "| tierkv sparse, 16-token blocks, 0 sink tokens, 32 recent tokens, 1 dense layer 10% | 100% (1) |" in text
