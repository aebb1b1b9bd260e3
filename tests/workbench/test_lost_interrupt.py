"""A Ctrl-C whose KeyboardInterrupt Python dropped (raised inside a finalizer) still stops the judgment."""

from __future__ import annotations

import gc
import signal

import pytest
import typer

from guards import progress
from workbench.cli import EXIT_INTERRUPTED, _judging


class _Finalized:
    def __del__(self):
        signal.raise_signal(signal.SIGINT)  # the handler's KeyboardInterrupt is raised here and dropped


# the dropped KeyboardInterrupt is the subject: Python reports it as unraisable, and pytest would warn about it
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_sigint_lost_in_a_finalizer_stops_at_the_next_progress_report(capsys):
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN where the suite was started in the background
    reached = []
    with pytest.raises(typer.Exit) as exc:
        with _judging():
            obj = _Finalized()
            del obj
            gc.collect()
            reached.append("after the finalizer")  # Python dropped the KeyboardInterrupt: the code goes on
            progress.phase("next phase")  # ... until the next report, which raises it again
            reached.append("after the report")
    assert exc.value.exit_code == EXIT_INTERRUPTED
    assert reached == ["after the finalizer"]
    assert "Interrupted" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is before  # restored
    progress.phase("a later judgment")  # the recorded Ctrl-C was cleared: nothing raises


def test_check_interrupt_raises_only_after_a_request():
    progress.clear_interrupt()
    progress.check_interrupt()
    progress.request_interrupt()
    with pytest.raises(KeyboardInterrupt):
        progress.check_interrupt()
    progress.clear_interrupt()
    progress.check_interrupt()
