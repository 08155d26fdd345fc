"""What users type, from a third audit: seeds and counts refused in flags with what is wrong, each command
checking only the ``TIERKV_*`` files it uses, ``tierkv plan`` reading ``$TIERKV_PROFILE`` and saying so, plan
labels that match what the planner computes, bounded plan options, settings that name the variable and the fix,
a password kept as typed, and the demo's and eval's first lines."""

from __future__ import annotations

import argparse
import io

import pytest
from rich.console import Console
from test_cli import PLAN, assert_one_line_error, tierkv

from tierkv import settings
from tierkv.bandwidth import LinkProfile
from tierkv.cli import _check_settings, build_parser, main
from tierkv.commands import SEED_MAX
from tierkv.errors import InvalidConfigError

SMALL_PLAN = ["plan", "--model", "smollm2-135m", "--context", "8K", "--gpu-gb", "1", "--cpu-gb", "1"]


def _error(capsys, argv: list[str]) -> str:
    """The one-line error of ``tierkv ARGV`` run in this process (exit status 2)."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


# ------------------------------------------------------------------------ 1, 12: seeds and counts in flags
@pytest.mark.parametrize("command", ["demo", "eval"])
def test_a_seed_past_torchs_range_is_refused_in_flags(command, capsys):
    """It was a traceback from torch.manual_seed (an overflow) once the model had loaded (parsed only here: without
    the bound an eval would run)."""
    with pytest.raises(SystemExit) as exited:
        build_parser(command).parse_args([command, "--seed", str(SEED_MAX + 1)])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "--seed" in err and "too large" in err and f"{SEED_MAX:,}" in err
    assert build_parser(command).parse_args([command, "--seed", str(SEED_MAX)]).seed == SEED_MAX


@pytest.mark.parametrize(("argv", "needle"), [
    (["--seed", "1e30"], "too large"),  # was "is not a whole number"
    (["--seed", "1.5"], "give an integer, e.g. 2"),
    (["--seed", "abc"], "is not a number"),
])
def test_an_integer_option_says_what_is_wrong(argv, needle, capsys):
    assert needle in _error(capsys, ["demo", *argv])


def test_token_counts_take_the_token_forms_elsewhere_accepted():
    """``--block-tokens 1M`` and ``--max-new-tokens 1e9`` were "not a whole number"; now they are token counts
    (and the demo's own checks bound them before any work)."""
    args = build_parser("demo").parse_args(["demo", "--block-tokens", "1M", "--max-new-tokens", "1e9"])
    assert (args.block_tokens, args.max_new_tokens) == (2**20, 10**9)
    assert build_parser("eval").parse_args(["eval", "--block-tokens", "1K"]).block_tokens == 1024


# ------------------------------------------------------------------------ 2, 3, 9: file settings per command
def test_bench_does_not_require_the_profile_it_writes(tmp_path, monkeypatch):
    """``TIERKV_PROFILE=p.json tierkv bench --profile-out p.json`` was refused: the file did not exist yet."""
    import tierkv.commands.bench as bench
    import tierkv.commands.demo as demo

    monkeypatch.setenv("TIERKV_PROFILE", str(tmp_path / "p.json"))
    _check_settings(bench)
    with pytest.raises(InvalidConfigError, match="TIERKV_PROFILE"):
        _check_settings(demo)


def test_plan_plans_with_the_profile_of_tierkv_profile_and_says_so(tmp_path):
    """``tierkv plan`` refused a bad TIERKV_PROFILE but planned with presets beside a good one."""
    path = tmp_path / "p.json"
    LinkProfile.from_presets("pcie5", "nvme-gen5").save(path)
    argv = [*SMALL_PLAN, "--gpu-gb", "0.05", "--cpu-gb", "0.5"]
    result = tierkv(*argv, env={"COLUMNS": "300", "TIERKV_PROFILE": str(path)})
    assert result.returncode == 0, result.stderr
    assert f"TIERKV_PROFILE={path}" in result.stdout and "via pcie5" in result.stdout
    without = tierkv(*argv, env={"COLUMNS": "300"}).stdout
    assert "links from" not in without and "via pcie4" in without  # the presets name themselves


def test_plan_builds_no_cache_so_tierkv_trace_is_not_checked():
    assert tierkv(*PLAN, "--context", "8K", env={"TIERKV_TRACE": "/dev/null"}).returncode == 0


def test_a_malformed_tierkv_profile_names_the_variable(tmp_path):
    """A missing file named TIERKV_PROFILE; a malformed one named only the path."""
    path = tmp_path / "bad.json"
    path.write_text('{"links": 5}')
    result = tierkv(*SMALL_PLAN, env={"TIERKV_PROFILE": str(path)})
    assert_one_line_error(result, 2, "TIERKV_PROFILE", "malformed", "or unset TIERKV_PROFILE")


# ------------------------------------------------------------------------ 4, 5, 6, 10, 11: plan
def test_a_cpu_plans_bound_row_is_the_max_the_planner_takes():
    """The planner reads the disk ahead on the engine's threads, so the bound is the largest busy row, not
    ``max(compute, sum of mover)`` as the label said."""
    result = tierkv("plan", "--model", "smollm2-135m", "--context", "8K", "--gpu-gb", "0.05", "--cpu-gb", "0.1",
                    "--device", "cpu", "--compute-ms-per-token", "1", env={"COLUMNS": "100"})
    assert result.returncode == 0, result.stderr
    assert "sum of mover" not in result.stdout
    assert "disk reads (engine threads)" in result.stdout and "max of the busy rows" in result.stdout
    assert "(disk reads)" in result.stdout  # the bound names the disk reads, not the mover


@pytest.mark.parametrize(("depth", "needle"), [("65", "at most 64"), ("1000000", "at most 64"),
                                               ("30", "give at most 29")])
def test_a_prefetch_depth_past_the_runtime_or_the_model_is_refused(depth, needle, capsys):
    """65 was accepted (the runtime caps at 64), 1000000 printed "staging of 1000001 layers"; smollm2 has 30."""
    assert needle in _error(capsys, [*SMALL_PLAN, "--prefetch-depth", depth])


def test_the_split_what_ifs_slower_note_gives_splits_reason():
    """It said gather's: "gathered on the device ... instead of copied host->device"."""
    result = tierkv("plan", "--model", "llama-3-8b", "--context", "256K", "--cpu-gb", "16", "--gpu-gb", "32",
                    "--executor", "split", env={"COLUMNS": "200"})
    note = next(line for line in result.stdout.splitlines() if line.startswith("* +16 GB device"))
    assert "attended on the device" in note and "gathered" not in note


@pytest.mark.parametrize(("argv", "needle"), [
    (["--compute-ms-per-token", "1e308"], "'1e308' must be a number > 0 and at most 1,000,000"),  # 300-digit output
    (["--host-dram-gbps", "1e300"], "'1e300' must be a number > 0 and at most 100,000"),  # said "inf must be ..."
    (["--host-cores", "100000"], "too large"),
])
def test_plan_numbers_are_bounded_and_echo_what_was_typed(argv, needle, capsys):
    err = _error(capsys, [*SMALL_PLAN, *argv])
    assert needle in err and "inf" not in err


def test_host_options_the_links_override_are_refused(tmp_path, capsys):
    """With --profile's measured host rate (or a CPU host's memcpy) they were silently ignored."""
    path = tmp_path / "p.json"
    LinkProfile.from_presets().save(path)
    data = path.read_text().replace('"links"', '"host_attention": {"bandwidth_bytes_per_s": 2e10, '
                                    '"single_thread_bytes_per_s": 1e10, "threads": 4}, "links"', 1)
    path.write_text(data)
    err = _error(capsys, [*SMALL_PLAN, "--executor", "split", "--profile", str(path), "--host-cores", "8"])
    assert "--host-cores" in err and "measured by tierkv bench" in err and "leave --host-cores out" in err
    assert "--host-dram-gbps" in _error(capsys, [*SMALL_PLAN, "--device", "cpu", "--host-dram-gbps", "50"])


# ------------------------------------------------------------------------ 7, 8, 13: settings
@pytest.mark.parametrize("below", [False, True])
def test_a_cache_dir_that_is_a_file_names_the_variable(tmp_path, monkeypatch, below):
    """It was a raw NotADirectoryError from the first use (``tierkv.models.load``)."""
    file = tmp_path / "f"
    file.write_text("")
    monkeypatch.setenv("TIERKV_CACHE_DIR", str(file / "sub" if below else file))
    with pytest.raises(InvalidConfigError, match="TIERKV_CACHE_DIR.*is not a directory") as caught:
        settings.get("cache_dir")
    assert ("is below" in str(caught.value)) == below


def test_a_relative_cache_dir_says_e_g_once(monkeypatch):
    monkeypatch.setenv("TIERKV_CACHE_DIR", "relative/cache")
    with pytest.raises(InvalidConfigError) as caught:
        settings.get("cache_dir")
    assert str(caught.value).count("e.g.") == 1


@pytest.mark.parametrize(("variable", "value", "unit"), [("TIERKV_IO_CHUNK", "4096", "4KiB"),
                                                         ("TIERKV_PREFETCH_MIN", "1048576", "1MiB"),
                                                         ("TIERKV_REMOTE_QUEUE", "67108864", "64MiB")])
def test_a_bare_byte_count_is_told_it_means_gb(variable, value, unit):
    """The message gave the range only: a byte count read as that many GB was left for the user to guess."""
    assert_one_line_error(tierkv(*SMALL_PLAN, env={variable: value}), 2, variable,
                          f"a bare number is GB: {value} is {value} GB", f"{unit} or {value}B")


def test_the_redis_password_keeps_its_spaces(monkeypatch):
    monkeypatch.setenv("TIERKV_REDIS_PASSWORD", " pass word ")
    assert settings.get("redis_password") == " pass word "
    monkeypatch.setenv("TIERKV_DISK_ENGINE", " posix ")  # other values are still read stripped
    assert settings.get("disk_engine") == "posix"


# ------------------------------------------------------------------------ 14, 16: first lines
def test_evals_estimate_counts_each_trials_fixed_cost(monkeypatch):
    """0.2-0.7 s was said of a 3 s run, and "between 0.0 s and 0.0 s" at 64 tokens: only the forwards' roofline."""
    import tierkv.commands.estimate as estimate
    from tierkv.commands.eval import TRIAL_FIXED_S, _estimate

    args = argparse.Namespace(device="cpu", lengths=[64, 128], depths=[0.5], samples=2, prefill_chunk=1024,
                              cache="dynamic")
    monkeypatch.setattr(estimate, "measure_cpu", lambda: None)
    monkeypatch.setattr(estimate, "greedy_s", lambda *a: (0.0, 0.0))
    assert f"between {4 * TRIAL_FIXED_S / 2:.1f} s and {4 * TRIAL_FIXED_S * 2:.1f} s" in _estimate(args, None)


def test_the_demos_first_line_calls_the_sizes_budgets(monkeypatch):
    """"into device 1.48 MiB + host 1.00 MiB + disk" read as a placement."""
    import tierkv.commands.estimate as estimate
    from tierkv.commands.demo import _announce

    monkeypatch.setattr(estimate, "measure_cpu", lambda: None)
    monkeypatch.setattr(estimate, "greedy_s", lambda *a: (1.0, 1.0))
    args = build_parser("demo").parse_args(["demo", "--no-reference"])
    out = io.StringIO()
    _announce(Console(file=out, width=300), args, None, 1024, 16, 1_550_000, 2**20, 2_130_000, 1_000_000)
    line = out.getvalue()
    assert "budgets of 1.48 MiB (device) and 1.00 MiB (host), the rest on disk" in line, line



def test_the_roofline_reads_each_kv_head_once():
    """A decode step's K/V bytes are the KV heads' (a query group shares its head): counting query heads made a
    grouped-query model's memory-bound step look group-times slower."""
    import transformers

    from tierkv.commands.estimate import forward_s
    from tierkv.planner import DeviceSpec

    def model(kv_heads: int):
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=8, num_key_value_heads=kv_heads, head_dim=8)
        return transformers.LlamaForCausalLM(config)

    slow_memory = DeviceSpec("memory-bound", 1e9, 1e18, 1.0)  # the step's time is its bytes
    grouped, full = (forward_s(model(heads), slow_memory, 1, 100_000) for heads in (2, 8))
    assert grouped < full / 3  # the weights' bytes aside, a quarter of the K/V
