"""End-to-end delay over simulated links (BottleFit Figs. 9, 11, 12 style), with measured compute.

Head, tail and full-model times are MEASURED on this CPU (batch 1, fastest of 5 interleaved rounds after a warm-up) for
torchvision resnet18 split at SP2 at the image size of the training benchmark
(``split_training.json``, whose accuracies the device tables show; 96 px when it is absent),
C in {1, 2, 3, 6, 9, 12}; payload bytes are the true 8-bit payload sizes; offload bytes are the
mean PNG/JPEG (quality 90) sizes of 64 real Fashion-MNIST test images at that size. Links are models
(see edgetorch.split.links): WiFi and LTE goodputs are assumptions spanning good to poor
channels, LoRa is SF 6 / CR 4/5 as in the paper at its three bandwidths.

Table 1 puts device and server on this CPU (so the options differ only by what crosses the
network and by the encoder/decoder). Tables 2-3 scale device compute by the Jetson Nano and
Raspberry Pi 4 profiles (assumed speed and power, see edgetorch.split.power) and add device energy;
their server is the planner's default edge server (``quadro-p600``, an assumption stated there).

Run: ``.venv/bin/python bench/split_delay.py``
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from _common import RESULTS_DIR, table, write_results
from edgetorch.measure.plots import new_figure, save_figure
from edgetorch.split.links import parse_link
from edgetorch.split.plan import (HostTimes, compare_deployments, image_file_bytes, load_accuracy, measure_host_times,
                                  plan_record)
from edgetorch.split.power import DEFAULT_SERVER, PROFILES, SERVERS, DeviceProfile

ARCH, DEFAULT_RESOLUTION, CHANNELS = "torchvision:resnet18", 96, [1, 2, 3, 6, 9, 12]
LINKS = ["wifi:50", "wifi:20", "wifi:5", "wifi:1", "lte:20", "lte:5", "lte:1",
         "lora:sf=6,bw=500", "lora:sf=6,bw=250", "lora:sf=6,bw=125"]
ACCURACY = RESULTS_DIR / "split_training.json"  # the training benchmark's results, when they hold accuracies


def as_measured(profile: DeviceProfile, times: HostTimes) -> DeviceProfile:
    """A profile whose device is this host itself (speed ratio 1) with the given power numbers."""
    return DeviceProfile("this CPU", profile.reference_model, profile.reference_resolution,
                         times.reference_s, profile.compute_watts, profile.transmit_watts,
                         profile.idle_watts, "device = this CPU, as measured")


def main() -> None:
    jetson, pi = PROFILES["jetson-nano"], PROFILES["raspberry-pi-4-lora"]
    try:
        accuracy = load_accuracy(ACCURACY)
        # Time the model the accuracies belong to: the training benchmark's image size.
        resolution = int(json.loads(ACCURACY.read_text())["scale"]["size"])
    except (ValueError, KeyError):  # absent, or without {teacher, split} accuracies
        accuracy, resolution = None, DEFAULT_RESOLUTION
    times = measure_host_times(ARCH, CHANNELS, resolution, jetson)
    files = image_file_bytes(resolution)
    links = [parse_link(s) for s in LINKS]

    here = SERVERS["this-machine"]  # Table 1: device and server are both this CPU
    measured = {link.name: compare_deployments(times, files, link, as_measured(jetson, times), accuracy, server=here)
                for link in links}
    options = [r.option for r in next(iter(measured.values()))]
    rows = []
    for i, option in enumerate(options):
        first = measured[links[0].name][i]
        rows.append([option, f"{first.sent_bytes:,}", f"{first.head_s * 1e3:.1f}", f"{first.tail_s * 1e3:.1f}"]
                    + [f"{measured[link.name][i].e2e_s * 1e3:,.0f}" for link in links])
    table1 = table(["option", "bytes sent", "D_H ms", "D_T ms"] + [link.name for link in links], rows)

    device_tables, records = [], {}
    for profile, profile_links in ((jetson, links[:7]), (pi, links[7:])):
        lines = []
        for link in profile_links:
            result = compare_deployments(times, files, link, profile, accuracy)
            record = records[f"{profile.name} | {link.name}"] = plan_record(result, link, profile, times, accuracy)
            # The usual options, and whichever option wins on delay or energy (often a small C).
            shown = {"local", "offload jpeg", "split C=3", "split C=12", record["best_delay"], record["best_energy"]}
            for r in record["rows"]:
                if r["option"] in shown:
                    lines.append([link.name, r["option"], f"{r['e2e_s'] * 1e3:,.0f}",
                                  f"{r['energy_j'] * 1e3:,.0f}", f"{r['power_w']:.2f}",
                                  "-" if r["accuracy"] is None else f"{100 * r['accuracy']:.2f}",
                                  "yes" if record["best_delay"] == r["option"] else "",
                                  "yes" if record["best_energy"] == r["option"] else ""])
        device_tables.append(
            f"### {profile.name} (speed ratio {profile.reference_seconds / times.reference_s:.3g} x this CPU; "
            f"{profile.source})\n\n"
            + table(["link", "option", "D_e2e ms", "energy mJ", "mean power W", "accuracy %", "best delay",
                     "best energy"], lines))

    plot_path = RESULTS_DIR / "split_delay.png"
    fig, ax = new_figure((10, 4.5))
    for i, option in enumerate(options):
        ax.plot(range(len(links)), [measured[link.name][i].e2e_s for link in links], marker="o", label=option)
    ax.set_xticks(range(len(links)), [link.name.replace(" Mbit/s", "") for link in links], rotation=30, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("end-to-end delay, s (log)")
    ax.set_title(f"{ARCH} {resolution}px, compute measured on this CPU (device = server)")
    ax.legend(fontsize=8, ncol=2)
    save_figure(fig, plot_path)

    acc_note = (f"Accuracies from `{ACCURACY.name}`." if accuracy else
                f"`{ACCURACY.name}` held no accuracies when this ran: this benchmark reports delay and energy only.")
    body = (
        f"Compute measured here: full model {times.full_s * 1e3:.1f} ms; per C head/tail in the table; "
        f"the profiles' reference model (resnet152, 224 px) {times.reference_s * 1e3:.0f} ms. Offload sends "
        f"PNG {files['png']:,.0f} B or JPEG {files['jpeg']:,.0f} B (mean of 64 real Fashion-MNIST test images "
        f"at {resolution} px, gray). {acc_note}\n\n"
        "## End-to-end delay D_e2e = D_H + D_N + D_T in ms, device = server = this CPU\n\n"
        + table1 + "\n\n![delay per link](split_delay.png)\n\n"
        "## With device profiles (assumptions) and device energy\n\n"
        f"Server: the planner's default `{DEFAULT_SERVER}` profile ({SERVERS[DEFAULT_SERVER].source}).\n\n"
        + "\n\n".join(device_tables)
    )
    write_results("split_delay", "Split computing: end-to-end delay over simulated links", body,
                  {"arch": ARCH, "resolution": resolution, "channels": CHANNELS,
                   "host_times": asdict(times),
                   "file_bytes": files, "accuracy_source": accuracy.source if accuracy else None,
                   "measured": {name: [asdict(r) for r in rows_] for name, rows_ in measured.items()},
                   "device_plans": records})
    print(f"wrote {Path(plot_path)}")


if __name__ == "__main__":
    main()
