import json

import pytest
import torch
from conftest import run_job

from job.env import format_info, info, pick_device
from job.errors import ConfigError


def test_pick_device():
    assert pick_device("cpu") == torch.device("cpu")
    auto = pick_device("auto")
    assert auto.type == ("cuda" if torch.cuda.is_available() else auto.type)
    with pytest.raises(ConfigError, match="expected auto, cpu"):
        pick_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available here"):
            pick_device("cuda")


def test_info_report_fields():
    report = info()
    for key in (
        "torch",
        "cuda_available",
        "cuda_version",
        "cudnn_version",
        "device_count",
        "devices",
        "current_device",
        "cpu_count",
        "shm_gib",
    ):
        assert key in report
    assert report["device_count"] == torch.cuda.device_count()
    text = format_info(report)
    assert "torch" in text and ("CUDA available" in text or "CUDA not available" in text)


def test_info_command_plain_and_json():
    plain = run_job("info", timeout=120)
    assert plain.returncode == 0, plain.stderr
    assert "training would use:" in plain.stdout
    data = json.loads(run_job("info", "--json", timeout=120).stdout)
    assert data["cpu_count"] >= 1 and isinstance(data["devices"], list)
