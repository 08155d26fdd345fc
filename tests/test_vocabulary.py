"""tierkv.vocabulary: one spelling of every link and executor, shared by the runtime, planner, telemetry and CLI."""

from __future__ import annotations

import json

from tierkv.vocabulary import (
    CLI_EXECUTORS,
    PLAN_EXECUTORS,
    PROFILE_LINKS,
    READ_LINKS,
    ExecutorName,
    LinkName,
    executor_name,
)


def test_members_are_their_strings_everywhere():
    link = LinkName.HOST_TO_DEVICE
    assert link == "host->device" and f"{link}" == str(link) == "host->device" and f"{link:>13}" == " host->device"
    assert {"host->device": 1}[link] == 1 and json.dumps({link: ExecutorName.SPARSE}) == '{"host->device": "sparse"}'


def test_the_runtime_registers_executors_under_their_names():
    import tierkv.attention.sparse
    import tierkv.attention.streaming  # noqa: F401 - each executor module registers its class
    from tierkv.attention.base import EXECUTORS

    assert set(EXECUTORS) == {name.value for name in ExecutorName}
    assert {executor_name(spelling) for spelling in CLI_EXECUTORS} <= set(ExecutorName)
    assert executor_name("exact_gather") is executor_name("gather") is ExecutorName.EXACT_GATHER


def test_the_planner_bandwidth_model_and_cli_use_the_same_names():
    from tierkv.bandwidth import LINK_KEYS
    from tierkv.planner import EXECUTORS

    assert tuple(LINK_KEYS) == PROFILE_LINKS and tuple(CLI_EXECUTORS) == EXECUTORS


def test_the_store_counts_bytes_on_named_links():
    from tierkv.store.transfer import LINKS

    assert set(LINKS) <= {link.value for link in LinkName} and set(READ_LINKS) <= set(LinkName)


def test_plan_prices_split_before_demo_and_eval_run_it():
    import tierkv.attention.split  # noqa: F401 - registers the split executor
    from tierkv.attention.base import EXECUTORS
    from tierkv.planner import PLANNED

    assert executor_name("split") is ExecutorName.SPLIT and ExecutorName.SPLIT.value in EXECUTORS
    assert tuple(PLAN_EXECUTORS) == PLANNED == (*CLI_EXECUTORS, "split") and "split" not in CLI_EXECUTORS
