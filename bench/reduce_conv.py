"""Layer reduction beyond the paper: a plain CNN, channel pruning and low-rank convolutions, measured.

What it measures. The zoo's VGG-style ``PlainCNN`` (five 3x3 convolutions with batch norm, ReLU and
max pooling, then two Linear layers; pretrained here on Fashion-MNIST and cached) is reduced with
no retraining at alpha_tot in ALPHAS, by

* "prune": the paper's naive neuron pruning applied to channels (eq. 14 on channel powers; the
  channel's mean moves into the next layer's bias), batch norms shrinking with their channels;
* "prune-ls": correlation-aware channel pruning (pivoted Cholesky on the channel covariance, the
  next layer refit by least squares);
* "lowrank": each convolution's ``C_out x C_in k k`` matrix truncated by SVD into a thin k x k
  convolution and a 1x1 convolution (eq. 13),

each with the uniform and the exact ("optimal") allocation, plus the paper's PSO for J and
solver time. Uniform is the library's baseline: pruning keeps the same fraction of every layer's
channels; low-rank keeps the last layer dense and gives every other layer one share of its
multiplications (the paper's Fig. 3 baseline). Per point: test accuracy (all 10,000 test images), MACs (``count_macs``, equal to the
allocation's cost), J, solver seconds and, for the optimal allocation, the measured CPU latency
ratio reduced / full at 1 torch thread (``compare_latency``, batch 256, interleaved rounds).

Outputs: docs/results/reduce_conv.{json,md,png}. Run: ``.venv/bin/python bench/reduce_conv.py``
(about 10 minutes on 2 cores the first time, 3 of them pretraining the network).
"""

from __future__ import annotations

from dataclasses import asdict

import torch
from _common import RESULTS_DIR, log, table, write_results
from torch import nn

from edgetorch.data import load_dataset
from edgetorch.measure.plots import new_figure, save_figure
from edgetorch.reduce import ALLOCATIONS, METHODS, ChainReducer, compare_latency, count_macs
from edgetorch.zoo import default_config, evaluate_accuracy, load_pretrained, pretrain

NAME = "reduce_conv"
ALPHAS = (0.3, 0.5, 0.7, 0.8, 0.9)
CALIBRATION = 2_000
LATENCY_BATCH, LATENCY_ROUNDS = 256, 15


def main() -> None:
    torch.set_num_threads(1)  # one thread: the 2 shared cores made 2-thread timings erratic (reduce_layer_factors)
    config = default_config("plaincnn", "fashion-mnist")
    model, record = load_pretrained(config) or pretrain(config)  # cached after the first run
    test = load_dataset("fashion-mnist", "test")
    calibration = load_dataset("fashion-mnist", "train", limit=CALIBRATION).tensors[0]
    example = test.tensors[0][:LATENCY_BATCH]
    full_macs = count_macs(model, example[:1])
    full_accuracy = evaluate_accuracy(model, test)
    log(f"CNN: {100 * full_accuracy:.2f}% test accuracy, {full_macs:,} MACs")
    reducer = ChainReducer(model, calibration)  # reduce_model's reductions, the statistics and SVDs measured once
    rows = []
    for alpha in ALPHAS:
        for method in METHODS:
            for allocation in ALLOCATIONS:
                result = reducer.reduce(alpha, method, allocation)
                macs = count_macs(result.model, example[:1])
                assert macs == result.allocation.cost, (macs, result.allocation.cost)
                row = {"alpha": alpha, "method": method, "allocation": allocation, "macs": macs,
                       "achieved_alpha": 1 - macs / full_macs, "accuracy": evaluate_accuracy(result.model, test),
                       "objective_J": result.allocation.objective, "solver_seconds": result.allocation.seconds,
                       "proven_gap": result.allocation.proven_gap,
                       "factors": [f.kept_inputs if f.kept_inputs is not None else f.rank for f in result.layers],
                       "parameters": sum(p.numel() for p in result.model.parameters())}
                if allocation == "optimal":
                    timing = compare_latency(model, result.model, example, rounds=LATENCY_ROUNDS)
                    row["latency_ratio"] = timing.ratio
                    row["latency"] = asdict(timing)
                rows.append(row)
                log(f"alpha {alpha} {method:8s} {allocation:8s}: {100 * row['accuracy']:.2f}%, "
                    f"J {row['objective_J']:.4g}, {row['solver_seconds']:.2f} s, factors {row['factors']}"
                    + (f", latency {row['latency_ratio']:.3f}" if "latency_ratio" in row else ""))
    exact_beats_pso = all(
        r["objective_J"] <= p["objective_J"] * (1 + 1e-9) + 1e-12
        for r in rows if r["allocation"] == "optimal"
        for p in rows if p["allocation"] == "pso" and (p["alpha"], p["method"]) == (r["alpha"], r["method"])
    )
    report(model, record, full_accuracy, full_macs, rows, exact_beats_pso)
    if not exact_beats_pso:
        raise SystemExit("exact J above PSO's somewhere: a solver bug (results written)")


def report(model, record, full_accuracy, full_macs, rows, exact_beats_pso) -> None:
    fig, ax = new_figure((7.5, 4.5))
    styles = {"prune": "tab:red", "prune-ls": "tab:green", "lowrank": "tab:blue"}
    for method in METHODS:
        for allocation, line in (("uniform", ":"), ("optimal", "-")):
            pts = [r for r in rows if r["method"] == method and r["allocation"] == allocation]
            ax.plot([r["alpha"] for r in pts], [100 * r["accuracy"] for r in pts], line, marker="o",
                    color=styles[method], label=f"{method}, {allocation}")
    ax.axhline(100 * full_accuracy, color="gray", lw=0.8, ls="--", label="full network")
    ax.set_xlabel("alpha_tot (share of multiplications removed)")
    ax.set_ylabel("test accuracy, % (no retraining)")
    ax.set_title("Fashion-MNIST CNN: channel pruning and low-rank convolutions")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    save_figure(fig, RESULTS_DIR / f"{NAME}.png")

    by = {(r["alpha"], r["method"], r["allocation"]): r for r in rows}
    accuracy_rows = [[a] + [f"{100 * by[a, m, al]['accuracy']:.2f}" for m in METHODS for al in ("uniform", "optimal")]
                     for a in ALPHAS]
    j_rows = [[a, m, f"{by[a, m, 'pso']['objective_J']:.4g}", f"{by[a, m, 'optimal']['objective_J']:.4g}",
               f"{by[a, m, 'pso']['solver_seconds']:.2f}", f"{by[a, m, 'optimal']['solver_seconds']:.3f}"]
              for a in ALPHAS for m in METHODS]
    optimal = [r for r in rows if r["allocation"] == "optimal"]
    latency_rows = [[r["alpha"], r["method"], f"{r['macs'] / full_macs:.3f}", f"{r['latency_ratio']:.3f}",
                     f"{r['parameters']:,}", str(r["factors"])] for r in optimal]
    body = f"""
Network: the zoo's `PlainCNN()`: {", ".join(f"conv {m.in_channels}->{m.out_channels}" for m in model if isinstance(m, nn.Conv2d))}
(3x3, each with batch norm and ReLU; 2x2 max pooling after the 2nd, 4th and 5th), Flatten,
{", ".join(f"Linear {m.in_features}->{m.out_features}" for m in model if isinstance(m, nn.Linear))}.

Trained here by the zoo recipe (`edgetorch.zoo.pretrained("plaincnn", "fashion-mnist")`: {record['config']['epochs']}
epochs on all 60,000 training images, AdamW one-cycle, peak lr {record['config']['lr']}, {record['train_seconds'] / 60:.1f} min
here); {100 * full_accuracy:.2f}%
on the 10,000 test images;
{full_macs:,} multiplications per image (weights only, the paper's footnote 1). Reductions use
{CALIBRATION:,} unlabeled training images for the channel statistics and no retraining.
The units pruned are channels: a convolution's cost is kernel area x output positions per channel
pair, and the Linear after the Flatten counts each channel's 3 x 3 positions; low-rank layers are
the convolutions' ``C_out x C_in k k`` matrices (and the Linear layers' own).

Allocations: `uniform` (pruning: the same keep fraction of every layer's channels; low-rank: the
paper's Fig. 3 baseline, the last layer dense and one share of its multiplications for every other
layer, the share that meets the budget), `optimal` (the exact solver on the paper's J, eq. 12) and,
for J and solver time only, `pso` (the paper's particle swarm).

## Test accuracy %, uniform vs exact-optimal allocation

{table(["alpha_tot"] + [f"{m} {al}" for m in METHODS for al in ("uniform", "optimal")], accuracy_rows)}

![accuracy vs alpha](reduce_conv.png)

## J (eq. 12) and solver seconds: PSO vs exact

{table(["alpha_tot", "method", "J PSO", "J exact", "s PSO", "s exact"], j_rows)}

Exact J never above PSO's: {"yes" if exact_beats_pso else "NO (a bug)"}.

## Optimal allocation: MACs, measured latency (1 thread, batch {LATENCY_BATCH}), parameters, factors

Factors are kept input channels per layer (pruning; the last is the Linear's kept channels) or
ranks (low-rank; a full rank keeps the layer dense).

{table(["alpha_tot", "method", "MAC ratio", "latency ratio", "parameters", "factors"], latency_rows)}
"""
    write_results(NAME, "Layer reduction on a CNN: channel pruning and low-rank convolutions", body,
                  {"network_record": record, "full_accuracy": full_accuracy,
                   "full_macs": full_macs, "calibration_samples": CALIBRATION, "rows": rows,
                   "exact_never_above_pso": exact_beats_pso})


if __name__ == "__main__":
    main()
