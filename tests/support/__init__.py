"""Harness pieces the tests share (fixtures stay in tests/conftest.py).

- :mod:`tests.support.relay`: a relay in this process (:func:`~tests.support.relay.running`)
  or as a subprocess (:func:`~tests.support.relay.relay_process`), an SSE stream on it
  (:func:`~tests.support.relay.sse`), readiness, WebSocket and publishing helpers;
- :mod:`tests.support.hostile`: the harness of the hostile-input tests;
- :mod:`tests.support.sse`: an SSE reader over an aiohttp response, on the project's
  one decoder (:mod:`relay.protocol.sse_reader`);
- :mod:`tests.support.worker`: a worker app with a mock engine (:class:`Harness`);
- :mod:`tests.support.demo`: the demo stack behind its front door;
- :mod:`tests.support.cli`: a command run to completion (:func:`~tests.support.cli.run_cli`:
  exit code, stdout, stderr);
- :mod:`tests.support.tls_certs`: a CA and certificates made with openssl;
- :mod:`tests.support.docker_backend`: the suite's cluster in Docker instead.

Processes are started and stopped (by pid) with :mod:`devstack.procs`, servers directly
(a :class:`devstack.procs.Proc` stopped in the same test or fixture), commands that run
to completion through :func:`tests.support.cli.run_cli`; free ports come
from :func:`devstack.procs.free_port`.
"""
