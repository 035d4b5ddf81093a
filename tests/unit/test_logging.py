import logging

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
