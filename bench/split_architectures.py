"""The paper's and the authors' released bottleneck designs side by side: size and compute, no training.

For resnet18, resnet50 and densenet121 teachers, and the authors' own resnet152 and densenet169
(the only teachers their released configurations cover), 10 classes, C = 12, SP1 and SP2, 224 px, and
both ``inject_bottleneck(..., architecture=)`` designs, it reports the encoder and decoder
parameters, the multiplications per image on the device (the head) and on the server (the tail,
and its decoder alone), the bottleneck shape and its 8-bit payload bytes
(``edgetorch.split.payload_size``). Multiplications are ``edgetorch.reduce.count_macs`` on a
1x3x224x224 input (convolutions and linear layers; normalisation and pooling are not
multiplications of weights). The models are built on the meta device: shapes only, so the whole
run takes seconds and needs no weights.

Run: ``.venv/bin/python bench/split_architectures.py``
"""

from __future__ import annotations

import torch
from torch import nn

from _common import table, write_results
from edgetorch.reduce import count_macs
from edgetorch.split import payload_size
from edgetorch.split.bottleneck import ARCHITECTURES, SPLIT_POINTS, BottleneckModel, inject_bottleneck
from edgetorch.zoo import build_model

TEACHERS = ("resnet18", "resnet50", "densenet121", "resnet152", "densenet169")
CHANNELS, RESOLUTION, CLASSES = 12, 224, 10


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def measure(student: BottleneckModel, teacher_macs: int) -> dict:
    """One student's row: parameters, multiplications per image, bottleneck and payload.

    Args:
        student: a bottleneck-injected model (on the meta device is enough).
        teacher_macs: the unsplit teacher's multiplications per image, for the ratio.

    Returns:
        A JSON-ready dict.
    """
    x = torch.empty(1, 3, RESOLUTION, RESOLUTION, device="meta")
    z = student.head(x)
    encoder, decoder = student.bottleneck_parts()
    head_macs, tail_macs = count_macs(student.head, x), count_macs(student.tail, z)
    return {"encoder_params": _params(encoder), "decoder_params": _params(decoder),
            "head_macs": head_macs, "tail_macs": tail_macs, "decoder_macs": count_macs(decoder, z),
            "student_over_teacher_macs": (head_macs + tail_macs) / teacher_macs,
            "bottleneck_shape": list(z.shape[1:]), "payload_bytes": payload_size(z.shape)}  # fmt: skip


def main() -> None:
    rows = []
    for name in TEACHERS:
        with torch.device("meta"):
            teacher = build_model(f"torchvision:{name}", num_classes=CLASSES)
        teacher_macs = count_macs(teacher, torch.empty(1, 3, RESOLUTION, RESOLUTION, device="meta"))
        for split_point in SPLIT_POINTS:
            for architecture in ARCHITECTURES:
                student = inject_bottleneck(teacher, CHANNELS, split_point, architecture=architecture)
                rows.append({"teacher": name, "teacher_macs": teacher_macs, "split_point": split_point,
                             "architecture": architecture, **measure(student, teacher_macs)})  # fmt: skip
    ratios = {}
    for r in rows:
        if r["architecture"] == "released":
            paper = next(p for p in rows if (p["teacher"], p["split_point"], p["architecture"]) ==
                         (r["teacher"], r["split_point"], "paper"))  # fmt: skip
            ratios[f"{r['teacher']} {r['split_point']}"] = {
                "decoder_params": r["decoder_params"] / paper["decoder_params"],
                "decoder_macs": r["decoder_macs"] / paper["decoder_macs"],
                "head_macs": r["head_macs"] / paper["head_macs"]}  # fmt: skip

    def m(v: int) -> str:
        return f"{v / 1e6:,.1f}"

    body = table(
        ["teacher", "split", "design", "encoder params", "decoder params", "head MMACs (device)",
         "tail MMACs (server)", "of which decoder", "student / teacher MACs", "bottleneck", "8-bit payload B"],
        [[r["teacher"], r["split_point"], r["architecture"], f"{r['encoder_params']:,}", f"{r['decoder_params']:,}",
          m(r["head_macs"]), m(r["tail_macs"]), m(r["decoder_macs"]), f"{r['student_over_teacher_macs']:.2f}",
          "x".join(map(str, r["bottleneck_shape"])), f"{r['payload_bytes']:,}"] for r in rows],
    )  # fmt: skip
    body += "\n\nReleased over paper, per teacher and split point:\n\n" + table(
        ["teacher, split", "decoder params", "decoder MACs", "head MACs"],
        [[k, f"{v['decoder_params']:.2f}x", f"{v['decoder_macs']:.2f}x", f"{v['head_macs']:.2f}x"]
         for k, v in ratios.items()],
    )  # fmt: skip
    body += (
        f"\n\nC = {CHANNELS}, {RESOLUTION} px, {CLASSES} classes, batch 1. MMACs: millions of multiplications per "
        "image (`edgetorch.reduce.count_macs`: convolutions and linear layers). Encoder params include the stem "
        "(a copy of the teacher's in the paper design, fresh layers in the released one). The payload is the "
        "8-bit bottleneck plus its header (`edgetorch.split.payload_size`). `paper` is edgetorch's default "
        "(`inject_bottleneck(..., architecture=\"paper\")`); `released` is the authors' code "
        "(docs/split_training.md says which facts come from which file)."
    )
    write_results("split_architectures", "Bottleneck designs: the paper's text vs the authors' released code",
                  body, {"channels": CHANNELS, "resolution": RESOLUTION, "num_classes": CLASSES, "rows": rows,
                         "released_over_paper": ratios})  # fmt: skip


if __name__ == "__main__":
    main()
