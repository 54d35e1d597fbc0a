"""Test doubles for the decoding code that must actually run.

Tests swap in oracle drafts and planted bugs by patching a function where the decode loop looks it
up (``proposers._draft_logits``, ``speculative_sampling._process_at``, ...). A double installed
on a name the loop no longer reads (a re-export left behind when code moves to another module)
changes nothing: the test then runs the real code, and accepted-draft cases or planted bugs silently
stop being exercised. ``patch_called`` counts the double's calls, and the autouse fixture in
``conftest.py`` fails the test at teardown when a double installed with it was never called.
"""

import functools

INSTALLED = []  # (owner, name, calls) of every double installed by the running test


def patch_called(monkeypatch, owner, name, double):
    """``monkeypatch.setattr(owner, name, double)``, counting calls; returns the call counter ``[n]``."""
    calls = [0]

    @functools.wraps(double)
    def counted(*args, **kwargs):
        calls[0] += 1
        return double(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    INSTALLED.append((owner, name, calls))
    return calls


def never_called() -> list:
    """``owner.name`` of every double installed by the running test that was never called."""
    return [f"{getattr(owner, '__name__', owner)}.{name}" for owner, name, calls in INSTALLED if not calls[0]]
