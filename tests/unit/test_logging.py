import logging

import pytest

from modelopt_lite.logging import get_logger


def _handler():
    get_logger("modelopt_lite.test")
    return logging.getLogger("modelopt_lite").handlers[0]


def test_info_only_on_rank_zero_warnings_everywhere(monkeypatch):
    handler = _handler()
    info = logging.LogRecord("modelopt_lite.x", logging.INFO, "", 0, "m", None, None)
    warn = logging.LogRecord("modelopt_lite.x", logging.WARNING, "", 0, "m", None, None)
    debug = logging.LogRecord("modelopt_lite.x", logging.DEBUG, "", 0, "m", None, None)
    monkeypatch.setenv("RANK", "1")
    assert not handler.filter(info)
    assert handler.filter(warn)
    assert handler.filter(debug)
    assert warn.rank_prefix == "[rank 1] "
    monkeypatch.setenv("RANK", "0")
    assert handler.filter(info)
    assert info.rank_prefix == ""


def test_get_logger_namespaces(lib_caplog):
    assert get_logger("foo").name == "modelopt_lite.foo"
    assert get_logger("modelopt_lite.formats").name == "modelopt_lite.formats"
    with lib_caplog.at_level(logging.INFO, logger="modelopt_lite"):
        get_logger("foo").info("hello")
    assert [r.getMessage() for r in lib_caplog.records] == ["hello"]


def _stderr_of(code: str, **env: str) -> str:
    import os
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}, timeout=300
    )
    assert run.returncode == 0, run.stderr
    return run.stderr


def test_torchaos_cuda_extension_lines_stay_out_of_the_console_on_cpu():
    pytest.importorskip("torchao")
    import torch

    if torch.cuda.is_available():
        pytest.skip("with CUDA a torchao extension that fails to load is reported as torchao reports it")
    bare = _stderr_of("import torchao")
    if "Failed to load" not in bare:
        pytest.skip("this torchao loads its extensions without a line: nothing to keep out")
    quiet = _stderr_of("import modelopt_lite, torchao")
    assert "Failed to load" not in quiet
    assert "is an Enum subclass" not in quiet
    debug = _stderr_of("import modelopt_lite, torchao", MODELOPT_LITE_LOG_LEVEL="DEBUG")
    assert "Failed to load" in debug  # nothing is dropped at DEBUG
