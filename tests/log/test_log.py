"""The ``tpcore`` logger: warnings show and info does not by default, ``TPCORE_LOG_LEVEL`` sets it, a record
prints once, and the ranks' records and running counts reach the caller, with their rank, before the reply."""

from __future__ import annotations

import logging

import pytest
import rank_helpers

from tpcore import log
from tpcore.progress import ByteCounter


@pytest.fixture
def tpcore_logger():
    """The ``tpcore`` logger, its level and handlers restored after the test."""
    logger = logging.getLogger("tpcore")
    level, handlers = logger.level, list(logger.handlers)
    yield logger
    logger.setLevel(level)
    logger.handlers[:] = handlers


def unconfigure_root(monkeypatch) -> None:
    """Leave the root logger without handlers, as in a script that never configured logging: pytest's capture
    handlers, which it adds as the test starts, are set aside until it ends."""
    monkeypatch.setattr(logging.getLogger(), "handlers", [])


def test_by_default_warnings_print_on_stderr_and_info_does_not(monkeypatch, capsys, tpcore_logger):
    unconfigure_root(monkeypatch)
    tpcore_logger.setLevel(logging.NOTSET)  # as imported without TPCORE_LOG_LEVEL: the root's WARNING applies
    logger = logging.getLogger("tpcore.tests")
    logger.info("reading the files")
    logger.warning("much stays whole")
    assert capsys.readouterr().err == "WARNING tpcore.tests: much stays whole\n"
    tpcore_logger.setLevel(logging.INFO)
    logger.info("reading the files")
    assert capsys.readouterr().err == "INFO tpcore.tests: reading the files\n"


def test_a_record_prints_once_where_the_application_configured_logging(monkeypatch, capsys, tpcore_logger):
    unconfigure_root(monkeypatch)
    tpcore_logger.setLevel(logging.NOTSET)
    logging.getLogger().addHandler(logging.StreamHandler())  # what logging.basicConfig() adds, on stderr
    logging.getLogger("tpcore.tests").warning("much stays whole")
    assert capsys.readouterr().err == "much stays whole\n"  # the application's handler alone


@pytest.mark.parametrize(("value", "level"), [("INFO", logging.INFO), ("debug", logging.DEBUG), ("15", 15)])
def test_tpcore_log_level_takes_a_name_or_a_number(monkeypatch, tpcore_logger, value, level):
    monkeypatch.setenv(log.LEVEL_ENV, value)
    log.configure_from_environment()
    assert tpcore_logger.level == level
    assert sum(isinstance(handler, log._StderrUnlessHandled) for handler in tpcore_logger.handlers) == 1


def test_a_tpcore_log_level_that_names_no_level_is_a_warning(monkeypatch, tpcore_logger, caplog):
    tpcore_logger.setLevel(logging.NOTSET)
    monkeypatch.setenv(log.LEVEL_ENV, "loud")
    log.configure_from_environment()
    assert tpcore_logger.level == logging.NOTSET
    assert [r.getMessage() for r in caplog.records] == [
        "TPCORE_LOG_LEVEL='loud' is neither a logging level name nor a number; the level stays as it was"
    ]


# -- records and running counts from the ranks (the session's rank pools) ---------------------------


def test_a_ranks_records_reach_the_callers_logger_with_their_rank_at_the_callers_level(rank_pools, caplog):
    pool = rank_pools.get(2)
    caplog.set_level(logging.INFO, logger="tpcore")
    assert pool.run(rank_helpers.log_from_rank, "record of rank %d") == [0, 1]
    received = [(r.rank, r.name, r.levelname, r.getMessage()) for r in caplog.records if r.name == "tpcore.tests"]
    assert sorted(received) == [
        (rank, "tpcore.tests", level, f"rank {rank}: record of rank {rank}")
        for rank in (0, 1)
        for level in ("INFO", "WARNING")  # DEBUG is below the caller's level: never sent
    ]
    assert {r.process for r in caplog.records if r.name == "tpcore.tests"} == set(pool.pids)
    caplog.clear()
    caplog.set_level(logging.WARNING, logger="tpcore")  # the next call carries the new level
    pool.run(rank_helpers.log_from_rank, "record of rank %d")
    assert sorted(r.levelname for r in caplog.records if r.name == "tpcore.tests") == ["WARNING", "WARNING"]


def test_records_from_every_thread_of_a_rank_all_arrive_whole_before_its_reply(rank_pools, caplog):
    count = 400
    assert rank_pools.get(2).run(rank_helpers.log_from_two_threads, count) == [count, count]
    for rank in (0, 1):
        for thread in ("main", "other"):
            messages = [
                r.getMessage()
                for r in caplog.records
                if r.name == "tpcore.tests" and r.rank == rank and thread in r.msg
            ]
            assert messages == [f"rank {rank}: {thread} {index}" for index in range(count)]


def test_running_counts_reach_on_progress_in_order_before_the_reply(rank_pools):
    seen: list[tuple[int, int]] = []
    pool = rank_pools.get(2)
    counts = [10, 25, 40]
    results = pool.scatter(rank_helpers.report_counts, lambda rank: (counts,), on_progress=lambda *c: seen.append(c))
    assert results == [40, 40]
    assert [count for rank, count in seen if rank == 0] == counts and [c for r, c in seen if r == 1] == counts
    assert pool.run(rank_helpers.report_counts, [1]) == [1, 1]  # without on_progress they are dropped


def test_a_byte_counter_reports_at_most_every_interval_and_its_final_count():
    reported: list[int] = []
    counter = ByteCounter(reported.append, interval=3600.0)
    for _ in range(5):
        counter(100)
    assert reported == []  # within the interval
    counter.close()
    counter.close()
    assert reported == [500]  # once at the end
    every = ByteCounter(reported.append, interval=0.0)
    every(7)
    every(8)
    every.close()
    assert reported == [500, 7, 15]
