"""``tierkv plan`` on inputs past the ordinary: huge contexts and tiny chunks in bounded work, hostile config.json
files refused in one line that names the file and the field, a what-if of nothing refused, and a note when a
``--profile`` does not fit what is planned (a CPU-only host's links priced for a GPU, a ``--quick`` smoke test)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tierkv.bandwidth import LayerLoad
from tierkv.cli import main
from tierkv.errors import InvalidConfigError
from tierkv.model_presets import MAX_LAYERS, MODEL_PRESETS, model_from_config
from tierkv.planner import GPU_KEY, QUICK_NOTE, WARNINGS_KEY, build_request, plan, what_ifs
from tierkv.stats import default_profile

LOAD_BUDGET = 10_000
"""LayerLoads a plan may build: a few per layer and executor, however long the context or small the chunk."""

CONFIG = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256, "vocab_size": 100}
SMALL = ["--context", "8K", "--gpu-gb", "1", "--cpu-gb", "1"]


@pytest.fixture
def load_budget(monkeypatch):
    """Fail a test as soon as it builds more than LOAD_BUDGET LayerLoads (one per streaming chunk would)."""
    built = []
    check = LayerLoad.__post_init__

    def counted(self: LayerLoad) -> None:
        built.append(self)
        if len(built) > LOAD_BUDGET:
            raise AssertionError(f"more than {LOAD_BUDGET} LayerLoads built: work grows with context / chunk")
        check(self)

    monkeypatch.setattr(LayerLoad, "__post_init__", counted)
    return built


@pytest.mark.parametrize("argv", [
    ["--context", "1M", "--gpu-gb", "20", "--cpu-gb", "1", "--chunk-tokens", "1"],
    ["--context", "1024G", "--gpu-gb", "9000000000", "--cpu-gb", "1"],
    ["--context", "128M", "--gpu-gb", "20", "--cpu-gb", "1", "--executor", "streaming"],
    ["--context", "1M", "--gpu-gb", "80", "--cpu-gb", "512", "--chunk-tokens", "16"],
])
def test_huge_contexts_and_tiny_chunks_plan_in_bounded_work(argv, load_budget, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "llama-3-8b", *argv, "--json", str(out)]) == 0, capsys.readouterr().err
    streaming = next(e for e in json.loads(out.read_text())["executors"] if e["executor"] == "streaming")
    assert streaming["fits"] and streaming["predicted_step_s"] > 0
    assert load_budget  # the plan went through LayerLoad (the budget counted real work)


def _config(tmp_path, name: str, fields: dict | str) -> str:
    path = tmp_path / name
    path.write_text(fields if isinstance(fields, str) else json.dumps({**CONFIG, **fields}))
    return str(path)


@pytest.mark.parametrize(("fields", "needle"), [
    ({"num_attention_heads": 0}, "num_attention_heads=0 must be an integer from 1"),
    ({"num_hidden_layers": "abc"}, 'num_hidden_layers="abc" must be an integer'),
    ({"num_attention_heads": None}, "num_attention_heads=null must be an integer"),
    ('{"num_hidden_layers": 1e400, "num_attention_heads": 4, "hidden_size": 256, "vocab_size": 100}',
     "num_hidden_layers=Infinity must be an integer"),
    ({"num_hidden_layers": 10**9}, f"num_hidden_layers=1000000000 must be an integer from 1 to {MAX_LAYERS}"),
    ({"hidden_size": 10**400}, "hidden_size=1000"),
    ({"num_key_value_heads": 8}, "num_key_value_heads=8 must divide num_attention_heads=4"),
    ({"num_attention_heads": 3}, "hidden_size=256 is not a multiple of num_attention_heads=3"),
    ({"head_dim": -64}, "head_dim=-64 must be an integer"),
    ({"sliding_window": -5, "layer_types": ["sliding_attention", "full_attention"]}, "sliding_window=-5 must be"),
    ({"layer_types": 7}, "layer_types=7 must be a list of layer kinds"),
    ({"text_config": "x"}, "text_config must be a JSON object"),
])
def test_a_hostile_config_is_refused_in_one_line_naming_file_and_field(fields, needle, tmp_path, capsys):
    path = _config(tmp_path, "hostile.json", fields)
    assert main(["plan", "--model", path, *SMALL]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert path in err and needle in err, err


def test_a_config_counts_in_digits_or_integral_floats_still_plan(tmp_path):
    model = model_from_config(_config(tmp_path, "x.json", {"num_hidden_layers": "2", "hidden_size": 256.0}))
    assert (model.layers, model.hidden_size, model.head_dim) == (2, 256, 64)


def test_a_model_is_named_after_its_file_or_its_folder(tmp_path):
    assert model_from_config(_config(tmp_path, "sw.json", {})).name == "sw.json"
    folder = tmp_path / "Llama-Tiny"
    folder.mkdir()
    assert model_from_config(_config(folder, "config.json", {})).name == "Llama-Tiny"
    with pytest.raises(InvalidConfigError, match=r"sw\.json'?: sliding_window=-5"):
        model_from_config(_config(tmp_path, "sw.json", {"sliding_window": -5, "layer_types": ["sliding_attention",
                                                                                             "full_attention"]}))


def test_a_model_spec_past_the_layer_limit_is_refused():
    with pytest.raises(InvalidConfigError, match=f"{MAX_LAYERS + 1} layers is more than the planner's {MAX_LAYERS}"):
        dataclasses.replace(MODEL_PRESETS["llama-3-8b"], layers=MAX_LAYERS + 1)


@pytest.mark.parametrize("extra", ["0", "0GB"])
def test_a_what_if_of_no_device_memory_is_refused(extra, capsys):
    assert main(["plan", "--model", "llama-3-8b", *SMALL, "--what-if-gpu-gb", extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "adds no device memory" in err and "16" in err, err
    with pytest.raises(InvalidConfigError, match="extra_gpu_bytes=0 must be >= 1"):
        what_ifs(plan(build_request("llama-3-8b", "8K", gpu=1, cpu=1)), extra_gpu_bytes=0)


@pytest.mark.parametrize("quick", [False, True])
def test_a_cpu_only_profile_priced_for_a_gpu_is_noted(quick, tmp_path, capsys):
    warnings = "the host was busy" + (f"; {QUICK_NOTE}" if quick else "")
    profile = dataclasses.replace(default_profile("cpu"), machine={GPU_KEY: "none", WARNINGS_KEY: warnings})
    assert profile.serial_mover
    profile.save(tmp_path / "cpu.json")
    argv = ["plan", "--model", "smollm2-135m", "--context", "8K", "--gpu-gb", "0.05", "--cpu-gb", "0.2",
            "--profile", str(tmp_path / "cpu.json")]
    out = tmp_path / "plan.json"
    assert main([*argv, "--device", "h100-sxm", "--json", str(out)]) == 0
    notes = json.loads(out.read_text())["notes"]
    gpu = [note for note in notes if "without a GPU" in note]
    assert len(gpu) == 1 and "--device h100-sxm" in gpu[0] and "drop --profile" in gpu[0]
    assert "note: the --profile was measured on a host without a GPU" in capsys.readouterr().out.replace("\n", " ")
    assert any("`tierkv bench --quick`" in note for note in notes) == quick
    busy = next(note for note in notes if "measured with warnings" in note)
    assert "the host was busy" in busy and QUICK_NOTE not in busy
    assert main([*argv, "--json", str(out)]) == 0  # the CPU it was measured on: nothing to note about the device
    assert not any("without a GPU" in note for note in json.loads(out.read_text())["notes"])
