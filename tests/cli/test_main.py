"""The `edgeflow` command: every subcommand reaches its entry point; bad input is exit 2 with one message."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from edgeflow.cli.main import COMMANDS
from edgeflow.paths import REPO_ROOT

EDGEFLOW = Path(sys.executable).parent / "edgeflow"  # the console script pyproject.toml's [project.scripts] installs


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(EDGEFLOW), *args], capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "HF_HUB_OFFLINE": "1"})


def test_the_console_script_is_installed_and_lists_every_subcommand_with_an_example():
    assert EDGEFLOW.exists(), "pip install -e . installs `edgeflow` ([project.scripts])"
    r = run("--help")
    assert r.returncode == 0
    for name, cmd in COMMANDS.items():
        assert f"  {name}  " in r.stdout or f"  {name} " in r.stdout, name
        assert cmd.example in r.stdout
    assert "exit codes: 0 done, 1 a run failed, 2 bad input" in r.stdout


@pytest.mark.parametrize("name", [n for n in COMMANDS if n not in ("report", "completion", "up", "down")])
def test_each_subcommands_help_is_its_entry_points_own_after_an_example(name):
    r = run(name, "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"example: {COMMANDS[name].example}\n") and "usage:" in r.stdout, r.stdout[:400]
    assert "Traceback" not in r.stderr


def test_an_unknown_subcommand_or_option_is_exit_2_with_one_message():
    r = run("relase")
    assert r.returncode == 2 and "unknown subcommand 'relase'; did you mean 'release'?" in r.stderr and not r.stdout
    r = run("fleet", "lst")
    assert r.returncode == 2 and "invalid choice: 'lst'" in r.stderr and "Traceback" not in r.stderr
    r = run("follow", "not-a-run-id")
    assert r.returncode == 2 and "invalid UUID value: 'not-a-run-id'" in r.stderr


def test_a_profile_that_does_not_load_is_exit_2_naming_the_field_before_any_run(tmp_path):
    r = run("release", "--profile", "nope.yaml")
    assert r.returncode == 2 and r.stderr.startswith("edgeflow release: profile nope.yaml not found; profiles live in")
    data = yaml.safe_load((REPO_ROOT / "configs" / "test-tiny.yaml").read_text())
    data["distill"]["stpes"] = 3
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    r = run("rollout", f"--profile={bad}")
    assert r.returncode == 2 and "distill.stpes" in r.stderr and "Traceback" not in r.stderr + r.stdout
    assert "Starting temporary server" not in r.stdout + r.stderr  # refused before any flow run


def test_a_path_that_is_not_an_engine_is_exit_2(tmp_path):
    r = run("serve", str(tmp_path))
    assert r.returncode == 2 and "no engine.json" in r.stderr + r.stdout and "Traceback" not in r.stderr
    r = run("page-test", "--engine", str(tmp_path))
    assert r.returncode == 2 and "no engine.json there" in r.stderr


def test_report_prints_a_release_report_or_names_where_they_are(tmp_path):
    reports = REPO_ROOT / "reports"
    reports.mkdir(exist_ok=True)
    path = reports / "cli-test-release.md"
    path.write_text("# Release cli-test-release\n\n| variant | passed |\n")
    try:
        r = run("report", "cli-test-release")
        assert r.returncode == 0 and r.stdout == path.read_text()
    finally:
        path.unlink()
    r = run("report", "cli-test-release")
    assert r.returncode == 2 and f"no report {path}" in r.stderr


def test_bash_completion_offers_the_subcommands():
    r = run("completion", "bash")
    assert r.returncode == 0 and "complete -o filenames -F _edgeflow edgeflow" in r.stdout
    script = r.stdout + 'COMP_WORDS=(edgeflow rel); COMP_CWORD=1; _edgeflow; echo "${COMPREPLY[@]}"\n'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert out.stdout.split() == ["release"], out
    assert run("completion", "zsh").returncode == 2


def test_a_failed_check_is_exit_1():
    r = run("envcheck", "--target", "jetson-jp6")  # this host is no Jetson
    assert r.returncode == 1, r.stdout + r.stderr
