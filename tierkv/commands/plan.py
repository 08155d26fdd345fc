"""``tierkv plan``: predict placement, tokens/s and bottleneck for a model, context and machine.

Example::

    tierkv plan --model llama-3-8b --context 1M --gpu-gb 20 --cpu-gb 128 --link pcie5 --disk nvme-gen4

Errors the user can fix (bad sizes, a KV that does not fit) print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from tierkv.errors import TierKVError
from tierkv.model_presets import MODEL_PRESETS
from tierkv.planner import DEVICES, Plan, WhatIf, build_request, plan, what_ifs

GB = 10**9


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", required=True, help=f"preset ({', '.join(MODEL_PRESETS)}) or path of a HF config.json"
    )
    parser.add_argument("--context", required=True, help="tokens per sequence: 32768, 128K, 1M (binary K/M)")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together (default 1)")
    parser.add_argument("--gpu-gb", required=True, help="KV cache device budget: GB (20) or a size ('20GiB')")
    parser.add_argument("--cpu-gb", required=True, help="pinned host budget: GB or a size string")
    parser.add_argument(
        "--disk-gb", default=None, help="disk budget: GB or a size string (default: no limit)"
    )
    parser.add_argument(
        "--link", choices=["pcie4", "pcie5"], default=None, help="PCIe preset (default pcie4)"
    )
    parser.add_argument(
        "--disk", choices=["nvme-gen4", "nvme-gen5"], default=None, help="NVMe preset (default nvme-gen4)"
    )
    parser.add_argument(
        "--profile",
        default=None,
        help="measured LinkProfile JSON (from `tierkv bench`); --link/--disk override",
    )
    parser.add_argument(
        "--device",
        choices=list(DEVICES),
        default="h100-sxm",
        help="compute roofline assumption (default h100-sxm)",
    )
    parser.add_argument(
        "--compute-ms-per-token",
        type=float,
        default=None,
        help="device compute of one decode step (one token per sequence), instead of the roofline estimate",
    )
    parser.add_argument(
        "--prefetch-depth", type=int, default=None, help="layers prefetched ahead (default: auto)"
    )
    parser.add_argument("--executor", choices=("gather", "streaming"), default="gather",
                        help="gather: whole layers staged on the device (default); streaming: two chunks")
    parser.add_argument("--chunk-tokens", type=int, default=4096, help="streaming chunk length (default 4096)")
    parser.add_argument("--what-if-gpu-gb", type=float, default=16.0, help="extra device GB for the what-if")
    parser.add_argument("--json", metavar="OUT.json", default=None, help="also write the plan as JSON")


def _size(nbytes: float) -> str:
    """Binary units throughout, so 128 KiB/token x 1M tokens reads as 128 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.2f} {unit}"
    return f"{nbytes:,.0f} B"


def _rate(plan_: Plan) -> str:
    return f"{plan_.forecast.step_s * 1e3:,.1f} ms/step, {plan_.tokens_per_s:,.2f} tok/s"


def _render(console: Console, result: Plan, alternatives: list[WhatIf]) -> None:
    req, fc = result.request, result.forecast
    tiers = result.bytes_per_tier
    table = Table(title=f"tierkv plan: {req.model.name}, context {req.context:,} x batch {req.batch}")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_row("KV per token", _size(result.kv_bytes_per_token))
    table.add_row("KV total", _size(result.kv_bytes_total))
    what = "2 chunks" if result.request.executor == "streaming" else f"{fc.prefetch_depth + 1} layers"
    table.add_row("device staging", f"{_size(result.staging_bytes)} ({what})")
    table.add_row("KV on device", _size(tiers.device))
    table.add_row("KV on host", _size(tiers.host))
    table.add_row("KV on disk", _size(tiers.disk))
    for key, nbytes in result.bytes_moved_per_step.items():
        link = req.links.links.get(key)
        via = f" via {link.name}" if link else ""
        table.add_row(f"moved per token {key}", f"{_size(nbytes / req.batch)}{via}")
    table.add_row("compute per step", f"{result.compute_s_per_step * 1e3:,.2f} ms ({req.device.name})")
    table.add_row(
        "busy host->device / disk", f"{fc.host_to_device_s * 1e3:,.1f} ms / {fc.disk_s * 1e3:,.1f} ms"
    )
    table.add_row("pipeline fill", f"{fc.fill_s * 1e3:,.2f} ms")
    table.add_row("predicted step", f"{fc.step_s * 1e3:,.1f} ms")
    table.add_row("tokens/s", f"{result.tokens_per_s:,.2f}")
    table.add_row("bottleneck", fc.bottleneck.value)
    table.add_row("overlap efficiency", f"{fc.overlap_efficiency:.1%}")
    console.print(table)

    if alternatives:
        wi = Table(title="what-if")
        wi.add_column("change")
        wi.add_column("step", justify="right")
        wi.add_column("tokens/s", justify="right")
        wi.add_column("speed-up", justify="right")
        wi.add_column("bottleneck")
        for alt in alternatives:
            p = alt.plan
            wi.add_row(
                alt.label,
                f"{p.forecast.step_s * 1e3:,.1f} ms",
                f"{p.tokens_per_s:,.2f}",
                f"{fc.step_s / p.forecast.step_s:.2f}x",
                p.forecast.bottleneck.value,
            )
        console.print(wi)


def run(args: argparse.Namespace) -> int:
    console = Console()
    try:
        request = build_request(
            args.model,
            args.context,
            gpu=args.gpu_gb,
            cpu=args.cpu_gb,
            disk=args.disk_gb,
            batch=args.batch,
            link=args.link,
            disk_link=args.disk,
            profile=args.profile,
            device=args.device,
            compute_ms_per_step=args.compute_ms_per_token,
            prefetch_depth=args.prefetch_depth,
            executor=args.executor,
            chunk_tokens=args.chunk_tokens,
        )
        result = plan(request)
        alternatives = what_ifs(result, extra_gpu_bytes=int(args.what_if_gpu_gb * GB))
    except TierKVError as e:
        console.print(f"[red]tierkv plan: {type(e).__name__}:[/red] {e}", highlight=False)
        return 2
    _render(console, result, alternatives)
    if args.json:
        data = result.to_dict()
        data["what_ifs"] = [
            {
                "change": alt.label,
                "predicted_step_s": alt.plan.forecast.step_s,
                "tokens_per_s": alt.plan.tokens_per_s,
                "bottleneck": alt.plan.forecast.bottleneck.value,
            }
            for alt in alternatives
        ]
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        console.print(f"wrote {args.json}")
    return 0
