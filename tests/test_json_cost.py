"""A JSON file's size bounds what reading it costs, not what parsing it costs: ``[{},{},...]`` becomes 24 times its
size in Python objects. Files tierkv reads from others (a link profile, an eval run folder's reference, a shared
store's manifest) are refused before parsing where they would cost far more than any file tierkv writes."""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

import pytest

from tierkv.bandwidth import LinkProfile
from tierkv.errors import InvalidConfigError
from tierkv.inputs import PARSE_FACTOR, CostlyJSONError, parse_json
from tierkv.persist import manifest as manifests
from tierkv.persist import record
from tierkv.persist.blockfile import DIRECTORY_NAME, PersistentStore
from tierkv.quality.run_folder import read_reference

EMPTY_OBJECTS = b'{"links": [' + b"{}," * 1_000_000 + b"{}]}"  # 3 MB of text (profiles: 4 MiB), ~75 MB parsed


def _peak(call) -> int:
    tracemalloc.start()
    try:
        call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("text", [b"[" + b"{}," * 100_000 + b"{}]", b"[" + b"[]," * 100_000 + b"[]]",
                                  b"[" + b'"ab",' * 100_000 + b'"ab"]'], ids=["dicts", "lists", "short strings"])
def test_text_of_nearly_nothing_but_structure_is_refused_before_parsing(text: bytes):
    with pytest.raises(CostlyJSONError, match="would take about"):
        parse_json(text)


def test_files_as_tierkv_writes_them_parse():
    """Records of a few fields, token ids (small ones too), a manifest's listing: 4-8 bytes parsed per byte."""
    records = [{"prompt": f"needle-4096-{i}", "method": "sparse", "task": "needle", "length": 4096, "depth": 0.5,
                "correct": True, "top1": 0.98, "kl": 0.001, "answer": "123"} for i in range(2000)]
    ids = {"prompts": [{"context_ids": [i % 300 for i in range(100_000)], "question_ids": [5, 7]}]}
    listing = {"clock": 5, "blocks": {f"{i:032x}": [262144, i, 3] for i in range(5000)}}
    for value in (records, ids, listing, json.loads(json.dumps(listing, separators=(",", ":")))):
        text = json.dumps(value).encode()
        assert parse_json(text) == value
    assert PARSE_FACTOR <= 16


def test_a_link_profile_of_empty_objects_is_refused_before_it_costs_memory(tmp_path: Path):
    path = tmp_path / "profile.json"
    path.write_bytes(EMPTY_OBJECTS)

    def load() -> None:
        with pytest.raises(InvalidConfigError, match=r"profile\.json.*would take about \d+ MiB of memory to parse"):
            LinkProfile.load(path)

    assert _peak(load) < 3 * len(EMPTY_OBJECTS)  # the text itself and little more


def test_an_eval_reference_of_empty_objects_is_refused_naming_the_file(tmp_path: Path):
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    (folder / "reference.json").write_bytes(b'{"model": "demo", "prompts": [' + b"{}," * 2_000_000 + b"{}]}")
    with pytest.raises(InvalidConfigError, match=r"reference\.json.*would take about"):
        read_reference(folder)


def test_a_shared_stores_manifest_of_empty_objects_is_a_lost_manifest_not_a_parse(tmp_path: Path):
    """A manifest that verifies (a member of a group-shared store writes it) but lists nearly nothing but
    structure is treated as lost, as a damaged one is: the store starts empty, having parsed nothing."""
    PersistentStore(tmp_path, 1 << 20).close()
    head, payload = record.encode({"kind": "manifest", "format": manifests.FORMAT},
                                  b'{"clock":0,"blocks":{},"pad":[' + b"{}," * 2_000_000 + b"{}]}")
    manifest = tmp_path / DIRECTORY_NAME / "manifest"
    manifest.write_bytes(bytes(head) + bytes(payload))
    os.chmod(manifest, 0o600)
    stores: list[PersistentStore] = []
    assert _peak(lambda: stores.append(PersistentStore(tmp_path, 1 << 20))) < 3 * len(payload)
    assert stores[0].recovery.manifest_lost
    stores[0].close()
