"""Delay/power planning: link models (LoRa airtime against published values), profiles, the plan."""

from __future__ import annotations

import importlib
import json
from dataclasses import replace

import numpy as np
import pytest

from edgetorch.split.links import LoRaLink, RateLink, TraceLink, parse_link
from edgetorch.split.payload import payload_size
from edgetorch.split.plan import (
    Accuracy,
    HostTimes,
    compare_deployments,
    image_file_bytes,
    load_accuracy,
    measure_host_times,
    measure_server,
    plan_record,
    server_times,
)
from edgetorch.split.power import (
    DEFAULT_SERVER,
    PROFILES,
    SERVERS,
    DeviceProfile,
    ServerProfile,
    load_profile,
    load_server,
    profile_json,
)


@pytest.mark.parametrize("sf, phy_bytes, ms", [
    # The Things Network airtime tables: a 10-byte application payload is 23 PHY bytes (13 of
    # LoRaWAN overhead), explicit header, CRC on, 8 preamble symbols, BW 125 kHz, CR 4/5.
    (7, 23, 61.696),
    (12, 23, 1482.752),  # SF12 at 125 kHz switches on the low data-rate optimisation
])
def test_lora_airtime_matches_published_values(sf, phy_bytes, ms):
    assert LoRaLink(spreading_factor=sf).airtime(phy_bytes) * 1e3 == pytest.approx(ms, abs=1e-6)


def test_lora_sf6_implicit_header_and_paper_rate():
    link = LoRaLink(spreading_factor=6, bandwidth_hz=500e3)
    assert link.nominal_bps == pytest.approx(37_500)  # the paper's "maximum data rate of 37.5 kbps"
    # SF6: implicit header (IH=1), symbol 128 us: 12.25 preamble + 8 + ceil((80-24+28+16-20)/24)*5 symbols.
    assert link.airtime(10) == pytest.approx((12.25 + 8 + 4 * 5) * 64 / 500e3)


def test_lora_paper_rate_model_next_to_time_on_air():
    rate = parse_link("lora:sf=6,bw=500,model=rate")
    airtime = parse_link("lora:sf=6,bw=500")
    assert rate.delays(1762, 4)[0] == pytest.approx((1762 + 4) * 8 / 37_500)  # the paper's bytes x 8 / rate
    assert rate.uplink(1762)[0] == pytest.approx(1762 * 8 / 37_500)
    assert airtime.delays(1762, 4)[0] > rate.delays(1762, 4)[0]  # headers, preambles, fragments
    assert "nominal-rate model" in rate.name and "nominal" not in airtime.name
    with pytest.raises(ValueError, match="airtime or rate"):
        parse_link("lora:model=fast")


def test_lora_fragments_and_duty_cycle():
    link = LoRaLink(max_payload=255)
    full, rest = link.airtime(255), link.airtime(90)
    assert link.fragments(600) == 3 and link.transfer_s(600) == pytest.approx(2 * full + rest)
    slow = replace(link, duty_cycle=0.01)
    assert slow.transfer_s(600) == pytest.approx(2 * full + rest + 2 * full * 99)
    assert slow.uplink(600)[0] == pytest.approx(2 * full + rest)  # radio on-air time only
    with pytest.raises(ValueError, match="0..255 bytes"):
        link.airtime(256)


def test_rate_and_trace_links(tmp_path):
    wifi = parse_link("wifi:8,rtt_ms=10")
    assert isinstance(wifi, RateLink)
    assert wifi.delays(996)[0] == pytest.approx(1000 * 8 / 8e6 + 0.01)
    assert parse_link("lte:10").rtt_s == 0.05
    trace = tmp_path / "lte.txt"
    trace.write_text("1\n2\n4\n")
    link = parse_link(f"trace:{trace},rtt_ms=0")
    assert isinstance(link, TraceLink)
    assert link.delays(124_996).tolist() == pytest.approx([1.0, 0.5, 0.25])
    assert isinstance(parse_link("lora:sf=7,bw=250,cr=2,duty=0.01"), LoRaLink)


@pytest.mark.parametrize("spec, match", [
    ("5g:100", "unknown link kind"),
    ("wifi:-1", "non-positive"),
    ("wifi:abc", "bad link spec"),
    ("wifi:10,foo=1", "unknown options"),
    ("lora:sf=5", "spreading factor"),
    ("lora:bw=200", "bandwidth"),
    ("lora:cr=9", "coding rate"),
    ("lora:sf", "key=value"),
    ("trace:/nonexistent/file", "bad link spec"),
])
def test_bad_link_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_link(spec)


def test_profiles_are_labelled_assumptions_and_replaceable(tmp_path):
    for profile in PROFILES.values():
        assert profile.source.startswith("ASSUMPTION")
    path = tmp_path / "mine.json"
    path.write_text(profile_json(replace(PROFILES["jetson-nano"], name="mine", idle_watts=0.5)))
    assert load_profile(str(path)).idle_watts == 0.5
    path.write_text(json.dumps({"name": "x"}))
    with pytest.raises(ValueError, match="exactly the keys .*accepted: jetson-nano, raspberry-pi-4, raspberry-pi-4-lora or a .json"):
        load_profile(str(path))
    with pytest.raises(ValueError, match="unknown device 'iphone'; accepted: jetson-nano"):
        load_profile("iphone")
    with pytest.raises(ValueError, match="compute_watts must be > 0"):
        replace(PROFILES["jetson-nano"], compute_watts=0)


TIMES = HostTimes("torchvision:resnet18", 96, full_s=0.2, head_s={3: 0.02, 12: 0.025},
                  tail_s={3: 0.19, 12: 0.19}, bottleneck_shapes={3: (3, 12, 12), 12: (12, 12, 12)},
                  reference_s=1.0)
DEVICE = DeviceProfile("dev", "torchvision:resnet18", 96, 2.0, compute_watts=5.0, transmit_watts=2.0,
                       idle_watts=1.0, source="ASSUMPTION: test")
SERVER = ServerProfile("fast", "torchvision:resnet18", 96, 0.5, "ASSUMPTION: test")  # twice this host's speed
FILES = {"png": 20_000.0, "jpeg": 8_000.0}


def test_plan_follows_the_delay_and_energy_model():
    link = RateLink("test", 1e6, 0.01)
    accuracy = Accuracy(0.9, 0.88, {3: 0.85}, "test.json")
    rows = {r.option: r for r in compare_deployments(TIMES, FILES, link, DEVICE, accuracy, server=SERVER)}
    assert list(rows) == ["local", "offload png", "offload jpeg", "split C=3", "split C=12"]
    local = rows["local"]
    assert (local.head_s, local.network_s, local.tail_s, local.sent_bytes) == (0.4, 0.0, 0.0, 0)
    assert local.energy_j == pytest.approx(5.0 * 0.4) and local.power_w == pytest.approx(5.0)
    split = rows["split C=3"]
    nbytes = payload_size((1, 3, 12, 12))
    assert split.sent_bytes == nbytes
    uplink, network = nbytes * 8 / 1e6, (nbytes + 4) * 8 / 1e6 + 0.01
    assert split.head_s == pytest.approx(0.04) and split.tail_s == pytest.approx(0.095)
    assert split.network_s == pytest.approx(network)
    assert split.e2e_s == pytest.approx(0.04 + network + 0.095)
    assert split.energy_j == pytest.approx(5.0 * 0.04 + 2.0 * uplink + 1.0 * (network - uplink + 0.095))
    assert (rows["offload png"].accuracy, rows["offload jpeg"].accuracy, split.accuracy) == (0.9, 0.88, 0.85)
    assert rows["split C=12"].accuracy is None
    record = plan_record(list(rows.values()), link, DEVICE, TIMES, accuracy, SERVER)
    assert record["best_delay"] == min(rows.values(), key=lambda r: r.e2e_s).option
    assert record["accuracy_source"] == "test.json" and record["device_slowdown_vs_host"] == 2.0
    assert record["server"]["source"] == "ASSUMPTION: test" and record["server_times_from"].startswith("this machine's times x 0.5")
    json.dumps(record)


def test_slow_links_favour_split_over_offload_and_trace_gives_a_tail():
    rows = {r.option: r for r in compare_deployments(TIMES, FILES, LoRaLink(bandwidth_hz=500e3), DEVICE, server=SERVER)}
    assert rows["split C=3"].e2e_s < rows["offload jpeg"].e2e_s < rows["offload png"].e2e_s
    trace = TraceLink("t", (1e5, 1e6, 1e7), 0.0)
    row = compare_deployments(TIMES, FILES, trace, DEVICE, server=SERVER)[1]
    assert row.network_p95_s > row.network_s
    assert row.network_s == pytest.approx(float(np.mean(trace.delays(20_000))))


def test_accuracy_file(tmp_path):
    path = tmp_path / "acc.json"
    path.write_text(json.dumps({"teacher": 0.91, "split": {"3": 0.8, "12": 0.9}}))
    accuracy = load_accuracy(path)
    assert (accuracy.teacher, accuracy.jpeg, accuracy.split, accuracy.source) == (0.91, None, {3: 0.8, 12: 0.9}, str(path))
    path.write_text(json.dumps({"teacher": 91}))
    with pytest.raises(ValueError, match="not an accuracy file"):
        load_accuracy(path)


def test_coded_payloads_are_a_row_of_their_own_sent_size_by_size():
    """Issue 27: the planner sends each real coded payload size over the link. On LoRa (a step
    function of the bytes: fragments) the mean delay of the sizes is not the delay of their mean."""
    times = replace(TIMES, coded_encode_s={3: 0.002})
    sizes = (60, 60, 60, 300)  # mostly small payloads, one large one
    accuracy = Accuracy(0.9, None, {3: 0.85}, "student.json", {3: sizes, 12: (900,)})
    lora = LoRaLink(bandwidth_hz=500e3)
    rows = {r.option: r for r in compare_deployments(times, FILES, lora, DEVICE, accuracy, server=SERVER)}
    assert list(rows) == ["local", "offload png", "offload jpeg", "split C=3", "split C=3 coded", "split C=12"]
    coded, plain = rows["split C=3 coded"], rows["split C=3"]
    assert coded.sent_bytes == 120 and coded.accuracy == plain.accuracy == 0.85  # the same codes
    assert coded.head_s == pytest.approx((0.02 + 0.002) * 2) and coded.tail_s == plain.tail_s
    each = [float(lora.delays(b).mean()) for b in sizes]
    assert coded.network_s == pytest.approx(np.mean(each)) and coded.network_s != pytest.approx(lora.delays(120).mean())
    assert coded.network_p95_s == pytest.approx(np.percentile(each, 95))
    assert coded.e2e_s < plain.e2e_s  # 120 bytes on average against 466
    # no coded timing (host times measured before it existed): no coded row, not a row without encoding
    assert "split C=3 coded" not in {r.option for r in compare_deployments(TIMES, FILES, lora, DEVICE, accuracy,
                                                                             server=SERVER)}
    # a rate-trained student's version-3 payloads have an accuracy of their own
    rated = replace(accuracy, coded={3: 0.83})
    rows = {r.option: r for r in compare_deployments(times, FILES, lora, DEVICE, rated, server=SERVER)}
    assert rows["split C=3 coded"].accuracy == 0.83 and rows["split C=3"].accuracy == 0.85


def test_accuracy_files_and_student_records_give_coded_sizes(tmp_path):
    path = tmp_path / "acc.json"
    path.write_text(json.dumps({"split": {"3": 0.8}, "coded_bytes": {"3": [70, 80]}}))
    assert load_accuracy(path).coded_bytes == {3: (70, 80)}
    for bad in ({"3": []}, {"3": [0]}, {"3": [2**32]}, {"3": "70"}, {"x": [70]}):
        path.write_text(json.dumps({"split": {"3": 0.8}, "coded_bytes": bad}))
        with pytest.raises(ValueError, match="not an accuracy file"):
            load_accuracy(path)
    record = {"format": "edgetorch-split-student", "evaluation": {
        "teacher_accuracy": 0.9, "offload": {}, "student": {
            "bottleneck_shape": [3, 12, 12], "quantized_accuracy": 0.85,
            "coded_payload_bytes": {"mean": 75.0, "median": 75.0, "p90": 79.0, "largest": 80, "sample": [70, 80]}}}}
    path.write_text(json.dumps(record))
    assert load_accuracy(path).coded_bytes == {3: (70, 80)} and load_accuracy(path).coded == {}
    record["evaluation"]["student"]["coded_accuracy"] = 0.83  # a rate-trained student's record
    path.write_text(json.dumps(record))
    assert load_accuracy(path).coded == {3: 0.83}
    path.write_text(json.dumps({"split": {"3": 0.8}, "coded": {"3": 1.5}}))
    with pytest.raises(ValueError, match="fractions in"):
        load_accuracy(path)
    del record["evaluation"]["student"]["coded_accuracy"]
    del record["evaluation"]["student"]["coded_payload_bytes"]  # a version-1 record
    path.write_text(json.dumps(record))
    assert load_accuracy(path).coded_bytes == {}


def test_image_file_bytes_from_real_images(tmp_path, bomb_png):
    sizes = image_file_bytes(32, count=4, dataset="digits")
    assert set(sizes) == {"png", "jpeg", "png_encode_s", "jpeg_encode_s"} and all(v > 0 for v in sizes.values())
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(3):  # the user's own colour photos, of another size
        (tmp_path / "a").mkdir(exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (50, 70, 3), dtype=np.uint8)).save(tmp_path / "a" / f"{i}.png")
    own = image_file_bytes(32, images_dir=tmp_path)
    assert own["png"] > sizes["png"]  # three channels of noise compress worse than gray digits
    (tmp_path / "a" / "bad.png").write_bytes(b"no")
    with pytest.raises(ValueError, match="not a readable image"):
        image_file_bytes(32, images_dir=tmp_path)
    (tmp_path / "a" / "bad.png").unlink()
    bomb_png(tmp_path / "a" / "bomb.png")
    with pytest.raises(ValueError, match="bomb.png: not a readable image .*decompression bomb"):
        image_file_bytes(32, images_dir=tmp_path)
    with pytest.raises(ValueError, match="0.png is not a folder; a folder of .* images is expected"):
        image_file_bytes(32, images_dir=tmp_path / "a" / "0.png")


def test_the_device_pays_for_encoding_what_it_sends():
    times = replace(TIMES, payload_encode_s={3: 0.001, 12: 0.002})
    files = {**FILES, "png_encode_s": 0.003, "jpeg_encode_s": 0.004}
    link = RateLink("test", 1e6, 0.01)
    rows = {r.option: r for r in compare_deployments(times, files, link, DEVICE, server=SERVER)}
    assert rows["split C=3"].head_s == pytest.approx((0.02 + 0.001) * 2)  # device = 2x this host
    assert rows["offload png"].head_s == pytest.approx(0.003 * 2)
    assert rows["offload jpeg"].head_s == pytest.approx(0.004 * 2)
    assert rows["offload jpeg"].energy_j > compare_deployments(TIMES, FILES, link, DEVICE, server=SERVER)[2].energy_j


def _cli():
    """``edgetorch split ...`` in-process: ``_cli()("split", "plan", ...)``."""
    from typer.testing import CliRunner

    from edgetorch.cli import app

    importlib.import_module("edgetorch.cli.split")  # registers `edgetorch split`
    return lambda *args: CliRunner().invoke(app, list(args))


def _flat(output: str) -> str:
    return " ".join(output.replace("│", " ").split())  # rich wraps error panels


def test_cli_plan_prints_every_option_and_writes_json(tmp_path):
    run = _cli()
    device = tmp_path / "board.json"  # a cheap reference model keeps the test fast
    device.write_text(profile_json(DeviceProfile("board", "torchvision:resnet18", 32, 0.5, 3.0, 1.5, 1.0, "ASSUMPTION: test")))
    accuracy = tmp_path / "acc.json"
    accuracy.write_text(json.dumps({"teacher": 0.9, "split": {"3": 0.87}}))
    out = tmp_path / "plan.json"
    result = run("split", "plan", "--link", "wifi:5", "--link", "lora:sf=6,bw=500", "--device", str(device),
                 "--server", "this-machine", "--size", "32", "--channels", "3", "--channels", "12",
                 "--accuracy", str(accuracy), "--json", str(out))
    assert result.exit_code == 0, result.output
    for option in ("local", "offload png", "offload jpeg", "split C=3", "split C=12"):
        assert option in result.output
    assert f"accuracy: {accuracy}" in result.output.replace("\n", "")
    records = json.loads(out.read_text())
    assert [r["link"] for r in records] == ["wifi 5 Mbit/s", "LoRa SF6 BW500 CR4/5"]
    split3 = next(r for r in records[0]["rows"] if r["option"] == "split C=3")
    assert split3["sent_bytes"] == payload_size((1, 3, 4, 4)) and split3["accuracy"] == 0.87
    assert records[0]["server"]["name"] == "this-machine"
    assert records[0]["server_times_from"] == "this machine's times, unscaled"
    bad = run("split", "plan", "--link", "carrier-pigeon:1")
    assert bad.exit_code != 0 and "unknown link kind" in bad.output
    (tmp_path / "empty").mkdir()
    no_images = run("split", "plan", "--link", "wifi:5", "--device", str(device), "--server", "this-machine",
                    "--size", "32", "--channels", "3", "--images", str(tmp_path / "empty"))
    assert no_images.exit_code == 2 and "images found" in _flat(no_images.output)


def test_cli_plan_reads_nothing_from_the_current_directory_and_leaves_the_rng_alone(tmp_path, monkeypatch):
    """No --accuracy: no accuracy, and a message that says what to pass, wherever the command runs
    (it once read docs/results/split_training.json from there); its seeded timing models leave
    the caller's random stream where it was."""
    import torch

    results = tmp_path / "docs" / "results"
    results.mkdir(parents=True)
    (results / "split_training.json").write_text(json.dumps({"teacher": 0.9, "jpeg": 0.85, "split": {"3": 0.87}}))
    device = tmp_path / "board.json"
    device.write_text(profile_json(DeviceProfile("board", "torchvision:resnet18", 32, 0.5, 3.0, 1.5, 1.0, "ASSUMPTION: test")))
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    result = _cli()("split", "plan", "--link", "wifi:5", "--device", str(device), "--server", "this-machine",
                    "--size", "32", "--channels", "3", "--json", "plan.json")
    assert result.exit_code == 0, result.output
    assert torch.equal(torch.rand(4), expected)
    assert "accuracy: none given: pass --accuracy FILE" in _flat(result.output)
    assert all(row["accuracy"] is None for row in json.loads((tmp_path / "plan.json").read_text())[0]["rows"])


def test_accuracy_file_without_accuracies_is_refused(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"benchmark": "split_training", "runs": []}))
    with pytest.raises(ValueError, match="neither a 'teacher' nor a 'split'"):
        load_accuracy(path)


def test_time_modules_takes_the_fastest_interleaved_round():
    import torch

    from edgetorch.split.plan import time_modules

    seen = []

    class Recorder(torch.nn.Module):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def forward(self, x):
            seen.append(self.name)
            return x

    seconds = time_modules({"a": (Recorder("a"), torch.zeros(1)), "b": (Recorder("b"), torch.zeros(1))}, rounds=3)
    assert seen == ["a", "b"] * 4  # one warm-up each, then round-robin
    # Seconds per call, not nanoseconds (a microsecond call would read >= 1000): the bound is far
    # above the fastest of 3 rounds of an identity call even on a busy machine.
    assert set(seconds) == {"a", "b"} and all(0 <= s < 60 for s in seconds.values())


def test_server_profiles_built_in_and_json(tmp_path):
    p600 = load_server("quadro-p600")
    assert p600.source.startswith("ASSUMPTION") and "P600" in p600.source
    # The Jetson Nano's ResNet-152 time over the GPUs' peak FP32 ratio (cores x clock, paper Sec. V-A).
    assert p600.reference_seconds == pytest.approx(0.53 * (128 * 0.95) / (384 * 1.45)) == pytest.approx(0.1157, abs=1e-4)
    assert load_server("this-machine").reference_seconds is None
    path = tmp_path / "mine.json"
    path.write_text(profile_json(replace(p600, name="mine", reference_seconds=0.05)))
    assert load_server(str(path)) == replace(p600, name="mine", reference_seconds=0.05)
    with pytest.raises(ValueError, match="unknown server 'gpu'; accepted: quadro-p600, this-machine or a .json file"):
        load_server("gpu")
    with pytest.raises(ValueError, match="not a valid server profile .*is missing"):
        load_server(str(tmp_path / "missing.json"))


@pytest.mark.parametrize("content, match", [
    ("{not json", "Expecting property name"),
    ("[1, 2]", "exactly the keys"),
    ('{"name": "x", "source": "y"}', r"the keys \['name', 'reference_model', .*optionally \['measured'\]"),
    ('{"name": "x", "reference_model": "torchvision:resnet152", "reference_resolution": 224, '
     '"reference_seconds": 0.1, "source": "y", "speedup": 2}', "exactly the keys"),
    ('{"name": "x", "reference_model": "torchvision:resnet152", "reference_resolution": null, '
     '"reference_seconds": 0.1, "source": "y"}', "together, or none of them"),
    ('{"name": "x", "reference_model": "torchvision:resnet152", "reference_resolution": 224, '
     '"reference_seconds": -1, "source": "y"}', "reference_seconds must be > 0"),
    ('{"name": "x", "reference_model": null, "reference_resolution": null, "reference_seconds": null, '
     '"source": "y", "measured": {"arch": "torchvision:resnet18"}}',
     r"measured must be null or an object with exactly the keys \['arch', 'resolution', 'split_point', 'full_s', 'tail_s'\]"),
    ('{"name": "x", "reference_model": null, "reference_resolution": null, "reference_seconds": null, '
     '"source": "y", "measured": {"arch": "a", "resolution": 32, "split_point": "sp2", "full_s": 0.1, "tail_s": {}}}',
     "tail_s {C: seconds > 0}"),
    ('{"name": "x", "reference_model": null, "reference_resolution": null, "reference_seconds": null, '
     '"source": "y", "measured": 3}', "measured must be null or"),
])
def test_malformed_server_json_is_a_clear_error(tmp_path, content, match):
    path = tmp_path / "server.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=f"server.json: not a valid server profile .*{match}.*; accepted: quadro-p600, "
                                         "this-machine or a .json file"):
        load_server(str(path))


def test_measured_server_round_trip_and_use(tmp_path):
    measured = measure_server("torchvision:resnet18", [3, 12], 32, rounds=1, name="box")
    assert measured.name == "box" and measured.source.startswith("MEASURED on ")
    assert measured.reference_model == "torchvision:resnet152" and measured.reference_seconds > 0
    assert (measured.measured.arch, measured.measured.resolution, measured.measured.split_point) == (
        "torchvision:resnet18", 32, "sp2")
    path = tmp_path / "server.json"
    path.write_text(profile_json(measured))
    loaded = load_server(str(path))
    assert loaded == measured and set(loaded.measured.tail_s) == {3, 12}  # JSON's "3" is C = 3 again
    times = replace(TIMES, arch="torchvision:resnet18", resolution=32, head_s={3: 0.02}, tail_s={3: 0.19})
    device = replace(DEVICE, reference_model=loaded.reference_model, reference_resolution=loaded.reference_resolution)
    used = server_times(times, device, loaded)
    assert used.basis == "measured on the server"
    assert (used.full_s, used.tail_s) == (loaded.measured.full_s, {3: loaded.measured.tail_s[3]})
    other = server_times(replace(times, tail_s={6: 0.19}), device, loaded)  # C = 6 was not measured: scaled
    assert other.tail_s == {6: pytest.approx(0.19 * loaded.reference_seconds / times.reference_s)}
    assert "its measured times are of torchvision:resnet18 32 px sp2 C=3,12, not of this plan" in other.basis


def test_the_server_reference_is_timed_when_it_is_not_the_devices():
    device = replace(DEVICE, reference_model="torchvision:resnet18", reference_resolution=32)
    server = replace(SERVER, reference_resolution=64)
    times = measure_host_times("torchvision:resnet18", [3], 32, device, rounds=1, server=server)
    assert times.split_point == "sp2" and times.server_reference_s > 0
    assert server_times(times, device, server).full_s == pytest.approx(times.full_s * 0.5 / times.server_reference_s)
    same = measure_host_times("torchvision:resnet18", [3], 32, device, rounds=1, server=replace(server, reference_resolution=32))
    assert same.server_reference_s is None  # one timing of the shared reference serves both
    with pytest.raises(ValueError, match="which was not timed here: pass server= to measure_host_times"):
        server_times(same, device, server)


# A host twice as slow as the Jetson Nano running the paper's ResNet-152 at 224 px (the reference
# model itself: local = 0.53 s), SP2 heads a tenth of the model; the Jetson on the paper's WiFi.
PAPER_TIMES = HostTimes("torchvision:resnet152", 224, full_s=1.06, head_s={3: 0.1, 12: 0.1},
                        tail_s={3: 0.96, 12: 0.96}, bottleneck_shapes={3: (3, 28, 28), 12: (12, 28, 28)},
                        reference_s=1.06)
PAPER_FILES = {"png": 100_000.0, "jpeg": 15_000.0}


def test_default_server_is_an_edge_gpu_not_this_machine():
    import inspect

    from edgetorch.cli.split import plan

    assert DEFAULT_SERVER == "quadro-p600" != "this-machine"
    assert inspect.signature(compare_deployments).parameters["server"].default == SERVERS[DEFAULT_SERVER]
    assert inspect.signature(plan_record).parameters["server"].default == SERVERS[DEFAULT_SERVER]
    assert inspect.signature(plan).parameters["server"].default.default == DEFAULT_SERVER
    jetson = PROFILES["jetson-nano"]
    for mbps in (50, 20, 5, 1):  # BottleFit Fig. 9: offload or split wins, never local
        wifi = parse_link(f"wifi:{mbps}")
        rows = {r.option: r for r in compare_deployments(PAPER_TIMES, PAPER_FILES, wifi, jetson)}
        assert rows["local"].e2e_s == pytest.approx(0.53)
        assert plan_record(list(rows.values()), wifi, jetson, PAPER_TIMES, None)["best_delay"] != "local"
        # The finding: a server as slow as this host makes local win.
        slow = compare_deployments(PAPER_TIMES, PAPER_FILES, wifi, jetson, server=SERVERS["this-machine"])
        assert min(slow, key=lambda r: r.e2e_s).option == "local"


def test_cli_measure_server_then_plan_with_it(tmp_path):
    run = _cli()
    server = tmp_path / "server.json"
    result = run("split", "measure-server", "--out", str(server), "--size", "32", "--channels", "3",
                 "--name", "edge-box")
    assert result.exit_code == 0, result.output
    assert load_server(str(server)).measured.tail_s.keys() == {3}
    device = tmp_path / "board.json"
    device.write_text(profile_json(DeviceProfile("board", "torchvision:resnet18", 32, 0.5, 3.0, 1.5, 1.0, "ASSUMPTION: test")))
    out = tmp_path / "plan.json"
    result = run("split", "plan", "--link", "wifi:5", "--device", str(device), "--server", str(server),
                 "--size", "32", "--channels", "3", "--json", str(out))
    assert result.exit_code == 0, result.output
    assert "server: edge-box (MEASURED on" in _flat(result.output)
    record = json.loads(out.read_text())[0]
    assert record["server"]["name"] == "edge-box" and record["server_times_from"] == "measured on the server"
    split3 = next(r for r in record["rows"] if r["option"] == "split C=3")
    assert split3["tail_s"] == record["server"]["measured"]["tail_s"]["3"]


@pytest.mark.parametrize("args, message", [
    (["plan", "--link", "wifi:5", "--server", "gpu"], "unknown server 'gpu'; accepted: quadro-p600, this-machine or a .json"),
    (["plan", "--link", "wifi:5", "--server-speedup", "4"], "No such option: --server-speedup"),
    (["plan", "--link", "wifi:5", "--server", "this-machine", "--model", "torchvision:vgg11", "--size", "32",
      "--channels", "3"], "cannot inject a bottleneck into VGG"),
    (["measure-server", "--out", "server.json", "--channels", "0"], "--channels must be positive"),
    (["measure-server", "--out", "server.json", "--split-point", "sp9"], "unknown split point 'sp9'; accepted: sp1, sp2"),
    (["measure-server", "--out", "no/such/dir/server.json"], "does not exist; create it first"),
    (["measure-server", "--out", "server.json", "--device", "tpu"], "not a device; accepted: cpu, cuda, cuda:N"),
    (["measure-server"], "Missing option '--out'"),
])
def test_cli_server_usage_errors_exit_2(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    result = _cli()("split", *args)
    assert result.exit_code == 2 and message in _flat(result.output), result.output
    assert not (tmp_path / "server.json").exists()


def test_malformed_server_file_on_the_command_line(tmp_path):
    path = tmp_path / "server.json"
    path.write_text('{"name": "x"}')
    result = _cli()("split", "plan", "--link", "wifi:5", "--server", str(path))
    assert result.exit_code == 2 and "not a valid server profile" in _flat(result.output)
