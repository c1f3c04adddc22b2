"""``edgetorch split``: train a student, export it, serve its tail, run its head, plan a deployment."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.table import Table

from ..errors import EdgetorchError
from ..tail_defaults import HEADER_TIMEOUT_S, KEEP_ALIVE_S, MAX_BATCH, MAX_CONNECTIONS, READ_TIMEOUT_S, WRITE_TIMEOUT_S
from .._extras import install_hint
from ._app import App, Group, app, console, device_option, output_dir, output_file, plot_file, write_json

if TYPE_CHECKING:  # the commands import torch-backed modules only when they run
    from ..split.student import StudentRun

split_app = App(cls=Group, help="BottleFit split computing: train, export, serve, infer, probe, plan (measure-server for the planner).", no_args_is_help=True)
app.add_typer(split_app, name="split")


def _secret(env: str | None, what: str) -> str | None:
    """A token or key read from an environment variable (never from the command line, which
    other users can read in the process list)."""
    import os

    if env is None:
        return None
    value = os.environ.get(env)
    if not value:
        raise typer.BadParameter(f"environment variable {env} is not set or empty (it should hold the {what})")
    return value


# Options that `split export --trained DIR` takes from the training record instead.
_FROM_TRAINING = ("model", "channels", "split_point", "downsample", "architecture", "size", "num_classes",
                  "class_names", "color", "normalize")
_ARCHITECTURE_HELP = "bottleneck design: paper (the paper's text) or released (the authors' code: 2x2 convs, heavier decoder)"


@split_app.command()
def train(
    teacher: str = typer.Option(..., help="teacher: torchvision:resnet18|50|152|densenet121|169|201, or package.module:factory returning one (imports that module: runs its code)"),
    teacher_weights: Path = typer.Option(None, help="the teacher's trained weights (.safetensors, or a .pt/.pth state dict, read by torch's restricted unpickler: tensors only); required for torchvision: (nothing is downloaded)"),
    data: str = typer.Option(..., help="an image folder (one subfolder per class, or a path,label .csv), or digits / fashion-mnist"),
    out: Path = typer.Option(..., callback=output_dir, help="run directory: a checkpoint per stage (the same command resumes), then student.safetensors + student.json for `split export --trained`"),
    size: int = typer.Option(224, min=8, help="input height = width (images are resized to it, as `split infer` does)"),
    channels: int = typer.Option(12, min=1, help="bottleneck channels C"),
    split_point: str = typer.Option("sp2", help="sp1 or sp2"),
    downsample: bool = typer.Option(False, metavar="", help="halve the bottleneck's height and width once more"),
    architecture: str = typer.Option("paper", help=_ARCHITECTURE_HELP),
    stage2: str = typer.Option("ft", help="after GHND: ft (fine-tune with cross entropy) or kd (knowledge distillation)"),
    freeze_encoder: bool = typer.Option(False, "--freeze-encoder", metavar="", help="stage 2 trains only the tail (the paper's FE)"),
    rate_weight: float | None = typer.Option(None, min=0.0, help="rate-aware stage 2: train the whole student through fixed per-channel steps with this weight per estimated bit per image (e.g. 1e-4; 0: rounding alone); payloads are then entropy-coded version 3. Default: the paper's stage 2"),
    # the default is split.bottlefit.CODE_LEVELS (not imported here: it imports torch; a test checks)
    code_levels: int = typer.Option(16, min=2, max=256, help="with --rate-weight: codes spanning each bottleneck channel's range on the training images (its fixed step is range / (levels - 1)); fewer levels, coarser steps"),
    epochs: int = typer.Option(10, min=1, help="epochs per stage (paper: 10); the learning rate drops x0.1 after the first half"),
    batch_size: int = typer.Option(32, min=1, help="images per step"),
    lr: float = typer.Option(1e-3, help="learning rate of both stages (paper: 1e-3)"),
    color: str = typer.Option(None, help="rgb or gray (default: rgb for a folder; the built-ins are gray)"),
    normalize: str = typer.Option(None, help="imagenet or none (default: imagenet for a folder, none for the built-ins)"),
    val_fraction: float = typer.Option(None, help="folder: share of each class held out for the evaluation (default 0.2)"),
    train_limit: int = typer.Option(None, min=1, help="built-ins: train on the first N training images"),
    val_limit: int = typer.Option(None, min=1, help="built-ins: evaluate on the first N test images"),
    skip_bad_images: bool = typer.Option(False, "--skip-bad-images", metavar="", help="folder: leave out the images that cannot be decoded (listed in student.json); default: one is an error that names it"),
    seed: int = typer.Option(0, help="seeds the new layers, the batch order and a folder's validation split"),
    device: str = typer.Option("cpu", callback=device_option, help="cpu, cuda or cuda:N"),
    json_path: Path = typer.Option(None, "--json", callback=output_file, help="also write the training record (student.json) here"),
    plot: Path = typer.Option(None, callback=plot_file, help="write the loss curves of both stages here (.png, .pdf, .svg)"),
    progress: bool = typer.Option(True, "--progress/--no-progress", metavar="", help="show progress bars"),
) -> None:
    """Train a BottleFit student from a teacher: GHND, then FT or KD; evaluate it through the 8-bit payload."""
    from ..split.bottlefit import BottleFitConfig
    from ..split.recipe import RecipeConfig, plot_losses, train_student

    try:
        config = RecipeConfig(teacher=teacher, data=data, size=size, color=color, normalize=normalize,
                              teacher_weights=None if teacher_weights is None else str(teacher_weights),
                              val_fraction=val_fraction, train_limit=train_limit, val_limit=val_limit,
                              skip_bad_images=skip_bad_images,
                              bottlefit=BottleFitConfig(channels=channels, split_point=split_point, downsample=downsample,
                                                        architecture=architecture, stage2=stage2, freeze_encoder=freeze_encoder, epochs=epochs,
                                                        batch_size=batch_size, lr=lr, seed=seed, rate_weight=rate_weight,
                                                        code_levels=code_levels))  # fmt: skip
        run = train_student(config, out, device=device, progress=progress, log=console.print)
    except ValueError as err:  # bad input, found before training starts (ImageFolderError, CheckpointError)
        raise typer.BadParameter(install_hint(err)) from None
    except KeyboardInterrupt:
        console.print(f"interrupted: finished epochs are checkpointed under {out}; run the same command "
                      "again to resume", style="yellow")
        raise typer.Exit(130) from None
    except (RuntimeError, FloatingPointError, OSError) as err:
        console.print(f"split train failed: {err}", style="red")
        raise typer.Exit(1) from None
    _print_evaluation(run)
    write_json(json_path, run.to_json())
    if plot is not None:
        plot_losses(run.stages, plot, f"{teacher} -> C={channels} {split_point} student")
        console.print(f"wrote {plot}")
    artifact = out / "artifact"
    console.print(f"student: {out / 'student.safetensors'}; export it with:\n"
                  f"  edgetorch split export --trained {shlex.quote(str(out))} --out {shlex.quote(str(artifact))}")


def _print_evaluation(run: StudentRun) -> None:
    """The evaluation of `split train` as a table: accuracy and bytes sent per image, per option."""
    ev = run.evaluation
    student, files = ev.student, ev.offload
    table = Table(title=f"validation: {ev.val_images:,} images at {run.resolution} px")
    for col in ("option", "accuracy", "bytes per image"):
        table.add_column(col, justify="left" if col == "option" else "right")
    table.add_row("teacher (float input, no transfer)", f"{ev.teacher_accuracy:.2%}", "-")
    for name, label in (("png", "teacher on PNG files (full offload)"), ("jpeg90", "teacher on JPEG q90 files")):
        table.add_row(label, f"{files[name].accuracy:.2%}", f"{files[name].mean_bytes:,.0f}")
    shape = "x".join(map(str, student.bottleneck_shape))
    table.add_row(f"student, float {shape} bottleneck", f"{student.float_accuracy:.2%}", f"{student.float32_bytes:,}")
    table.add_row("student, 8-bit payload", f"{student.quantized_accuracy:.2%}", f"{student.payload_bytes:,}")
    if student.coded_payload_bytes is not None:
        coded = student.coded_payload_bytes
        steps = run.code_tables.steps is not None  # version 3: the fixed steps, its own accuracy
        table.add_row(f"student, entropy-coded payload{', fixed steps' if steps else ''} (deployed; mean, p90)",
                      f"{student.coded_accuracy if steps else student.quantized_accuracy:.2%}",
                      f"{coded.mean:,.0f}, {coded.p90:,.0f}")
    console.print(table)


@split_app.command()
def export(
    ctx: typer.Context,
    model: str = typer.Option(None, help="teacher: torchvision:resnet18|50|152 or torchvision:densenet121|169|201"),
    channels: int = typer.Option(None, min=1, help="bottleneck channels C"),
    out: Path = typer.Option(..., callback=output_dir, help="artifact directory to write"),
    checkpoint: Path = typer.Option(None, help="trained BottleneckModel state dict (.safetensors), loaded strictly"),
    trained: Path = typer.Option(None, help="a `split train --out` directory: the student, its architecture, resolution, classes and preprocessing all come from it"),
    random_init: bool = typer.Option(False, "--random-init", metavar="", help="export untrained weights (timing, smoke tests)"),
    split_point: str = typer.Option("sp2", help="sp1 or sp2"),
    downsample: bool = typer.Option(False, metavar="", help="halve the bottleneck's height and width once more"),
    architecture: str = typer.Option("paper", help=_ARCHITECTURE_HELP),
    size: int = typer.Option(224, min=8, help="input height = width the head is exported for"),
    num_classes: int = typer.Option(10, min=1, help="classifier outputs"),
    class_names: str = typer.Option(None, help="comma-separated class names, in label order, for `split infer` to print"),
    color: str = typer.Option("gray", help="images the client sends: gray (Fashion-MNIST teachers) or rgb"),
    normalize: str = typer.Option("none", help="pixel normalisation after scaling to [0, 1]: none or imagenet"),
    key_env: str = typer.Option(None, help="sign the manifest with HMAC-SHA256, the key (>= 16 bytes) read from this environment variable"),
    onnx: bool = typer.Option(False, "--onnx", metavar="", help="also write head.onnx for devices that run onnxruntime (needs edgetorch[onnx])"),
    entropy_coding: bool = typer.Option(True, "--entropy-coding/--no-entropy-coding", metavar="", help="with --trained: payloads entropy-coded with the run's code tables (today's student: the same values in fewer bytes; a --rate-weight student: its fixed steps, payload version 3); --no-entropy-coding sends each 8-bit code as a byte"),
    json_path: Path = typer.Option(None, "--json", callback=output_file, help="write what was exported (shapes, files, SHA-256) here"),
) -> None:
    """Write head.safetensors, tail.safetensors and manifest.json for a bottleneck-injected model."""
    from ..split.bottleneck import inject_bottleneck
    from ..split.export import save
    from ..split.manifest import Preprocess
    from ..split.recipe import NORMALISATIONS
    from ..split.student import load_trained
    from ..zoo import build_model, load_weights

    if sum((checkpoint is not None, trained is not None, random_init)) != 1:
        raise typer.BadParameter("give exactly one of --checkpoint FILE, --trained DIR or --random-init")
    if trained is not None:
        # By the enum's name: typer may bring its own copy of click, whose ParameterSource is another class.
        given = [name for name in _FROM_TRAINING if getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE"]
        if given:
            raise typer.BadParameter(f"--trained takes the architecture and preprocessing from {trained}; drop "
                                     + ", ".join("--" + name.replace("_", "-") for name in given))
    elif model is None or channels is None:
        raise typer.BadParameter("--model and --channels are required with --checkpoint or --random-init")
    if normalize not in NORMALISATIONS:
        raise typer.BadParameter(f"--normalize must be one of {', '.join(NORMALISATIONS)}, got {normalize!r}")
    key = _secret(key_env, "HMAC key")
    names = None if class_names is None else [n.strip() for n in class_names.split(",")]
    tables = None
    try:
        if trained is not None:
            run = load_trained(trained)
            student, size, preprocess, names = run.model, run.resolution, run.preprocess, list(run.class_names)
            tables = run.code_tables if entropy_coding else None
        else:
            student = inject_bottleneck(build_model(model, num_classes=num_classes), channels, split_point,
                                        downsample=downsample, architecture=architecture)
            if checkpoint is not None:
                load_weights(student, checkpoint)
            preprocess = Preprocess((size, size), color, *NORMALISATIONS[normalize])
        manifest = save(student, out, size, preprocess, class_names=names, key=key, onnx=onnx, code_tables=tables)
    except (EdgetorchError, ValueError, TypeError, ImportError) as err:
        raise typer.BadParameter(install_hint(err)) from None
    source = trained or checkpoint or "random init"
    extras = [what for what, on in (("signed", key), ("with head.onnx", onnx), ("entropy-coded payloads", tables)) if on]
    console.print(f"wrote {out}: head -> {list(manifest.bottleneck_shape)} bottleneck, tail -> "
                  f"{manifest.num_classes} logits ({', '.join([str(source), *extras])})")
    console.print(f"artifact id {manifest.artifact_id} (pin it with `split serve/infer --expect-id`)")
    write_json(json_path, {"artifact": str(out), "artifact_id": manifest.artifact_id, "source": str(source),
                           "signed": key is not None,
                           "manifest": json.loads((out / "manifest.json").read_text())})


@split_app.command()
def serve(
    artifact_dir: Path = typer.Argument(..., help="directory written by `edgetorch split export`"),
    host: str = typer.Option("127.0.0.1", help="address to bind"),
    port: int = typer.Option(8000, min=0, max=65535, help="port to bind"),
    max_payload_bytes: int = typer.Option(None, min=1, help="request size limit (default: 64 bottlenecks)"),
    max_batch: int = typer.Option(MAX_BATCH, min=1, help="payloads with more samples get 413, before decoding"),
    header_timeout: float = typer.Option(HEADER_TIMEOUT_S, min=0.1, help="seconds for a request line and headers, else 408"),
    read_timeout: float = typer.Option(READ_TIMEOUT_S, min=0.1, help="seconds for a whole request body, else 408"),
    keep_alive: float = typer.Option(KEEP_ALIVE_S, min=0.1, help="seconds an idle keep-alive connection stays open"),
    write_timeout: float = typer.Option(WRITE_TIMEOUT_S, min=0.1, help="seconds a client that stops reading its answer is kept, then dropped"),
    max_connections: int = typer.Option(MAX_CONNECTIONS, min=1, help="connections kept open (a new one closes the longest idle); "
                                                          "requests running at once beyond it get 503, except /health"),
    max_pipelined: int = typer.Option(16, min=1, help="requests a client may queue ahead of its answers before the "
                                                      "connection is closed"),
    token_env: str = typer.Option(None, help="require `Authorization: Bearer <token>`, the token read from this environment variable"),
    key_env: str = typer.Option(None, help="refuse the artifact unless signed with the HMAC key in this environment variable"),
    expect_id: str = typer.Option(None, "--expect-id", help="refuse any artifact but the one with this id (export prints it), even one signed with the same key"),
    ray: bool = typer.Option(False, "--ray", metavar="", help="serve behind Ray Serve's proxy (needs edgetorch[ray]); see docs/split_ray.md"),
    replicas: int = typer.Option(1, min=1, help="with --ray: tail replicas, each loading and verifying the artifact"),
    num_cpus_per_replica: float = typer.Option(1.0, min=0.0, help="with --ray: CPUs Ray reserves per replica"),
) -> None:
    """Serve the tail over HTTP (POST /infer, GET /health, GET /metrics) with uvicorn, or on Ray Serve."""
    from ..split.protocol import uvicorn_config
    from ..split.server import ServerConfig, app_from_dir

    token = _secret(token_env, "bearer token")
    key = _secret(key_env, "HMAC key")
    if replicas > 1 and not ray:
        raise typer.BadParameter("--replicas needs --ray (without Ray, run several `split serve` processes)")
    try:
        config = ServerConfig(max_payload_bytes, token, max_batch=max_batch, header_timeout_s=header_timeout,
                              read_timeout_s=read_timeout, keep_alive_s=keep_alive, write_timeout_s=write_timeout,
                              max_connections=max_connections, max_pipelined=max_pipelined,
                              expect_artifact_id=expect_id)
        if ray:
            from ..split import ray_app

            console.print("Ray's own services listen on this machine's network address, whatever "
                          "--host says; the Ray proxy does not enforce --header-timeout, --write-timeout, "
                          "--max-connections or --max-pipelined (docs/split_ray.md)", style="yellow")
            ray_app.run(artifact_dir, host, port, replicas, config, key=key, num_cpus_per_replica=num_cpus_per_replica)
            return
        server = app_from_dir(artifact_dir, config, key)
    except (EdgetorchError, ValueError, ImportError) as err:
        raise typer.BadParameter(install_hint(err)) from None
    import uvicorn

    uvicorn.Server(uvicorn_config(server, host, port)).run()


@split_app.command()
def infer(
    artifact_dir: Path = typer.Argument(..., help="directory written by `edgetorch split export`"),
    images: list[Path] = typer.Argument(..., help="PNG/JPEG files"),
    server: str = typer.Option(..., help="base URL of `edgetorch split serve`, e.g. http://127.0.0.1:8000"),
    token_env: str = typer.Option(None, help="send the bearer token read from this environment variable"),
    key_env: str = typer.Option(None, help="refuse the artifact unless signed with the HMAC key in this environment variable"),
    expect_id: str = typer.Option(None, "--expect-id", help="refuse any artifact but the one with this id (export prints it), even one signed with the same key"),
    runtime: str = typer.Option("torch", help="run the head with torch (safetensors) or onnx (head.onnx, needs onnxruntime)"),
    top_k: int = typer.Option(3, min=1, help="print this many most probable classes per image"),
    json_path: Path = typer.Option(None, "--json", callback=output_file, help="write the predictions, payload bytes and stage times here"),
) -> None:
    """Run the head here, send the 8-bit payload, print predictions and each stage's time."""
    import httpx

    from ..split.client import SplitClient, SplitClientError
    from ..split.manifest import SplitArtifactError

    token = _secret(token_env, "bearer token")
    key = _secret(key_env, "HMAC key")
    try:
        with SplitClient.from_dir(artifact_dir, server, token=token, key=key, expect_id=expect_id,
                                  runtime=runtime) as client:
            result = client.infer_files(images)
    except (SplitArtifactError, ValueError, ImportError) as err:
        raise typer.BadParameter(install_hint(err)) from None
    except (SplitClientError, httpx.HTTPError) as err:
        console.print(f"request failed: {err}", style="red")
        raise typer.Exit(1) from None
    predictions = result.top(top_k, client.manifest.class_names)
    for path, ranked in zip(images, predictions):
        console.print(f"{path}: " + ", ".join(f"{name} {p:.1%}" for name, p in ranked), highlight=False)
    stages = "  ".join(f"{k} {v * 1e3:.1f} ms" for k, v in result.seconds.items())
    console.print(f"payload {result.payload_bytes:,} bytes for {len(images)} image(s); {stages}")
    write_json(json_path, {"images": [{"path": str(path), "top": [{"class": name, "probability": p} for name, p in ranked]}
                                      for path, ranked in zip(images, predictions)],
                           "payload_bytes": result.payload_bytes, "seconds": result.seconds})


@split_app.command()
def probe(
    url: str = typer.Argument(..., help="the tail server as your devices reach it, e.g. http://10.0.0.5:8000 (through any proxy in front)"),
    token_env: str = typer.Option(None, help="send the bearer token read from this environment variable"),
    clients: int = typer.Option(4, min=1, help="load: concurrent keep-alive clients"),
    requests: int = typer.Option(25, min=1, help="load: batch-1 requests per client, back to back"),
    hostile: bool = typer.Option(False, "--hostile", metavar="", help="also open stalled connections and send fuzzed requests"),
    stalled: int = typer.Option(100, min=1, help="with --hostile: connections that stop halfway through a request"),
    fuzz: int = typer.Option(500, min=1, help="with --hostile: seeded malformed requests, 32 at a time"),
    header_deadline: float = typer.Option(None, min=0.1, help="with --hostile: the seconds the server gives a request line and headers (its --header-timeout; default: a default server's); a connection stalled in its headers must be closed within this + 1 s"),
    read_deadline: float = typer.Option(None, min=0.1, help="with --hostile: the seconds the server gives a request body (its --read-timeout; default: a default server's); a connection stalled in its body must be closed within this + 1 s, and fuzzed requests that send less body than they declare are waited for this + 10 s"),
    deadline: float = typer.Option(None, hidden=True),  # replaced: an error names the two options above
    json_path: Path = typer.Option(None, "--json", callback=output_file, help="write every phase's full result here"),
) -> None:
    """Check a running tail server end to end: load latency, and with --hostile stalled connections and fuzzing.

    Exits 1 when a check fails: a load error (an error status, a transport failure, an answer that is not the
    expected JSON or is longer than the probe reads), a stalled connection held past its deadline (--header-deadline or
    --read-deadline) + 1 s, or an answer of 500 or more.
    """
    from dataclasses import asdict

    import httpx

    from ..split.fuzz import FuzzConfig, run_fuzz
    from ..split.loadgen import MAX_PROBE_PAYLOAD_BYTES, LoadConfig, Target, get, run_load
    from ..split.payload import encode, payload_size
    from ..split.probe import StallConfig, run_stall

    if deadline is not None:  # one deadline for both was checked against the header timeout alone
        raise typer.BadParameter(f"--deadline is replaced by --header-deadline (the server's --header-timeout, "
                                 f"default {HEADER_TIMEOUT_S:g} s) and --read-deadline (its --read-timeout, default "
                                 f"{READ_TIMEOUT_S:g} s): a server's body deadline is not its header deadline",
                                 param_hint="--deadline")
    # Read here, not as the options' defaults: the module that holds them is under edgetorch.split,
    # whose import brings torch, and `--help` must not wait for torch.
    header_deadline = HEADER_TIMEOUT_S if header_deadline is None else header_deadline
    read_deadline = READ_TIMEOUT_S if read_deadline is None else read_deadline
    try:
        target = Target.from_url(url, _secret(token_env, "bearer token"))
    except ValueError as err:
        raise typer.BadParameter(install_hint(err)) from None
    try:
        status, body = get(target, "/")
        if status != 200:
            raise ValueError(f"it answered {status}: {body[:200]!r}")
        info = json.loads(body)
        shape, limit = tuple(info["bottleneck_shape"]), info["max_payload_bytes"]
        if type(limit) is not int:
            raise ValueError(f"max_payload_bytes {limit!r} is not a whole number")
        # The server's answer is outside data: check the shape it claims against the payload limit
        # it states, and against the probe's own (the server states both), before a tensor of that
        # shape is made (a claim of 10^15 elements is refused here).
        limit = min(limit, MAX_PROBE_PAYLOAD_BYTES)
        if len(shape) != 3 or not all(type(d) is int and d > 0 for d in shape) \
                or payload_size((1, *shape)) > limit:
            raise ValueError(f"bottleneck_shape {list(shape)[:4]} is not 3 positive ints within the payload "
                             f"limit of {limit} bytes")
    except (httpx.HTTPError, ValueError, KeyError, TypeError, RecursionError) as err:  # AnswerError is a ValueError
        console.print(f"{url} did not answer GET / as a split tail server does: {err!r}", style="red")
        raise typer.Exit(1) from None
    import torch

    payload = encode(torch.randn(1, *shape, generator=torch.Generator().manual_seed(0)))
    load = run_load(target, payload, LoadConfig(clients, requests))
    table = Table(title=f"{url}: bottleneck {list(shape)}, payload {len(payload):,} bytes")
    for col in ("phase", "result", "check"):
        table.add_column(col)
    checks = [load.errors == 0]
    kinds = f" ({json.dumps(load.errors_by_kind)})" if load.errors else ""
    table.add_row(f"load: {clients} x {requests}", f"{load.errors} errors of {load.requests}{kinds}; p50 {load.p50_ms:.1f} ms, "
                  f"p90 {load.p90_ms:.1f}, p99 {load.p99_ms:.1f}, max {load.max_ms:.1f}; {load.throughput_rps:.1f} req/s",
                  "ok" if checks[-1] else "FAILED")
    record = {"load": asdict(load)}
    if hostile:
        stall = run_stall(target, payload, StallConfig(stalled, header_deadline, read_deadline))
        held = "; ".join(f"{kind} max {k['closed_after_s_max']:.2f} s (deadline {k['deadline_s']:g} s)"
                         for kind, k in stall.by_kind.items() if k["closed_after_s_max"] is not None) or "-"
        over = f", {stall.answers_over_cap} answers over the probe's cap" if stall.answers_over_cap else ""
        checks.append(stall.closed_within_deadline_plus_1s == stall.connections)
        table.add_row(f"stalled: {stalled}", f"{stall.closed} closed by the server ({stall.answered_408} with 408{over}), "
                      f"{held}; /health {stall.health_ok_while_held}/{stall.health_polls_while_held} while held",
                      "ok" if checks[-1] else "FAILED")
        fuzzed = run_fuzz(target, shape, limit, FuzzConfig(fuzz, read_timeout_s=read_deadline))
        answered = {s: n for s, n in fuzzed.statuses.items() if s.isdigit()}  # the rest: why there was no answer
        fours = sum(n for s, n in answered.items() if s.startswith("4"))
        checks.append(fuzzed.answers_5xx == 0)
        table.add_row(f"fuzz: {fuzz}", f"{fours} 4xx, {fuzzed.answers_5xx} 5xx, {fuzz - sum(answered.values())} "
                      f"unanswered; {json.dumps(fuzzed.statuses)}", "ok" if checks[-1] else "FAILED")
        record.update(stall=asdict(stall), fuzz=asdict(fuzzed))
    console.print(table)
    write_json(json_path, record)
    if not all(checks):
        raise typer.Exit(1)


# Said when `split plan` has no --accuracy. --accuracy once defaulted to docs/results/split_training.json
# read from the current directory: the same command planned differently by where it was run.
NO_ACCURACY = ("none given: pass --accuracy FILE (the training benchmark's accuracies are in "
               "docs/results/split_training.json in the repository)")

# `split plan` and `split measure-server` share these defaults, so a server measured with its
# defaults covers a default plan.
PLAN_MODEL, PLAN_CHANNELS, PLAN_RESOLUTION = "torchvision:resnet18", [1, 2, 3, 6, 9, 12], 96


def _check_channels(channels: list[int]) -> None:
    if any(c < 1 for c in channels):
        raise typer.BadParameter(f"--channels must be positive bottleneck channel counts, got {channels}")


@split_app.command()
def plan(
    link: list[str] = typer.Option(..., help="repeatable: wifi:MBPS, lte:MBPS, trace:FILE, lora:sf=6,bw=125,cr=1[,model=rate]"),
    device: str = typer.Option("jetson-nano", help="jetson-nano, raspberry-pi-4, raspberry-pi-4-lora or a profile .json"),
    model: str = typer.Option(PLAN_MODEL, help="teacher architecture"),
    channels: list[int] = typer.Option(PLAN_CHANNELS, help="repeatable: bottleneck channels to compare"),
    split_point: str = typer.Option("sp2", help="sp1 or sp2"),
    size: int = typer.Option(PLAN_RESOLUTION, min=8, help="input height = width"),
    accuracy: Path = typer.Option(None, help="accuracy JSON {teacher, jpeg, split: {C: acc}}, e.g. the training benchmark's docs/results/split_training.json (default: none, the plan shows no accuracy)"),
    server: str = typer.Option("quadro-p600", help="quadro-p600 (the paper's edge server, speed assumed), this-machine, or a .json (e.g. from `split measure-server` run on the server)"),
    images: Path = typer.Option(None, help="offload file sizes from your own images under this folder (default: Fashion-MNIST test images)"),
    json_path: Path = typer.Option(None, "--json", callback=output_file, help="write the plan(s) as JSON here"),
) -> None:
    """Local vs full offload (PNG/JPEG) vs split at each C: delay, device energy, accuracy."""
    from ..split.links import parse_link
    from ..split.plan import (compare_deployments, image_file_bytes, load_accuracy, measure_host_times, plan_record,
                              server_times)
    from ..split.power import load_profile, load_server

    _check_channels(channels)
    try:
        links = [parse_link(spec) for spec in link]
        profile = load_profile(device)
        server_profile = load_server(server)
        known = None if accuracy is None else load_accuracy(accuracy)
    except ValueError as err:
        raise typer.BadParameter(install_hint(err)) from None
    try:  # before the timing, so a bad --images folder is reported at once
        files = image_file_bytes(size, images_dir=images)
    except ValueError as err:
        raise typer.BadParameter(install_hint(err)) from None
    with console.status("timing the head/tail per C and the profiles' reference models on this machine"):
        try:
            times = measure_host_times(model, sorted(set(channels)), size, profile, split_point,
                                       server=server_profile)
        except ValueError as err:  # a model or split point inject_bottleneck does not accept
            raise typer.BadParameter(install_hint(err)) from None
    console.print(f"device: {profile.name} ({profile.source}); device/host speed ratio "
                  f"{profile.reference_seconds / times.reference_s:.3g}")
    console.print(f"server: {server_profile.name} ({server_profile.source}); its times: "
                  f"{server_times(times, profile, server_profile).basis}")
    console.print(f"accuracy: {known.source if known else NO_ACCURACY}; offload files: "
                  f"{images or 'Fashion-MNIST test images'} at {size}px (PNG {files['png']:,.0f} B, "
                  f"JPEG {files['jpeg']:,.0f} B; device-side encoding is counted)")
    records = []
    for one in links:
        rows = compare_deployments(times, files, one, profile, known, server=server_profile)
        record = plan_record(rows, one, profile, times, known, server_profile)
        records.append(record)
        table = Table(title=f"{model} {size}px on {profile.name} over {one.name}, server {server_profile.name}")
        for col in ("option", "bytes sent", "D_head ms", "D_net ms (p95)", "D_tail ms", "D_e2e ms",
                    "energy mJ", "power W", "accuracy"):
            table.add_column(col, justify="left" if col == "option" else "right")
        for r in rows:
            marks = "".join(m for m, best in (("*d", record["best_delay"]), ("*e", record["best_energy"])) if best == r.option)
            table.add_row(f"{r.option} {marks}", f"{r.sent_bytes:,}", f"{r.head_s * 1e3:.1f}",
                          f"{r.network_s * 1e3:.1f} ({r.network_p95_s * 1e3:.1f})", f"{r.tail_s * 1e3:.1f}",
                          f"{r.e2e_s * 1e3:.1f}", f"{r.energy_j * 1e3:.0f}", f"{r.power_w:.2f}",
                          "-" if r.accuracy is None else f"{r.accuracy:.3f}")
        console.print(table)
    console.print("*d = lowest delay, *e = lowest device energy. Times measured on this machine, scaled by the "
                  "device and server profiles' speeds (unless measured on the server); links and power are assumptions.")
    write_json(json_path, records)


@split_app.command("measure-server")
def measure_server(
    out: Path = typer.Option(..., callback=output_file, help="the server profile JSON to write, for `split plan --server FILE`"),
    model: str = typer.Option(PLAN_MODEL, help="teacher architecture (as `split plan --model`)"),
    channels: list[int] = typer.Option(PLAN_CHANNELS, help="repeatable: bottleneck channels whose tails to time"),
    split_point: str = typer.Option("sp2", help="sp1 or sp2"),
    size: int = typer.Option(PLAN_RESOLUTION, min=8, help="input height = width"),
    device: str = typer.Option("cpu", callback=device_option, help="where the server runs the tail: cpu, cuda or cuda:N"),
    name: str = typer.Option(None, help="the profile's name (default: this machine's host name and --device)"),
) -> None:
    """Run on the edge server: time the full model, each C's tail and the reference model there, for `split plan --server`."""
    from ..split.plan import measure_server as measure
    from ..split.power import profile_json

    _check_channels(channels)
    with console.status(f"timing the full model, the tails and the reference model on {device}"):
        try:
            profile = measure(model, sorted(set(channels)), size, split_point, device, name)
        except ValueError as err:  # a model or split point inject_bottleneck does not accept
            raise typer.BadParameter(install_hint(err)) from None
    out.write_text(profile_json(profile))
    tails = ", ".join(f"C={c} {s * 1e3:.1f}" for c, s in profile.measured.tail_s.items())
    console.print(f"{profile.name}: full model {profile.measured.full_s * 1e3:.1f} ms, tails (ms) {tails}, "
                  f"{profile.reference_model} {profile.reference_resolution}px {profile.reference_seconds * 1e3:.1f} ms\n"
                  f"wrote {out}; on the planning machine: edgetorch split plan --server {shlex.quote(str(out))} ...")
