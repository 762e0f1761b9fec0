#!/usr/bin/env python
"""Plot a training run's live all-to-all metrics (logging.a2a_metrics) from its metrics.jsonl:
one column per MoE layer; rows: forward-dispatch bytes per rank and step (mean and max, sent
and received), the straggler factors (received max / mean over EP ranks; tokens per expert
max / mean), and for the row / rank / node dispatch semantics on the same routing the share
of bytes between ranks that crosses a node and the bytes they would send.

    python tools/plot_a2a_metrics.py runs/main_job/metrics.jsonl --out a2a_live.png

Reading it: docs/a2a_model.md, "Live metrics".
"""

from __future__ import annotations

import json
import sys

from megatron_mvmoe.toolkit import flags

SEMANTICS = ("row", "rank", "node")


def parse_args(argv=None):
    p = flags.tool_parser(__doc__)
    p.add_argument("metrics", help="a run's metrics.jsonl (logging.run_dir)")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--json", action="store_true",
                   help="print {\"plot\": path, \"records\": n} instead of the path")
    return p.parse_args(argv)


def read_records(path: str):
    """The train records that carry live a2a metrics: [(step, {layer: metrics})]."""
    try:
        with open(path) as f:
            lines = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not a readable metrics.jsonl ({err}). Fix: pass the "
                         "metrics.jsonl in the run's --run-dir") from None
    found = [(r["step"], r["a2a"]) for r in lines if r.get("kind") == "train" and r.get("a2a")]
    if not found:
        raise ValueError(f"{path}: no live all-to-all metrics. Fix: train with --run-dir, an "
                         "MoE model at EP > 1 and --a2a-metrics true (the default)")
    return found


def plot(records, path: str) -> str:
    from megatron_mvmoe.analysis.plots import _pyplot, _save

    plt = _pyplot()
    layers = sorted(records[-1][1], key=lambda name: int(name.split("_")[1]))
    fig, axes = plt.subplots(4, len(layers), figsize=(4.2 * len(layers), 10.5), squeeze=False,
                             sharex=True)
    steps = [step for step, _ in records]
    for col, layer in enumerate(layers):
        def series(key, inner=None):
            return [(m[layer][inner] if inner else m[layer])[key] for _, m in records]

        ax = axes[0][col]
        for key, style in (("sent_mean", "-"), ("sent_max", "--"), ("received_mean", "-"),
                           ("received_max", "--")):
            ax.plot(steps, [v / 1e6 for v in series(f"dispatch_fwd_{key}")], style, label=key)
        ax.set_title(f"{layer} ({records[-1][1][layer]['semantics']} semantic)", fontsize=9)
        ax.set_ylabel("dispatch fwd MB / rank / step", fontsize=8)
        ax = axes[1][col]
        ax.plot(steps, series("dispatch_fwd_received_max_over_mean"), label="received max/mean")
        ax.plot(steps, series("expert_max_over_mean"), label="tokens per expert max/mean")
        ax.set_ylabel("max / mean", fontsize=8)
        own = records[-1][1][layer]["semantics"]
        shown = SEMANTICS if own in SEMANTICS else (*SEMANTICS, own)  # allgather: its own
        ax = axes[2][col]
        for semantics in shown:
            ax.plot(steps, [100 * v for v in series(f"{semantics}_inter_node_share",
                                                    "would_send")], label=semantics)
        ax.set_ylabel("inter-node share of\nbytes between ranks (%)", fontsize=8)
        ax.set_ylim(0, 100)
        ax = axes[3][col]
        for semantics in shown:
            ax.plot(steps, [v / 1e6 for v in series(semantics, "would_send")], label=semantics)
        ax.set_ylabel("would send, MB / rank / step", fontsize=8)
        ax.set_xlabel("step")
    for row in axes:
        row[0].legend(fontsize=7)
    fig.suptitle("Live all-to-all metrics (forward dispatch, bookkeeping included)", fontsize=10)
    return _save(plt, fig, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        records = read_records(args.metrics)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    written = plot(records, args.out)
    print(json.dumps({"plot": written, "records": len(records)}) if args.json else written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
