"""The root command: start-up without torch, --version, and the lazy top-level package."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout


def test_help_and_version_never_import_torch():
    # Importing torch takes seconds; `edgetorch --help` must answer in well under 0.5 s.
    code = ("import sys; from typer.testing import CliRunner; from edgetorch.cli import app; "
            "r = CliRunner(); h = r.invoke(app, ['--help']); s = r.invoke(app, ['split', 'export', '--help']); "
            "v = r.invoke(app, ['--version']); "
            "print(h.exit_code, s.exit_code, v.exit_code, v.output.strip(), 'torch' in sys.modules)")
    assert _run(code).split() == ["0", "0", "0", "edgetorch", "0.1.0", "False"]


def test_public_names_load_on_first_use():
    code = ("import sys, edgetorch; print('torch' in sys.modules); "
            "from edgetorch import Bitmap, build_model; print(Bitmap.__name__, 'Bitmap' in dir(edgetorch)); "
            "print(sorted(edgetorch.__all__) == edgetorch.__all__ and all(hasattr(edgetorch, n) for n in edgetorch.__all__))")
    assert _run(code).split() == ["False", "Bitmap", "True", "True"]
    assert _run("import edgetorch; print(edgetorch.split.load.__name__)").strip() == "load"
    missing = subprocess.run([sys.executable, "-c", "import edgetorch; edgetorch.nope"], capture_output=True, text=True)
    assert "has no attribute 'nope'" in missing.stderr


MISTAKES = [
    (["profile", "--model", "torchvision:resnet18", "--json", "missing/out.json"], "directory .*missing does not exist"),
    (["profile", "--model", "torchvision:resnet18", "--plot", "."], "is a directory; give a file path"),
    (["profile", "--model", "torchvision:resnet18", "--device", "tpu"], "'tpu' is not a device; accepted: cpu, cuda"),
    (["profile", "--model", "torchvision:resnet18", "--policy", "bitmap:threshold=inf"], "threshold must be finite"),
    (["reduce", "--model", "zoo:mlp", "--weights", "none.safetensors", "--alpha", "0.5"], "does not exist"),
    (["reduce", "--model", "zoo:mlp", "--weights", ".", "--alpha", "0.5"], "is a directory, not a file"),
    (["reduce", "--model", "zoo:mlp", "--size", "32", "--alpha", "0.5"], "pretrained on 28x28 images; use --size 28"),
    (["split", "export", "--model", "torchvision:resnet18", "--channels", "2", "--random-init", "--out", "file"],
     "is an existing file; give a directory"),
    (["split", "plan", "--link", "wifi:5", "--channels", "0"], "--channels must be positive"),
]


@pytest.mark.parametrize("args, message", MISTAKES)
def test_user_mistakes_get_a_message_and_exit_code_2_not_a_traceback(tmp_path, monkeypatch, args, message):
    from typer.testing import CliRunner

    from edgetorch.cli import app

    monkeypatch.chdir(tmp_path)  # short relative paths: the error box wraps long ones
    (tmp_path / "file").write_text("x")
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert re.search(message, " ".join(result.output.replace("│", " ").split())), result.output
    assert isinstance(result.exception, SystemExit)  # a usage error, not an exception escaping


def test_piped_help_is_not_cut_at_80_columns():
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "TERMINAL_WIDTH")}
    out = subprocess.run([sys.executable, "-m", "edgetorch.cli", "split", "export", "--help"], capture_output=True,
                         text=True, check=True, env=env).stdout
    assert "…" not in out and "torchvision:densenet121|169|201" in out


@pytest.mark.parametrize("text, shown", [
    ("[/bold]", "[/bold]"), ("[red]x[/red]", "[red]x[/red]"), (":smile:", ":smile:"),
    ("[link=file:///etc/passwd]y[/link]", "[link=file:///etc/passwd]y[/link]"),
    ("\x1b[31mred\x1b[0m", "\\x1b[31mred\\x1b[0m"), ("evil\u202egnp.exe", "evil\\u202egnp.exe"),
], ids=["close-tag", "style", "emoji", "link", "ansi", "bidi"])
def test_the_console_prints_names_from_files_literally(text, shown):
    """Class names, paths and error messages come from files: as rich markup, '[/bold]' crashed `split
    infer` (MarkupError) after the server had answered; an ANSI escape reached the terminal raw."""
    from edgetorch.cli._app import console

    with console.capture() as captured:
        console.print(f"photo.png: {text} 97.0%")
    assert captured.get().strip() == f"photo.png: {shown} 97.0%"


COMMANDS = [[], ["split"], ["finetune"], ["reduce"], ["profile"], ["split", "train"], ["split", "export"], ["split", "plan"],
            ["split", "measure-server"], ["split", "serve"], ["split", "infer"], ["split", "probe"], ["predict"], ["val"], ["export"]]


def test_one_option_vocabulary_across_the_commands_with_flags_shown_as_flags():
    """Issue 28, item 9: --batch/--batch-size, --size/--resolution, --data/--dataset, --out/--output
    and --limit/--train-limit named the same thing in different commands, and boolean flags showed
    a <bool> value (Typer's own --help too). Help now shows one spelling of each, and no flag asks for a value."""
    from typer.testing import CliRunner

    from edgetorch.cli import app
    from edgetorch.cli._app import RENAMED_OPTIONS

    runner = CliRunner()
    for command in COMMANDS:
        shown = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "200"})
        assert shown.exit_code == 0, shown.output
        options = set(re.findall(r"--[a-z][a-z0-9-]*", shown.output))
        assert not options & set(RENAMED_OPTIONS), (command, options & set(RENAMED_OPTIONS))
        flags = [line for line in shown.output.splitlines() if "<bool>" in line]
        assert not flags, (command, flags)


@pytest.mark.parametrize("old, new, command, value, refused", [
    ("--batch", "--batch-size", ["profile", "--model", "zoo:cnn"], "0", "'--batch-size'"),
    ("--resolution", "--size", ["split", "plan", "--link", "wifi:5"], "0", "'--size'"),
    ("--dataset", "--data", ["reduce", "--alpha", "0.5"], "no-such-data", "'no-such-data' is neither a built-in dataset"),
    ("--output", "--out", ["reduce", "--alpha", "0.5"], "nothing/here.safetensors", "'--out'"),
    ("--limit", "--train-limit", ["finetune", "--model", "zoo:cnn", "--data", "digits"], "0", "'--train-limit'"),
])
def test_an_old_spelling_still_works_for_one_release_with_a_warning(old, new, command, value, refused):
    # A value the option refuses shows that the old spelling reached it, without running a job.
    from typer.testing import CliRunner

    from edgetorch.cli import app

    for spelling in ([old, value], [f"{old}={value}"]):
        result = CliRunner().invoke(app, [*command, *spelling])
        said = " ".join(result.output.split())
        assert f"warning: {old} is now {new} (the old spelling works until edgetorch 0.3)" in said, said
        assert result.exit_code == 2 and refused in said and "No such option" not in said, said
