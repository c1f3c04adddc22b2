"""``edgetorch profile``: saved-activation bytes and measured peak memory per policy, and with
``--fidelity`` how far each policy moves the gradients."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.table import Table

from .._extras import install_hint
from ._app import app, console, device_option, mib, output_file, plot_file, write_json

if TYPE_CHECKING:  # the command imports torch-backed modules only when it runs
    from ..activations.profile import PolicyProfile


@app.command()
def profile(
    model: str = typer.Option(..., help="torchvision:NAME, zoo:NAME or pkg.module:factory (imports that module: runs its code)"),
    batch_size: int = typer.Option(16, min=1, help="batch size"),
    size: int = typer.Option(224, min=1, help="input height and width"),
    policy: list[str] = typer.Option(
        ["dense", "bitmap"],
        help="repeatable: dense, bitmap[:threshold=0.01,value_dtype=float16], quantized[:bits=8], "
             "backrazor:sparsity=0.9[,exact=int8,values=int8,scope=all]; add +checkpoint to recompute stages",
    ),
    channels: int = typer.Option(None, help="input channels (default: the first conv's)"),
    num_classes: int = typer.Option(10, min=1, help="classifier outputs"),
    device: str = typer.Option("cpu", callback=device_option, help="cpu, cuda or cuda:N"),
    freeze_batchnorm: bool = typer.Option(False, "--freeze-batchnorm", "--freeze-bn", metavar="", help="freeze batch norm first (the Back Razor paper's choice)"),
    fidelity: bool = typer.Option(False, "--fidelity", metavar="",
                                  help="also compare each policy's gradients with plain PyTorch's on the same batch"),
    json_path: Path = typer.Option(None, "--json", callback=output_file, help="write the results as JSON here"),
    plot: Path = typer.Option(None, callback=plot_file, help="write the memory breakdown per policy here (.png, .pdf, .svg)"),
) -> None:
    """Profile one training step per policy: saved-activation bytes (ledger) and measured peak memory."""
    from ..activations.profile import profile_policies
    from ..activations.step import parse_training_policy
    from ..zoo import build_model

    try:
        for spec in policy:
            parse_training_policy(spec)
        build_model(model, num_classes=num_classes)  # fail fast on unknown names
    except (ValueError, TypeError, ImportError) as err:
        raise typer.BadParameter(install_hint(err)) from None

    with console.status("") as status:
        done = []

        def progress(result: PolicyProfile) -> None:
            done.append(result)
            status.update(f"profiled {len(done)}/{len(policy)} policies")

        status.update(f"profiling {policy[0]} (a fresh process per policy)")
        result = profile_policies(model, batch_size, size, policy, channels=channels,
                                  num_classes=num_classes, device=device, freeze_batchnorm=freeze_batchnorm,
                                  fidelity=fidelity, on_result=progress)

    table = Table(title=f"{model}  batch {batch_size}  {size}px  ({device})")
    table.add_column("policy", no_wrap=True)
    for col in ("saved act. MiB\n(ledger)", "dense act. MiB\n(ledger)", "vs dense", "sparsity",
                "forward incr. MiB\n(measured)", "step incr. MiB\n(measured)",
                "peak MiB\n(measured)", "step s"):
        table.add_column(col, justify="right")
    for r in result.results:
        table.add_row(r.policy, mib(r.activation_bytes), mib(r.dense_activation_bytes), f"{r.stored_over_dense:.3f}",
                      f"{r.sparsity:.1%}", mib(r.forward_increase_bytes), mib(r.step_peak_increase_bytes),
                      mib(r.peak_memory_bytes), f"{r.step_seconds:.2f}")
    console.print(table)
    console.print("ledger = exact tensor bytes autograd holds; measured = the process peak "
                  f"({result.results[0].peak_memory_kind}); they are different quantities.")
    if fidelity:
        # A table of its own: twelve columns do not fit the console's 130 (headers were cut).
        console.print(_fidelity_table(result.results))
    record = result.to_json()
    write_json(json_path, record)
    if plot is not None:
        from ..measure.plots import plot_memory_breakdown

        console.print(f"wrote {plot_memory_breakdown(record, plot)}")


def _fidelity_table(results: list[PolicyProfile]) -> Table:
    """Memory and gradient fidelity side by side, one row per policy ('-': no input gradient, or
    a number that is not finite, which the JSON record holds as null)."""
    table = Table(title="one step's gradients against plain PyTorch's on the same batch")
    table.add_column("policy", no_wrap=True)
    for col in ("saved act.\nvs dense", "worst param.\ncosine", "max param.\nrel. L2 error", "input grad.\ncosine"):
        table.add_column(col, justify="right")
    table.add_column("worst parameter")
    for r in results:
        f = r.fidelity
        inputs = None if f.input is None else f.input.cosine
        table.add_row(r.policy, f"{r.stored_over_dense:.3f}",
                      *("-" if v is None or not math.isfinite(v) else format(v, spec) for v, spec in
                        ((f.worst_cosine, ".4f"), (f.max_relative_error, ".3g"), (inputs, ".4f"))),
                      f.worst_parameter or "-")
    return table
