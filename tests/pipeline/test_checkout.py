"""The deployments' pull step enters the worker's own checkout, read where the flow runs."""
import os
from pathlib import Path

import pytest

from edgeflow.pipeline.checkout import enter_checkout

REPO = Path(__file__).resolve().parents[2]


def test_enters_edgeflow_repo_of_the_host_that_runs_the_flow(tmp_path, monkeypatch):
    (tmp_path / "prefect.yaml").write_text("name: edgeflow\n")
    monkeypatch.chdir("/")
    monkeypatch.setenv("EDGEFLOW_REPO", str(tmp_path))
    assert enter_checkout() == {"directory": str(tmp_path)} and Path.cwd() == tmp_path
    monkeypatch.delenv("EDGEFLOW_REPO")
    assert enter_checkout() == {"directory": str(REPO)}  # unset: the checkout edgeflow is installed from


def test_a_directory_that_is_no_checkout_is_refused_naming_the_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEFLOW_REPO", str(tmp_path))
    cwd = os.getcwd()
    with pytest.raises(FileNotFoundError, match=f"EDGEFLOW_REPO={tmp_path} holds no prefect.yaml"):
        enter_checkout()
    assert os.getcwd() == cwd
