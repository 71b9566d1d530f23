"""The README as a new user reads it: its commands parse, its figures table matches the
result files, and (slow) its set-up and generate commands work on a fresh clone."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def readme_commands(text: str) -> list[list[str]]:
    """Every `tandem ...` command line in the README's bash blocks (continuations joined,
    comments dropped), and the flags of each `make serve ARGS="..."` as `tandem serve`'s."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words and words[0] in ("tandem", ".venv/bin/tandem"):
                commands.append(words[1:])
            elif words[:2] == ["make", "serve"] and len(words) > 2:
                commands.append(["serve", *shlex.split(words[2].removeprefix("ARGS="))])
    return commands


def test_the_readme_is_an_entry_point_not_a_diary():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    for word in ("this stop", "the stop before", "issue ", " wave "):
        assert word not in text.lower(), word


def test_every_tandem_command_in_the_readme_parses():
    from tandem.cli import build_parser

    commands = readme_commands(README.read_text())
    assert {c[0] for c in commands} >= {"generate", "serve", "bench", "router", "sim"}
    for argv in commands:
        parser, _ = build_parser(argv[0])
        try:
            parser.parse_args(argv)
        except SystemExit as e:
            pytest.fail(f"`tandem {shlex.join(argv)}` does not parse (exit {e.code})")


def test_an_unknown_flag_in_a_readme_command_would_be_caught():
    from tandem.cli import build_parser

    parser, _ = build_parser("serve")
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--no-such-flag"])


def test_the_figures_table_and_page_match_the_result_files():
    done = subprocess.run(
        [sys.executable, "scripts/figures.py", "check"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_every_result_file_says_where_and_how_it_was_measured():
    sys.path.insert(0, str(ROOT / "scripts"))
    import figures

    kinds = figures.load()
    assert kinds
    for kind, data in kinds.items():
        assert data["cpu"], kind
        for name, r in data["figures"].items():
            for field in ("value", "detail", "date", "commit", "command"):
                assert r.get(field), f"{kind}/{name}.json has no {field}"
            assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", r["date"])
            assert re.fullmatch(r"[0-9a-f]{7,40}", r["commit"])


@pytest.mark.slow
def test_the_readme_followed_literally_on_a_fresh_clone(tmp_path):
    """Clone, run the set-up `make serve` runs first, then the README's generate command, in
    a HOME of its own (no model cache: the GGUF is converted on first use). Shared: pip's
    download cache, so the packages are not fetched again, and the suite's kernel cache
    (built kernels are tagged by source, flags and torch, so the clone's sources find their
    own builds; building into an empty cache, bounded, raced and interrupted, is
    tests/model/test_kernel_build.py's, and took 70 of this test's 200 s)."""
    from tandem.model.kernels.kernel_cache import cache_root

    clone, home = tmp_path / "tandem", tmp_path / "home"
    home.mkdir()
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    pip_cache = subprocess.run(
        [sys.executable, "-m", "pip", "cache", "dir"], capture_output=True, text=True
    ).stdout.strip()
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8"}
    if pip_cache:
        env["PIP_CACHE_DIR"] = pip_cache
    env["TORCH_EXTENSIONS_DIR"] = str(cache_root().parent)
    setup = subprocess.run(
        ["make", "setup"], cwd=clone, env=env, capture_output=True, text=True, timeout=1200
    )
    assert setup.returncode == 0, setup.stdout + setup.stderr
    steps = [ln for ln in setup.stdout.splitlines() if ln.startswith("setup: ")]
    assert steps[0].startswith("setup: creating .venv") and "installing torch" in steps[2]
    assert re.fullmatch(r"setup: done in \d+ s", steps[-1]), steps
    assert "Deprecat" not in setup.stderr, setup.stderr  # setuptools' license-table warnings

    generate = next(c for c in readme_commands(README.read_text()) if c[0] == "generate")
    run = subprocess.run(
        [str(clone / ".venv/bin/tandem"), *generate],
        cwd=clone, env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip(), "no answer"
    assert "dequantizing SmolLM2-135M-Instruct.Q4_1.gguf" in run.stderr  # a fresh model cache
    assert "Traceback" not in run.stderr
