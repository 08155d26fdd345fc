"""``tierkv eval``'s run folder is untrusted input: what is planted or damaged in it is refused in one line naming
the file and the fix (never a traceback, never read whole, never followed through a link), a plot is never written
through a planted link, and a saved KV or reference is reused only for the very prompts and model it was made for."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from tierkv.cli import main
from tierkv.quality import report
from tierkv.quality.run_folder import MAX_RESULTS_BYTES

NEEDLE = ["eval", "--tasks", "needle", "--model", "demo", "--lengths", "512", "--depths", "0.5", "--samples", "1"]


def _reference_args(out: Path, seed: int = 0) -> list[str]:
    return [*NEEDLE, "--stage", "reference", "--seed", str(seed), "--out", str(out)]


def _measure_args(out: Path) -> list[str]:
    return [*NEEDLE, "--stage", "measure", "--methods", "exact", "--out", str(out)]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of full attention on one needle prompt (seed 0), made once by the real CLI."""
    out = tmp_path_factory.mktemp("reference") / "run"
    assert main(_reference_args(out)) == 0
    return out


@pytest.fixture
def run_folder(reference_run: Path, tmp_path: Path) -> Path:
    """A copy of :func:`reference_run` this test may change."""
    copy = tmp_path / "run"
    shutil.copytree(reference_run, copy, symlinks=True)
    return copy


def _no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tierkv.models.load", lambda *a, **k: pytest.fail("the model was loaded"))


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("tierkv eval: error: ") and "Traceback" not in err, err
    return err


DAMAGED_RESULTS = {
    "truncated": b'{"setup": {}, "results": [',
    "a list": b"[1, 2, 3]",
    "no results": b'{"setup": {}}',
    "a record not an object": b'{"setup": {}, "results": [1]}',
    "a record of unknown method": b'{"results": [{"prompt": "p", "method": "x", "task": "needle", "length": 1, '
                                  b'"correct": true}]}',
    "setup a list": b'{"setup": [], "results": []}',
    "nested deeper than the stack": b"[" * 100_000 + b"]" * 100_000,
    "not UTF-8": b"\xff\xfe",
}


@pytest.mark.parametrize("content", DAMAGED_RESULTS.values(), ids=DAMAGED_RESULTS.keys())
def test_a_damaged_results_file_is_refused_before_the_model_loads(content: bytes, run_folder: Path, capsys,
                                                                  monkeypatch):
    """A results file the tables could not read is refused in one line naming it and the fix, before a run."""
    (run_folder / "tierkv.json").write_bytes(content)
    _no_model(monkeypatch)
    assert main(_measure_args(run_folder)) == 2
    err = _one_line_error(capsys)
    assert str(run_folder / "tierkv.json") in err and "move it out of the folder" in err, err


def test_a_results_file_that_is_a_link_is_refused_not_followed(run_folder: Path, tmp_path: Path, capsys,
                                                               monkeypatch):
    """A link planted as a results file is never read through (it could name any file of the user's)."""
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({"results": []}))
    (run_folder / "tierkv.json").symlink_to(elsewhere)
    _no_model(monkeypatch)
    assert main(_measure_args(run_folder)) == 2
    assert "is a symbolic link" in _one_line_error(capsys)


def test_a_huge_results_file_is_refused_before_it_is_read(run_folder: Path, capsys, monkeypatch):
    """A results file larger than any run writes (a sparse file here) is refused by its size, never read whole."""
    with open(run_folder / "tierkv.json", "wb") as file:
        file.truncate(MAX_RESULTS_BYTES + 1)
    _no_model(monkeypatch)
    assert main(_measure_args(run_folder)) == 2
    assert "is larger than 64 MiB" in _one_line_error(capsys)


@pytest.mark.parametrize("prompt", [{"bogus": 1}, "text", {"task": "needle", "length": 2, "sample": 0,
                                                              "context_ids": ["a"], "question_ids": [1]}],
                         ids=["unknown fields", "not an object", "ids not numbers"])
def test_a_reference_of_damaged_prompts_is_refused(prompt: object, run_folder: Path, capsys):
    """``reference.json``'s prompts are checked field by field before the model sees one."""
    (run_folder / "reference.json").write_text(json.dumps({"model": "demo", "prompts": [prompt], "results": []}))
    assert main(_measure_args(run_folder)) == 2
    err = _one_line_error(capsys)
    assert str(run_folder / "reference.json") in err and "fresh --out folder" in err, err


def test_a_stray_tierkv_json_is_left_out_of_the_summary(run_folder: Path, capsys):
    """A file named like tierkv's but not a results file (notes) is neither read nor a reason to fail."""
    (run_folder / "tierkv-notes.json").write_text("my notes, not JSON")
    assert main(_reference_args(run_folder)) == 0, capsys.readouterr().err
    assert "full attention" in capsys.readouterr().out


def test_the_heatmap_replaces_a_planted_link_and_is_private(tmp_path: Path, capsys):
    """``--out``'s heatmap.png is written as a fresh 0600 file in place of a link, and a new ``--out`` is 0700."""
    precious = tmp_path / "precious.png"
    precious.write_bytes(b"precious")
    out = tmp_path / "new" / "out"
    out.parent.mkdir()
    assert main(["eval", "--lengths", "256", "--depths", "0.5", "--samples", "1", "--out", str(out / "inner")]) == 0
    assert stat.S_IMODE((out / "inner").stat().st_mode) == 0o700 == stat.S_IMODE(out.stat().st_mode)
    (out / "inner" / "heatmap.png").unlink()
    (out / "inner" / "heatmap.png").symlink_to(precious)
    assert main(["eval", "--lengths", "256", "--depths", "0.5", "--samples", "1", "--out", str(out / "inner")]) == 0
    heatmap = out / "inner" / "heatmap.png"
    assert precious.read_bytes() == b"precious"
    assert not heatmap.is_symlink() and heatmap.read_bytes().startswith(b"\x89PNG")
    assert stat.S_IMODE(heatmap.stat().st_mode) == 0o600


def _link_planted(folder: Path, name: str) -> tuple[Path, Path]:
    """A user's file, and a link to it planted at the plot path ``name``."""
    precious, path = folder / "precious.txt", folder / name
    precious.write_text("precious")
    path.symlink_to(precious)
    return precious, path


def _assert_replaced(precious: Path, path: Path) -> None:
    """The plot took the link's place (0600) and the file it named is untouched."""
    assert precious.read_text() == "precious"
    assert not path.is_symlink() and path.read_bytes().startswith(b"\x89PNG")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_the_bench_plot_replaces_a_planted_link(tmp_path: Path):
    """``tierkv bench --plot-out``'s PNG is written in place of a link at its path, never through it."""
    from tierkv.bandwidth import LinkProfile
    from tierkv.calibrate import plot
    from tierkv.calibrate.results import BenchResult, Measurement

    precious, path = _link_planted(tmp_path, "tierkv-bench.png")
    measurements = [Measurement("host->host", "memcpy", s, s, 1, s / 5e9) for s in (4096, 1 << 20)]
    machine = {"cpu": "x", "cores": "2", "gpu": "none", "filesystem": "ext4", "date": "today"}
    plot(BenchResult(measurements, LinkProfile.from_presets(), machine), path)
    _assert_replaced(precious, path)


def test_the_report_plot_replaces_a_planted_link(tmp_path: Path):
    """``python -m tierkv.quality.report --plot`` writes in place of a link at its path, never through it."""
    precious, path = _link_planted(tmp_path, "quality.png")
    records = [{"prompt": "needle/512/d0.50/#0", "task": "needle", "length": 512, "method": method,
                "correct": True} for method in ("full", "sparse@0.1")]
    report.plot(records, path, "demo")
    _assert_replaced(precious, path)


def test_an_interrupted_prefill_is_not_reused_for_another_seed(run_folder: Path, capsys):
    """The KV an interrupted run saved (its reference.json not yet written) is reused only for the very ids it was
    prefilled from: another seed's prompt of the same key is prefilled again, and its answer is right."""
    (run_folder / "reference.json").unlink()
    assert main(_reference_args(run_folder, seed=1)) == 0
    assert "prefilling it again" in capsys.readouterr().err
    (record,) = json.loads((run_folder / "reference.json").read_text())["results"]
    assert record["correct"] and record["output"].strip().startswith(record["answer"]), record


def test_a_reference_of_another_seed_is_refused(run_folder: Path, capsys):
    """A reference whose prompt of a key holds other ids (another --seed) is refused, not reported as this run's."""
    assert main(_reference_args(run_folder, seed=1)) == 2
    assert "another --seed" in _one_line_error(capsys)


def test_a_reference_of_another_model_is_refused(run_folder: Path, capsys):
    """A reference another model made is neither extended nor measured with this one."""
    path = run_folder / "reference.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), model="smollm2")))
    for argv in (_reference_args(run_folder), _measure_args(run_folder)):
        assert main(argv) == 2
        assert "give --model smollm2 or a fresh --out folder" in _one_line_error(capsys)


def test_a_saved_kv_of_other_ids_is_refused_by_measure(run_folder: Path, capsys):
    """``--stage measure`` decodes only from KV prefilled from the reference's own prompt ids."""
    kv = next((run_folder / "kv").iterdir())
    other = run_folder.parent / "other"
    assert main(_reference_args(other, seed=1)) == 0
    os.replace(next((other / "kv").iterdir()), kv)
    assert main(_measure_args(run_folder)) == 2
    assert "was not prefilled from this prompt's token ids" in _one_line_error(capsys)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the folder another owner")
@pytest.mark.parametrize("how", ["another owner", "group-writable"])
def test_a_run_folder_another_user_can_write_is_refused_before_the_model_loads(how: str, run_folder: Path, capsys,
                                                                              monkeypatch):
    """A run folder another user owns or can write (one made in /tmp by someone else, with a reference and KV of
    their own planted in it) is refused before anything in it is read or the model loads."""
    if how == "another owner":
        os.chown(run_folder, 1002, 1002)
    else:
        run_folder.chmod(0o770)
        os.chown(run_folder, os.geteuid(), 1002)
    _no_model(monkeypatch)
    assert main(_measure_args(run_folder)) == 1  # (a DiskTierError, as for a disk_dir)
    assert str(run_folder) in _one_line_error(capsys)
