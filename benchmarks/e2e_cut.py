#!/usr/bin/env python3
"""End to end on one GPU: RedKnot's DeepSeek-V4 model with the Triton kernels (``KernelSet("triton")``)
against the reference ops, on a 3-layer real-dimension cut (SWA, CSA, HCA like real layers 1-3; all 256
experts; bf16; synthetic weights made on the GPU).

    PYTHONUNBUFFERED=1 python3 benchmarks/e2e_cut.py --out "$OUT"     # H200, < 5 minutes
    python benchmarks/e2e_cut.py --smoke                              # CPU dry run (Triton interpreter, toy widths)
    python benchmarks/e2e_cut.py --smoke --backend reference          # the script's own logic in ~1 minute
    python3 benchmarks/e2e_cut.py --model v41 --out "$OUT"            # the V4.1 cut (benchmarks/e2e_v41.py)

1. Parity of the cut at 2K/4K/8K (one prefill step, logits of 64 rows). bf16 criterion: the two bf16
   paths round in different places, so each is compared with the fp32 truth (the same weights in fp32,
   reference ops): mean row error(triton bf16) <= 1.5 x mean row error(reference bf16) + 5e-3; the
   direct triton-vs-reference error and top-1 agreement are printed too.
2. Chunked prefill at 8K → 440K (one step per ``--chunk`` tokens; peak memory reported), decode steps at
   batch 1 and 32 at 8K / 128K (32 sequences forked from one prefilled sequence: shared prefix blocks,
   private tail blocks and slots), each as a fraction of the floor of ``redknot.models.deepseek_v4.cost``
   (H200 bf16 796 TFLOP/s, 4.17 TB/s) and as a speedup over the transformers numbers of the same cut
   (shared/reference/performance.md). Time per registry op of one chunk / step (CUDA events) at the end.
3. Tiny model (every layer type, fp32): greedy tokens of the Triton path on the device == the reference
   path on the CPU.
Results: ``e2e.json``, ``e2e.csv``, ``e2e.txt`` under ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU dry run: Triton interpreter, toy widths, short contexts")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="directory for e2e.json/csv/txt (default $OUT)")
    ap.add_argument("--prefill", type=int, nargs="*", default=[8192, 32768, 65536, 131072, 450560])
    ap.add_argument("--decode", type=int, nargs="*", default=[8192, 131072], help="decode contexts")
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 32])
    ap.add_argument("--parity", type=int, nargs="*", default=[2048, 4096, 8192])
    ap.add_argument("--chunk", type=int, default=8192, help="prefill tokens per step")
    ap.add_argument("--budget-s", type=float, default=270.0, help="start no new section after this")
    ap.add_argument("--backend", default="triton", help="kernel backend under test (reference: dry-run the script "
                    "itself quickly on a CPU)")
    ap.add_argument("--model", default="v4", choices=["v4", "v41"],
                    help="v41: the DeepSeek-V4.1 cut; must come first, the rest goes to benchmarks/e2e_v41.py")
    ap.add_argument("--unfused-projections", action="store_true",
                    help="V4: run each attention linear on its own (no fuse_projections; the before of an A/B)")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: tiny,parity,prefill,decode,truth")
    ap.add_argument("--profile-graph", type=int, default=0, metavar="N",
                    help="profile N replays of each graph decode step (device time per kernel)")
    ap.add_argument("--profile-prefill", type=int, default=0, metavar="N",
                    help="profile N runs of the last prefill chunk at every prefill context (device time per kernel)")
    ap.add_argument("--side-stream-tokens", type=int, default=0,
                    help="also capture each graph decode step with the MoE's shared expert on a second stream for "
                         "batches up to N (hardware.side_stream_max_tokens) and time both graphs alternately")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["--model", "v41"]:  # the V4.1 cut takes its own options
        import e2e_v41
        e2e_v41.main(argv[2:])
        return 0
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere
        args.prefill, args.decode, args.batches, args.parity, args.chunk = [96, 200], [200], [1, 2], [64], 64
    import torch
    import e2e_parts as parts
    dev = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 truth needs true fp32 GEMMs
    run = parts.Run(args, dev)
    run.log(f"device {parts.device_name(dev)}, torch {torch.__version__}")
    skip = {s for s in args.skip.split(",") if s}
    status = 0
    model = parts.build_cut(run, torch.bfloat16)
    if "parity" not in skip:
        run.section("parity", lambda: parts.parity_bf16(run, model))
        if "truth" not in skip:  # the fp32 cut needs the memory of the bf16 one: rebuilt after (same weights)
            del model
            parts.free(dev)
            run.section("truth", lambda: parts.parity_truth(run))
            model = parts.cut_model(run, torch.bfloat16)
            model.set_kernels(parts.KernelSet(default=args.backend))
    if "prefill" not in skip:  # decode contexts are timed right after their own prefill
        run.section("prefill", lambda: parts.prefill_sweep(run, model, decode="decode" not in skip))
    del model
    parts.free(dev)
    if "tiny" not in skip:
        status |= run.section("tiny", lambda: parts.tiny_greedy(run))
    status |= parts.report(run)
    return status


if __name__ == "__main__":
    sys.exit(main())
