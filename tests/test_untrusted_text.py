"""Files of an eval run folder, a shared store and a model config as untrusted input: a saved KV or
log-probabilities file is refused on its header before its tensors cost memory, and the text such files carry
reaches the terminal and the logs without control characters."""

from __future__ import annotations

import io
import json
import logging
import re
import struct
from pathlib import Path

import pytest
import safetensors.torch
import torch

from tests.models import VOCAB, tiny_model
from tierkv.cli import main
from tierkv.errors import IntegrityError, InvalidConfigError
from tierkv.persist import record
from tierkv.persist.blockfile import PersistentStore
from tierkv.quality.run_folder import KV_IDS, KV_MODEL, Unusable, ids_hash, load_logprobs, read_kv
from tierkv.quality.tasks import Prompt

ESCAPES = "\x1b]0;OWNED\x07\x1b[2J"
PROMPT = Prompt("fidelity", 9, 0, tuple(range(2, 9)), (9, 10), continuation_ids=(3, 4, 5))
TOKENS = len(PROMPT.ids) - 1


def _kv_file(tmp_path: Path, heads: int = 2, dim: int = 16, dtype: torch.dtype = torch.float32,
             tokens: int = TOKENS) -> Path:
    """A saved KV of the tiny Llama's two layers (2 KV heads of 16) for PROMPT, of the shapes given."""
    (tmp_path / "kv").mkdir(exist_ok=True)
    path = tmp_path / "kv" / "p.safetensors"
    tensors = {f"{kind}{i}": torch.zeros(1, heads, tokens, dim, dtype=dtype) for kind in "kv" for i in range(2)}
    path.write_bytes(safetensors.torch.save(tensors, metadata={KV_MODEL: "tiny", KV_IDS: ids_hash(PROMPT.ids[:-1])}))
    return path


def test_a_saved_kv_of_the_models_shape_is_read(tmp_path):
    kv = read_kv(_kv_file(tmp_path), tiny_model("llama"), "tiny", PROMPT)
    assert len(kv) == 2 and kv[0][0].shape == (1, 2, TOKENS, 16)


@pytest.mark.parametrize(("shape", "said"), [
    ({"heads": 64}, "of shape [1, 64, 8, 16], not [1, 2, 8, 16 or fewer]"),
    ({"dim": 512}, "of shape [1, 2, 8, 512], not [1, 2, 8, 16 or fewer]"),
    ({"dtype": torch.float16}, "of dtype 'F16', not the model's torch.float32"),
    ({"dtype": torch.int32}, "of dtype 'I32', not the model's")])
def test_a_saved_kv_of_other_heads_dim_or_dtype_than_the_models_is_refused_by_name(tmp_path, shape, said):
    with pytest.raises(Unusable, match=re.escape(f"holds k0 {said}")):
        read_kv(_kv_file(tmp_path, **shape), tiny_model("llama"), "tiny", PROMPT)


def _sparse_kv(tmp_path: Path, heads: int) -> Path:
    """A sparse file whose header claims ``heads`` x 256 float32 per token and layer (8 GiB at 1M heads)."""
    n = heads * TOKENS * 256 * 4
    header = {"__metadata__": {KV_IDS: ids_hash(PROMPT.ids[:-1])},
              **{f"{kind}{i}": {"dtype": "F32", "shape": [1, heads, TOKENS, 256],
                                "data_offsets": [(2 * i + j) * n, (2 * i + j + 1) * n]}
                 for i in range(2) for j, kind in enumerate("kv")}}
    data = json.dumps(header).encode()
    data += b" " * (-len(data) % 8)
    (tmp_path / "kv").mkdir(exist_ok=True)
    path = tmp_path / "kv" / "p.safetensors"
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(data)) + data)
        out.truncate(8 + len(data) + 4 * n)
    return path


def test_a_huge_sparse_saved_kv_is_refused_before_it_is_read(tmp_path):
    """A planted file claiming 8 GiB of K/V for 8 tokens: refused on its header, with or without the model."""
    path = _sparse_kv(tmp_path, 1 << 18)
    with pytest.raises(Unusable, match=r"holds 8,589,934,592 bytes of K/V for 8 tokens, more than 8 MiB a token"):
        read_kv(path, None, None, PROMPT, unmarked=True)
    with pytest.raises(Unusable, match=r"holds k0 of shape \[1, 262144, 8, 256\]"):
        read_kv(path, tiny_model("llama"), None, PROMPT, unmarked=True)


def test_a_safetensors_error_quoting_the_file_loses_its_control_characters(tmp_path):
    header = json.dumps({"k0": {"dtype": ESCAPES, "shape": [1], "data_offsets": [0, 4]}}).encode()
    (tmp_path / "kv").mkdir()
    path = tmp_path / "kv" / "p.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    with pytest.raises(Unusable, match="is not a safetensors file") as refused:
        read_kv(path, None, None, PROMPT, unmarked=True)
    assert "]0;OWNED" in str(refused.value) and "\x1b" not in str(refused.value)


def _logprobs(tmp_path: Path, tensor: torch.Tensor) -> Path:
    (tmp_path / "logprobs").mkdir(exist_ok=True)
    path = tmp_path / "logprobs" / "p.safetensors"
    path.write_bytes(safetensors.torch.save({"logprobs": tensor}))
    return path


def test_saved_log_probabilities_are_checked_against_the_vocabulary_and_dtype(tmp_path):
    steps = len(PROMPT.continuation_ids)
    assert load_logprobs(_logprobs(tmp_path, torch.zeros(steps, VOCAB)), PROMPT, VOCAB).shape == (steps, VOCAB)
    with pytest.raises(InvalidConfigError, match=f"one row of {VOCAB} log-probabilities per compared step"):
        load_logprobs(_logprobs(tmp_path, torch.zeros(steps, VOCAB * 4)), PROMPT, VOCAB)
    with pytest.raises(InvalidConfigError, match="one row of vocabulary log-probabilities"):
        load_logprobs(_logprobs(tmp_path, torch.zeros(steps, (1 << 20) + 1, dtype=torch.bool)), PROMPT)
    with pytest.raises(InvalidConfigError, match="of dtype 'I64', not a float"):
        load_logprobs(_logprobs(tmp_path, torch.zeros(steps, VOCAB, dtype=torch.int64)), PROMPT, VOCAB)


def _emitted(logger: str, *args: object, exc_info: bool = False) -> str:
    """What a handler of the root logger writes for a warning on ``logger``."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logging.getLogger().addHandler(handler)
    try:
        logging.getLogger(logger).warning(*args, exc_info=exc_info)  # type: ignore[arg-type]
    finally:
        logging.getLogger().removeHandler(handler)
    return stream.getvalue()


@pytest.mark.parametrize("logger", ["tierkv", "tierkv.remote"])
def test_tierkvs_log_lines_carry_no_control_characters(logger):
    import tierkv.logs  # noqa: F401 - its filters are on tierkv's loggers once it is imported

    line = _emitted(logger, "tierkv: %s holds %s", "/store", "x\r\nERROR tierkv: forged \x1b[2J\x1b]0;OWNED\x07")
    assert line == "tierkv: /store holds xERROR tierkv: forged [2J]0;OWNED\n", repr(line)
    try:
        raise ValueError("kept")
    except ValueError:
        line = _emitted(logger, "tierkv: failed \x1b[2J", exc_info=True)
    assert line.startswith("tierkv: failed [2J\nTraceback") and "ValueError: kept" in line, line


def test_a_log_record_that_does_not_format_passes_the_filter_for_its_handler():
    """The filter formats each message first; one that does not format (a wrong argument) is passed on as it is,
    for the handler to report as logging does (``handleError``), not raised out of the ``log`` call."""
    from tierkv.logs import PrintableMessages

    record = logging.LogRecord("tierkv", logging.WARNING, __file__, 1, "tierkv: %d blocks", ("x",), None)
    assert PrintableMessages().filter(record) and record.args == ("x",)


def test_a_foreign_name_in_a_shared_store_is_logged_escaped(tmp_path, caplog):
    PersistentStore(tmp_path, 1 << 20).close()
    name = f"x\nERROR tierkv: forged line {ESCAPES}"
    (tmp_path / "tierkv-persist" / "blocks" / name).mkdir()
    with caplog.at_level("WARNING", logger="tierkv"):
        PersistentStore(tmp_path, 1 << 20).close()
    line = next(r.getMessage() for r in caplog.records if "not tierkv's" in r.getMessage())
    assert repr(name) in line, line


def test_a_records_key_is_quoted_escaped():
    header = {"kind": "block", "key": f"x\nERROR tierkv: forged {ESCAPES}"}
    with pytest.raises(IntegrityError) as refused:
        record.check_block(header, 0, "ab" * 16)
    assert repr(header["key"]) in str(refused.value) and "\x1b" not in str(refused.value)


def test_report_tables_show_a_results_files_method_names_without_escapes_or_markup(tmp_path):
    from rich.console import Console

    from tierkv.quality.report import load_results, markdown, summary_table

    (tmp_path / "reference.json").write_text(json.dumps({"model": "demo", "prompts": [], "results": []}))
    (tmp_path / "kvpress.json").write_text(json.dumps({"setup": {}, "results": [
        {"prompt": "p", "method": f"x{ESCAPES}[bold]b[/bold]@0.5", "task": "needle", "length": 8, "correct": True}]}))
    screen = io.StringIO()
    Console(file=screen, force_terminal=True, width=200).print(summary_table(tmp_path))
    assert "x]0;OWNED[2J[bold]b[/bold] 50%" in screen.getvalue() and "\x1b]0;OWNED" not in screen.getvalue()
    text = markdown(load_results(tmp_path))
    assert "| x]0;OWNED[2J[bold]b[/bold] 50% |" in text and "\x1b" not in text


def test_plans_title_from_a_config_name_carries_no_escapes(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64,
                                  "vocab_size": 100, "_name_or_path": f"m{ESCAPES}"}))
    assert main(["plan", "--model", str(config), "--context", "1K", "--gpu-gb", "1", "--cpu-gb", "1"]) == 0
    out = capsys.readouterr().out
    assert "m]0;OWNED[2J" in out and "\x1b]0;OWNED" not in out


def test_a_reference_prompts_unknown_field_is_named_escaped():
    with pytest.raises(ValueError, match="unknown fields") as refused:
        Prompt.from_dict({**PROMPT.to_dict(), f"x{ESCAPES}": 1})
    assert repr(f"x{ESCAPES}") in str(refused.value) and "\x1b" not in str(refused.value)


def test_a_resumed_results_files_setup_is_named_without_escapes(tmp_path):
    from tierkv.commands.eval import _resumed_records
    from tierkv.quality.harness import CacheSetup

    path = tmp_path / "tierkv.json"
    path.write_text(json.dumps({"setup": {"sinks": f"4{ESCAPES}"}, "results": []}))
    with pytest.raises(InvalidConfigError, match=r"holds results measured with --sinks 4\]0;OWNED\[2J, not"):
        _resumed_records(path, CacheSetup())
