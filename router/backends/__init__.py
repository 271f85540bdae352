"""Every target a request can be sent to, behind one interface (:class:`~router.backends.base.Backend`).

* :mod:`router.backends.base`: the interface, and what a target answers.
* :mod:`router.backends.agent`: an agent's transport (:class:`~router.backends.agent.AgentWork`):
  its outbox, the Work on its AgentLink, and the batcher in front of it.
* :mod:`router.backends.cloud`: the cloud tier (one gateway or a pool of them) as a backend.

An agent's handle (:class:`router.fleet.registry.AgentHandle`: identity, state, estimates) is the
backend the policy sees, and asks its ``work``; the cloud is one more backend, on
``Tier.CLOUD``. The policy (:mod:`router.policy`) chooses among backends by the same rules
whatever they are, and the cascades and the auditor ask them alike.
"""
