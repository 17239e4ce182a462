"""The `qnorm train` subcommand (wired into `qnorm.cli` by `add_train_parser`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from qnorm.cli_args import output_dir, positive_int

DEFAULT_OUT = Path("out/train")


def _train(args: argparse.Namespace) -> int:
    # Imported here so that `qnorm --help` and the other subcommands stay fast
    # (torch, brevitas and scikit-learn load only for a training run).
    from qnorm.train.families import DEFAULT_FAMILIES, family_names

    families = family_names(args.family or DEFAULT_FAMILIES)  # before the seconds of imports below
    from qnorm.train.experiment import FoldMismatchError, default_jobs, run_training

    jobs = args.jobs or (1 if args.quick else default_jobs())
    try:
        table = run_training(
            args.out, epochs=args.epochs, seed=args.seed, kinds=args.kinds,
            families=families, quick=args.quick,
            progress=not args.no_progress, jobs=jobs,
        )
    except FoldMismatchError as err:
        print(f"qnorm train: FAILED: {err}", file=sys.stderr)
        return 1
    print(table.to_markdown(), end="")
    print(f"wrote {table.files['markdown']}, {table.files['json']} and checkpoints under "
          f"{args.out}")
    return 0


def add_train_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `train` to the `qnorm` subcommands; its handler is `args.func(args)` -> exit code.

    An unknown family or kind, or a bad setting, raises UsageError before anything
    trains (the main CLI turns it into a one-line error); a folded SNN that predicts
    differently from the unfolded one exits 1 after the tables are written.
    """
    parser = subparsers.add_parser(
        "train",
        help="train the digits transformer per norm and the MPBN SNN (or the deployable mixer "
             "and pow2 SNN); write checkpoints and an accuracy table",
        description="Train, on scikit-learn's bundled digits, the int8 transformer once per "
                    "norm kind and the spiking CNN per neuron kind (the integer MPBN LIF also "
                    "folded), or with --family the deployable models; print and write the "
                    "accuracy table (accuracy.md, accuracy.json) and pickle-free checkpoints.",
    )
    parser.add_argument("--out", type=output_dir, default=DEFAULT_OUT,
                        help=f"output directory (default: {DEFAULT_OUT})")
    parser.add_argument("--family", nargs="+", metavar="FAMILY",
                        help="model families to train: transformer (norm kinds), snn (neuron "
                             "kinds), and the deployable ones whose checkpoints `qnorm compile` "
                             "takes: mixer (integer norm kinds), snn-pow2 (integer neuron kinds), "
                             "transformer-int (integer attention and GELU; integer norm kinds, "
                             "compared with the float transformer), llama (pre-RMSNorm, gated "
                             "SiLU); default: transformer snn")
    parser.add_argument("--epochs", type=positive_int,
                        help="epochs for every model (default: 20 transformers and mixer, 8 SNN; "
                             "--quick: 4 and 2)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the split, the initialization and the data order (default 0)")
    parser.add_argument("--kinds", nargs="+", metavar="KIND",
                        help="norm and neuron kinds, each trained in every chosen family that "
                             "takes it; default per family: transformer float LN and every "
                             "integer norm (int_ln l1 shift int_rms), snn the float and integer "
                             "MPBN LIF, mixer and transformer-int every integer norm, llama "
                             "int_rms, snn-pow2 int_mpbn_lif")
    parser.add_argument("--quick", action="store_true",
                        help="smoke-test size: few epochs on 512 training samples")
    parser.add_argument("--jobs", type=positive_int,
                        help="models trained in parallel processes, one thread each; results "
                             "do not depend on it (default: 2 where 2 cores are available; 1 "
                             "with --quick, where starting workers costs more than it saves)")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    parser.set_defaults(func=_train)
    return parser
