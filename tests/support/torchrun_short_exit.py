"""``python torchrun_short_exit.py ARGS``: ``torchrun ARGS`` whose agent waits at most
:data:`EXIT_BARRIER_SECONDS` for the other nodes' agents once its own workers succeeded.

torchrun's elastic agent keeps a node whose workers finished waiting in an exit barrier for
every other node's agent, 300 s by default (not a command-line option); an agent whose workers
failed never joins it. A test where one node is killed on purpose while the other completes uses
this launcher so the complete node's launcher returns (status 0, the barrier's timeout logged) in
seconds instead of five minutes.
"""

from __future__ import annotations

from torch.distributed.elastic.agent.server import api

EXIT_BARRIER_SECONDS = 5.0
_exit_barrier = api.SimpleElasticAgent._exit_barrier


def _short_exit_barrier(self: api.SimpleElasticAgent) -> None:
    self._exit_barrier_timeout = min(self._exit_barrier_timeout, EXIT_BARRIER_SECONDS)
    _exit_barrier(self)


api.SimpleElasticAgent._exit_barrier = _short_exit_barrier  # type: ignore[method-assign]

if __name__ == "__main__":
    from torch.distributed.run import main

    main()
