"""Untrusted link profiles and trace paths: numbers no float holds and terminal escapes in a profile file are
refused or defused when it is read, and a trace never lands on a name it may not, or should not, replace."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tierkv import TieredCache, safefs
from tierkv.bandwidth import LinkProfile
from tierkv.cli import main
from tierkv.commands import writable_file
from tierkv.errors import DiskTierError, InvalidConfigError
from tierkv.inputs import output_problem
from tierkv.persist import conversation
from tierkv.stats import make_trace

HUGE = int("1" + "0" * 400)  # a JSON integer no float holds: float() raises OverflowError
ESCAPES = "\x1b]0;TITLE\x07\x1b[2J\x1b[31m\x9b1m"  # set the window title, clear the screen, colour (C0 and C1)
SMALL_PLAN = ["plan", "--model", "smollm2-135m", "--context", "8K", "--gpu-gb", "1", "--cpu-gb", "1"]


def _profile(tmp_path: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """A preset profile saved to ``tmp_path`` and changed by ``edit`` (as anyone may hand one over)."""
    path = tmp_path / "profile.json"
    LinkProfile.from_presets().save(path)
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    return path


# ------------------------------------------------------------------ what a profile file is
@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d.update(format=2), "of format 2, written by a newer tierkv .*upgrade tierkv"),
    (lambda d: d.update(format=True), "field 'format' is True, not 1"),
    (lambda d: d.update(format="1"), "field 'format' is '1', not 1"),
    (lambda d: d.update(compute_by_layer={"a": 1}), r"has fields no profile of format 1 has \(compute_by_layer\)"),
    (lambda d: d.update(profile=d.pop("links")), "is `tierkv bench --json`'s record, not a link profile"),
])
def test_a_file_that_is_not_a_profile_of_this_format_is_refused(tmp_path: Path, edit: Callable, message: str) -> None:
    """A newer tierkv's profile (a later format, fields this one does not know) was planned with in part, and
    bench's --json record said only "malformed (KeyError: 'links')": each is refused with what it is."""
    with pytest.raises(InvalidConfigError, match=message):
        LinkProfile.load(_profile(tmp_path, edit))


def test_a_profile_saved_before_it_had_a_format_plans_as_before(tmp_path: Path) -> None:
    path = _profile(tmp_path, lambda d: d.pop("format"))
    assert LinkProfile.load(path) == LinkProfile.load(_profile(tmp_path, lambda d: None))
    older = _profile(tmp_path, lambda d: d.pop("format") and d.update(contention=1.2, disk_contention=1.3))
    assert LinkProfile.load(older).contention == LinkProfile.load(_profile(tmp_path, lambda d: d.update(
        contention=1.2))).contention  # one factor for all, as profiles of then were read


# ------------------------------------------------------------------ numbers in a profile file
@pytest.mark.parametrize(("edit", "named"), [
    (lambda d: d.update(host_attention={"bandwidth_bytes_per_s": 1e10, "single_thread_bytes_per_s": 1e9,
                                        "threads": float("inf")}), "host_attention.threads=inf"),
    (lambda d: d["links"]["host->device"].update(bandwidth_bytes_per_s=HUGE), "host->device.bandwidth_bytes_per_s"),
    (lambda d: d["links"]["disk->host"].update(latency_s=HUGE), "disk->host.latency_s"),
    (lambda d: d["contention"].update(compute_by_copies=HUGE), "contention.compute_by_copies"),
    (lambda d: d.update(contention=HUGE), "contention="),
    (lambda d: d.update(layer_overhead_s=HUGE), "layer_overhead_s"),
    (lambda d: d["machine"].update(compute_flops="1e400"), "machine.compute_flops"),
])
def test_a_profile_number_no_float_holds_is_refused_by_name(tmp_path: Path, edit: Callable, named: str) -> None:
    """Infinity or a 400-digit integer raised a bare OverflowError from the float/int conversion; it is an
    InvalidConfigError naming the field, its digits cut short."""
    path = _profile(tmp_path, edit)
    with pytest.raises(InvalidConfigError, match="malformed") as caught:
        LinkProfile.load(path)
    assert named in str(caught.value) and "0" * 100 not in str(caught.value)


@pytest.mark.parametrize("threads", [2.5, True, "8"])
def test_host_attention_threads_must_be_a_whole_number(tmp_path: Path, threads: object) -> None:
    """A thread count is an integer: 2.5 was truncated to 2, true read as 1 thread."""
    path = _profile(tmp_path, lambda d: d.update(host_attention={
        "bandwidth_bytes_per_s": 1e10, "single_thread_bytes_per_s": 1e9, "threads": threads}))
    with pytest.raises(InvalidConfigError, match="host_attention.threads=.* is not a whole number"):
        LinkProfile.load(path)


def test_plan_refuses_a_profile_number_no_float_holds_in_one_line(tmp_path: Path, capsys: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``tierkv plan`` with such a profile, by ``--profile`` or ``$TIERKV_PROFILE``: one line naming the field."""
    path = _profile(tmp_path, lambda d: d.update(layer_overhead_s=HUGE))
    assert main([*SMALL_PLAN, "--profile", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err and "layer_overhead_s" in err, err
    monkeypatch.setenv("TIERKV_PROFILE", str(path))
    assert main(SMALL_PLAN) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "TIERKV_PROFILE" in err and "layer_overhead_s" in err, err


# ------------------------------------------------------------------ text in a profile file
def test_profile_text_loses_control_characters_when_loaded(tmp_path: Path) -> None:
    """The strings of a profile (machine, link and kernel names) reach the terminal: none keeps a control
    character that could drive it."""
    def edit(data: dict[str, Any]) -> None:
        data["machine"].update(warnings=f"busy {ESCAPES}", gpu=f"{ESCAPES}H100")
        data["links"]["host->device"]["name"] = f"pcie{ESCAPES}"
        data["host_attention"] = {"bandwidth_bytes_per_s": 1e10, "single_thread_bytes_per_s": 1e9, "threads": 4,
                                  "kernel": f"native{ESCAPES}"}

    profile = LinkProfile.load(_profile(tmp_path, edit))
    assert profile.machine["gpu"] == "]0;TITLE[2J[31m1mH100"
    texts = [*profile.machine, *profile.machine.values(), *(link.name for link in profile.links.values())]
    assert profile.host_attention is not None
    texts.append(profile.host_attention.kernel)
    assert not [text for text in texts if any(ord(c) < 0x20 or 0x7f <= ord(c) <= 0x9f for c in text)]


def test_plan_prints_profile_text_literally(tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A profile's warnings and GPU name, printed in ``tierkv plan``'s notes, are shown as written: rich markup
    in them is not rendered (nor swallowed), escapes do not reach the terminal."""
    path = _profile(tmp_path, lambda d: (d["machine"].update(warnings=f"[bold]loud[/bold] {ESCAPES}",
                                                             gpu="[blink]gpu[/blink]"), d.update(serial_mover=True)))
    monkeypatch.setenv("COLUMNS", "400")  # one note a line
    assert main([*SMALL_PLAN, "--device", "h100-sxm", "--profile", str(path)]) == 0
    out = capsys.readouterr().out
    assert "[bold]loud[/bold]" in out and "gpu: [blink]gpu[/blink]" in out, out
    assert "\x1b" not in out and "\x07" not in out


# ------------------------------------------------------------------ a trace path in a sticky directory
OTHER_UID = 65534  # the other user (nobody), who owns what she planted
USER_UID = 65533  # this test's user while it runs as someone other than root
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to plant another user's file and to act as a "
                                                          "third user")


@pytest.fixture
def sticky_tmp() -> Iterator[Path]:
    """A directory as /tmp is (1777, root's): every user may make names in it, none replace another's."""
    path = Path(tempfile.mkdtemp(prefix="tierkv-sticky-"))
    path.chmod(0o1777)
    yield path
    for entry in path.iterdir():
        entry.unlink()
    path.rmdir()


@contextlib.contextmanager
def acting_as(uid: int) -> Iterator[None]:
    """Run the block with effective uid ``uid`` (root's saved uid takes it back after)."""
    os.seteuid(uid)
    try:
        yield
    finally:
        os.seteuid(0)


def _plant(folder: Path) -> dict[str, Path]:
    """The other user's file and link in ``folder``, each at a name this user might choose."""
    file, link = folder / "tierkv-trace.json", folder / "link.json"
    file.write_text("hers\n")
    file.chmod(0o666)  # writable by anyone: only the sticky rule keeps this user from replacing it
    link.symlink_to(folder / "elsewhere.json")
    for path in (file, link):
        os.lchown(path, OTHER_UID, OTHER_UID)
    return {"file": file, "link": link}


@needs_root
def test_another_users_entry_in_a_sticky_directory_is_refused_when_given(sticky_tmp: Path) -> None:
    """A trace (or save) path that another user's file or link holds in /tmp could not be renamed over at close
    (EPERM: the trace was lost, only logged); it is refused when the path is given, naming the fix."""
    planted = _plant(sticky_tmp)
    with acting_as(USER_UID):
        with pytest.raises(PermissionError):  # what the rename at close would meet
            os.replace(Path(tempfile.mkstemp(dir=sticky_tmp)[1]), planted["file"])
        for path in planted.values():
            problem = output_problem(path)
            assert problem is not None and problem[0] == errno.EPERM and "another user" in problem[1]
            with pytest.raises(InvalidConfigError, match="belongs to another user.*choose a path of your own"):
                make_trace(path)
            with pytest.raises(DiskTierError, match="belongs to another user.*Choose a path of your own"):
                safefs.write_file(path, [b"{}"], shared=False)
            with pytest.raises(DiskTierError, match="belongs to another user.*choose a path of your own"):
                conversation.check_target(path)  # a save refused before any K/V is copied
            with pytest.raises(argparse.ArgumentTypeError, match="belongs to another user.*a path of your own"):
                writable_file("--json", "out.json")(str(path))  # an option refused while parsed, before a run
        mine = sticky_tmp / "mine.json"
        mine.write_text("{}")
        assert output_problem(mine) is None  # this user's own entry is replaced as ever
    assert planted["file"].read_text() == "hers\n" and planted["link"].is_symlink()


@needs_root
def test_root_and_a_sticky_directorys_owner_may_replace_others_entries(sticky_tmp: Path) -> None:
    """The check follows the kernel's rule: root, and the owner of the sticky directory, may rename over anyone's."""
    planted = _plant(sticky_tmp)
    assert output_problem(planted["file"]) is None
    os.chown(sticky_tmp, USER_UID, USER_UID)
    with acting_as(USER_UID):
        assert output_problem(planted["file"]) is None
        safefs.write_file(planted["file"], [b"{}"], shared=False)
    assert planted["file"].read_text() == "{}" and not stat.S_ISLNK(planted["file"].lstat().st_mode)


# ------------------------------------------------------------------ numbered traces of $TIERKV_TRACE
def test_numbered_traces_never_replace_what_is_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``TIERKV_TRACE=run.json`` the 2nd and 3rd caches of a process wrote run-2.json and run-3.json unchecked:
    the user's own run-2.json was replaced, a folder run-3.json lost the trace. They take the next free names."""
    (tmp_path / "run-2.json").write_text("the user's own file\n")
    (tmp_path / "run-3.json").mkdir()
    monkeypatch.setenv("TIERKV_TRACE", str(tmp_path / "run.json"))
    for _ in range(3):
        TieredCache(gpu_gb="1MiB", cpu_gb="1MiB").close()
    assert (tmp_path / "run-2.json").read_text() == "the user's own file\n"
    assert (tmp_path / "run-3.json").is_dir()
    for name in ("run.json", "run-4.json", "run-5.json"):
        assert "traceEvents" in json.loads((tmp_path / name).read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run-2.json", "run-3.json", "run-4.json", "run-5.json",
                                                          "run.json"]


def test_a_numbered_trace_name_is_claimed_when_the_cache_is_built(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The numbered name is created (an empty trace) when the trace is made, so a file made there afterwards by
    anyone cannot be taken for free and replaced at close; a link there is left alone, never followed."""
    (tmp_path / "run-2.json").symlink_to(tmp_path / "target.json")
    monkeypatch.setenv("TIERKV_TRACE", str(tmp_path / "run.json"))
    first, second = make_trace(None), make_trace(None)
    assert first is not None and second is not None
    assert first.path == str(tmp_path / "run.json") and second.path == str(tmp_path / "run-3.json")
    claimed = (tmp_path / "run-3.json").lstat()
    assert stat.S_ISREG(claimed.st_mode) and stat.S_IMODE(claimed.st_mode) == 0o600
    events = json.loads((tmp_path / "run-3.json").read_text())["traceEvents"]
    assert [event for event in events if event["ph"] == "X"] == []  # no span yet: an empty trace
    assert not (tmp_path / "target.json").exists()


def test_a_numbered_trace_that_cannot_be_created_is_refused_when_the_cache_is_built(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A numbered name the folder does not take (longer than its limit) is an InvalidConfigError naming it at
    build, not a trace lost at close."""
    longest = os.pathconf(tmp_path, "PC_NAME_MAX")
    base = tmp_path / ("r" * (longest - 5) + ".json")  # fits; "<stem>-2.json" does not
    monkeypatch.setenv("TIERKV_TRACE", str(base))
    assert make_trace(None) is not None
    with pytest.raises(InvalidConfigError, match="TIERKV_TRACE=.*-2.json.*longer than"):
        make_trace(None)
