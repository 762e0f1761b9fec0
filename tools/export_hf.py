#!/usr/bin/env python
"""Export a trained checkpoint to a self-contained Hugging Face model directory.

Reads a checkpoint of any TP/PP/EP layout on one CPU process (dist-checkpointing gathers the
shards), and writes config.json, sharded model-*.safetensors with their index, the tokenizer
files and generation_config.json, atomically (a failed export leaves no directory behind).

Classes (megatron_mvmoe/hf/config_map.py): dense -> LlamaForCausalLM; smoe with softmax
top-k and no shared expert -> MixtralForCausalLM (with --qk-layernorm: Qwen3MoeForCausalLM);
smoe with sigmoid (+ expert bias) and a shared expert -> Glm4MoeForCausalLM; every other
model (latent, multi_router, multi_view with its gamma, mh_moe, BitNet, Megatron-LM's
--multi-latent-attention, group-limited routing, shared-expert gates, QK norm elsewhere)
-> our MVMoEForCausalLM, loadable with
AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True). A setting no class
computes is refused before anything is written, every such field named in one error.

Examples:
    python tools/export_hf.py --load runs/main_job/checkpoints --out runs/main_job/hf
    python tools/export_hf.py --load CKPT --out DIR --hf-class mvmoe --max-shard-size 500MB --json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import warnings

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")

_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 2 ** 10,
          "MIB": 2 ** 20, "GIB": 2 ** 30}


def shard_bytes(text: str) -> int:
    """'2GB', '500MB', '1GiB' or a byte count -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"--max-shard-size {text!r}: use e.g. 2GB, 500MB")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="checkpoint root, or one iter_* directory")
    p.add_argument("--out", required=True, help="the HF directory to write (must not exist)")
    p.add_argument("--hf-class", default="auto",
                   help="auto (default: a stock class where one computes the model exactly), "
                   "mvmoe (always our class), or LlamaForCausalLM / MixtralForCausalLM / "
                   "Qwen3MoeForCausalLM / Glm4MoeForCausalLM (refused when it would not "
                   "compute the model)")
    p.add_argument("--max-shard-size", type=shard_bytes, default=shard_bytes("2GB"),
                   help="largest safetensors shard (default 2GB)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from megatron_mvmoe.checkpointing.errors import CheckpointError
    from megatron_mvmoe.hf.export import export_checkpoint

    args = parse_args(argv)
    try:
        summary = export_checkpoint(args.load, args.out, args.hf_class, args.max_shard_size,
                                    args.overwrite)
    except (ValueError, CheckpointError) as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"wrote {summary['out']} ({summary['hf_class']}, {summary['tensors']} tensors, "
              f"{summary['bytes'] / 1e6:.1f} MB) in {summary['read_s'] + summary['write_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
