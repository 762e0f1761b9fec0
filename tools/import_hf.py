#!/usr/bin/env python
"""Import a Hugging Face model directory as a megatron_mvmoe checkpoint.

Reads a directory written by tools/export_hf.py (our MVMoEForCausalLM, or the stock
LlamaForCausalLM / MixtralForCausalLM / Glm4MoeForCausalLM it writes where they compute the
model exactly) or any transformers checkpoint of those classes whose fields our model
expresses, and saves it with the trainer's own checkpoint writer at step 0 (manifest,
fingerprint, weights; the optimizer starts fresh): `--load CKPT` resumes training from
it at any TP/PP/EP layout, dist-checkpointing resharding it. The import itself runs on one
process; --tensor/--pipeline/--expert-model-parallel-size check now that the model divides
over the layout you will train it at. A dense decoder (Llama) becomes our dense model, which
--warm-start-from upcycles into an MoE of the same shape.

Every mismatch (a config field our model does not express, a weight the config does not
describe, a missing shard) is one line naming the file or field and the fix; nothing is
written then.

Examples:
    python tools/import_hf.py --hf runs/main_job/hf --save runs/imported
    python tools/import_hf.py --hf DIR --save CKPT --expert-model-parallel-size 2 --json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import warnings

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf", required=True, help="the Hugging Face model directory")
    p.add_argument("--save", required=True, help="checkpoint root to write (must be new)")
    for flag, dest in (("--tensor-model-parallel-size", "tp"),
                       ("--pipeline-model-parallel-size", "pp"),
                       ("--expert-model-parallel-size", "ep"),
                       ("--expert-tensor-parallel-size", "etp")):
        p.add_argument(flag, dest=dest, type=int, default=None,
                       help="a layout the model must divide over (checked now)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return p.parse_args(argv)


def main(argv=None) -> int:
    import os

    from megatron_mvmoe.checkpointing.errors import CheckpointError
    from megatron_mvmoe.hf.importer import import_directory

    args = parse_args(argv)
    existed = os.path.exists(args.save)
    layout = {"tp": args.tp, "pp": args.pp, "ep": args.ep, "etp": args.etp}
    try:
        summary = import_directory(args.hf, args.save, layout)
    except (ValueError, CheckpointError, KeyError) as err:
        if not existed:
            shutil.rmtree(args.save, ignore_errors=True)  # nothing left behind
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"wrote {summary['checkpoint']} ({summary['hf_class']}, {summary['tensors']} "
              f"tensors) in {summary['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
