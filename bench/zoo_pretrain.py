"""Run the zoo's Fashion-MNIST pretraining recipes and record what they reach.

For each zoo model, trains :func:`edgetorch.zoo.default_config` on Fashion-MNIST from scratch
(the cached checkpoint is overwritten, so later ``pretrained()`` calls reuse this run) and
records test accuracy, wall and CPU time. Wall time depends on other load on the machine, so
the load average before and after each run is recorded too.

Usage: python bench/zoo_pretrain.py [--models cnn mlp] [--dataset fashion-mnist] [--data-root DIR]
"""

from __future__ import annotations

import argparse
import logging
import os

from _common import pct, table, write_results

from edgetorch.data import cache_dir
from edgetorch.zoo import default_config, pretrain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["cnn", "mlp"])
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--data-root", default=None, help="Fashion-MNIST IDX directory")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    runs = []
    for name in args.models:
        config = default_config(name, args.dataset)
        load_before = os.getloadavg()[0]
        _, meta = pretrain(config, data_root=args.data_root)
        load_after = os.getloadavg()[0]
        runs.append({**meta, "load_avg_1min_before": load_before, "load_avg_1min_after": load_after})

    rows = [
        (
            r["config"]["model"],
            f"{r['num_parameters']:,}",
            r["config"]["epochs"],
            f"{r['train_samples']:,}",
            pct(r["test_accuracy"]),
            f"{r['train_seconds']:.0f}",
            f"{r['train_cpu_seconds']:.0f}",
            f"{r['load_avg_1min_before']:.1f} / {r['load_avg_1min_after']:.1f}",
        )
        for r in runs
    ]
    body = (
        table(
            ["model", "params", "epochs", "train samples", "test accuracy", "wall s", "CPU s",
             "load avg before / after"],
            rows,
        )
        + f"\n\nDataset: {args.dataset}, test accuracy on the full test split. Recipe: "
        "AdamW, one-cycle learning rate, no augmentation (`edgetorch.zoo.pretrain`). "
        "Configs (lr, batch, seed, weight decay) are in the JSON. Wall time counts training "
        "only (not data loading or evaluation); CPU time sums all threads. A load average above "
        "the core count means other jobs shared the CPU and wall time is inflated. Checkpoints "
        f"were cached under `{cache_dir() / 'zoo'}`.\n"
    )
    write_results("zoo_pretrain", f"Zoo pretraining on {args.dataset}", body, {"runs": runs})


if __name__ == "__main__":
    main()
