"""Helpers shared by the tests, one module per concept (not collected by pytest):

* ``waiting``: poll a condition until it holds (``wait_until``, ``async_wait_until``);
* ``pools``: read a pool's raw Redis keys and check them (snapshots, ``used``, ``assert_empty``,
  ``check_consistent``), run the Lua scripts directly, read the server clock;
* ``history``: the safety sweep over recorded lease intervals;
* ``procs``: subprocesses (read /proc, signal, the ``gpulock`` CLI's argv, a server process in
  its own session killed at teardown and at exit);
* ``servers``: the Redis-compatible server binaries this machine has, replication settings;
* ``proxy``: a TCP proxy that cuts, freezes and delays connections;
* ``service``: the demo service under gunicorn or uvicorn as a process group;
* ``serve``: ``gpulock serve`` as a user starts it (its environment, the process, its workers
  ready);
* ``apps``: an ASGI app's lifespan and an in-process HTTP client on it.

The broker tests' own server and tokens are ``tests/broker/_support.py``.

The test tree's root (``tests/``) is on ``sys.path`` (pytest puts it there for the top-level
``conftest.py``), so these import as ``support.<module>``.
"""
