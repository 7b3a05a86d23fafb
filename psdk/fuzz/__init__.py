"""Fuzzing a live ps (``python -m psdk fuzz``): sequences, a worker key beside a real job, single messages.

Three stages, each against a ps of its own:

* :mod:`psdk.fuzz.stateful`: hypothesis drives a live ps through
  sequences of every operation of the protocol, from workers holding real
  sessions, over ZeroMQ frames, over shared memory (knocks and doorbells)
  and with CURVE on, mutating fields and arrays on the way, and checks the
  ps's books, its store and its liveness after every step.
* :mod:`psdk.fuzz.alongside`: a real job trains to its end while
  one of its worker keys sends random hostile requests on its own session.
* :mod:`psdk.fuzz.single`: mutated copies of real messages from a
  connection that holds no session, many thousands a second.

The first two share :mod:`psdk.fuzz.harness`: the live ps on a
thread, the connections to it, and the record of what was sent and answered.

This is psdk's own tooling, kept apart from :mod:`psdk.testing` (the kit
plugin authors test with): it needs hypothesis (``pip install 'psdk[fuzz]'``),
and no product module imports it but the ``fuzz`` command, when it runs
(``tests/test_fuzz.py`` and ``tests/test_structure.py`` hold these).
"""
