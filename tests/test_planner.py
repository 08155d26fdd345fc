"""Planner arithmetic against hand-computed Llama-3-8B numbers, config parsing, the CLI and its errors."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from tierkv.bandwidth import Bottleneck
from tierkv.commands import plan as plan_command
from tierkv.errors import BudgetTooSmallError, CapacityError, InvalidConfigError
from tierkv.model_presets import MODEL_PRESETS, model_from_config, resolve_model
from tierkv.planner import (
    build_request,
    compare_executors,
    fastest_advice,
    host_attention_rate,
    parse_tokens,
    plan,
    sparse_advice,
    sparse_fetched_tokens,
    sparse_table_bytes,
    sparse_what_if,
    split_min_device_bytes,
    what_ifs,
)

GiB = 2**30
M = 2**20


@pytest.mark.parametrize(
    ("name", "kib_per_token"),
    [("llama-3-8b", 128), ("llama-3-70b", 320), ("mistral-7b", 128), ("qwen2.5-7b", 56)],
)
def test_preset_kv_bytes_per_token(name, kib_per_token):
    # 2 (K,V) * layers * kv_heads * head_dim * 2 bytes: Llama-3-8B 2*32*8*128*2 = 131072 = 128 KiB.
    assert MODEL_PRESETS[name].kv_bytes_per_token == kib_per_token * 2**10


def test_preset_parameter_counts_match_the_model_names():
    assert MODEL_PRESETS["llama-3-8b"].params == pytest.approx(8.03e9, rel=0.01)
    assert MODEL_PRESETS["llama-3-70b"].params == pytest.approx(70.6e9, rel=0.01)
    assert MODEL_PRESETS["qwen2.5-7b"].params == pytest.approx(7.6e9, rel=0.01)


@pytest.mark.parametrize(
    ("text", "tokens"), [("1M", 2**20), ("128K", 131072), ("32768", 32768), (4096, 4096)]
)
def test_parse_tokens(text, tokens):
    assert parse_tokens(text) == tokens


@pytest.mark.parametrize("bad", ["lots", "-5", 0, "1.5X"])
def test_parse_tokens_rejects_bad_input(bad):
    with pytest.raises(InvalidConfigError, match="128K"):
        parse_tokens(bad)


def test_llama_3_8b_1m_tokens_hand_computed():
    req = build_request("llama-3-8b", "1M", gpu=20, cpu=136, link="pcie5", prefetch_depth=1)
    result = plan(req)
    total = 128 * GiB  # 128 KiB/token * 2^20 tokens
    # one layer holds 1M * 4 KiB = 4 GiB of K/V; layer-ahead needs two buffers, each with the runtime's 25 %
    # growth headroom (tierkv.staging: the cache reserves exactly this at its peak)
    staging = 2 * 5 * GiB
    assert result.kv_bytes_total == total
    assert result.staging_bytes == staging
    tiers = result.bytes_per_tier
    assert tiers.device == 20 * 10**9 - staging
    assert tiers.host == total - tiers.device
    assert tiers.disk == 0
    moved = result.bytes_moved_per_step
    assert moved["host->device"] == pytest.approx(tiers.host, abs=32)  # per-layer rounding
    assert moved["disk->host"] == 0
    # ~126 GB over 50 GB/s PCIe 5.0: about 2.5 s per token, the link is the bottleneck.
    assert result.forecast.bottleneck is Bottleneck.HOST_TO_DEVICE
    assert result.forecast.step_s == pytest.approx(tiers.host / 50e9, rel=0.05)
    assert result.tokens_per_s == pytest.approx(1 / result.forecast.step_s)


def test_host_overflow_goes_to_disk_and_disk_is_the_bottleneck():
    result = plan(build_request("llama-3-8b", "1M", gpu=20, cpu=64, link="pcie5", disk_link="nvme-gen4"))
    tiers = result.bytes_per_tier
    assert tiers.host == 64 * 10**9
    assert tiers.disk == result.kv_bytes_total - tiers.device - tiers.host > 0
    assert result.bottleneck is Bottleneck.DISK
    labels = [w.label for w in what_ifs(result)]
    assert labels == ["+16 GB device", "NVMe Gen5"]


def test_small_context_fits_on_device_and_is_compute_bound():
    result = plan(build_request("llama-3-8b", "32K", gpu=20, cpu=16))
    assert result.bytes_per_tier.host == result.bytes_per_tier.disk == 0
    assert result.bottleneck is Bottleneck.COMPUTE
    # ~16 GB of bf16 weights at 70 % of 3.35 TB/s: ~7 ms per token on the default h100-sxm assumption.
    assert 5e-3 < result.compute_s_per_step < 10e-3


def test_compute_override_and_what_ifs_help():
    req = build_request("llama-3-8b", "128K", gpu=4, cpu=64, compute_ms_per_step=20.0)
    result = plan(req)
    assert result.compute_s_per_step == pytest.approx(20e-3)
    for alternative in what_ifs(result):
        assert alternative.plan.forecast.step_s <= result.forecast.step_s


def test_capacity_error_names_the_fix():
    with pytest.raises(CapacityError, match="raise --disk-gb or --cpu-gb"):
        plan(build_request("llama-3-8b", "1M", gpu=20, cpu=64, disk=10))


def test_staging_that_does_not_fit_names_the_fix():
    with pytest.raises(BudgetTooSmallError, match="raise --gpu-gb to at least 5.84 to decode with prefetch off "
                                                  r"\(slower\), 12 to read 1 layer ahead"):
        plan(build_request("llama-3-8b", "1M", gpu=5, cpu=200))


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(gpu="20 apples"), "not a size"),
        (dict(link="pcie9"), "pcie4, pcie5"),
        (dict(model="gpt-17"), "llama-3-8b"),
        (dict(device="abacus"), "h100-sxm"),
        (dict(batch=0), "batch"),
    ],
)
def test_bad_input_is_invalid_config(kwargs, needle):
    args = dict(model="llama-3-8b", context="1M", gpu=20, cpu=128) | kwargs
    with pytest.raises(InvalidConfigError, match=needle):
        build_request(args.pop("model"), args.pop("context"), **args)


def test_hf_config_with_sliding_window_layers(tmp_path):
    # Gemma2-9B's published config: 42 layers, alternating 4096-token sliding window and global layers.
    config = {
        "model_type": "gemma2",
        "num_hidden_layers": 42,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "hidden_size": 3584,
        "intermediate_size": 14336,
        "vocab_size": 256000,
        "sliding_window": 4096,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = resolve_model(str(tmp_path / "config.json"))
    assert model.sliding_layers == 21
    per_layer_token = 2 * 8 * 256 * 2
    assert model.kv_bytes(M) == (21 * M + 21 * 4096) * per_layer_token
    assert model_from_config(tmp_path) == model  # a model directory works too


def test_hf_config_head_dim_default_and_layer_types(tmp_path):
    config = {
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "hidden_size": 512,
        "vocab_size": 1000,
        "dtype": "float16",
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    }
    path = tmp_path / "c.json"
    path.write_text(json.dumps(config))
    model = model_from_config(path)
    assert (model.kv_heads, model.head_dim, model.dtype_bytes, model.sliding_layers) == (8, 64, 2, 2)


@pytest.mark.parametrize(("moe", "width"), [
    ({}, 2048),  # dense
    ({"num_local_experts": 32, "num_experts_per_tok": 4}, 4 * 2048),  # gpt-oss, Mixtral: experts as wide as the MLP
    ({"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768}, 8 * 768),  # Qwen3-MoE
    ({"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
      "shared_expert_intermediate_size": 5632}, 4 * 1408 + 5632),  # Qwen2-MoE: a shared expert
    ({"n_routed_experts": 64, "num_experts_per_tok": 6, "moe_intermediate_size": 1408, "n_shared_experts": 2},
     8 * 1408),  # DeepSeek-style shared experts
    ({"num_local_experts": 1, "num_experts_per_tok": 1}, 2048),  # one expert: dense
    ({"num_local_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": -5, "n_shared_experts": "2"},
     2 * 2048),  # values that are not counts count as absent
])  # fmt: skip
def test_hf_config_prices_the_experts_a_token_takes(tmp_path, moe, width):
    config = {"num_hidden_layers": 4, "num_attention_heads": 8, "hidden_size": 512, "intermediate_size": 2048,
              "vocab_size": 1000, **moe}  # fmt: skip
    path = tmp_path / "c.json"
    path.write_text(json.dumps(config))
    model = model_from_config(path)
    assert model.intermediate_size == width
    assert model.params_per_layer == 4 * 512 * 512 + 3 * 512 * width


def test_hf_config_errors(tmp_path):
    with pytest.raises(InvalidConfigError, match="does not exist"):
        model_from_config(tmp_path / "nope.json")
    (tmp_path / "c.json").write_text(json.dumps({"num_hidden_layers": 2}))
    with pytest.raises(InvalidConfigError, match="num_attention_heads"):
        model_from_config(tmp_path / "c.json")


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tierkv plan")
    plan_command.add_arguments(parser)
    return plan_command.run(parser.parse_args(argv))


def test_cli_prints_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = [
        "--model",
        "llama-3-8b",
        "--context",
        "1M",
        "--gpu-gb",
        "20",
        "--cpu-gb",
        "128",
        "--link",
        "pcie5",
    ]
    assert _cli([*argv, "--disk", "nvme-gen4", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "128.00 KiB" in text and "host->device" in text and "what-if" in text
    data = json.loads(out.read_text())
    assert data["kv_bytes_total"] == 128 * GiB
    assert set(data["bytes_per_tier"]) == {"device", "host", "disk"}
    assert data["predicted_step_s"] > 0
    assert data["bottleneck"] == "host->device"
    assert data["what_ifs"]


def test_cli_uses_a_measured_profile(tmp_path, capsys):
    from tierkv.bandwidth import Link, LinkProfile

    profile = LinkProfile.from_presets().replace(**{"host->device": Link("measured-pcie", 12e9, 1e-5)})
    path = tmp_path / "profile.json"
    profile.save(path)
    out = tmp_path / "plan.json"
    argv = ["--model", "qwen2.5-7b", "--context", "128K", "--gpu-gb", "2", "--cpu-gb", "64"]
    assert _cli([*argv, "--profile", str(path), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["links"]["host->device"]["name"] == "measured-pcie"


def test_cli_reports_user_errors_with_status_2(capsys):
    from tierkv.cli import main

    argv = ["plan", "--model", "llama-3-8b", "--context", "1M", "--gpu-gb", "20", "--cpu-gb", "64", "--disk-gb", "1"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("tierkv plan: error: ") and "raise --disk-gb" in captured.err


def _cpu_host_profile(tmp_path):
    """A CPU-only host's measured profile: one serial mover thread does gathers, copies and disk reads."""
    from tierkv.bandwidth import Contention, Link, LinkProfile

    links = {"device->device": Link("memcpy-gather", 3.53e9, 0.0), "host->device": Link("memcpy", 3.56e9, 0.0),
             "device->host": Link("memcpy", 3.5e9, 0.0), "disk->host": Link("nvme", 1.43e9, 152e-6),
             "host->disk": Link("nvme-write", 2.18e9, 118e-6), "host->host": Link("memcpy", 4e9, 0.0)}
    path = tmp_path / "cpu.json"
    LinkProfile(links, {"source": "test"}, True, Contention(1.09, 1.0, 1.41, 1.02), 359e-6).save(path)
    return str(path)


def test_table_rows_add_up_to_the_step(capsys):
    assert _cli(["--model", "llama-3-8b", "--context", "1M", "--gpu-gb", "20", "--cpu-gb", "128",
                 "--link", "pcie5"]) == 0
    text = capsys.readouterr().out
    result = plan(build_request("llama-3-8b", "1M", gpu=20, cpu=128, link="pcie5"))
    fc = result.forecast
    assert fc.lower_bound_s == max(seconds for _, seconds in result.busy_rows())
    for label, seconds in [("compute per step (roofline, h100-sxm)", result.compute_s_per_step),
                           ("= device busy", fc.compute_s), ("host->device link busy", fc.host_to_device_s),
                           ("+ not overlapped (fill, stalls)", fc.step_s - fc.lower_bound_s),
                           ("= predicted step", fc.step_s)]:
        row = next(line for line in text.splitlines() if label in line)
        assert f"{seconds * 1e3:,.1f} ms" in row, (label, row)


def test_given_compute_is_not_labelled_with_a_device(capsys):
    assert _cli(["--model", "llama-3-8b", "--context", "128K", "--gpu-gb", "4", "--cpu-gb", "64",
                 "--compute-ms-per-token", "20"]) == 0
    text = capsys.readouterr().out
    assert "compute per step (given)" in text and "h100" not in text


def test_serial_mover_host_names_the_gather_when_no_kv_is_on_the_host(tmp_path):
    """All KV on the device of a CPU host: the mover is still busy (it gathers), and the table says so."""
    result = plan(build_request("llama-3-8b", "32K", gpu=20, cpu=8, profile=_cpu_host_profile(tmp_path)))
    assert result.bytes_per_tier.host == result.bytes_per_tier.disk == 0
    rows = dict(result.busy_rows())
    assert rows["mover: gather + host->device"] > 0
    assert result.bytes_moved_per_step["device->device"] == result.bytes_per_tier.device
    assert [w.label for w in what_ifs(result)] == ["+16 GB device"]  # no PCIe on a CPU-only host


def test_a_slower_what_if_says_why(tmp_path):
    result = plan(build_request("llama-3-8b", "32K", gpu=1, cpu=8, profile=_cpu_host_profile(tmp_path),
                                compute_ms_per_step=100))  # (the mover bounds the step)
    more = what_ifs(result)[0]
    assert more.plan.forecast.step_s > result.forecast.step_s
    assert more.note.startswith("slower: ") and "more KV is gathered on the device" in more.note
    for alternative in what_ifs(plan(build_request("llama-3-8b", "1M", gpu=20, cpu=128))):
        assert alternative.note == "" and alternative.plan.forecast.step_s <= plan(
            build_request("llama-3-8b", "1M", gpu=20, cpu=128)).forecast.step_s


def test_streaming_executor_stages_two_chunks_not_layers():
    gather = plan(build_request("llama-3-8b", "1M", gpu="20GB", cpu="128GB"))
    streaming = plan(build_request("llama-3-8b", "1M", gpu="20GB", cpu="128GB", executor="streaming",
                                   chunk_tokens=4096))
    per_layer_token = 128 * 1024 // 32  # Llama-3-8B: 4 KiB of K/V per token per layer in bf16
    assert streaming.staging_bytes == 2 * 4096 * per_layer_token
    assert gather.staging_bytes == 2 * 2**20 * 5 // 4 * per_layer_token  # with the runtime's growth headroom
    assert streaming.bytes_per_tier.device - gather.bytes_per_tier.device == gather.staging_bytes - \
        streaming.staging_bytes


def test_gather_budget_error_suggests_streaming():
    with pytest.raises(BudgetTooSmallError, match="--executor streaming"):
        plan(build_request("llama-3-8b", "1M", gpu="4GB", cpu="128GB", prefetch_depth=1))
    tiny = plan(build_request("llama-3-8b", "1M", gpu="4GB", cpu="128GB", executor="streaming"))
    assert tiny.bytes_per_tier.device > 0


def test_streaming_forecast_pipelines_chunks_across_layers():
    """Streaming keeps one chunk in flight across layer boundaries: only the first chunk's copy is exposed."""
    p = plan(build_request("llama-3-8b", "128K", gpu="2GB", cpu="128GB", executor="streaming", chunk_tokens=4096))
    chunk_bytes = 4096 * 4096  # one chunk of one layer: 4 KiB of bf16 K/V per token
    host_share = p.bytes_per_tier.host / p.kv_bytes_total
    fill = p.request.links.link("host->device").transfer_time(round(chunk_bytes * host_share))
    assert p.bottleneck.value == "host->device"
    assert p.forecast.fill_s == pytest.approx(fill)
    assert p.forecast.step_s == pytest.approx(p.forecast.lower_bound_s + fill, rel=1e-3)


@pytest.mark.parametrize("page", [None, 256], ids=["default-pages", "whole-blocks"])
def test_sparse_step_reads_the_budgets_fraction_and_pays_for_the_summaries(page):
    """Llama-3-8B at 1M tokens, 32K attended: 1/32 of every layer's KV crosses the links; the device holds the
    prefill's two chunks, one layer's selection (the budget and a block, with 25% growth headroom), a column of
    blocks to summarise (one 1 MiB block) and one summary per page (4·H_kv·D values = 2 tokens' K/V): 16 per
    256-token block at the default 16-token pages, one where the page is the block, in tables of 4096 x 1.25 + 1
    rows a layer."""
    exact = plan(build_request("llama-3-8b", "1M", gpu=24, cpu=136, link="pcie5", sparse_rest_bits=0))
    sparse = plan(build_request("llama-3-8b", "1M", gpu=24, cpu=136, link="pcie5", executor="sparse",
                                sparse_tokens="32K", sparse_page_tokens=page, sparse_rest_bits=0))
    per_layer_token = 4 * 1024
    summaries = 32 * 5121 * (256 // (page or 16)) * per_layer_token * 2  # layers x rows x pages x 2 tokens' K/V
    selection = (32768 + 256) * per_layer_token * 5 // 4
    assert sparse.staging_bytes == 2 * 4096 * per_layer_token + selection + 2**20 + summaries
    tiers = sparse.bytes_per_tier
    assert tiers.device == 24 * 10**9 - sparse.staging_bytes and tiers.disk == 0
    moved = sparse.bytes_moved_per_step
    assert moved["host->device"] == pytest.approx(tiers.host / 32, rel=1e-6)
    assert sparse.forecast.prefetch_depth == 0  # the read waits for the layer's query
    link = sparse.request.links.link("host->device")
    assert sparse.forecast.step_s >= link.transfer_time(moved["host->device"])  # at least its reads, in series
    # 16-token pages' summaries hold 1/8 of the KV (17 GB of the 20 here), which pushes KV off the device
    assert exact.forecast.step_s / sparse.forecast.step_s > (10 if page else 3)


def test_a_rest_copy_is_paid_for_in_device_bytes_and_compute_not_in_reads():
    """A 2-bit rest copy of Llama-3-8B's bf16 KV at 128K: 2 + 2 bits per key and value, and a bf16 min and step
    per 32 values (4 bits more per value) — (2 + 2 + 1) / 32 of a block's bytes per table row (512 blocks a layer,
    grown by 1.25, one more) on the device, the same reads, and a step that attends every block from it (slower
    than the selection alone)."""
    def sparse(bits):
        return plan(build_request("llama-3-8b", "128K", gpu=40, cpu=136, link="pcie5", executor="sparse",
                                  sparse_tokens="12K", sparse_rest_bits=bits))

    alone, rest = sparse(0), sparse(2)
    assert rest.staging_bytes - alone.staging_bytes == 32 * (512 * 5 // 4 + 1) * 2**20 * 5 // 32
    assert rest.bytes_moved_per_step == alone.bytes_moved_per_step  # the KV fits the device either way
    assert rest.forecast.step_s > alone.forecast.step_s
    with pytest.raises(InvalidConfigError, match="sparse_rest_bits=3"):
        build_request("llama-3-8b", "128K", gpu=40, cpu=136, executor="sparse", sparse_rest_bits=3)


def test_plan_says_when_sparse_is_the_better_choice():
    exact = plan(build_request("llama-3-8b", "1M", gpu=24, cpu=136, link="pcie5", sparse_tokens="32K",
                               sparse_rest_bits=0))
    alternative = sparse_what_if(exact)
    assert alternative.plan.request.executor == "sparse" and "approximate" in alternative.note
    assert "faster: the better choice" in sparse_advice(exact, alternative)
    sparse = alternative.plan
    back = sparse_what_if(sparse)
    assert back.plan.request.executor == "gather" and "sparse is predicted" in sparse_advice(sparse, back)
    covering = plan(build_request("llama-3-8b", "8K", gpu=20, cpu=136, sparse_tokens="8K", sparse_rest_bits=0))
    assert sparse_what_if(covering) is None  # the budget covers the context: sparse would read it all


@pytest.mark.parametrize("executor", ["gather", "split"])
def test_the_sparse_what_if_names_its_share_of_the_kv_attended(executor):
    """The share is of the KV an exact step attends, whatever the exact executor moves (split moves almost
    nothing: a share of its moved bytes read 50,803%)."""
    base = plan(build_request("llama-3-8b", "1M", gpu=24, cpu=128, link="pcie5", executor=executor, sparse_rest_bits=0))
    note = sparse_what_if(base).note
    share = float(note.split("reads ")[1].split("%")[0])
    assert 0 < share < 5  # 2,048 of 1M tokens, with sinks, recent window and summaries


def test_sparse_cost_grows_with_its_budget_not_the_context():
    small = plan(build_request("llama-3-8b", "256K", gpu=24, cpu=136, link="pcie5", executor="sparse",
                               sparse_tokens=4096, sparse_rest_bits=0))  # 24 GB: the 1M context's summaries take 17 GB
    large = plan(build_request("llama-3-8b", "1M", gpu=24, cpu=136, link="pcie5", executor="sparse",
                               sparse_tokens=4096, sparse_rest_bits=0))
    read = [p.bytes_moved_per_step["host->device"] + p.bytes_moved_per_step["device->device"] for p in (small, large)]
    assert read[0] == pytest.approx(read[1], rel=0.01)  # 4096 tokens per layer either way
    assert large.staging_bytes - small.staging_bytes == sparse_table_bytes(large.request) - \
        sparse_table_bytes(small.request)


def test_cli_plans_sparse_and_writes_the_advice(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert _cli(["--model", "llama-3-8b", "--context", "1M", "--gpu-gb", "24", "--cpu-gb", "136",
                    "--link", "pcie5", "--executor", "sparse", "--sparse-tokens", "32K", "--sparse-rest-bits", "0",
                    "--json", str(out)]) == 0  # the default 4-bit rest copy does not fit 24 GB at 1M tokens
    text = capsys.readouterr().out
    assert "32,768-token" in text and "exact (gather)" in text
    data = json.loads(out.read_text())
    assert data["sparse_advice"].startswith("sparse is predicted") and data["prefetch_depth"] == 0
    assert any(w["change"] == "exact (gather)" for w in data["what_ifs"])


# ----------------------------------------------------------------------- issue 29: a CPU host's plan is meaningful
def test_a_cpu_profile_prices_compute_on_the_cpu_not_an_h100(tmp_path, capsys):
    """``tierkv plan --profile`` from a CPU-only host: the roofline is that host's (its measured memcpy and
    FLOP/s), so SmolLM2 at 4K decodes at tens of tokens/s, not thousands."""
    from tierkv.bandwidth import LinkProfile
    from tierkv.planner import COMPUTE_FLOPS_KEY

    path = _cpu_host_profile(tmp_path)
    profile = LinkProfile.load(path)
    profile.machine[COMPUTE_FLOPS_KEY] = "5e10"
    profile.save(path)
    assert _cli(["--model", "smollm2-135m", "--context", "4K", "--gpu-gb", "0.1", "--cpu-gb", "1",
                 "--profile", path, "--json", "-"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["compute_source"] == "roofline, cpu, measured" and "h100" not in captured.err
    assert data["device"]["peak_flops"] == 5e10  # a memcpy of 4 GB/s reads and writes: reads at 8 GB/s
    assert data["device"]["memory_bandwidth_bytes_per_s"] == 8e9 and data["device"]["efficiency"] == 1.0
    assert 1 < data["tokens_per_s"] < 200


def test_device_cpu_without_a_profile_uses_memcpy_links_and_the_cpu_preset(capsys):
    from tierkv.planner import CPU_PRESET

    result = plan(build_request("smollm2-135m", "4K", gpu=0.1, cpu=1, device="cpu"))
    assert result.request.device == CPU_PRESET and result.request.links.serial_mover
    assert result.request.links.links["host->device"].name == "dram-memcpy"
    assert result.tokens_per_s < 1000


def test_tiny_rows_never_print_zero_ms(capsys):
    assert _cli(["--model", "smollm2-135m", "--context", "64", "--gpu-gb", "1", "--cpu-gb", "1"]) == 0
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.rstrip(" │").endswith((" ms", " us"))]
    assert rows and " 0.0 ms" not in text, text
    assert plan_command._ms(3.2e-5) == "32 us" and plan_command._ms(2.5642) == "2,564.2 ms"
    assert plan_command._rate(61578.2) == "61,600" and plan_command._rate(0.3891) == "0.389"


def test_budget_error_gives_a_flag_value_that_parses_and_suffices(capsys):
    from tierkv.units import parse_size

    with pytest.raises(BudgetTooSmallError) as info:
        _cli(["--model", "smollm2-135m", "--context", "16K", "--gpu-gb", "0.01", "--cpu-gb", "1"])
    err = str(info.value)
    minimum = err.split("raise --gpu-gb to at least ")[1].split()[0]
    ahead = err.split("(slower), ")[1].split()[0]
    streaming = err.split("--executor streaming (two chunks instead of whole layers: --gpu-gb ")[1].split()[0]
    assert "0.0 GB" not in err
    assert _cli(["--model", "smollm2-135m", "--context", "16K", "--gpu-gb", minimum, "--cpu-gb", "1",
                 "--prefetch-depth", "0"]) == 0
    capsys.readouterr()
    assert _cli(["--model", "smollm2-135m", "--context", "16K", "--gpu-gb", ahead, "--cpu-gb", "1",
                 "--prefetch-depth", "1", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["prefetch_depth"] == 1
    assert _cli(["--model", "smollm2-135m", "--context", "16K", "--gpu-gb", streaming, "--cpu-gb", "1",
                 "--executor", "streaming"]) == 0
    assert parse_size(streaming) < parse_size(minimum)


def test_a_pcie_link_on_a_cpu_host_is_refused():
    with pytest.raises(InvalidConfigError, match="no PCIe link"):
        build_request("smollm2-135m", "4K", gpu=0.1, cpu=1, device="cpu", link="pcie5")


# ------------------------------------------------------------------------------------------- split executor
TARGET = ["--model", "llama-3-8b", "--context", "1M", "--gpu-gb", "20", "--cpu-gb", "128", "--link", "pcie5",
          "--disk", "nvme-gen4"]


def _words(text: str) -> str:
    """Printed text with table borders and line wraps removed, for phrases that wrap."""
    return " ".join(text.replace("│", " ").replace("┃", " ").split())


def test_split_device_minimum_is_the_runtimes_and_does_not_grow_with_the_context():
    """Llama-3-8B, batch 1, 4K chunks, 256-token blocks (1 MiB slots). A CPU host: the prefill's two streaming
    chunks (2 x 4096 x 4 KiB) beside 33 open blocks (32 layers + one being allocated), under the slab-chunk rule;
    the same number as ``TieredCache.min_split_device_bytes`` for the same config. A GPU host adds the decode
    step's scratch: the query and two (out, lse) (3 x 32 x 129 fp32), one 4K-token piece of K/V in fp32 and its
    scores, masks and positions."""
    import dataclasses

    import torch
    from transformers import LlamaConfig

    from tierkv.hf.sizing import min_split_device_bytes
    from tierkv.stats import default_profile

    gpu = build_request("llama-3-8b", "1M", gpu=20, cpu=256, link="pcie5", executor="split")
    cpu = dataclasses.replace(gpu, links=default_profile("cpu"))
    chunks, tails = 2 * 4096 * 4096, 33 * 2**20
    assert split_min_device_bytes(cpu) == -(-chunks * 16 // 15) + tails == 70_394_403
    config = LlamaConfig(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096,
                         head_dim=128, intermediate_size=14336, vocab_size=128256, dtype=torch.bfloat16)
    assert min_split_device_bytes(config, device="cpu") == split_min_device_bytes(cpu)  # one function
    scratch = 3 * 32 * 129 * 4 + 4096 * 2 * 8 * 128 * 4 + 6 * 32 * 4096 * 4 + 4 * 4096 * 8
    staging = {context: plan(dataclasses.replace(gpu, context=parse_tokens(context))).staging_bytes
               for context in ("8K", "128K", "1M")}
    assert set(staging.values()) == {chunks + scratch} == {70_435_200}  # gather's grows: 10 GiB at 1M
    assert split_min_device_bytes(gpu) > chunks + scratch + tails  # and the two landing buffers on CUDA


def test_split_below_its_minimum_is_refused_with_the_minimum():
    with pytest.raises(BudgetTooSmallError, match="open tail blocks, the prefill's two streaming chunks and the "
                                                  "decode step's bounded scratch") as info:
        plan(build_request("llama-3-8b", "1M", gpu="100MB", cpu=256, executor="split"))
    assert "at least 126.62MB, lower --batch (split's minimum does not grow with the context)" in str(info.value)


def test_host_attention_rate_says_where_it_came_from(tmp_path):
    from tierkv.bandwidth import HostAttention, Link, LinkProfile

    presets = LinkProfile.from_presets("pcie5", "nvme-gen4")
    rate = host_attention_rate(presets, 32)
    assert rate.bytes_per_s == min(32 * 8e9, 0.8 * 300e9) == 240e9 and "32 cores" in rate.source
    assert host_attention_rate(presets, 16).bytes_per_s == 128e9  # 16 cores x 8 GB/s: the cores bound it
    assert host_attention_rate(presets, 64, 200e9).bytes_per_s == 160e9  # 0.8 x 200 GB/s: DRAM bounds it
    assert host_attention_rate(presets).bytes_per_s == 240e9  # 32 cores by default
    measured = LinkProfile({"host->host": Link("memcpy", 4e9, 0.0)}, {"cpu": "x"})
    old = host_attention_rate(measured)
    assert old.bytes_per_s == 0.8 * 4e9 and "measured memcpy" in old.source and "tierkv bench" in old.source
    measured.host_attention = HostAttention(12e9, 5e9, 4, "native")
    new = host_attention_rate(measured, 32)  # a measurement wins over the core count
    assert new.bytes_per_s == 12e9 and new.source.startswith("measured by tierkv bench: 4 threads")
    no_memcpy = host_attention_rate(LinkProfile({"host->device": Link("pcie", 25e9, 0.0)}, {"cpu": "x"}), 8)
    assert no_memcpy.bytes_per_s == 64e9 and no_memcpy.source.startswith("preset: min(8 cores")
    cpu_presets = LinkProfile({"host->host": Link("dram-memcpy", 20e9, 1e-6)}, {"source": "presets: dram"}, True)
    assert host_attention_rate(cpu_presets, 32).bytes_per_s == 16e9  # a CPU host's presets: 0.8 x its memcpy
    with pytest.raises(InvalidConfigError, match="host_cores"):
        host_attention_rate(presets, 0)


def test_split_1m_tokens_hand_computed():
    """The issue's machine: no layer staged, so 20 GB less the prefill chunks and the decode scratch (67 MiB) of KV
    on the device; the rest (117 GB) attended by 32 cores at 240 GB/s, every layer bound by the CPUs, plus per layer
    the query down and the CPU part's (out, lse) up."""
    from tierkv.planner import _lm_head_s

    req = build_request("llama-3-8b", "1M", gpu=20, cpu=128, link="pcie5", disk_link="nvme-gen4", executor="split",
                        host_cores=32)
    result = plan(req)
    tiers = result.bytes_per_tier
    assert tiers.device == 20 * 10**9 - 70_435_200 and tiers.host == 128 * GiB - tiers.device and tiers.disk == 0
    assert result.host_attention is not None and result.host_attention.bytes_per_s == 240e9
    fc = result.forecast
    assert fc.host_attention_s == pytest.approx(tiers.host / 240e9, rel=1e-9)
    merge = (10e-6 + 8192 / 50e9) + (10e-6 + 16512 / 50e9)
    assert fc.step_s == pytest.approx(tiers.host / 240e9 + 32 * merge + _lm_head_s(req.model, 1, req.device),
                                      rel=1e-9)
    assert fc.bottleneck is Bottleneck.HOST_ATTENTION and result.bound_label == "host attention"
    moved = result.bytes_moved_per_step
    assert moved["device->device"] == 0 and moved["host->device"] == 32 * 16512  # no K/V crosses the link
    gather = plan(build_request("llama-3-8b", "1M", gpu=20, cpu=128, link="pcie5", disk_link="nvme-gen4"))
    assert gather.forecast.step_s / fc.step_s > 5


def test_a_cpu_host_prices_split_on_its_measured_memcpy(tmp_path):
    """A CPU-only profile without a kernel measurement: 0.8 x its 4 GB/s memcpy, every share on the compute
    thread after the layer's compute."""
    req = build_request("llama-3-8b", "32K", gpu=1, cpu=8, profile=_cpu_host_profile(tmp_path), executor="split")
    result = plan(req)
    assert result.host_attention is not None and result.host_attention.bytes_per_s == 3.2e9
    fc = result.forecast
    assert fc.attention_on_compute and fc.host_attention_s == pytest.approx(4 * GiB / 3.2e9, rel=1e-6)
    assert fc.step_s == pytest.approx(fc.compute_s + fc.host_attention_s, rel=1e-9)
    assert result.bytes_moved_per_step["host->device"] == 0  # nothing crosses a link on a CPU host


def test_executors_are_compared_and_the_fastest_exact_one_named():
    base = plan(build_request("llama-3-8b", "1M", gpu=20, cpu=128, link="pcie5", host_cores=32, sparse_rest_bits=0,
                              sparse_page_tokens=256))  # (16-token pages' summaries take 21 GB at 1M)
    options = compare_executors(base)
    assert [o.executor for o in options] == ["gather", "streaming", "sparse", "split"]
    assert options[0].plan is base and all(o.plan is not None for o in options)
    advice = fastest_advice(options)
    assert advice.startswith("fastest exact executor for this machine: split (2.04 tok/s, 5.2x gather)")
    assert "240 GB/s (preset: min(32 cores" in advice
    small = plan(build_request("llama-3-8b", "1M", gpu="100MB", cpu=200, link="pcie5", executor="streaming",
                               sparse_rest_bits=0))
    refused = {o.executor: o for o in compare_executors(small)}
    assert refused["gather"].plan is None and refused["gather"].note.startswith("does not fit")
    assert refused["split"].plan is None and "at least 126.62MB" in refused["split"].note  # its fixed minimum
    assert fastest_advice(list(refused.values())) == "fastest exact executor for this machine: streaming (0.353 tok/s)"


def test_cli_target_prints_split_beside_gather_with_its_host_bandwidth(tmp_path, capsys):
    """The issue's target: on a 32-core host split is predicted faster than gather, whose 0.39 tok/s is unchanged,
    and the plan says which host attention rate it assumed and where the number came from."""
    out = tmp_path / "plan.json"
    assert _cli([*TARGET, "--host-cores", "32", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    words = _words(text)
    gather_row = next(line for line in text.splitlines() if line.startswith("│ gather *"))
    assert "2,566.9 ms" in gather_row and "0.39" in gather_row  # gather: unchanged
    split_row = next(line for line in text.splitlines() if line.startswith("│ split "))
    assert "490.7 ms" in split_row and "2.04" in split_row and "5.23x" in split_row
    assert "split: attend in place" in words  # the what-if table too
    assert "fastest exact executor for this machine: split (2.04 tok/s, 5.2x gather); host attention at 240 GB/s " \
           "(preset: min(32 cores x 8 GB/s, 0.8 x 300 GB/s host DRAM)" in words
    data = json.loads(out.read_text())
    by_name = {entry["executor"]: entry for entry in data["executors"]}
    assert by_name["split"]["tokens_per_s"] > by_name["gather"]["tokens_per_s"] == pytest.approx(data["tokens_per_s"])
    assert by_name["split"]["host_attention_bytes_per_s"] == 240e9
    assert "32 cores" in by_name["split"]["host_attention_source"]
    assert round(data["tokens_per_s"], 2) == 0.39


def test_cli_plans_split_and_states_its_host_rate(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert _cli([*TARGET, "--executor", "split", "--host-cores", "16", "--json", str(out)]) == 0
    words = _words(capsys.readouterr().out)
    assert "host attention rate 128.0 GB/s" in words and "min(16 cores x 8 GB/s" in words
    assert "no layer staged" in words and "host CPUs attend host + disk KV" in words
    data = json.loads(out.read_text())
    assert data["host_attention"]["bytes_per_s"] == 128e9 and data["bottleneck"] == "host attention"
    assert data["staging_bytes"] == 70_435_200


def test_cli_split_from_a_measured_profile_names_the_measurement(tmp_path, capsys):
    from tierkv.bandwidth import HostAttention, LinkProfile

    profile = LinkProfile.load(_cpu_host_profile(tmp_path))
    profile.host_attention = HostAttention(6e9, 3e9, 2, "native")
    path = tmp_path / "measured.json"
    profile.save(path)
    argv = ["--model", "llama-3-8b", "--context", "32K", "--gpu-gb", "1", "--cpu-gb", "8", "--profile", str(path)]
    assert _cli([*argv, "--executor", "split"]) == 0
    words = _words(capsys.readouterr().out)
    assert "host attention rate 6.0 GB/s" in words and "measured by tierkv bench: 2 threads (native kernel" in words


def test_sparse_selects_pages_and_reads_whole_sectors_from_disk():
    """A budget that is not a whole number of blocks is read in pages (rounded down to 16 tokens, not to 256); the
    disk reads whole 4 KiB sectors, so 8-token pages of Llama-3-8B (a 2 KiB run per head) read twice the bytes they
    hold from disk, 16-token ones (4 KiB) what they hold; a page that does not divide the block is refused."""
    def sparse(page):
        return build_request("llama-3-8b", "128K", gpu=8, cpu=4, disk=1000, link="pcie5", executor="sparse",
                             sparse_tokens=1024, sparse_page_tokens=page, sparse_rest_bits=0)

    assert sparse_fetched_tokens(sparse(None), 0) == 1024 and sparse_fetched_tokens(sparse(256), 0) == 1024
    assert sparse_fetched_tokens(build_request("llama-3-8b", "128K", gpu=4, cpu=8, executor="sparse",
                                               sparse_tokens=1000, sparse_rest_bits=0), 0) == 992
    read = {page: plan(sparse(page)) for page in (8, 16, 256)}
    disk = {page: p.bytes_moved_per_step["disk->host"] / p.bytes_per_tier.disk for page, p in read.items()}
    assert disk[16] == pytest.approx(disk[256], rel=0.02) and disk[8] == pytest.approx(2 * disk[16], rel=0.02)
    with pytest.raises(InvalidConfigError, match="sparse_page_tokens=24 must divide block_tokens=256"):
        sparse(24)


def test_cli_takes_the_sparse_page(tmp_path):
    out = tmp_path / "plan.json"
    assert _cli(["--model", "llama-3-8b", "--context", "128K", "--gpu-gb", "20", "--cpu-gb", "64", "--executor",
                 "sparse", "--sparse-tokens", "8K", "--sparse-page-tokens", "64", "--json", str(out)]) == 0
    coarse = json.loads(out.read_text())
    assert _cli(["--model", "llama-3-8b", "--context", "128K", "--gpu-gb", "20", "--cpu-gb", "64", "--executor",
                 "sparse", "--sparse-tokens", "8K", "--json", str(out)]) == 0
    fine = json.loads(out.read_text())
    assert fine["staging_bytes"] > coarse["staging_bytes"]  # four times the page summaries


def test_auto_depth_stops_where_a_deeper_staging_leaves_the_kv_no_room():
    """Sweep 3: a disk budget of 0 (the KV must fit device and host): depth 1 fits, a deeper one's staging pushes
    KV past the budgets (CapacityError); the search keeps the depth that fits instead of refusing the plan."""
    result = plan(build_request("llama-3-8b", "128K", gpu=20, cpu=12, disk=0))
    assert result.bytes_per_tier.disk == 0 and result.forecast.prefetch_depth >= 1


def test_a_latent_attention_config_is_refused_with_why_the_plan_would_be_wrong(tmp_path):
    """TieredCache decodes multi-head latent attention (tests/test_hf_architectures.py), but transformers expands
    every cached latent again each step: a plan from the cache's bytes alone would be far too fast, so none."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_hidden_layers": 27, "num_attention_heads": 16, "hidden_size": 2048,
                                "vocab_size": 102400, "kv_lora_rank": 512, "qk_rope_head_dim": 64}))
    with pytest.raises(InvalidConfigError, match="TieredCache decodes such models.*expands every cached token"):
        model_from_config(path)


@pytest.mark.parametrize(("kinds", "attention"), [
    ({"layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]}, 1),  # Qwen3-Next
    ({"layers_block_type": ["linear_attention", "moe", "full_attention", "mlp"]}, 1),
    ({"hybrid_override_pattern": "M-*E"}, 1),  # Nemotron-H
    ({"attn_layer_period": 2, "attn_layer_offset": 1}, 2),  # Jamba
    ({"attn_layer_indices": [1, 3]}, 2),  # Bamba
    ({"layer_types": ["hybrid"] * 4}, 4),  # Falcon-H1: attention in every layer
])
def test_a_hybrid_config_plans_the_kv_of_its_attention_layers_and_the_weights_of_all(tmp_path, kinds, attention):
    """A hybrid's K/V is its attention layers' (four times too much if every layer counted); its weights, which set
    the compute, are every layer's."""
    dense = {"num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 4, "hidden_size": 2048,
             "vocab_size": 151936, "intermediate_size": 4096}
    (tmp_path / "hybrid.json").write_text(json.dumps({**dense, **kinds}))
    (tmp_path / "dense.json").write_text(json.dumps(dense))
    model, plain = model_from_config(tmp_path / "hybrid.json"), model_from_config(tmp_path / "dense.json")
    assert model.layers == attention and model.other_layers == 4 - attention
    assert model.kv_bytes_per_token * 4 == plain.kv_bytes_per_token * attention
    assert model.params == plain.params
    held = [plan(build_request(str(tmp_path / name), "128K", gpu=1, cpu=64)).bytes_per_tier
            for name in ("hybrid.json", "dense.json")]  # fmt: skip
    assert sum(dataclasses.astuple(held[0])) * 4 == sum(dataclasses.astuple(held[1])) * attention


@pytest.mark.parametrize(("kinds", "match"), [
    ({"layer_types": ["linear_attention"] * 4}, "no attention layer"),  # Mamba only
    ({"layer_types": ["indexed_attention"] * 4}, "indexed_attention.? layers"),
    ({"layer_types": ["full_attention"] * 3}, "3 layer kinds for 4 layers"),
])
def test_a_config_whose_kv_the_planner_cannot_size_is_refused_with_why(tmp_path, kinds, match):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_hidden_layers": 4, "num_attention_heads": 16, "hidden_size": 2048,
                                "vocab_size": 151936, **kinds}))
    with pytest.raises(InvalidConfigError, match=match):
        model_from_config(path)
