"""Entropy-coded split payloads against today's 8-bit ones and against sending the image (issue 27).

What it measures. A resnet18 teacher trained on Fashion-MNIST (cached, as ``bench/split_training.py``
trains it) and, at SP2 for each C, on the same test images:

* today's student (``edgetorch split train``'s recipe: GHND, then FT with the encoder frozen): its
  8-bit payload (exact size, accuracy) and the same codes entropy-coded (payload version 2, no
  retraining: the decoded tensor is checked bit for bit against the 8-bit one's);
* rate-trained students (``split train --rate-weight W``: GHND, then FT of the whole student through
  fixed per-channel steps with W times the estimated bits per image in the loss; payload version 3)
  at several weights: the real payload of each test image encoded alone (mean, median, p90,
  largest) and the accuracy through those payloads;
* encoding plus decoding one image's payload on one CPU thread (the head's output given): the
  median over images of the fastest of ``TIME_ROUNDS`` rounds;
* full offload: the teacher on the test images sent as PNG, JPEG and WebP files at several qualities.

Bytes are always real payloads or files, never an entropy estimate. It writes the rate-accuracy
plot beside the tables.

Scales. Default: a shared 2-core CPU: 64 px (the SP2 bottleneck is C x 8 x 8), the first 5,000
training and 2,000 test images, a 3-epoch teacher and 1 epoch per stage (about 40 minutes; stages
are cached and resume). The issue's Fashion-MNIST setup (as ``bench/split_training.py`` ran it on a
GPU): ``--size 96 --train 60000 --test 10000 --teacher-epochs 10 --epochs 3 --batch 128 --device cuda
--name split_coded_96px``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import time
from pathlib import Path

import numpy as np
import torch
from _common import RESULTS_DIR, log, table, write_results
from split_training import Scale, teacher_config  # the same teacher (one cache entry) at the same scale

from edgetorch.data import cache_dir
from edgetorch.measure.plots import new_figure, save_figure
from edgetorch.split import file_offload, load_rgb, train_teacher
from edgetorch.split.bottlefit import BottleFitConfig
from edgetorch.split.bottleneck import split
from edgetorch.split.payload import decode, encode, payload_size, read_header
from edgetorch.split.recipe import RecipeConfig, train_student
from edgetorch.split.teacher import teacher_paths

DATASET = "fashion-mnist"
IMAGE_QUALITIES = (1, 5, 10, 25, 50, 90)  # JPEG and WebP: the curve down to where accuracy falls
RATE_WEIGHTS = (0.0, 1e-4, 3e-4)
CODE_LEVELS = 16
TIME_IMAGES = 200
TIME_ROUNDS = 3
EVAL_BATCH = 250


def _codec_seconds(head: torch.nn.Module, images: torch.Tensor, tables) -> tuple[float, float]:
    """Median over images of the fastest encode and decode of one image's coded payload."""
    with torch.inference_mode():
        bottlenecks = head(images[:TIME_IMAGES]).split(1)
    encode_s, decode_s = [], []
    for z in bottlenecks:
        blob = encode(z, tables=tables)
        best_e = best_d = float("inf")
        for _ in range(TIME_ROUNDS):
            start = time.perf_counter()
            encode(z, tables=tables)
            middle = time.perf_counter()
            decode(blob, tables=tables)
            best_e, best_d = min(best_e, middle - start), min(best_d, time.perf_counter() - middle)
        encode_s.append(best_e)
        decode_s.append(best_d)
    return float(np.median(encode_s)), float(np.median(decode_s))


def _student(config: RecipeConfig, out, test, threads: int, device: str) -> dict:
    """Train (or load from the cache) one student and measure its payloads on ``test``."""
    run = train_student(config, out, device=device, progress=False, log=log)
    student = run.evaluation.student
    head, _ = split(run.model.eval().cpu())
    tables = run.code_tables
    with torch.inference_mode():
        # which version each test image's payload went as (encode sends the 8-bit one where it is smaller)
        versions = [read_header(encode(one, tables=tables), tables).version
                    for batch in test.tensors[0].split(EVAL_BATCH) for one in head(batch).split(1)]
        if tables.steps is None:  # version 2: the coded path gives the 8-bit path's tensor, bit for bit
            z = head(test.tensors[0][:EVAL_BATCH])
            assert torch.equal(decode(encode(z, tables=tables), tables=tables), decode(encode(z)))
    torch.set_num_threads(1)
    encode_s, decode_s = _codec_seconds(head, test.tensors[0], tables)
    torch.set_num_threads(threads)
    coded = student.coded_payload_bytes
    rated = config.bottlefit.rate_weight is not None
    row = {"channels": config.bottlefit.channels, "rate_weight": config.bottlefit.rate_weight,
           "code_levels": config.bottlefit.code_levels if rated else None,
           "bottleneck_shape": list(student.bottleneck_shape), "float_accuracy": student.float_accuracy,
           "accuracy_8bit": student.quantized_accuracy, "coded_accuracy": student.coded_accuracy,
           "payload_bytes_8bit": student.payload_bytes,
           "header_bytes_8bit": payload_size((1, *student.bottleneck_shape)) - int(np.prod(student.bottleneck_shape)),
           "coded_mean": coded.mean, "coded_median": coded.median, "coded_p90": coded.p90, "coded_largest": coded.largest,
           "sent_8bit_share": versions.count(1) / len(versions), "coded_over_8bit": coded.mean / student.payload_bytes,
           "encode_ms": 1e3 * encode_s, "decode_ms": 1e3 * decode_s,
           "train_seconds": sum(stage.seconds for stage in run.stages)}
    log(f"C={row['channels']} rate {row['rate_weight']}: coded mean {coded.mean:.1f} B ({row['coded_over_8bit']:.2f}x of "
        f"{student.payload_bytes} B), accuracy coded {100 * student.coded_accuracy:.2f}% / 8-bit "
        f"{100 * student.quantized_accuracy:.2f}%, encode {1e3 * encode_s:.3f} ms, decode {1e3 * decode_s:.3f} ms")
    return row


def _file_bytes_at(files: dict, accuracy: float) -> tuple[str, float] | None:
    """The smallest image file (format and quality) whose teacher accuracy is at least ``accuracy``."""
    fits = [(f.mean_bytes, name) for name, f in files.items() if f.accuracy >= accuracy]
    return None if not fits else min(fits)[::-1]


def _plot(rows: list[dict], files: dict, path) -> None:
    fig, ax = new_figure((7.5, 4.8))
    for c in sorted({r["channels"] for r in rows}):
        base = next(r for r in rows if r["channels"] == c and r["rate_weight"] is None)
        rated = sorted((r for r in rows if r["channels"] == c and r["rate_weight"] is not None), key=lambda r: r["coded_mean"])
        line, = ax.plot([r["coded_mean"] for r in rated], [100 * r["coded_accuracy"] for r in rated], "o-",
                        label=f"C={c} rate-trained, coded (v3)")
        ax.plot([base["payload_bytes_8bit"]], [100 * base["accuracy_8bit"]], "s", color=line.get_color(),
                label=f"C={c} today: 8-bit")
        ax.plot([base["coded_mean"]], [100 * base["accuracy_8bit"]], "D", color=line.get_color(), fillstyle="none",
                label=f"C={c} today's codes, coded (v2)")
    for kind, marker in (("jpeg", "^--"), ("webp", "v--")):
        points = sorted((f.mean_bytes, 100 * f.accuracy) for name, f in files.items() if name.startswith(kind))
        ax.plot(*zip(*points), marker, color="gray" if kind == "jpeg" else "black", label=f"teacher on {kind.upper()} files")
    ax.plot([files["png"].mean_bytes], [100 * files["png"].accuracy], "*", color="black", label="teacher on PNG files")
    ax.set_xscale("log")
    ax.set_xlabel("bytes per image (real payloads and files, mean over test images)")
    ax.set_ylabel("test accuracy %")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    save_figure(fig, path, "Rate-accuracy: split payloads against image files (Fashion-MNIST)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--channels", type=int, nargs="+", default=[3, 12])
    parser.add_argument("--rate-weights", type=float, nargs="+", default=list(RATE_WEIGHTS))
    parser.add_argument("--code-levels", type=int, default=CODE_LEVELS, help="split train --code-levels of the rate-trained")
    parser.add_argument("--train", type=int, default=5_000)
    parser.add_argument("--test", type=int, default=2_000)
    parser.add_argument("--teacher-epochs", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=1, help="per BottleFit stage")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--name", default="split_coded", help="results file stem under docs/results")
    parser.add_argument("--from-log", nargs=2, metavar=("LOG", "OFFLOAD"),
                        help="write the results from this script's own output (LOG) and a file_offload run's output "
                             "(OFFLOAD: lines 'TEACHER acc' and 'OFFLOAD {json}') instead of measuring: for a run cut "
                             "by a device's time limit before it wrote them")
    args = parser.parse_args()
    if args.from_log:
        _check_log_scale(args, args.from_log[0])
        rows, files, teacher_accuracy = _read_logs(*args.from_log)
        note = (f"Assembled with `--from-log` from the output of this script on the device (`{args.from_log[0]}`), whose "
                "run was cut by the device's time limit while it scored the image files, and from `file_offload` "
                f"run on the same machine, with the same cached teacher and test images (`{args.from_log[1]}`). "
                "The log gives each student's mean coded bytes, accuracies and codec times; medians, p90s and "
                "the share sent 8-bit were not logged (shown as -).\n\n")
        _report(args, rows, files, teacher_accuracy, note, machine=_logged_machine(args.from_log[0]))
        return
    torch.set_num_threads(args.threads)
    tconfig = teacher_config(Scale(size=args.size, train=args.train, teacher_epochs=args.teacher_epochs, batch=args.batch))
    log(f"teacher {teacher_paths(tconfig)[0].name} (trained now unless cached)")
    teacher, tmeta = train_teacher(tconfig, progress=False, device=args.device)
    test = load_rgb(DATASET, "test", args.size, args.test)
    # the cache key: the scale alone (device, name and rate weights do not change what a stage trains)
    scale = json.dumps({k: v for k, v in vars(args).items() if k not in ("device", "name", "rate_weights", "code_levels")},
                       sort_keys=True)
    root = cache_dir() / "split" / f"bench-split_coded-{hashlib.sha256(scale.encode()).hexdigest()[:10]}"
    rows = []
    for c in args.channels:
        for weight in (None, *args.rate_weights):
            what = "GHND -> FT (FE)" if weight is None else f"GHND -> FT + rate {weight:g}"
            log(f"C={c}: {what} (trained now unless cached)")
            bottlefit = BottleFitConfig(channels=c, split_point="sp2", stage2="ft", freeze_encoder=weight is None,
                                        epochs=args.epochs, batch_size=args.batch, seed=0, rate_weight=weight,
                                        code_levels=args.code_levels)
            config = RecipeConfig(teacher="torchvision:resnet18", data=DATASET, teacher_weights=str(teacher_paths(tconfig)[0]),
                                  size=args.size, train_limit=args.train, val_limit=args.test, bottlefit=bottlefit)
            rows.append(_student(config, root / f"C{c}", test, args.threads, args.device))
    files = file_offload(teacher, test, "gray", jpeg_qualities=IMAGE_QUALITIES, webp_qualities=IMAGE_QUALITIES,
                         batch_size=EVAL_BATCH)
    _report(args, rows, files, tmeta["test_accuracy"], "")


_ROW_LINE = re.compile(r"C=(\d+) rate (None|[\d.e+-]+): coded mean ([\d.]+) B \([\d.]+x of (\d+) B\), accuracy coded "
                       r"([\d.]+)% / 8-bit ([\d.]+)%, encode ([\d.]+) ms, decode ([\d.]+) ms")


def _read_logs(log_path: str, offload_path: str) -> tuple[list[dict], dict, float]:
    """Rows, image files and the teacher's accuracy from this script's log and a file_offload run's output."""
    from edgetorch.split.evaluate import OffloadScore

    text = Path(log_path).read_text()
    rows = []
    for match in _ROW_LINE.finditer(text):
        c, weight, mean, eight, coded, quantized, enc, dec = match.groups()
        rows.append({"channels": int(c), "rate_weight": None if weight == "None" else float(weight),
                     "coded_mean": float(mean), "payload_bytes_8bit": int(eight), "coded_accuracy": float(coded) / 100,
                     "accuracy_8bit": float(quantized) / 100, "coded_over_8bit": float(mean) / int(eight),
                     "encode_ms": float(enc), "decode_ms": float(dec), "coded_median": None, "coded_p90": None,
                     "coded_largest": None, "sent_8bit_share": None, "header_bytes_8bit": None})
    lines = dict(line.split(" ", 1) for line in Path(offload_path).read_text().splitlines() if " " in line)
    files = {name: OffloadScore(**score) for name, score in json.loads(lines["OFFLOAD"]).items()}
    return rows, files, float(lines["TEACHER"])


def _logged_machine(log_path: str) -> str:
    """The machine line a device log starts with (``# machine: ...``)."""
    first = Path(log_path).read_text().partition("\n")[0]
    if not first.startswith("# machine: "):
        raise SystemExit(f"{log_path} must start with '# machine: ...' (where it was measured)")
    return first.removeprefix("# machine: ").strip()


def _check_log_scale(args: argparse.Namespace, log_path: str) -> None:
    """Refuse a log whose teacher and data are not the scale the command line names."""
    text = Path(log_path).read_text()
    wanted = [f"fashion-mnist-{args.size}px-", f"data: {args.train:,} training and {args.test:,} validation images"]
    missing = [w for w in wanted if w not in text]
    if missing:
        raise SystemExit(f"{log_path} is not a run at the scale given ({', '.join(map(repr, missing))} not in it)")


def _report(args: argparse.Namespace, rows: list[dict], files: dict, teacher_accuracy: float, note: str,
            machine: str | None = None) -> None:
    """Targets, tables, the plot and the results files."""
    targets = {}
    for c in sorted({r["channels"] for r in rows}):
        base = next(r for r in rows if r["channels"] == c and r["rate_weight"] is None)
        near = [r for r in rows if r["channels"] == c and r["rate_weight"] is not None
                and r["coded_accuracy"] >= base["accuracy_8bit"] - 0.003]
        best = min(near, key=lambda r: r["coded_mean"], default=None)
        below = [r for r in rows if r["channels"] == c and r["rate_weight"] is not None
                 and r["coded_mean"] < (_file_bytes_at(files, r["coded_accuracy"]) or ("none", float("inf")))[1]]
        targets[str(c)] = {
            "best_within_0.3_points": None if best is None else {"rate_weight": best["rate_weight"],
                                                                  "coded_over_8bit": best["coded_over_8bit"],
                                                                  "codec_ms": best["encode_ms"] + best["decode_ms"]},
            "coded_over_8bit_at_most_0.4": best is not None and best["coded_over_8bit"] <= 0.4,
            "codec_under_2ms": best is not None and best["encode_ms"] + best["decode_ms"] < 2.0,
            "below_image_files_at_equal_accuracy": [r["rate_weight"] for r in below]}

    body = note + (f"Fashion-MNIST at {args.size} px, the first {args.train:,} training and {args.test:,} test images; "
            f"resnet18 teacher ({args.teacher_epochs} epochs): {100 * teacher_accuracy:.2f}% on all "
            f"10,000 test images. Trained on {args.device}. Students at SP2, {args.epochs} epoch(s) per "
            f"stage, batch {args.batch}: \"today\" is `edgetorch split train`'s recipe (GHND, then FT with the encoder "
            "frozen; 8-bit payloads with a scale per image), \"rate W\" is `split train --rate-weight W` (GHND, then FT "
            f"of the whole student through fixed per-channel steps, {args.code_levels} codes over each channel's training range, "
            "W per estimated bit per image; payload version 3, "
            "16-byte header). Bytes are real payloads, each test image encoded alone (never an entropy estimate); "
            "accuracies are through those payloads. Today's codes entropy-coded (version 2) decode to the 8-bit "
            "tensor bit for bit, so they keep its accuracy. \"Sent 8-bit\": where the coded payload would be larger, "
            "`encode` sends the 8-bit one. Codec times: one CPU thread, the median over "
            f"{TIME_IMAGES} images of the fastest of {TIME_ROUNDS} rounds.\n\n")
    body += table(["C", "student", "accuracy %", "bytes mean", "median / p90 / largest", "of today's 8-bit",
                   "sent 8-bit", "encode ms", "decode ms"],
                  [row for r in rows for row in _table_rows(r)], right=range(2, 9))
    body += "\n\nFull offload, the teacher on the same test images sent as files:\n\n"
    body += table(["file", "mean B", "teacher accuracy %"],
                  [[name, f"{f.mean_bytes:,.0f}", f"{100 * f.accuracy:.2f}"] for name, f in files.items()], right=(1, 2))
    plot = RESULTS_DIR / f"{args.name}.png"
    _plot(rows, files, plot)
    body += f"\n\n![rate-accuracy]({plot.name})\n\nIssue 27's targets at this scale:\n\n"
    for c, t in targets.items():
        best = t["best_within_0.3_points"]
        body += (f"- C={c}: " + ("no rate-trained student within 0.3 points of today's 8-bit accuracy" if best is None else
                 f"the smallest within 0.3 points of today's 8-bit accuracy is rate {best['rate_weight']:g} at "
                 f"{best['coded_over_8bit']:.2f}x today's bytes (target 0.4x: {'met' if t['coded_over_8bit_at_most_0.4'] else 'missed'}); "
                 f"encode + decode {best['codec_ms']:.2f} ms (under 2 ms: {'met' if t['codec_under_2ms'] else 'missed'})")
                 + "; below the smallest image file at least as accurate: "
                 + (", ".join(f"rate {w:g}" for w in t["below_image_files_at_equal_accuracy"]) or "none") + ".\n")
    write_results(args.name, "Entropy-coded and rate-trained split payloads against 8-bit payloads and image files "
                  "(issue 27)", body,
                  {"scale": vars(args), "teacher_test_accuracy": teacher_accuracy, "rows": rows,
                   "offload": {name: {"mean_bytes": f.mean_bytes, "accuracy": f.accuracy} for name, f in files.items()},
                   "targets": targets}, "bench/split_coded.py", machine)


def _table_rows(r: dict) -> list[list[str]]:
    logged = r["coded_median"] is not None  # --from-log rows have means only
    spread = f"{r['coded_median']:.0f} / {r['coded_p90']:.0f} / {r['coded_largest']}" if logged else "-"
    sent = f"{100 * r['sent_8bit_share']:.1f}%" if logged else "-"
    codec = [sent, f"{r['encode_ms']:.3f}", f"{r['decode_ms']:.3f}"]
    if r["rate_weight"] is None:
        header = f" ({r['header_bytes_8bit']} header)" if logged else ""
        return [[r["channels"], "today, 8-bit", f"{100 * r['accuracy_8bit']:.2f}",
                 f"{r['payload_bytes_8bit']}{header}", "-", "1.00", "-", "-", "-"],
                [r["channels"], "today's codes, coded (v2)", f"{100 * r['accuracy_8bit']:.2f}", f"{r['coded_mean']:.1f}",
                 spread, f"{r['coded_over_8bit']:.2f}", *codec]]
    return [[r["channels"], f"rate {r['rate_weight']:g}, coded (v3)", f"{100 * r['coded_accuracy']:.2f}",
             f"{r['coded_mean']:.1f}", spread, f"{r['coded_over_8bit']:.2f}", *codec]]


if __name__ == "__main__":
    main()
